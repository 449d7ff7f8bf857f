"""The planner's cheap cost model: a :class:`~.job.SimJob`'s samples/s in closed form.

The planner scores thousands of candidate configurations; the SimGrid
simulator (about a second per job at 1,024 ranks) confirms only its final
choice. This model reads the same :class:`~.job.SimJob` the simulator runs,
so groups, servers, batches and the slowdown mean the same in both, and
follows the engine's step rule by rule (pure logic, no SimGrid):

* **A group's step** (:func:`group_step_seconds`): each member computes its
  batch (``SimJob.compute_seconds``) and sends its hop of the ring
  all-reduce bucket by bucket as backward fills them. A hop's link is
  work-conserving, so the last byte arrives at ``max_b(ready_b + latency +
  sum_{j >= b} bytes_j / bandwidth)``; the step ends when the slowest
  member's compute and hops end, plus the ring's ``2(n-1) - 1`` remaining
  latencies. With one bucket that is compute plus the closed-form ring
  ``2(n-1)(latency + bytes/(n bandwidth))`` exactly, as the simulator's own
  test checks. On a node of shared cores, compute that executes and the
  hops (memory copies) share the cores: both stretch by ranks per core.
* **sync**: samples of a step over the step.
* **hybrid, async**: a group's cycle is its step, the leader's exchange
  (push a shard to each server, the update, the reply) and the broadcast
  of the new weights (a pipelined chain). Every server serves every update
  (``server_update_s + master bytes / K x server_byte_s`` over its speed, or
  its link's time for its shard if longer), one at a time: when the groups'
  pushes come faster than the slowest server serves, every group waits the
  same ``w`` in its queue, the one that makes ``sum_g 1 / (cycle_g + w)``
  the service rate (first come, first served). With one server and tiny
  transfers this is the service-rate bound ``1 / update time`` exactly.
  Below saturation a push waits as in a queue: the server's link shared
  fairly (processor sharing), its updates first come, first served
  (M/D/1's mean wait), the load found by a fixed point. On a node of
  shared cores, the groups' core-seconds there per second (compute that
  executes, copies, server updates) may not exceed its cores: every group
  waits what keeps them within.

Not modelled (the simulator's business): contention between groups on a
shared link, queueing below saturation, ``--overlap``, the staleness bound.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .job import SimJob

__all__ = ["Estimate", "estimate", "group_step_seconds", "link_between"]


@dataclass(frozen=True)
class Estimate:
    """What the analytic model predicts for a job.

    Attributes:
        samples_per_sec: Predicted samples trained per second.
        ideal_samples_per_sec: The workers' compute-only rates summed.
        group_cycle_s: Seconds per update of each group (sync: the step).
        server_wait_s: Seconds each push waits in the servers' queue.
    """

    samples_per_sec: float
    ideal_samples_per_sec: float
    group_cycle_s: tuple[float, ...]
    server_wait_s: float = 0.0


# ------------------------------------------------------------------ routes
def _up(job: SimJob, node: int) -> tuple[float, float]:
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
    (bw_a, lat_a), (bw_b, lat_b) = _up(job, a_node), _up(job, b_node)
    return min(bw_a, bw_b), lat_a + lat_b, False


def _share(job: SimJob, node: int, ranks_on_node: dict[int, int]) -> float:
    """How much a node of shared cores stretches what executes on it."""
    n = job.nodes[node]
    if not n["shared"]:
        return 1.0
    return max(1.0, ranks_on_node.get(node, 0) / int(n["cores"]))


# ------------------------------------------------------------------- steps
def group_step_seconds(job: SimJob, group: list[int]) -> float:
    """Seconds of one step of ``group``: compute, then the bucketed ring
    all-reduce overlapping backward (see the module)."""
    counts: dict[int, int] = {}
    for w in job.workers:
        counts[w["node"]] = counts.get(w["node"], 0) + 1
    n = len(group)
    nodes = [job.workers[r]["node"] for r in group]
    # the ring's flows that leave (enter) each node share its NIC
    leaving: dict[int, int] = {}
    entering: dict[int, int] = {}
    if n > 1:
        for i in range(n):
            a, b = nodes[i], nodes[(i + 1) % n]
            if a != b:
                leaving[a] = leaving.get(a, 0) + 1
                entering[b] = entering.get(b, 0) + 1
    per_link = 2 * (n - 1) / n * job.grad_bytes if n > 1 else 0.0
    slowest, max_latency = 0.0, 0.0
    for i, r in enumerate(group):
        batch = job.workers[r]["batch"]
        stretch = _share(job, nodes[i], counts)
        compute = job.compute_seconds(r, batch)
        if not job.sleep_compute:
            compute *= stretch
        if n == 1:
            slowest = max(slowest, compute)
            continue
        a, b = nodes[i], (nodes[(i + 1) % n])
        bw, lat, copy = link_between(job, a, b)
        max_latency = max(max_latency, lat)
        if copy:  # a memory copy on the cores compute also uses
            slowest = max(slowest, compute + lat + per_link / bw * stretch)
            continue
        if a != b:
            bw /= max(leaving.get(a, 1), entering.get(b, 1))
        forward = compute * job.forward_share
        backward = compute - forward
        finish = compute
        remaining = per_link
        for ready, share in job.buckets:
            finish = max(finish, forward + backward * ready + lat + remaining / bw)
            remaining -= per_link * share
        slowest = max(slowest, finish)
    if n > 1:
        slowest += (2 * (n - 1) - 1) * max_latency
    return slowest


def _broadcast_seconds(job: SimJob, group: list[int]) -> float:
    """The new weights down the group's chain (one flow per link, pipelined)."""
    n = len(group)
    if n < 2:
        return 0.0
    worst, max_latency = 0.0, 0.0
    for i in range(n - 1):
        a, b = job.workers[group[i]]["node"], job.workers[group[i + 1]]["node"]
        bw, lat, _ = link_between(job, a, b)
        worst = max(worst, lat + job.grad_bytes / bw)
        max_latency = max(max_latency, lat)
    return worst + max(0, n - 2) * max_latency


