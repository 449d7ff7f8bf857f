"""All-reduce microbenchmark: hybridagg against raw MPI, gloo and Horovod.

Run under MPI, e.g. ``hybridagg run -n 2 -- python bench/allreduce.py --json out.json``.

For each message size (4 KiB ... 256 MiB by default) and each implementation,
the repetitions are interleaved (rep 1 of every implementation, then rep 2,
...) so slow drifts of a shared machine hit all of them alike. One
repetition's latency is the slowest rank's time (a collective is done when
its last rank is). The table prints, per implementation and size, OSU-style
avg/min/max over ranks of each rank's median time, the median and
interquartile range over repetitions, and nccl-tests' bandwidths:
``algbw = bytes / median`` and ``busbw = algbw * 2 (n - 1) / n``.

Implementations:
    hybridagg       DistributedOptimizer on a real backward whose gradients
                    total the size: time of backward + synchronize minus the
                    time of the same backward with reduction off (measured in
                    the same repetition, after one untimed backward, so both
                    timed passes find the caches alike), i.e. the time
                    reduction adds.
    hybridagg-flat  hybridagg.collectives.Collectives.allreduce on one flat buffer.
    mpi4py          blocking MPI_Allreduce on a numpy buffer.
    mpi4py-nb       MPI_Iallreduce + MPI_Wait on the same buffer.
    gloo            torch.distributed all_reduce with the gloo backend (DDP's CPU path).
    horovod         hvd.allreduce_ (sum), only when asked (``--impls horovod``) and
                    importable, best in a run of its own: Horovod's background
                    thread wakes every HOROVOD_CYCLE_TIME and, on a small
                    machine, takes CPU from the other implementations (measured
                    here on 2 cores: 4 KiB latencies of every other
                    implementation grew 5-10x with Horovod initialised).

``--wire bf16`` (or ``fp16``) sends hybridagg's gradients in that type
(summed in float32, with error feedback): the two hybridagg rows then use
the compact algorithm, the others stay float32 for comparison, and each
hybridagg-flat record carries ``sent_bytes``, the bytes one rank posted per
all-reduce (measured, from the collectives' counter).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np
import torch
from mpi4py import MPI

import hybridagg
from hybridagg.collectives import Collectives
from hybridagg.comm import WIRE_FORMATS, Comm
from hybridagg.optimizer import init_torch_distributed

IMPLS = ["hybridagg", "hybridagg-flat", "mpi4py", "mpi4py-nb", "gloo", "horovod"]


def parse_size(text: str) -> int:
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def human(nbytes: int) -> str:
    for unit, div in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= div:
            return f"{nbytes / div:g} {unit}"
    return f"{nbytes} B"


class Bench:
    """Holds the buffers of one size for every implementation."""

    def __init__(
        self, impls: list[str], nbytes: int, topo, bucket_mb: float, wire: str
    ) -> None:
        self.impls, self.topo = impls, topo
        self.comm = Comm(name="bench")
        self.collectives = Collectives(self.comm, wire=wire)
        n = max(1, nbytes // 4)
        self.np_buf = np.ones(n, dtype=np.float32)
        self.t_buf = torch.ones(n)
        if "hybridagg" in impls:
            # four parameters, so large sizes span several buckets
            parts = [n // 4] * 3 + [n - 3 * (n // 4)]
            self.params = [torch.nn.Parameter(torch.zeros(max(1, k))) for k in parts]
            named = [(f"p{i}", p) for i, p in enumerate(self.params)]
            self.opt = hybridagg.DistributedOptimizer(
                torch.optim.SGD(self.params, lr=0.0),
                named,
                topo,
                bucket_mb=bucket_mb,
                wire=wire,
            )

    def _backward(self) -> None:
        loss = sum(p.sum() for p in self.params)
        loss.backward()

    def run(self, impl: str, gap_s: float = 0.0) -> float:
        """One repetition of ``impl`` on this rank; returns seconds.

        With ``gap_s`` every rank sleeps that long after the barrier before
        it starts (the timer starts when its own sleep ends), as a paced
        training step computes before its reduction: the ranks then arrive
        as they wake up, not together, and an idle wait has backed off.
        """
        comm = self.comm
        comm.mpi.Barrier()  # blocking, as OSU: ranks leave it together
        if gap_s > 0 and impl != "hybridagg":
            time.sleep(gap_s)
        if impl == "hybridagg":
            # the backward alone, timed the second time, so that it and the
            # timed backward with reduction below find the caches alike
            for _ in range(2):
                self.opt.zero_grad()
                with self.opt.no_sync():
                    start = time.perf_counter()
                    self._backward()
                    local = time.perf_counter() - start
            self.opt.zero_grad()
            comm.mpi.Barrier()  # blocking, as OSU: ranks leave it together
            if gap_s > 0:
                time.sleep(gap_s)
            start = time.perf_counter()
            self._backward()
            self.opt.synchronize()
            return time.perf_counter() - start - local
        start = time.perf_counter()
        if impl == "hybridagg-flat":
            self.collectives.allreduce(self.t_buf)
        elif impl == "mpi4py":
            comm.mpi.Allreduce(MPI.IN_PLACE, self.np_buf)
        elif impl == "mpi4py-nb":
            comm.mpi.Iallreduce(MPI.IN_PLACE, self.np_buf).Wait()
        elif impl == "gloo":
            torch.distributed.all_reduce(self.t_buf)
        elif impl == "horovod":
            import horovod.torch as hvd

            hvd.allreduce_(self.t_buf, op=hvd.Sum)
        return time.perf_counter() - start

    def close(self) -> None:
        if "hybridagg" in self.impls:
            self.opt.reducer.close()
        self.comm.free()


def reps_for(nbytes: int, base: int) -> int:
    return max(25, min(base, int(base * 2**20 / max(nbytes, 1))))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--min", default="4K", help="smallest message (default 4K)")
    parser.add_argument("--max", default="256M", help="largest message (default 256M)")
    parser.add_argument(
        "--reps", type=int, default=40, help="repetitions at 1 MiB and below"
    )
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument(
        "--impls",
        default=",".join(i for i in IMPLS if i != "horovod"),
        help=f"comma-separated, from {IMPLS} (default: all but horovod)",
    )
    parser.add_argument("--bucket-mb", type=float, default=25.0)
    parser.add_argument(
        "--gap-ms",
        type=float,
        default=0.0,
        help="every rank sleeps this long before each timed reduction, as a "
        "paced training step computes first (default 0: back to back)",
    )
    parser.add_argument(
        "--wire",
        default="fp32",
        choices=WIRE_FORMATS,
        help="the type hybridagg's rows send (default fp32)",
    )
    parser.add_argument("--json", help="write one record per (impl, ranks, bytes) here")
    args = parser.parse_args(argv)

    topo = hybridagg.init()
    world = topo.comms.world
    impls = [i for i in args.impls.split(",") if i]
    unknown = set(impls) - set(IMPLS)
    if unknown:
        raise SystemExit(f"unknown --impls {sorted(unknown)}; choose from {IMPLS}")
    if "gloo" in impls:
        init_torch_distributed(topo.comms.workers, "gloo")
    if "horovod" in impls:
        try:
            import horovod.torch as hvd

            hvd.init(comm=topo.comms.workers.mpi)
        except ImportError:
            impls.remove("horovod")
    sizes = []
    size = parse_size(args.min)
    while size <= parse_size(args.max):
        sizes.append(size)
        size *= 4
    n = world.size
    records = []
    if world.rank == 0:
        print(
            f"# hybridagg all-reduce benchmark, {n} ranks, float32 data, hybridagg's "
            f"wire {args.wire}, {MPI.Get_library_version().splitlines()[0].strip()}"
        )
        print(
            f"# {'impl':<15}{'size':>10}{'avg_us':>12}{'min_us':>12}{'max_us':>12}"
            f"{'median_us':>12}{'iqr_us':>10}{'algbw_GB/s':>12}{'busbw_GB/s':>12}"
        )
    for nbytes in sizes:
        bench = Bench(impls, nbytes, topo, args.bucket_mb, args.wire)
        reps = reps_for(nbytes, args.reps)
        times = {impl: [] for impl in impls}
        for rep in range(args.warmup + reps):
            order = impls[rep % len(impls) :] + impls[: rep % len(impls)]
            for impl in order:
                t = bench.run(impl, args.gap_ms * 1e-3)
                if rep >= args.warmup:
                    times[impl].append(t)
        flat_ops = (args.warmup + reps) if "hybridagg-flat" in impls else 0
        sent = bench.collectives.bytes_sent
        bench.close()
        for impl in impls:
            mine = np.array(times[impl])
            everyone = np.array(world.allgather(mine.tolist()))  # ranks x reps
            per_rank = np.median(everyone, axis=1) * 1e6
            per_rep = everyone.max(axis=0) * 1e6
            q1, med, q3 = np.percentile(per_rep, [25, 50, 75])
            algbw = nbytes / (med * 1e-6) / 1e9
            busbw = algbw * 2 * (n - 1) / n if n > 1 else 0.0
            rec = {
                "impl": impl,
                "ranks": n,
                "bytes": nbytes,
                "avg_us": float(per_rank.mean()),
                "min_us": float(per_rank.min()),
                "max_us": float(per_rank.max()),
                "median_us": float(med),
                "iqr_us": float(q3 - q1),
                "algbw_GBps": algbw,
                "busbw_GBps": busbw,
                "reps": reps,
                "wire": args.wire if impl.startswith("hybridagg") else "fp32",
                "gap_ms": args.gap_ms,
            }
            if impl == "hybridagg-flat" and args.wire != "fp32" and flat_ops:
                rec["sent_bytes"] = sent // flat_ops
            records.append(rec)
            if world.rank == 0:
                print(
                    f"  {impl:<15}{human(nbytes):>10}{rec['avg_us']:12.1f}{rec['min_us']:12.1f}"
                    f"{rec['max_us']:12.1f}{med:12.1f}{q3 - q1:10.1f}{algbw:12.3f}{busbw:12.3f}",
                    flush=True,
                )
    if world.rank == 0 and args.json:
        with open(args.json, "w") as fh:
            json.dump(records, fh, indent=1)
        print(f"# wrote {len(records)} records to {args.json}")
    if world.rank == 0:
        summarize(records, n)
    return 0


def summarize(records: list[dict], n: int) -> None:
    """Print hybridagg's busbw relative to the faster MPI anchor and to gloo."""
    by = {(r["impl"], r["bytes"]): r for r in records}
    print("# hybridagg busbw / best(mpi4py, mpi4py-nb) and / gloo, per size")
    for nbytes in sorted({r["bytes"] for r in records}):
        h = by.get(("hybridagg", nbytes))
        anchors = [
            by[(i, nbytes)]["busbw_GBps"]
            for i in ("mpi4py", "mpi4py-nb")
            if (i, nbytes) in by
        ]
        gloo = by.get(("gloo", nbytes))
        if not h or not anchors or n < 2:
            continue
        vs_mpi = h["busbw_GBps"] / max(anchors)
        vs_gloo = h["busbw_GBps"] / gloo["busbw_GBps"] if gloo else float("nan")
        print(f"#   {human(nbytes):>10}  vs MPI {vs_mpi:6.2f}  vs gloo {vs_gloo:6.2f}")


if __name__ == "__main__":
    sys.exit(main())
