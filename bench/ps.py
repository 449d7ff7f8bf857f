"""Parameter-server benchmark: push+pull latency and bandwidth, and server capacity.

One command runs everything (it starts the MPI jobs itself)::

    python bench/ps.py --json ps.json

Latency (``--servers K``, one leader): a leader pushes a gradient of B bytes
(4 KiB ... 256 MiB) to the K servers and pulls the weights back, through
hybridagg's own client and server (parts of 4 MiB, pipelined). The anchor,
in the same job right after the PS at each size, is raw ``mpi4py``: the
leader sends the same bytes to the servers and receives the same bytes back
(point to point, blocking, the fastest way MPI moves them). The
``hybridagg-ps`` figure is the transport alone: the servers run with
``skip_update`` (they return each part without applying the optimizer).
The cost of the update is reported separately: ``update_us`` is the
servers' median time in the optimizer (SGD with momentum) per push, and
``hybridagg-ps+update`` is the full round trip with the update applied
(the parts' updates overlap the transfer of the other parts). ``algbw``
counts both directions, ``2 x bytes / time``.

Capacity: 1-4 leaders, each sleeping 2 ms between pushes of a 1 MiB model,
push to one server for a few seconds; the server's updates per second (a
capacity figure on this machine, not a scaling claim). ``--capacity-bytes``
sets the model's size (a real model's, to bound a training run's throughput:
``bench/hetero.py --ps-capacity``), ``--nap-ms 0`` keeps the server saturated,
and ``--kernels fused,loop`` measures the servers' optimizer (SGD with
momentum and weight decay) with torch's fused kernel and with its
per-parameter loop (``fused=False``) side by side.

``--cluster FILE`` runs every job across an emulated cluster (brought up
with ``hybridagg cluster up FILE``) through ``hybridagg-run --cluster``, its
ranks on the file's hosts in order: with
``bench/clusters/two-hosts-10g.toml`` and ``--servers 1`` the leader and the
server are on two hosts, one 10 Gbit/s link apart.

``--busy N`` keeps N processes spinning on this machine's cores while
every job runs, and marks each record ``busy``: on an emulated cluster the
kernel carries the links' bytes on the cores the ranks use, so a transfer
across it slows when they are busy (a link of a real cluster, whose NIC
moves the bytes, would not). The simulator's calibration leaves such
records out.

``--wire bf16`` (or ``fp16``): hybridagg's pushes and pulls travel in that
type (the raw anchor stays float32: the same model, twice the bytes); each
latency record carries ``wire`` and ``wire_bytes``, the bytes the client
posted per push (measured at its sends), half of ``bytes`` on bf16/fp16.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve()


def human(nbytes: int) -> str:
    for unit, div in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= div:
            return f"{nbytes / div:g} {unit}"
    return f"{nbytes} B"


# ------------------------------------------------------------ inside MPI jobs
def _leader_model(nbytes: int):
    import torch

    n = max(1, nbytes // 4)
    return torch.nn.Parameter(torch.zeros(n))


def _ps_round_trips(
    topo, nbytes: int, reps: int, skip_update: bool, wire: str = "fp32"
) -> tuple[list[float], int]:
    """The round trips' times, and the bytes the client posted per push."""
    import torch

    from hybridagg.ps.client import PSClient
    from hybridagg.ps.compensation import Compensation

    param = _leader_model(nbytes)
    opt = torch.optim.SGD([param], lr=0.001, momentum=0.9)
    from hybridagg.ps import protocol as P

    ps = topo.comms.leaders.dup("ps")
    posted = [0]
    send = ps.Isend

    def counting(buf, dest, tag):  # the gradient parts' sizes, as posted
        if tag >= P.PART_TAG0:  # the gradient parts (each part its own tag)
            posted[0] += buf.numel() * buf.element_size()
        return send(buf, dest, tag)

    ps.Isend = counting
    client = PSClient(
        ps,
        1,
        [param],
        [],
        opt,
        Compensation(),
        skip_update=skip_update,
        wire=wire,
    )
    client.flat_grad.fill_(1.0)
    times = []
    for rep in range(reps + 1):
        start = time.perf_counter()
        client.complete(client.push(client.flat_grad, 1.0, [0.001], client.versions))
        if rep:
            times.append(time.perf_counter() - start)
    client.done()
    client.receive_final()
    client.ps.free()
    return times, posted[0] // (reps + 1)


