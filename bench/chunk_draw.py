"""How long a worker waits for its next data chunk: the window on worker 0 against server 0.

Run under MPI with workers and one server (the last rank), e.g.::

    hybridagg run -n 5 -- python bench/chunk_draw.py
    hybridagg-run --cluster bench/clusters/four-workers-10g.toml -- python bench/chunk_draw.py

Every worker's main thread paces steps as a paced training step does: it
sleeps ``--step-ms`` (where a worker computes), then enters MPI once (where
it exchanges with the servers; here an ``MPI_Iprobe``). Its reader thread
draws a chunk number, as the loader's read-ahead does, then waits
``--chunk-steps`` steps' time before the next draw. The counter is either
``window`` (:class:`hybridagg.data.shares.WindowCounter`, an MPI one-sided
window on worker 0) or ``server`` (:class:`hybridagg.comm.counter.ServedCounter`,
answered by the server rank, which polls as a parameter server's loop does,
backing off at most ``HYBRIDAGG_SERVER_MAX_SLEEP_US``);
both run in one job, one after the other, over the same ranks.

Reported per counter: draws, the median and 90th percentile of a draw's
wait, and the CPU time the drawing thread used per draw (a wait that spins
inside MPI costs a core on a machine whose cores the ranks share). The
bound is the shared-memory window's: a draw that completes without
worker 0 takes microseconds.
"""

from __future__ import annotations

import argparse
import json
import threading
import time

import numpy as np
from mpi4py import MPI

from hybridagg.comm import Comm
from hybridagg.comm.counter import CounterHost, ServedCounter
from hybridagg.data.shares import WindowCounter
from hybridagg.ps.server import server_max_sleep


def _draws(counter, seconds: float, gap_s: float) -> tuple[list[float], float]:
    """The reader thread: draw, wait ``gap_s``, until ``seconds`` pass."""
    waits: list[float] = []
    cpu0 = time.thread_time()
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        t = time.perf_counter()
        counter.fetch_add()
        waits.append(time.perf_counter() - t)
        time.sleep(gap_s)
    return waits, time.thread_time() - cpu0


def _worker(counter, workers: Comm, args) -> tuple[list[float], float]:
    step = args.step_ms * 1e-3
    box: dict = {}
    reader = threading.Thread(
        target=lambda: box.update(
            r=_draws(counter, args.seconds, step * args.chunk_steps)
        )
    )
    workers.barrier(what="start")
    reader.start()
    while reader.is_alive():  # paced steps: one MPI entry a step
        time.sleep(step)
        workers.mpi.Iprobe()
    reader.join()
    return box["r"]


def _run(kind: str, world: Comm, workers: Comm | None, args) -> dict | None:
    server = world.size - 1
    counter = host = None
    if kind == "server":
        comm = world
        if world.rank == server:
            host = CounterHost(comm, range(server))
        else:
            counter = ServedCounter(comm, server, workers)
    elif workers is not None:
        counter = WindowCounter(workers)
    result = None
    if workers is not None:
        result = _worker(counter, workers, args)
    done = world.mpi.Ibarrier()
    if host is None:
        world.wait(done, "end of draws")
    else:  # a parameter server's loop: poll, back off at most its own cap
        world.wait_for(
            lambda: host.poll() >= 0 and done.Test(),
            "end of draws",
            max_sleep=server_max_sleep(),
        )
    if isinstance(counter, WindowCounter):
        counter.free()
    if host is not None:
        host.close()
    gathered = world.allgather(result, what="results")
    if world.rank != 0:
        return None
    waits = np.array([w for r in gathered if r for w in r[0]]) * 1e3
    cpu = sum(r[1] for r in gathered if r)
    return {
        "counter": kind,
        "workers": server,
        "draws": int(waits.size),
        "median_ms": float(np.median(waits)),
        "p90_ms": float(np.percentile(waits, 90)),
        "max_ms": float(waits.max()),
        "cpu_ms_per_draw": 1e3 * cpu / max(1, waits.size),
        "step_ms": args.step_ms,
        "chunk_steps": args.chunk_steps,
        "seconds": args.seconds,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--counters", default="window,server", help="window, server")
    p.add_argument("--step-ms", type=float, default=32.0, help="a paced step")
    p.add_argument("--chunk-steps", type=float, default=4.0, help="steps a chunk lasts")
    p.add_argument("--seconds", type=float, default=3.0, help="per counter")
    p.add_argument("--json", help="write the records here")
    args = p.parse_args(argv)
    world = Comm(MPI.COMM_WORLD, name="bench")
    if world.size < 2:
        raise SystemExit("chunk_draw: needs at least 2 ranks (workers and a server)")
    workers = world.split(
        0 if world.rank < world.size - 1 else None, world.rank, name="workers"
    )
    records = []
    for kind in args.counters.split(","):
        if kind not in ("window", "server"):
            raise SystemExit(f"chunk_draw: unknown counter {kind!r}")
        rec = _run(kind, world, workers, args)
        if rec is not None:
            records.append(rec)
    if world.rank == 0:
        print(
            f"{world.size - 1} workers, steps of {args.step_ms:g} ms, a draw every "
            f"{args.chunk_steps:g} steps, {args.seconds:g} s per counter"
        )
        print(
            "| counter | draws | wait median (ms) | p90 (ms) | max (ms) | CPU per draw (ms) |"
        )
        print("|---|---:|---:|---:|---:|---:|")
        for r in records:
            print(
                f"| {r['counter']} | {r['draws']} | {r['median_ms']:.3f} | "
                f"{r['p90_ms']:.3f} | {r['max_ms']:.1f} | {r['cpu_ms_per_draw']:.2f} |"
            )
        if args.json:
            with open(args.json, "w") as fh:
                json.dump({"records": records}, fh, indent=1)
            print(f"# wrote {args.json}")
    if workers is not None:
        workers.free()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
