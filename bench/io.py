"""I/O benchmark of the HDF5 loader (issue 5).

On a generated file of at least 1 GiB (3x32x32 uint8 synthetic images),
measures samples/s and MB/s (1 MB = 1e6 bytes) of one epoch:

* ``hybridagg``         the loader (posix driver), 1 rank and 2 ranks (aggregate)
* ``h5py-raw``          plain h5py ``read_direct`` of the same blocks in the same
                        order, no shuffle, no batches (the ceiling), 1 and 2 ranks
* ``torch-dataloader``  ``torch.utils.data.DataLoader(num_workers=2)`` over a
                        map-style h5py dataset (what users write today)
* ``hybridagg-mpio``    the loader through ``driver="mpio"``, when h5py has MPI
                        (run this script with ``.venv-mpio/bin/python``)
* ``hybridagg-train-loop``  a small CNN trained on the data; reports the
                        fraction of step time spent waiting for data

Page-cache-warm by default; ``--cold`` also drops the page cache before each
1-rank measurement (needs root and a writable ``/proc/sys/vm/drop_caches``).
An epoch of the 1 GiB file takes well under a second warm, so the warm
1-rank rows are the median of ``--reps`` epochs, raw and loader interleaved
(the records also carry the minimum and maximum).

Usage::

    .venv/bin/python bench/io.py --dir /tmp --json io.json [--cold]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from hybridagg.data import (  # noqa: E402
    EpochPlan,
    HDF5Dataset,
    HDF5Loader,
    convert_synthetic,
    mpio_available,
)
from hybridagg.data.reader import runs_of  # noqa: E402

SHAPE = (3, 32, 32)
SAMPLE_BYTES = int(np.prod(SHAPE))


def make_file(directory: Path, gib: float) -> Path:
    n = int(np.ceil(gib * (1 << 30) / SAMPLE_BYTES))
    path = directory / f"hybridagg-io-{n}.h5"
    if not path.exists():
        print(f"generating {path} ({n} samples, {n * SAMPLE_BYTES / 1e9:.2f} GB)")
        convert_synthetic(
            path, samples=n, shape=SHAPE, dtype="uint8", val_fraction=0.0, progress=True
        )
    return path


def warm(path: Path) -> None:
    with open(path, "rb") as f:
        while f.read(64 << 20):
            pass


def drop_caches() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def record(impl: str, ranks: int, samples: int, nbytes: int, seconds: float, **extra):
    rec = {
        "impl": impl,
        "ranks": ranks,
        "samples_per_sec": samples / seconds,
        "MBps": nbytes / seconds / 1e6,
        "seconds": seconds,
        "samples": samples,
    }
    rec.update(extra)
    return rec


# ------------------------------------------------------------------ one rank
def run_raw(path: Path, window_blocks: int, rank: int = 0, size: int = 1):
    """Read this rank's windows of epoch 0 (same blocks, same order) with h5py."""
    import h5py

    with h5py.File(path, "r") as f:
        d = f["train/samples"]
        block = int(f.attrs["block_samples"])
        plan = EpochPlan([d.shape[0]], block, window_blocks, seed=0, epoch=0)
        buf = np.empty((window_blocks * block, *SHAPE), dtype=np.uint8)
        n = 0
        t0 = time.perf_counter()
        for g in range(rank, plan.n_windows, size):
            row = 0
            for _, s, c in runs_of(plan.window_blocks(g)):
                d.read_direct(buf, np.s_[s:c], np.s_[row : row + c - s])
                row += c - s
            n += row
        return n, time.perf_counter() - t0


def run_loader(path: Path, batch: int, window_blocks: int, comm=None, driver="auto"):
    with HDF5Loader(
        path,
        batch_size=batch,
        comm=comm,
        window_blocks=window_blocks,
        seed=0,
        driver=driver,
    ) as ld:
        t0 = time.perf_counter()
        n = 0
        for _, y in ld:
            n += len(y)
        return n, time.perf_counter() - t0, ld.driver


def run_dataloader(path: Path, batch: int, max_seconds: float):
    import torch

    ds = HDF5Dataset(path)
    dl = torch.utils.data.DataLoader(
        ds,
        batch_size=batch,
        shuffle=True,
        num_workers=2,
        generator=torch.Generator().manual_seed(0),
    )
    n = 0
    t0 = time.perf_counter()
    for _, y in dl:
        n += len(y)
        if time.perf_counter() - t0 > max_seconds:
            break
    return n, time.perf_counter() - t0


def run_train_loop(path: Path, batch: int, window_blocks: int, steps: int):
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(64 * 8 * 8, 128),
        nn.ReLU(),
        nn.Linear(128, 10),
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    losses = []
    with HDF5Loader(
        path, batch_size=batch, window_blocks=window_blocks, seed=0, normalize=True
    ) as ld:
        it = iter(ld)
        x, y = next(it)  # the first batch (cold start) is not part of the loop
        ld.stats.wait_seconds = 0.0
        t0 = time.perf_counter()
        n = 0
        for step in range(steps):
            opt.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
            n += len(y)
            if step + 1 < steps:
                x, y = next(it)
        elapsed = time.perf_counter() - t0
        stall = ld.stats.wait_seconds / elapsed
        it.close()
        return (
            n,
            elapsed,
            stall,
            float(np.mean(losses[:10])),
            float(np.mean(losses[-10:])),
        )


