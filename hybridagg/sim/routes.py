"""Routes of a simulated job's messages: bandwidth and latency between nodes (pure logic).

The engine's platform (:mod:`.engine`) in closed form: each link carries
half its latency, a node of shared cores is one host on its NIC, and its
internal messages are memory copies; a message between nodes also crosses
the core switch when the cluster has one that limits, and between
namespaces of one machine it moves no faster than the kernel's rate on a
core. The analytic model and the pipelined
groups' cut read the same routes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # (a SimJob reads routes when it cuts its pipelines)
    from .job import SimJob

__all__ = ["link_between", "up_link"]


def up_link(job: SimJob, node: int) -> tuple[float, float]:
    """(bandwidth, latency) from a device of ``node`` up to the core switch."""
    n = job.nodes[node]
    inter_bw, inter_lat = float(job.inter["bandwidth"]), float(job.inter["latency"])
    if n["shared"]:  # the node's one host sits on its NIC
        return inter_bw, inter_lat / 2
    intra = n["intra"]
    return (
        min(float(intra["bandwidth"]), inter_bw),
        float(intra["latency"]) / 2 + inter_lat / 2,
    )


def link_between(job: SimJob, a_node: int, b_node: int) -> tuple[float, float, bool]:
    """(bandwidth, latency, is a memory copy) of a message from a rank on
    ``a_node`` to one on ``b_node`` (the engine's platform: each link carries
    half its latency; a shared node's internal messages are copies)."""
    if a_node == b_node:
        node = job.nodes[a_node]
        if node["shared"]:
            return float(node["memcpy_Bps"]), float(node["intra"]["latency"]), True
        return float(node["intra"]["bandwidth"]), float(node["intra"]["latency"]), False
    (bw_a, lat_a), (bw_b, lat_b) = up_link(job, a_node), up_link(job, b_node)
    bandwidth, latency = min(bw_a, bw_b), lat_a + lat_b
    if job.machine:  # (namespaces of one machine: a core at each end moves it)
        bandwidth = min(bandwidth, float(job.machine["kernel_Bps"]))
    if job.core is not None:  # (the core switch: a lone message has it all)
        bandwidth = min(bandwidth, float(job.core["bandwidth"]))
        latency += float(job.core["latency"])
    return bandwidth, latency, False
