"""A worker's set-up: model, optimizer, evaluator, the part resumed, loader, distributed optimizer."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ...comm import Comm
from ...data import HDF5Loader, compute_statistics
from ...data.loader import load_split_info
from ...optimizer import DistributedOptimizer
from ...runtime import envvars
from ...topology import Topology
from ...windows import window_blocks_for
from ..adaptive import server_batching
from ..board import check_available
from ..common import compensation_of, make_optimizer, seed_rng, set_rng_state
from ..config import TrainConfig
from ..evaluate import Evaluator
from ..export import check_destination
from ..losses import check_task
from ..models import build_model, check_fits, resolve_device
from ..precision import Precision
from ..resume import Resumed

__all__ = [
    "Local",
    "make_distributed_optimizer",
    "make_loader",
    "set_up_local",
    "training_statistics",
]


@dataclass
class Local:
    """What a worker builds without communicating."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    device: torch.device
    evaluator: Evaluator | None
    """Rank 0's, ``None`` elsewhere."""
    window_blocks: int
    """Blocks per loader window (the shuffle buffer and the dynamic chunk)."""
    statistics: tuple[np.ndarray, np.ndarray] | None = None
    """``--normalize compute``: the statistics computed at start (else ``None``)."""
    part: dict | None = None
    """This rank's part of the checkpoint resumed from (made for it if it had none)."""
    done_already: bool = False
    """The checkpoint has no part for this rank: its group had finished (hybrid, async)."""
    precision: Precision | None = None
    """``--amp``: autocast and the loss scale (continued from the part resumed)."""


def set_up_local(cfg: TrainConfig, topo: Topology, resumed: Resumed | None) -> Local:
    """Build the model, its optimizer and (rank 0) the evaluator; restore the resumed part.

    Args:
        cfg: The run's options.
        topo: The topology.
        resumed: The checkpoint resumed from, its parts loaded
            (:func:`~hybridagg.train.resume.start_run`); ``None``: fresh.

    Raises:
        ValueError, TypeError, OSError: A bad device, model (or one that does
            not fit the data), data file or checkpoint.
    """
    torch.manual_seed(cfg.seed)
    # first: collective over the workers, and no worker fails before it
    statistics = training_statistics(cfg, topo.comms.workers if topo.comms else None)
    info = load_split_info([cfg.data], "train")[0]
    if cfg.normalize == "stored" and info.norm_mean is None:
        raise ValueError(
            f"--normalize stored: data file {cfg.data} records no normalisation "
            "statistics (norm_mean, norm_std); pass --normalize compute (computed "
            "from the training split at start) or --normalize none, or write the "
            "file with 'hybridagg convert'"
        )
    window_blocks = window_blocks_for(info.length, info.block_samples, topo.num_workers)
    if resumed is not None:
        # the saved positions refer to the old run's sample order; a
        # checkpoint that did not record it was written at its own size
        window_blocks = resumed.worker.window_blocks or window_blocks_for(
            info.length, info.block_samples, resumed.plan.old.workers
        )
    check_task(cfg.loss, info.regression, cfg.data)
    check_available(cfg.tensorboard)
    if topo.rank == 0 and cfg.save_model:
        check_destination(cfg.save_model)  # (not after hours of training)
    # (init resolved --device for this rank: auto to its node-local GPU or the CPU)
    device = resolve_device(topo.device, topo.rank)
    precision = Precision.for_run(cfg.amp, device)  # (fp16 on a CPU: refused)
    model = build_model(cfg.model, info.sample_shape, info.num_classes).to(device)
    check_fits(model, info.sample_shape, info.num_classes, cfg.model, device, cfg.loss)
    optimizer = make_optimizer(cfg, model)
    evaluator = (
        Evaluator(cfg, model, device, loss=cfg.loss, statistics=statistics)
        if topo.rank == 0
        else None
    )
    local = Local(
        model,
        optimizer,
        device,
        evaluator,
        window_blocks,
        statistics,
        precision=precision,
    )
    if resumed is None:
        return local
    local.part = resumed.part
    if local.part is None:  # start_run checked that its group had finished
        local.done_already = True
        return local
    precision.load_state_dict(local.part.get("loss_scale"))
    if cfg.mode == "sync":
        try:
            model.load_state_dict(resumed.first["model"])
            optimizer.load_state_dict(resumed.first["optimizer"])
        except (RuntimeError, KeyError, TypeError, ValueError) as exc:
            raise ValueError(
                f"checkpoint {resumed.path} does not fit model {cfg.model!r}: {exc}"
            ) from None
    if "rng" in local.part:
        set_rng_state(local.part["rng"])
    else:
        seed_rng(int(local.part["rng_seed"]))
    return local


