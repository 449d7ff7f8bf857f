"""The non-finite check's cost against a step at ResNet-50 size.

Run under MPI, e.g. ``hybridagg run -n 2 -- python bench/nonfinite_check.py --json out.json``.

Every step, each rank checks the reduced gradient for NaN and infinity
(:func:`hybridagg.comm.all_finite`: a sum per bucket, the exact
``isfinite().all()`` only when a sum is not finite). This measures, on a
float32 gradient of ResNet-50's size (25,557,032 parameters, 97.5 MiB) cut
into the reducer's 25 MiB buckets, interleaved repetition by repetition so
drifts of a shared machine hit all alike:

    check-sum       all_finite over the buckets (what training runs)
    check-isfinite  torch.isfinite(bucket).all() over the buckets (the
                    exact check alone, for comparison)
    allreduce       hybridagg's all-reduce of the same buffer over every
                    rank (Collectives.allreduce: the ring or shared memory),
                    the communication of one step and a lower bound on it

A repetition's time is the slowest rank's (every rank checks its own copy at
the same time, as in training). The table prints medians and the check's
share of two step bounds: the all-reduce alone (no compute at all), and the
reference compute of a ResNet-50 step, estimated as its floating-point
operations (4.1 GFLOP forward per 224x224 image, backward twice that, times
``--batch``) at this rank's measured single-thread matrix-multiply rate.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

import hybridagg
from hybridagg.collectives import Collectives
from hybridagg.comm import Comm, all_finite

RESNET50_PARAMS = 25_557_032
RESNET50_FWD_GFLOP = 4.1  # per 224x224 image (multiply-adds counted as 2)
BUCKET_BYTES = 25 * 2**20


def buckets_of(flat: torch.Tensor) -> list[torch.Tensor]:
    """The reducer's buckets of ``flat`` (25 MiB each, the last one shorter)."""
    per = BUCKET_BYTES // flat.element_size()
    return list(flat.split(per))


def gemm_gflops(n: int = 1024, reps: int = 5) -> float:
    """This rank's single-thread float32 matrix-multiply rate, GFLOP/s."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    start = time.perf_counter()
    for _ in range(reps):
        torch.mm(a, b)
    return 2 * n**3 * reps / (time.perf_counter() - start) / 1e9


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--params", type=int, default=RESNET50_PARAMS)
    parser.add_argument("--batch", type=int, default=32, help="for the compute bound")
    parser.add_argument("--json", help="write the records here")
    args = parser.parse_args(argv)

    topo = hybridagg.init()
    world = topo.comms.world
    comm = Comm(name="bench")
    collectives = Collectives(comm)
    torch.manual_seed(world.rank)
    flat = torch.randn(args.params) * 1e-3
    scratch = flat.clone()
    buckets = buckets_of(flat)

    def run(impl: str) -> float:
        if impl == "allreduce":
            scratch.copy_(flat)  # (untimed: the same values every time)
        comm.mpi.Barrier()  # blocking, as OSU: ranks leave it together
        start = time.perf_counter()
        if impl == "check-sum":
            assert all_finite(buckets)
        elif impl == "check-isfinite":
            assert all(bool(torch.isfinite(b).all()) for b in buckets)
        else:
            collectives.allreduce(scratch)
        return time.perf_counter() - start

    impls = ["check-sum", "check-isfinite", "allreduce"]
    times: dict[str, list[float]] = {i: [] for i in impls}
    for rep in range(args.warmup + args.reps):
        order = impls[rep % len(impls) :] + impls[: rep % len(impls)]
        for impl in order:
            t = run(impl)
            if rep >= args.warmup:
                times[impl].append(t)
    gflops = gemm_gflops()
    everyone = world.allgather({"times": times, "gflops": gflops}, what="results")
    comm.free()
    if world.rank != 0:
        return 0
    med = {}
    for impl in impls:
        per_rep = [max(r["times"][impl][k] for r in everyone) for k in range(args.reps)]
        med[impl] = statistics.median(per_rep)
    compute_s = max(3 * RESNET50_FWD_GFLOP * args.batch / r["gflops"] for r in everyone)
    nbytes = args.params * 4
    print(
        f"# non-finite check, {args.params:,} float32 parameters "
        f"({nbytes / 2**20:.1f} MiB, {len(buckets)} buckets), {world.size} ranks, "
        f"{args.reps} reps, medians of the slowest rank"
    )
    print(f"# {'impl':<16}{'median_ms':>12}{'% of allreduce':>16}{'% of compute':>15}")
    records = []
    for impl in impls:
        ms = med[impl] * 1e3
        of_ar = 100 * med[impl] / med["allreduce"]
        of_compute = 100 * med[impl] / compute_s
        print(f"  {impl:<16}{ms:12.2f}{of_ar:16.2f}{of_compute:15.3f}")
        records.append(
            {
                "impl": impl,
                "ranks": world.size,
                "params": args.params,
                "median_ms": ms,
                "pct_of_allreduce": of_ar,
                "pct_of_compute": of_compute,
                "reps": args.reps,
            }
        )
    print(
        f"# compute bound: ResNet-50 forward+backward of {args.batch} images "
        f"= {3 * RESNET50_FWD_GFLOP * args.batch:.0f} GFLOP at "
        f"{min(r['gflops'] for r in everyone):.1f} GFLOP/s (slowest rank, one "
        f"thread) = {compute_s:.2f} s"
    )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"records": records, "compute_s": compute_s}, fh, indent=1)
        print(f"# wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
