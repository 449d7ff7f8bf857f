"""Calibration: the model's parameters fitted on microbenchmarks (pure logic).

The issue's rule: fit on microbenchmarks only, store the fits in the
profile, validate on training runs without refitting. :func:`calibrate`
reads the ``--json`` records of ``bench/allreduce.py`` and ``bench/ps.py``
and returns the profile with:

* ``allreduce_by_ranks``: per group size measured, the all-reduce's
  ``2(n-1)(latency + bytes/(n bandwidth))`` fitted on the median times of
  hybridagg's own flat all-reduce (``hybridagg-flat``; ``hybridagg``, the
  bucketed optimizer, where the flat one was not run);
* ``networks`` (:func:`fit_network`): a cluster's links between nodes
  from ``bench/allreduce.py`` run across them;
* ``server``: the optimizer's time per update and per byte of a shard
  (``update_us`` at each size, divided among the servers), a leader's
  transfer to a server (``hybridagg-ps``'s round trips without the update:
  ``2(latency + bytes/bandwidth)``), and what else a saturated server
  spends per byte (a capacity run's service time, ``1 / updates per
  second``, less the optimizer and the push's transfer: see
  :func:`_with_service`), with the capacity records kept.

Each line is fitted by least squares on relative error (weights ``1/t^2``:
4 KiB and 256 MiB count alike), its intercept held at 0 or more.
:func:`hybridagg.sim.job.machine_cluster` and the simulator then use them
for this machine (see there).
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from .cluster import ClusterSpec
from .profile import AllreduceFit, NetworkFit, Profile, ServerFit

__all__ = [
    "calibrate",
    "fit_allreduce",
    "fit_line",
    "fit_network",
    "fit_server",
    "kernel_bandwidth",
]

NOMINAL = 0.98
"""A ring whose links between nodes delivered at least this share of their
nominal bandwidth met nothing else: no core bandwidth is fitted."""

ALLREDUCE_IMPLS = ("hybridagg-flat", "hybridagg")
"""bench/allreduce.py's rows that are hybridagg's own reduction, preferred first."""


def fit_line(points: Iterable[tuple[float, float]]) -> tuple[float, float]:
    """``(a, b)`` of ``t = a + b x`` on ``(x, t)`` points, least squares on
    relative error, ``a >= 0`` and ``b >= 0``.

    Raises:
        ValueError: Fewer than one point, or a time that is not positive.
    """
    pts = [(float(x), float(t)) for x, t in points]
    if not pts:
        raise ValueError("no points to fit")
    if any(t <= 0 for _, t in pts):
        raise ValueError("every measured time must be positive")
    w = [1.0 / (t * t) for _, t in pts]
    sw = sum(w)
    sx = sum(wi * x for wi, (x, _) in zip(w, pts, strict=True))
    st = sum(wi * t for wi, (_, t) in zip(w, pts, strict=True))
    sxx = sum(wi * x * x for wi, (x, _) in zip(w, pts, strict=True))
    sxt = sum(wi * x * t for wi, (x, t) in zip(w, pts, strict=True))
    det = sw * sxx - sx * sx
    if len(pts) > 1 and det > 0:
        a = (sxx * st - sx * sxt) / det
        b = (sw * sxt - sx * st) / det
        if a >= 0 and b >= 0:
            return a, b
    # a constraint binds: the better of a line through 0 and a constant
    through = (sxt / sxx, 0.0) if sxx > 0 else (0.0, 0.0)
    constant = (st / sw, 0.0)

    def error(a: float, b: float) -> float:
        return sum(wi * (a + b * x - t) ** 2 for wi, (x, t) in zip(w, pts, strict=True))

    if sxx > 0 and error(0.0, through[0]) <= error(*constant):
        return 0.0, through[0]
    return constant


def _records(data: Any, what: str) -> list[dict]:
    if not isinstance(data, list) or not all(isinstance(r, dict) for r in data):
        raise ValueError(f"{what}: expected a JSON list of records (its --json output)")
    return data


def fit_allreduce(
    records: list[dict], source: str = "bench/allreduce.py"
) -> tuple[AllreduceFit, ...]:
    """One :class:`AllreduceFit` per group size in ``bench/allreduce.py``'s records.

    Raises:
        ValueError: No record of hybridagg's all-reduce with 2 ranks or more.
    """
    records = _records(records, source)
    impls = {r.get("impl") for r in records}
    impl = next((i for i in ALLREDUCE_IMPLS if i in impls), None)
    if impl is None:
        raise ValueError(
            f"{source}: no {' or '.join(ALLREDUCE_IMPLS)} records "
            f"(found {sorted(str(i) for i in impls)})"
        )
    by_ranks: dict[int, list[tuple[float, float]]] = {}
    for r in records:
        if r.get("impl") != impl or r.get("wire", "fp32") != "fp32":
            continue
        try:
            ranks, nbytes, us = (
                int(r["ranks"]),
                float(r["bytes"]),
                float(r["median_us"]),
            )
        except (KeyError, TypeError, ValueError):
            raise ValueError(
                f"{source}: a record lacks ranks, bytes or median_us: {r}"
            ) from None
        if ranks >= 2 and us > 0:
            by_ranks.setdefault(ranks, []).append((nbytes, us * 1e-6))
    if not by_ranks:
        raise ValueError(f"{source}: no {impl} record with 2 ranks or more")
    fits = []
    for ranks, points in sorted(by_ranks.items()):
        a, b = fit_line(points)
        # a = 2(n-1) latency, b = 2(n-1) / (n bandwidth)
        latency = a / (2 * (ranks - 1))
        bandwidth = 2 * (ranks - 1) / (ranks * b) if b > 0 else float("inf")
        if bandwidth == float("inf"):
            raise ValueError(
                f"{source}: {ranks} ranks' times do not grow with the bytes"
            )
        fits.append(
            AllreduceFit(
                latency_s=latency,
                bandwidth_Bps=bandwidth,
                ranks=ranks,
                points=tuple(sorted(points)),
            )
        )
    return tuple(fits)


def fit_network(
    records: list[dict], cluster: ClusterSpec, source: str = "bench/allreduce.py"
) -> NetworkFit:
    """The links between ``cluster``'s nodes from ``bench/allreduce.py`` run
    across them (``hybridagg-run --cluster``, ranks on the devices in order).

    The ring's time is fitted as in :func:`fit_allreduce` (at its largest
    measured group). Its phases wait for the slowest link, one between
    nodes: the fitted latency, less the node's own link's, is a message's
    latency between nodes. Each of the ring's links between nodes carries
    ``2(n-1)/n`` of the bytes at the fitted bandwidth; below the nodes'
    nominal link rate (:data:`NOMINAL`), they were held by what they all
    cross: the core's bandwidth is their count times it, or on a cluster of
    one machine's namespaces (its ``machine``) that machine's cores, whose
    kernel rate :func:`kernel_bandwidth` solves for.

    Raises:
        ValueError: No usable record, more ranks than the cluster's devices,
            or every rank on one node (no link between nodes measured).
    """
    fits = fit_allreduce(records, source)
    fit = max(fits, key=lambda f: f.ranks)
    nodes = [
        (t, k)
        for t in cluster.node_types
        for k in range(t.count)
        for _ in range(t.devices)
    ]
    if fit.ranks > len(nodes):
        raise ValueError(
            f"{source}: {fit.ranks} ranks, but cluster {cluster.name} has "
            f"{len(nodes)} devices"
        )
    ring = nodes[: fit.ranks]
    crossings = sum(1 for i in range(fit.ranks) if ring[i] != ring[(i + 1) % fit.ranks])
    if crossings == 0:
        raise ValueError(
            f"{source}: its {fit.ranks} ranks sit on one node of cluster "
            f"{cluster.name}; no link between nodes was measured"
        )
    node_type = ring[0][0]
    own = 0.0 if node_type.shared_cores else cluster.intra_link(node_type).latency
    nominal = cluster.inter_node.bandwidth
    if not node_type.shared_cores:
        nominal = min(nominal, cluster.intra_link(node_type).bandwidth)
    held = fit.bandwidth_Bps < NOMINAL * nominal
    core = kernel = 0.0
    if held and cluster.machine is not None:
        kernel = kernel_bandwidth(
            fit.bandwidth_Bps,
            ranks=fit.ranks,
            crossings=crossings,
            cores=cluster.machine.cores,
            copy_Bps=cluster.intra_link(node_type).bandwidth,
        )
    elif held:
        core = crossings * fit.bandwidth_Bps
    return NetworkFit(
        cluster=cluster.name,
        latency_s=max(0.0, fit.latency_s - own),
        core_Bps=core,
        ranks=fit.ranks,
        crossings=crossings,
        points=fit.points,
        kernel_Bps=kernel,
    )


def kernel_bandwidth(
    link_Bps: float, *, ranks: int, crossings: int, cores: int, copy_Bps: float
) -> float:
    """A core's rate of moving bytes between namespaces at each end of a
    message, from a ring all-reduce across the namespaces of one machine
    whose links carried ``link_Bps`` each (0: the copies alone explain it).

    In each of the ring's phases every link moves the same bytes ``s`` at
    once, and they all share the machine's cores: ``crossings`` links
    between namespaces cost ``s / kernel`` at each end, the others a copy
    ``s / copy_Bps``. The cores bound the phase: ``(2 crossings / kernel +
    (ranks - crossings) / copy_Bps) s = cores s / link_Bps``.
    """
    rest = cores / link_Bps - (ranks - crossings) / copy_Bps
    return 2 * crossings / rest if rest > 0 else 0.0


def fit_server(
    records: list[dict], base: ServerFit, source: str = "bench/ps.py"
) -> ServerFit:
    """The servers' fit from ``bench/ps.py``'s records (fp32 wire), keeping
    ``base``'s values where the records measure nothing.

    Raises:
        ValueError: Records of neither latency nor capacity.
    """
    records = _records(records, source)
    update: dict[float, list[float]] = {}
    trips: list[tuple[float, float]] = []
    capacity: list[tuple[float, float, float]] = []
    service: dict[float, list[float]] = {}
    for r in records:
        # (bench/ps.py --busy measures the transfers beside spinning
        # processes: the machine's load, not the server's)
        if r.get("wire", "fp32") != "fp32" or r.get("busy"):
            continue
        if "updates_per_sec" in r:
            nbytes = float(r.get("capacity_bytes", 2**20))  # (its default)
            capacity.append((float(r["leaders"]), nbytes, float(r["updates_per_sec"])))
            if float(r.get("nap_ms", 1.0)) == 0.0:  # saturated: the service time
                service.setdefault(
                    nbytes / max(1, int(r.get("servers", 1))), []
                ).append(1.0 / float(r["updates_per_sec"]))
            continue
        if (
            r.get("impl") == "hybridagg-ps"
            and "median_us" in r
            and int(r.get("servers", 1)) == 1
        ):
            trips.append(
                (
                    float(r["bytes"]) / int(r.get("servers", 1)),
                    float(r["median_us"]) * 1e-6,
                )
            )
        if "update_us" in r and r.get("impl") == "hybridagg-ps":
            shard = float(r["bytes"]) / int(r.get("servers", 1))
            update.setdefault(shard, []).append(float(r["update_us"]) * 1e-6)
    if not update and not trips and not service:
        raise ValueError(f"{source}: no latency or saturated capacity records")
    fit = base
    if update or (service and not trips):
        # the optimizer's own time; saturated service times stand in for it
        # only where no transfer was measured to take out of them
        pooled = update or service
        points = sorted((x, sorted(ts)[len(ts) // 2]) for x, ts in pooled.items())
        a, b = fit_line(points)
        fit = replace(
            fit, seconds_per_update=a, seconds_per_byte=b, points=tuple(points)
        )
    if trips:
        # the round trip: a shard out and back, 2(latency + bytes/bandwidth)
        a, b = fit_line(trips)
        fit = replace(
            fit,
            transfer_latency_s=a / 2,
            transfer_Bps=2 / b if b > 0 else 0.0,
        )
        if service and fit.transfer_Bps > 0:
            # (round trips that did not grow with the bytes leave the push's
            # copy to the node's copies, which the fit does not know)
            fit = _with_service(fit, service)
    return replace(fit, capacity=tuple(sorted(capacity)))


def _with_service(fit: ServerFit, service: dict[float, list[float]]) -> ServerFit:
    """``fit`` whose per-byte cost also carries the rest of a saturated
    server's service time.

    Saturated (``bench/ps.py``'s capacity at no nap) a server spends per
    update more than the optimizer and the transfer the simulator charges
    it with on shared memory (the push copied in, ``latency +
    bytes/bandwidth``; the leader copies the reply in): it checks the
    gradient and copies the weights to reply from for each group. That
    rest, per byte
    at the capacity's shard size (the median over sizes; none if the
    optimizer and the transfers already take the whole service time), is
    added to ``seconds_per_byte``: the simulated server then serves as
    fast as the measured one."""
    rests = []
    for shard, times in service.items():
        if shard <= 0:
            continue
        # (the leader counts measured are one server's cost, seen under
        # different contention: their median)
        seconds = statistics.median(times)
        charged = fit.seconds(shard) + fit.transfer_latency_s + shard / fit.transfer_Bps
        rests.append((seconds - charged) / shard)
    rest = statistics.median(rests) if rests else 0.0
    if rest <= 0:
        return fit
    return replace(fit, seconds_per_byte=fit.seconds_per_byte + rest)


def _load(path: str | Path, what: str) -> Any:
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ValueError(f"{what} {path} does not exist") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{what} {path} is not valid JSON: {exc}") from None


Paths = str | Path | Sequence[str | Path]


def _paths(value: Paths) -> list[str]:
    if isinstance(value, (str, Path)):
        return [str(value)]
    return [str(v) for v in value]


def _load_all(paths: list[str], what: str) -> list[dict]:
    records: list[dict] = []
    for path in paths:
        records += _records(_load(path, what), f"{what} {path}")
    return records


def calibrate(
    profile: Profile,
    *,
    allreduce_json: Paths | None = None,
    ps_json: Paths | None = None,
    network_json: Paths | None = None,
    network_cluster: ClusterSpec | None = None,
) -> Profile:
    """``profile`` with the fits of ``bench/allreduce.py --json`` and
    ``bench/ps.py --json`` outputs (see the module; each a file or several,
    e.g. one per ``mpiexec -n``: their records are pooled); the files are
    named in its notes (``calibrated_from``). ``network_json``:
    ``bench/allreduce.py`` run across ``network_cluster``'s nodes
    (:func:`fit_network`; it replaces that cluster's earlier fit).

    Raises:
        ValueError: A missing or bad file, naming it; a network without its
            cluster.
    """
    if (network_json is None) != (network_cluster is None):
        raise ValueError(
            "calibrate: network_json and network_cluster go together (the "
            "all-reduce across a cluster, and that cluster's file)"
        )
    if allreduce_json is None and ps_json is None and network_json is None:
        raise ValueError("calibrate needs allreduce_json, ps_json or network_json")
    notes = dict(profile.notes)
    sources = list(notes.get("calibrated_from", []))
    if allreduce_json is not None:
        paths = _paths(allreduce_json)
        data = _load_all(paths, "all-reduce results")
        fits = fit_allreduce(data, ", ".join(paths))
        profile = replace(profile, allreduce_by_ranks=fits)
        sources += paths
    if ps_json is not None:
        paths = _paths(ps_json)
        data = _load_all(paths, "parameter-server results")
        server = fit_server(data, profile.server, ", ".join(paths))
        profile = replace(profile, server=server)
        sources += paths
    if network_json is not None and network_cluster is not None:
        paths = _paths(network_json)
        data = _load_all(paths, "all-reduce results across a cluster")
        fit = fit_network(data, network_cluster, ", ".join(paths))
        others = tuple(n for n in profile.networks if n.cluster != fit.cluster)
        profile = replace(profile, networks=(*others, fit))
        sources += paths
    notes["calibrated_from"] = sources
    return replace(profile, notes=notes)