def training_statistics(
    cfg: TrainConfig, workers: Comm | None
) -> tuple[np.ndarray, np.ndarray] | None:
    """``--normalize compute``: the training split's statistics, else ``None``.

    Collective over ``workers`` (each reads its part of the split, see
    :func:`~hybridagg.data.compute_statistics`); every worker gets the same.

    Raises:
        ValueError, TypeError, OSError: A bad data file (on every worker).
    """
    if cfg.normalize != "compute":
        return None
    return compute_statistics(cfg.data, "train", comm=workers)


def make_loader(
    cfg: TrainConfig,
    topo: Topology,
    local: Local,
    resumed: Resumed | None,
    chunk_counter=None,
) -> HDF5Loader:
    """The training loader, positioned where the resumed part left it.

    With ``chunk_counter`` (server 0's, see :mod:`hybridagg.train.chunks`)
    the dynamic shares draw from it. With ``--on-group-failure continue``
    files are read independently (``posix``): an MPI-IO file is closed
    collectively, which a dead worker would block.

    With ``HYBRIDAGG_SAMPLE_LOG`` set, it records the ids of the samples it
    hands out (one file per worker in that folder).

    Raises:
        ValueError, TypeError, OSError: A bad data file or loader state.
    """
    loader = HDF5Loader(
        cfg.data,
        batch_size=cfg.batch_size,
        comm=topo.comms.workers,
        shares="static" if cfg.mode == "sync" else "dynamic",
        seed=cfg.seed,
        window_blocks=local.window_blocks,
        normalize=cfg.normalize != "none",
        statistics=local.statistics,
        device=local.device,
        chunk_counter=chunk_counter,
        **({"driver": "posix"} if cfg.survives_group_loss else {}),
    )
    log = envvars.get_str("HYBRIDAGG_SAMPLE_LOG")
    if log:
        loader.log_samples(Path(log) / f"rank-{topo.rank:05d}.log")
    idle = {
        "kind": "dynamic",
        "epoch": 0,
        "carry": [],
        "taken": [],
        "counter": None,
        "n_windows": loader.windows_per_epoch,
    }
    if resumed is None:
        return loader
    worker = resumed.worker
    if worker.loader_states is not None:
        # another number of workers: divide what no old worker consumed
        loader.load_resharded_state(
            [s if s is not None else idle for s in worker.loader_states]
        )
    elif worker.loader_state is not None:
        loader.load_state_dict(worker.loader_state)
    elif cfg.mode != "sync":
        # a finished group still takes part in the collective resume
        loader.load_state_dict(idle)
    return loader


def make_distributed_optimizer(
    cfg: TrainConfig, topo: Topology, local: Local
) -> DistributedOptimizer:
    """The distributed optimizer (collective: the servers receive their shards here)."""
    return DistributedOptimizer(
        local.optimizer,
        local.model.named_parameters(),
        topo,
        mode=cfg.mode,
        model=local.model,
        allreduce_backend=cfg.allreduce_backend,
        compensation=compensation_of(cfg),
        staleness_bound=cfg.staleness_bound,
        max_updates=cfg.steps if cfg.mode != "sync" else None,
        overlap=cfg.overlap,
        stream_push=cfg.stream_push,
        server_batching=server_batching(cfg, topo),
        fault_tolerant=cfg.survives_group_loss,
        wire=cfg.wire,
    )
