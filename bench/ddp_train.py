"""The outside baselines of ``bench/hetero.py``: PyTorch DDP (gloo) or Horovod.

Run under MPI like ``hybridagg train`` (``mpiexec -n 4 python bench/ddp_train.py
--data digits.h5 ...``; ``--backend horovod`` needs ``make horovod``).
Everything but the aggregation is hybridagg's, so the
comparison is of aggregation alone: the same model zoo, the same HDF5 loader
with static shares, the same emulated heterogeneity (``--slowdown``,
``--sample-ms``), the same learning-rate rule (``--lr`` per worker's batch,
scaled linearly by the samples of an update: DDP averages over the workers,
so the rate is multiplied by their number), the same validation on rank 0
and the same summary keys. DDP all-reduces inside ``backward()`` (Horovod posts
its all-reduces from the same hooks and waits in ``step()``), so a step's
emulated compute is slept between forward and backward: the target minus the
forward time and an estimate of the backward compute (twice the forward).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from mpi4py import MPI

from hybridagg.comm import Comm, configure_threads
from hybridagg.data import HDF5Loader
from hybridagg.data.loader import load_split_info
from hybridagg.optimizer import init_torch_distributed
from hybridagg.slowdown import parse_slowdown
from hybridagg.train.config import TrainConfig
from hybridagg.train.emulation import Pacer, ideal_samples_per_sec
from hybridagg.train.evaluate import Evaluator
from hybridagg.train.models import build_model
from hybridagg.train.pacing import LayerPacer


def _wrap(backend: str, model: torch.nn.Module, cfg: TrainConfig, n: int):
    """The model to call and the optimizer, aggregated by ``backend``."""
    if backend == "horovod":
        import horovod.torch as hvd

        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        opt = torch.optim.SGD(model.parameters(), lr=cfg.lr * n, momentum=cfg.momentum)
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
        return model, opt
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    return ddp, torch.optim.SGD(ddp.parameters(), lr=cfg.lr * n, momentum=cfg.momentum)


def train_ddp(cfg: TrainConfig, comm: Comm, backend: str = "ddp") -> dict | None:
    """One run with DDP or Horovod; returns the summary on rank 0."""
    rank, n = comm.rank, comm.size
    torch.manual_seed(cfg.seed)
    info = load_split_info([cfg.data], "train")[0]
    model = build_model(cfg.model, info.sample_shape, info.num_classes)
    ddp, opt = _wrap(backend, model, cfg, n)
    blocks = -(-info.length // info.block_samples)
    loader = HDF5Loader(
        cfg.data,
        batch_size=cfg.batch_size,
        comm=comm,
        seed=cfg.seed,
        normalize=True,
        window_blocks=max(1, min(8, blocks // (8 * n))),
    )
    evaluator = Evaluator(cfg, model, torch.device("cpu")) if rank == 0 else None
    slowdown = parse_slowdown(cfg.slowdown)
    comm.barrier(what="start")
    start = time.perf_counter()
    pacer = Pacer(slowdown, rank, cfg.sample_ms, start)
    layers = None  # the emulated compute inside forward and backward, as in hybridagg
    samples, updates, evals_s, first, bucket, accuracy = 0, 0, 0.0, None, 0, None
    epochs = cfg.max_epochs or 1
    for _ in range(epochs):
        for x, y in loader:
            opt.zero_grad()
            if layers is None:
                # no progress calls: DDP's and Horovod's communication runs in
                # their own background threads
                layers = LayerPacer.for_model(model, pacer, x[:1])
            layers.begin(len(y))
            out = ddp(x)
            if len(y):
                loss = torch.nn.functional.cross_entropy(out, y)
            else:  # a worker whose static share ran out joins with zeros
                loss = out.sum() * 0.0
            loss.backward()  # the all-reduce (an empty share still joins with 0s)
            layers.end()
            opt.step()
            samples += len(y)
            updates += 1
            if rank == 0 and updates // cfg.eval_every > bucket:
                bucket = updates // cfg.eval_every
                e0 = time.perf_counter()
                accuracy, _ = evaluator.evaluate(model)
                evals_s += time.perf_counter() - e0
                train_time = time.perf_counter() - start - evals_s
                target = cfg.target_accuracy
                if target is not None and accuracy >= target and first is None:
                    first = train_time
    end = time.perf_counter() - start
    loader.close()
    reports = comm.allgather((samples, end), what="report")
    if rank == 0:
        accuracy, _ = evaluator.evaluate(model)
        evaluator.close()
    if rank != 0:
        return None
    wall = max(w for _, w in reports)
    total = sum(s for s, _ in reports)
    ideal = (
        ideal_samples_per_sec(slowdown, n, cfg.sample_ms, wall)
        if cfg.sample_ms
        else None
    )
    return {
        "mode": backend,
        "world_size": n,
        "workers": n,
        "groups": [list(range(n))],
        "servers": 0,
        "samples": total,
        "samples_per_sec": total / wall,
        "ideal_samples_per_sec": ideal,
        "efficiency": (total / wall) / ideal if ideal else None,
        "wall_s": wall,
        "time_to_target_s": first,
        "target_accuracy": cfg.target_accuracy,
        "final_accuracy": accuracy,
        "steps": updates,
        "stall_fraction": None,
        "mean_staleness": 0.0,
        "seed": cfg.seed,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", choices=("ddp", "horovod"), default="ddp")
    p.add_argument("--data", required=True)
    p.add_argument("--model", default="mlp")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--target-accuracy", type=float)
    p.add_argument("--slowdown")
    p.add_argument("--sample-ms", type=float, default=0.0)
    p.add_argument("--seeds", default="0", help="comma-separated: one run per seed")
    p.add_argument("--summary", help="JSON list of the runs' summaries (rank 0)")
    args = p.parse_args(argv)
    configure_threads()
    comm = Comm(MPI.COMM_WORLD, name="ddp")
    if args.backend == "horovod":
        import horovod.torch as hvd

        hvd.init(comm=MPI.COMM_WORLD)
    else:
        init_torch_distributed(comm, "gloo")
    out = []
    for seed in [int(s) for s in args.seeds.split(",")]:
        cfg = TrainConfig(
            data=args.data,
            model=args.model,
            lr=args.lr,
            batch_size=args.batch_size,
            epochs=args.epochs,
            eval_every=args.eval_every,
            target_accuracy=args.target_accuracy,
            slowdown=args.slowdown,
            sample_ms=args.sample_ms,
            seed=seed,
        )
        summary = train_ddp(cfg, comm, args.backend)
        if summary is not None:
            out.append(summary)
    if comm.rank == 0 and args.summary:
        Path(args.summary).write_text(json.dumps(out, indent=1))
    if args.backend == "horovod":
        import horovod.torch as hvd

        hvd.shutdown()
    else:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
