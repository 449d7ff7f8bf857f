"""What a polling wait costs in CPU: the waiting rank's process time per wait.

Run under MPI on 2 ranks, e.g.
``hybridagg run -n 2 -- python bench/wait_cost.py --json out.json``.

Rank 0 sleeps ``T`` seconds and then sends one float; rank 1 waits for it
through :func:`hybridagg.comm.waits.wait` (the poll every blocking call of
the runtime goes through: a spin, then sleeps backing off with the time
waited) and records its own wall and CPU time (``time.process_time``) over
the wait. Per ``T`` (``--waits``), the medians over ``--reps``
repetitions, and the CPU as a share of the wall time. On oversubscribed
cores a waiting rank's CPU is taken from the ranks that compute, so this
is what a simulator that lets waits cost nothing leaves out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
from mpi4py import MPI

from hybridagg.comm.waits import wait


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--waits", default="0.01,0.05,0.2,1", help="seconds, comma-separated"
    )
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--json")
    args = p.parse_args(argv)
    try:
        waits = [float(w) for w in args.waits.split(",") if w]
    except ValueError:
        raise SystemExit(f"--waits must be numbers, got {args.waits!r}") from None
    if not waits or min(waits) <= 0 or args.reps < 1:
        raise SystemExit("--waits must be > 0 and --reps >= 1")
    comm = MPI.COMM_WORLD
    if comm.size != 2:
        raise SystemExit("run it on 2 ranks (hybridagg run -n 2 -- ...)")
    rows = []
    for seconds in waits:
        wall, cpu = [], []
        for _ in range(args.reps):
            comm.Barrier()
            if comm.rank == 0:
                time.sleep(seconds)
                comm.Send(np.zeros(1), dest=1)
                continue
            buf = np.empty(1)
            req = comm.Irecv(buf, source=0)
            t0, c0 = time.perf_counter(), time.process_time()
            wait(req, what="bench/wait_cost.py's message", timeout=60 + 2 * seconds)
            wall.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
        if comm.rank == 1:
            w, c = statistics.median(wall), statistics.median(cpu)
            rows.append(
                {"wait_s": seconds, "wall_s": w, "cpu_s": c, "cpu_share": c / w}
            )
    if comm.rank == 1:
        print("| wait (s) | wall (s) | CPU of the waiting rank (ms) | CPU / wall |")
        print("|---:|---:|---:|---:|")
        for r in rows:
            print(
                f"| {r['wait_s']:g} | {r['wall_s']:.3f} | {r['cpu_s'] * 1e3:.1f} "
                f"| {r['cpu_share']:.1%} |"
            )
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"reps": args.reps, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