def _server_seconds(job: SimJob) -> tuple[list[float], list[float]]:
    """Per server: its update's seconds, and its seconds of link time per
    update (its shard in over its node's link, shared by the node's servers)."""
    k = len(job.servers)
    on_node: dict[int, int] = {}
    for s in job.servers:
        on_node[s["node"]] = on_node.get(s["node"], 0) + 1
    update, link = [], []
    for s in job.servers:
        node = job.nodes[s["node"]]
        seconds = job.server_update_s + job.master_bytes / k * job.server_byte_s
        update.append(seconds / float(s["speed"]))
        shard = job.grad_bytes / k
        if node["shared"]:
            bw = float(job.inter["bandwidth"]) / on_node[s["node"]]
        else:
            bw = min(
                float(node["intra"]["bandwidth"]),
                float(job.inter["bandwidth"]) / on_node[s["node"]],
            )
        link.append(shard / bw)
    return update, link


def _exchange_seconds(
    job: SimJob,
    group: list[int],
    update: list[float],
    link: list[float],
    link_busy: list[float],
    cpu_busy: list[float],
    nic_busy: float = 0.0,
) -> float:
    """The leader's push of a shard to every server, the update, the reply.

    A server's link is shared fairly by the transfers on it (processor
    sharing: a transfer takes ``t / (1 - busy)``); its updates run one at a
    time (first come, first served: a push waits ``busy x u / (2 (1 - busy))``
    for the updates before it, M/D/1's mean), ``busy`` being the share of
    time the link or the server is in use.
    """
    leader = job.workers[group[0]]["node"]
    k = len(job.servers)
    shard = job.grad_bytes / k
    worst = 0.0
    off_node = sum(1 for s in job.servers if s["node"] != leader)
    for s, seconds, on_link, lb, cb in zip(
        job.servers, update, link, link_busy, cpu_busy, strict=True
    ):
        bw, lat, _ = link_between(job, leader, s["node"])
        if s["node"] != leader:
            bw /= max(1, off_node)  # the leader's pushes share its uplink
            transfer = max(shard / bw / (1 - nic_busy), on_link / (1 - lb))
        else:
            transfer = shard / bw
        wait = cb * seconds / (2 * (1 - cb))
        worst = max(worst, 2 * (lat + transfer) + seconds + wait)
    return worst


BUSY_CAP = 0.95
"""The highest share of time a server or its link counts as busy below
saturation (the waits grow without bound as it nears 1)."""