def run_latency(sizes: list[int], reps: int, wire: str = "fp32") -> list[dict] | None:
    from mpi4py import MPI

    import hybridagg
    from hybridagg.comm import Comm

    topo = hybridagg.init(groups="world", servers=MPI.COMM_WORLD.size - 1)
    raw = Comm(name="raw")  # the anchor's own communicator
    K = len(topo.servers)
    out = []
    for nbytes in sizes:
        if topo.is_server:
            hybridagg.serve(topo)  # transport only
            stats = hybridagg.serve(topo)  # with the update
            lo, hi = raw.bcast(None, 0)[raw.rank - 1]
            raw_buf = np.empty(hi - lo, dtype=np.float32)
            for _ in range(reps + 1):
                raw.mpi.Recv(raw_buf, 0, 7)
                raw.mpi.Send(raw_buf, 0, 8)
            raw.allgather(float(np.median(stats.apply_times[1:] or [0.0])))
            continue
        ps_times, wire_bytes = _ps_round_trips(topo, nbytes, reps, True, wire)
        full_times, _ = _ps_round_trips(topo, nbytes, reps, False, wire)
        # raw anchor: the same bytes, sharded the same way, both directions
        from hybridagg.ps.shards import shard_ranges

        ranges = shard_ranges(max(1, nbytes // 4), K)
        raw.bcast(ranges, 0)  # servers size their buffers from the shard
        flat = np.ones(max(1, nbytes // 4), dtype=np.float32)
        raw_times = []
        for rep in range(reps + 1):
            start = time.perf_counter()
            for s, (lo, hi) in enumerate(ranges):
                raw.mpi.Send(flat[lo:hi], 1 + s, 7)
            for s, (lo, hi) in enumerate(ranges):
                raw.mpi.Recv(flat[lo:hi], 1 + s, 8)
            if rep:
                raw_times.append(time.perf_counter() - start)
        update_s = max(raw.allgather(0.0))
        for impl, times in (
            ("hybridagg-ps", ps_times),
            ("mpi4py-p2p", raw_times),
            ("hybridagg-ps+update", full_times),
        ):
            t = np.array(times)
            med = float(np.median(t))
            out.append(
                {
                    "impl": impl,
                    "ranks": 1 + K,
                    "servers": K,
                    "bytes": nbytes,
                    "avg_us": float(t.mean() * 1e6),
                    "min_us": float(t.min() * 1e6),
                    "max_us": float(t.max() * 1e6),
                    "median_us": med * 1e6,
                    "algbw_GBps": 2 * nbytes / med / 1e9,
                    "update_us": update_s * 1e6,
                    "wire": "fp32" if impl == "mpi4py-p2p" else wire,
                    "wire_bytes": nbytes if impl == "mpi4py-p2p" else wire_bytes,
                }
            )
    return out if topo.rank == 0 else None


def run_capacity(
    seconds: float, nap_ms: float, nbytes: int, kernel: str, wire: str = "fp32"
) -> dict | None:
    import torch

    import hybridagg

    topo = hybridagg.init(groups="each", servers=1)
    if topo.is_server:
        hybridagg.serve(topo)
        return None
    param = _leader_model(nbytes)
    # fused=None leaves the kernel to the servers (fused); False forces the loop
    user = torch.optim.SGD(
        [param],
        lr=0.01,
        momentum=0.9,
        weight_decay=1e-4,
        fused=None if kernel == "fused" else False,
    )
    opt = hybridagg.DistributedOptimizer(
        user, [("w", param)], topo, mode="async", wire=wire
    )
    exchange = opt._exchange

    def one_step() -> None:
        opt.zero_grad()
        param.sum().backward()
        if nap_ms > 0:
            time.sleep(nap_ms / 1000)
        opt.step()

    for _ in range(3):  # the server's first update pays torch's lazy imports
        one_step()
    workers = topo.comms.workers
    workers.barrier(what="capacity start")
    v0, t0 = max(exchange.model_versions), time.perf_counter()
    while time.perf_counter() < t0 + seconds:
        one_step()
    v1, t1 = max(exchange.model_versions), time.perf_counter()
    workers.barrier(what="capacity end")
    opt.finish()
    # rank 0 saw the server's version before and after the window; every
    # version in between is one update by some leader
    if topo.rank == 0:
        return {
            "impl": "hybridagg-ps",
            "leaders": topo.num_groups,
            "servers": 1,
            "updates_per_sec": (v1 - v0) / (t1 - t0),
            "nap_ms": nap_ms,
            "capacity_bytes": nbytes,
            "kernel": kernel,
            "wire": wire,
        }
    return None


# ------------------------------------------------------------------ driver
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--inner", choices=["latency", "capacity"], help=argparse.SUPPRESS
    )
    parser.add_argument("--servers", default="1,2", help="server counts for latency")
    parser.add_argument("--min", type=int, default=4096)
    parser.add_argument("--max", type=int, default=256 * 2**20)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--leaders", default="1,2,3,4")
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--nap-ms", type=float, default=2.0)
    parser.add_argument(
        "--capacity-bytes",
        type=int,
        default=2**20,
        help="model size in the capacity jobs (bytes)",
    )
    parser.add_argument(
        "--kernels",
        default="fused",
        help="servers' optimizer kernels in the capacity jobs: fused, loop or both",
    )
    parser.add_argument(
        "--only",
        choices=["latency", "capacity"],
        help="run one part of the benchmark",
    )
    parser.add_argument(
        "--wire",
        default="fp32",
        choices=("fp32", "bf16", "fp16"),
        help="the type hybridagg's pushes and pulls travel in (default fp32)",
    )
    parser.add_argument(
        "--cluster",
        help="run each job across this emulated cluster (its file; up with "
        "hybridagg cluster up): ranks on its hosts in order, the leaders first, "
        "the servers last",
    )
    parser.add_argument(
        "--busy",
        type=int,
        default=0,
        help="processes kept spinning on this machine's cores during every job "
        "(default 0): how much the transfers depend on the CPU",
    )
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--json", help="write the records here")
    args = parser.parse_args(argv)
    if args.busy < 0:
        raise SystemExit(f"--busy: a number of processes, 0 or more, got {args.busy}")
    sizes = []
    s = args.min
    while s <= args.max:
        sizes.append(s)
        s *= 4
    if args.inner == "latency":
        recs = run_latency(sizes, args.reps, args.wire)
        if recs is not None:
            Path(args.out).write_text(json.dumps(recs))
        return 0
    if args.inner == "capacity":
        rec = run_capacity(
            args.seconds, args.nap_ms, args.capacity_bytes, args.kernels, args.wire
        )
        if rec is not None:
            Path(args.out).write_text(json.dumps([rec]))
        return 0
    return drive(args, sizes)


@contextlib.contextmanager
def spinning(count: int) -> Iterator[list[subprocess.Popen]]:
    """``count`` processes spinning on this machine's cores until the block
    ends (``--busy``): the load a transfer meets when ranks compute beside it.
    Yields the processes."""
    spinners = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"])
        for _ in range(count)
    ]
    try:
        yield spinners
    finally:
        for proc in spinners:
            proc.kill()
        for proc in spinners:
            proc.wait(timeout=30)


def drive(args, sizes) -> int:
    kernels = args.kernels.split(",")
    if not kernels or any(k not in ("fused", "loop") for k in kernels):
        raise SystemExit(f"--kernels: fused and/or loop, got {args.kernels!r}")
    import tempfile

    from hybridagg.runtime import runner

    records: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        latency = [
            (
                1 + int(k),
                [
                    "--inner",
                    "latency",
                    "--reps",
                    str(args.reps),
                    "--min",
                    str(args.min),
                    "--max",
                    str(args.max),
                    "--wire",
                    args.wire,
                ],
            )
            for k in args.servers.split(",")
        ]
        # kernels alternate inside each leader count: side by side in time
        capacity = [
            (
                int(n) + 1,
                [
                    "--inner",
                    "capacity",
                    "--seconds",
                    str(args.seconds),
                    "--nap-ms",
                    str(args.nap_ms),
                    "--capacity-bytes",
                    str(args.capacity_bytes),
                    "--kernels",
                    kernel,
                    "--wire",
                    args.wire,
                ],
            )
            for n in args.leaders.split(",")
            for kernel in kernels
        ]
        jobs = {"latency": latency, "capacity": capacity}.get(
            args.only, latency + capacity
        )
        for i, (nranks, extra) in enumerate(jobs):
            out = Path(tmp) / f"job{i}.json"
            cmd = [sys.executable, str(HERE), *extra, "--out", str(out)]
            with spinning(args.busy):
                result = runner.run_job(
                    runner.launch_argv(nranks, cmd, cluster=args.cluster),
                    timeout=1800,
                    env=runner.mpiexec_env(),
                )
            if result.returncode != 0 or not out.exists():
                print(result.stdout[-3000:], result.stderr[-3000:], file=sys.stderr)
                raise SystemExit(f"benchmark job {extra[1]} at {nranks} ranks failed")
            records += [
                {**r, "busy": args.busy} if args.busy else r
                for r in json.loads(out.read_text())
            ]
    print_tables(records)
    if args.json:
        Path(args.json).write_text(json.dumps(records, indent=1))
        print(f"# wrote {len(records)} records to {args.json}")
    return 0


def print_tables(records: list[dict]) -> None:
    lat = [r for r in records if "bytes" in r]
    print(
        f"# push+pull, one leader; update cost reported separately\n"
        f"# {'impl':<20}{'servers':>8}{'size':>10}{'avg_us':>12}{'min_us':>12}{'max_us':>12}"
        f"{'algbw_GB/s':>12}{'update_us':>11}{'ps/raw':>8}"
    )
    by = {(r["impl"], r["servers"], r["bytes"]): r for r in lat}
    for r in lat:
        raw = by.get(("mpi4py-p2p", r["servers"], r["bytes"]))
        ratio = r["algbw_GBps"] / raw["algbw_GBps"] if raw else float("nan")
        print(
            f"  {r['impl']:<20}{r['servers']:>8}{human(r['bytes']):>10}{r['avg_us']:12.1f}"
            f"{r['min_us']:12.1f}{r['max_us']:12.1f}{r['algbw_GBps']:12.3f}"
            f"{r['update_us']:11.1f}{ratio:8.2f}"
        )
    cap = [r for r in records if "leaders" in r]
    if cap:
        print("# server capacity: leaders pushing a model, sleeping between pushes")
        print(
            f"# {'leaders':>8}{'servers':>8}{'model':>14}{'nap_ms':>8}"
            f"{'kernel':>7}{'updates/s':>12}"
        )
        for r in cap:
            size = human(r.get("capacity_bytes", 2**20))
            print(
                f"  {r['leaders']:>8}{r['servers']:>8}{size:>14}{r['nap_ms']:8g}"
                f"{r.get('kernel', 'loop'):>7}{r['updates_per_sec']:12.1f}"
            )


if __name__ == "__main__":
    sys.exit(main())