# --------------------------------------------------------------- two ranks
def worker(args) -> None:
    """One rank of a multi-rank measurement (started under mpiexec)."""
    from mpi4py import MPI

    from hybridagg.comm import Comm

    comm = Comm(name="bench")
    path = Path(args.file)
    comm.barrier()
    t0 = time.perf_counter()
    if args.worker == "h5py-raw":
        n, _ = run_raw(path, args.window_blocks, comm.rank, comm.size)
    else:
        driver = "mpio" if args.worker == "hybridagg-mpio" else "posix"
        n, _, _ = run_loader(path, args.batch, args.window_blocks, comm, driver)
    comm.barrier()
    elapsed = time.perf_counter() - t0
    total = sum(comm.allgather(n))
    if comm.rank == 0:
        rec = record(args.worker, comm.size, total, total * SAMPLE_BYTES, elapsed)
        Path(args.out).write_text(json.dumps(rec))
    comm.free()
    del MPI


def run_ranks(impl: str, path: Path, args, ranks: int) -> dict | None:
    from hybridagg.runtime import runner

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rec.json"
        cmd = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--worker",
            impl,
            "--file",
            str(path),
            "--out",
            str(out),
            "--batch",
            str(args.batch),
            "--window-blocks",
            str(args.window_blocks),
        ]
        res = runner.run_job(
            runner.mpiexec_argv(ranks, cmd), timeout=900, env=runner.mpiexec_env()
        )
        if res.returncode != 0 or not out.exists():
            print(f"{impl} at {ranks} ranks failed:\n{res.stderr[-3000:]}")
            return None
        return json.loads(out.read_text())


# ---------------------------------------------------------------------- main
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default="/tmp", help="where the generated file lives")
    ap.add_argument("--gib", type=float, default=1.0, help="file size in GiB (>= 1)")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--window-blocks", type=int, default=8)
    ap.add_argument("--ranks", type=int, default=2, help="ranks of the aggregate row")
    ap.add_argument("--train-steps", type=int, default=150)
    ap.add_argument("--dataloader-seconds", type=float, default=60.0)
    ap.add_argument("--cold", action="store_true", help="also measure cold cache")
    ap.add_argument("--reps", type=int, default=7, help="epochs per warm 1-rank row")
    ap.add_argument("--json", help="write the records to this file")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--file", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return 0
    import torch

    torch.set_num_threads(1)
    path = make_file(Path(args.dir), args.gib)
    nbytes_file = path.stat().st_size
    records = []

    def add(rec, note=""):
        records.append(rec)
        print(
            f"{rec['impl']:<22} ranks={rec['ranks']}  {rec['samples_per_sec']:>10.0f} "
            f"samples/s  {rec['MBps']:>8.1f} MB/s  {note}",
            flush=True,
        )

    def one_rank(cache: str):
        if cache == "cold":
            drop_caches()
        else:
            warm(path)
        n, s = run_raw(path, args.window_blocks)
        add(record("h5py-raw", 1, n, n * SAMPLE_BYTES, s, cache=cache), cache)
        if cache == "cold":
            drop_caches()
        n, s, _ = run_loader(path, args.batch, args.window_blocks)
        add(record("hybridagg", 1, n, n * SAMPLE_BYTES, s, cache=cache), cache)

    def one_rank_warm(reps: int):
        warm(path)
        run_raw(path, args.window_blocks)  # warm-up pass, not recorded
        times: dict[str, list[tuple[int, float]]] = {"h5py-raw": [], "hybridagg": []}
        for _ in range(reps):
            times["h5py-raw"].append(run_raw(path, args.window_blocks))
            times["hybridagg"].append(
                run_loader(path, args.batch, args.window_blocks)[:2]
            )
        for impl, runs in times.items():
            secs = sorted(s for _, s in runs)
            n = runs[0][0]
            add(
                record(
                    impl,
                    1,
                    n,
                    n * SAMPLE_BYTES,
                    secs[len(secs) // 2],
                    cache="warm",
                    reps=reps,
                    samples_per_sec_min=n / secs[-1],
                    samples_per_sec_max=n / secs[0],
                ),
                f"warm, median of {reps}",
            )

    print(f"file {path}: {nbytes_file / 2**30:.2f} GiB")
    one_rank_warm(args.reps)
    if args.cold:
        cold_ok = drop_caches()
        if cold_ok:
            one_rank("cold")
        else:
            print("cannot drop the page cache here: no cold figures")
    warm(path)
    n, s = run_dataloader(path, args.batch, args.dataloader_seconds)
    add(record("torch-dataloader", 1, n, n * SAMPLE_BYTES, s, cache="warm"), "warm")
    if mpio_available():
        rec = run_ranks("hybridagg-mpio", path, args, 1)
        if rec:
            add(dict(rec, cache="warm"), "warm")
    for impl in ("h5py-raw", "hybridagg") + (
        ("hybridagg-mpio",) if mpio_available() else ()
    ):
        rec = run_ranks(impl, path, args, args.ranks)
        if rec:
            add(dict(rec, cache="warm"), "warm")
    n, s, stall, first, last = run_train_loop(
        path, 128, args.window_blocks, args.train_steps
    )
    add(
        record(
            "hybridagg-train-loop",
            1,
            n,
            n * SAMPLE_BYTES,
            s,
            stall_fraction=stall,
            loss_first=first,
            loss_last=last,
            cache="warm",
        ),
        f"stall {stall:.2%} of step time; loss {first:.3f} -> {last:.3f}",
    )
    warm_recs = [r for r in records if r.get("cache") == "warm" and r["ranks"] == 1]
    by = {r["impl"]: r for r in warm_recs}
    ratio = by["hybridagg"]["samples_per_sec"] / by["h5py-raw"]["samples_per_sec"]
    vs_dl = (
        by["hybridagg"]["samples_per_sec"] / by["torch-dataloader"]["samples_per_sec"]
    )
    print(
        f"1 rank, warm: hybridagg = {ratio:.0%} of raw h5py, {vs_dl:.1f}x the DataLoader"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(records, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