def estimate(job: SimJob) -> Estimate:
    """The analytic prediction for ``job`` (see the module)."""
    ideal = job.ideal_samples_per_sec()
    steps = [group_step_seconds(job, g) for g in job.groups]
    samples = [sum(job.workers[r]["batch"] for r in g) for g in job.groups]
    if job.mode == "sync" or not job.servers:
        rate = sum(s / t for s, t in zip(samples, steps, strict=True) if t > 0)
        return Estimate(rate, ideal, tuple(steps))
    update, link = _server_seconds(job)
    rest = [
        step + _broadcast_seconds(job, g)
        for g, step in zip(job.groups, steps, strict=True)
    ]
    idle = [0.0] * len(job.servers)

    # each leader's pushes leave its node by the node's link: the seconds
    # they hold it per update (0 when every server is on the leader's node)
    leader_node = [job.workers[g[0]]["node"] for g in job.groups]
    nic = [
        job.grad_bytes
        * sum(1 for s in job.servers if s["node"] != n)
        / len(job.servers)
        / _up(job, n)[0]
        for n in leader_node
    ]

    def cycles_at(
        link_busy: list[float], cpu_busy: list[float], per_group: list[float]
    ) -> list[float]:
        out = []
        for i, (g, r) in enumerate(zip(job.groups, rest, strict=True)):
            others = sum(  # the other leaders' pushes on this node's link
                nic[j] * per_group[j]
                for j in range(len(job.groups))
                if j != i and leader_node[j] == leader_node[i]
            )
            out.append(
                r
                + _exchange_seconds(
                    job, g, update, link, link_busy, cpu_busy, min(BUSY_CAP, others)
                )
            )
        return out

    cycles = cycles_at(idle, idle, [0.0] * len(job.groups))
    # a server copies its reply itself to a leader on its node of shared
    # cores before it serves the next push: that copy is part of its service
    busy = [
        u + _reply_copy_seconds(job, s)
        for s, u in zip(job.servers, update, strict=True)
    ]
    service = max(max(u, lk) for u, lk in zip(busy, link, strict=True))
    if sum(1.0 / c for c in cycles) < 1.0 / service:
        # below saturation: the queues' waits, to a fixed point (waits lengthen
        # the cycles, which lowers the load: damped iteration converges)
        for _ in range(200):
            per_second = sum(1.0 / c for c in cycles)
            link_busy = [min(BUSY_CAP, lk * per_second) for lk in link]
            cpu_busy = [min(BUSY_CAP, u * per_second) for u in busy]
            new = cycles_at(link_busy, cpu_busy, [1.0 / c for c in cycles])
            done = max(abs(a - b) / b for a, b in zip(new, cycles, strict=True))
            cycles = [(a + b) / 2 for a, b in zip(new, cycles, strict=True)]
            if done < 1e-9:
                break
    wait = _queue_wait(cycles, service)
    wait = max(wait, _cores_wait(job, cycles, update))
    rate = sum(s / (c + wait) for s, c in zip(samples, cycles, strict=True))
    return Estimate(rate, ideal, tuple(c + wait for c in cycles), server_wait_s=wait)


def _reply_copy_seconds(job: SimJob, server: dict) -> float:
    """A server's mean seconds copying replies to leaders on its own node of
    shared cores, per update (groups equally weighted)."""
    node = job.nodes[server["node"]]
    if not node["shared"]:
        return 0.0
    local = sum(1 for g in job.groups if job.workers[g[0]]["node"] == server["node"])
    shard = job.grad_bytes / len(job.servers)
    return local / len(job.groups) * shard / float(node["memcpy_Bps"])


def _core_work(job: SimJob, update: list[float]) -> dict[int, list[float]]:
    """Per node of shared cores: each group's core-seconds there per update
    (compute that executes, ring and broadcast hops as copies, the leader's
    pushes and replies to servers on the node as copies, the servers' updates)."""
    work: dict[int, list[float]] = {}
    k = len(job.servers)
    for n, node in enumerate(job.nodes):
        if not node["shared"]:
            continue
        copy = float(node["memcpy_Bps"])
        per_group = []
        for g in job.groups:
            size = len(g)
            seconds = 0.0
            for i, r in enumerate(g):
                if job.workers[r]["node"] != n:
                    continue
                if not job.sleep_compute:
                    seconds += job.compute_seconds(r, job.workers[r]["batch"])
                nxt = job.workers[g[(i + 1) % size]]["node"]
                if size > 1 and nxt == n:  # ring hop and broadcast hop, copied
                    seconds += 2 * (size - 1) / size * job.grad_bytes / copy
                    seconds += job.grad_bytes / copy if i < size - 1 else 0.0
            leader = job.workers[g[0]]["node"]
            for s, u in zip(job.servers, update, strict=True):
                if s["node"] == n:
                    seconds += u
                    if leader == n:  # push and reply of the shard, copied
                        seconds += 2 * job.grad_bytes / k / copy
            per_group.append(seconds)
        work[n] = per_group
    return work


def _cores_wait(job: SimJob, cycles: list[float], update: list[float]) -> float:
    """The wait that keeps each node of shared cores within its cores: the
    groups' core-seconds per second there at most ``cores`` (0 if they fit)."""
    worst = 0.0
    for n, per_group in _core_work(job, update).items():
        cores = float(job.nodes[n]["cores"])
        if sum(w / c for w, c in zip(per_group, cycles, strict=True)) <= cores:
            continue
        low, high = 0.0, sum(per_group) / cores
        for _ in range(100):  # bisection: the demand falls as the wait grows
            mid = (low + high) / 2
            if (
                sum(w / (c + mid) for w, c in zip(per_group, cycles, strict=True))
                > cores
            ):
                low = mid
            else:
                high = mid
            if high - low <= 1e-12 * max(1.0, high):
                break
        worst = max(worst, high)
    return worst


def _queue_wait(cycles: list[float], service: float) -> float:
    """The wait ``w >= 0`` with ``sum 1/(c + w) = 1/service`` (0 below saturation)."""
    if service <= 0 or sum(1.0 / c for c in cycles) <= 1.0 / service:
        return 0.0
    low, high = 0.0, len(cycles) * service
    for _ in range(100):  # bisection: the sum falls as w grows
        mid = (low + high) / 2
        if sum(1.0 / (c + mid) for c in cycles) > 1.0 / service:
            low = mid
        else:
            high = mid
        if high - low <= 1e-12 * max(1.0, high):
            break
    return high if math.isfinite(high) else 0.0
