"""Does the heartbeat's thread slow the main thread's communication?

Run under MPI, e.g. ``hybridagg run -n 2 -- python bench/heartbeat.py``.

Times a polled all-reduce (``Comm.Allreduce``, what every step's collectives
wait through) of a small and a large buffer, in blocks of ``--iters``
operations, with no heartbeat and with heartbeats of the default failure
timeout (30 s: a beat a second) and of the tests' one (5 s: a beat every
0.5 s), side by side: the repetitions are
interleaved (one block of each variant in turn) so drifts of a shared
machine hit all alike. A block's time is its slowest rank's. Prints each
variant's median per operation and its ratio to no heartbeat.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from mpi4py import MPI

from hybridagg.comm import Comm, Heartbeat


def _block(comm: Comm, buf: np.ndarray, iters: int) -> float:
    comm.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        comm.Allreduce(buf)
    mine = time.perf_counter() - t0
    return comm.allreduce(mine, max) / iters


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=12)
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument(
        "--sizes", default="4096,4194304", help="bytes, comma-separated"
    )
    args = parser.parse_args(argv)
    comm = Comm(MPI.COMM_WORLD, name="bench")
    variants = {"none": None, "timeout 30 s": 30.0, "timeout 5 s": 5.0}
    for size in (int(s) for s in args.sizes.split(",")):
        buf = np.ones(size // 4, dtype=np.float32)
        times: dict[str, list[float]] = {v: [] for v in variants}
        _block(comm, buf, args.iters)  # warm-up
        for _ in range(args.reps):
            for name, timeout in variants.items():
                if timeout is None:
                    times[name].append(_block(comm, buf, args.iters))
                    continue
                with Heartbeat(MPI.COMM_WORLD, timeout=timeout):
                    times[name].append(_block(comm, buf, args.iters))
        if comm.rank == 0:
            base = statistics.median(times["none"])
            for name, values in times.items():
                med = statistics.median(values)
                print(
                    f"{size:>9} B  {name:<14} {med * 1e6:9.1f} us/op  "
                    f"ratio {med / base:.3f}"
                )
    comm.free()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
