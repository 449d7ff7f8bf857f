"""Pieces the training roles share: optimizers, manifests, RNG state."""

from __future__ import annotations

import functools
from dataclasses import MISSING, fields
from pathlib import Path

import numpy as np
import torch

from ..ps.compensation import Compensation
from ..topology import Topology
from .config import OptimOptions, TrainConfig
from .config.changes import ConfigChange, config_changes, refusal
from .elastic import Layout, ReshardPlan, reshard_plan

__all__ = [
    "check_manifest",
    "compensation_of",
    "make_optimizer",
    "manifest",
    "rng_state",
    "seed_rng",
    "set_rng_state",
    "warm_up_optimizer",
]


def manifest(cfg: TrainConfig, topo: Topology, **extra) -> dict:
    """What a checkpoint's manifest records about the run (the committer adds its id)."""
    return {
        "mode": cfg.mode,
        "model": cfg.model,
        "world_size": topo.world_size,
        "servers": len(topo.servers),
        "groups": [list(g) for g in topo.groups],
        "config": cfg.as_dict(),
        **extra,
    }


@functools.cache
def _defaults() -> dict:
    return {f.name: f.default for f in fields(TrainConfig) if f.default is not MISSING}


def check_manifest(
    saved: dict, cfg: TrainConfig, topo: Topology, path: Path
) -> tuple[list[ConfigChange], ReshardPlan]:
    """Whether this run may resume the checkpoint at ``path``, whose manifest is ``saved``.

    The configuration is compared field by field
    (:func:`~hybridagg.train.config.changes.config_changes`): a changed
    mode is refused, other changes that alter training are refused unless
    ``--accept-config-changes``. The topology (world size, servers, groups)
    may differ: :func:`~hybridagg.train.elastic.reshard_plan` maps the
    checkpoint's ranks onto this run's.

    Returns:
        The differences accepted (``--accept-config-changes``, topology
        flags), for a notice, and the plan of what each rank continues from.

    Raises:
        ValueError: One message naming every refused difference, or a
            manifest that does not record a valid layout.
    """
    after = cfg.as_dict()
    before = saved.get("config")
    if not isinstance(before, dict):  # a manifest that records no configuration
        before = {k: saved[k] for k in ("model", "mode") if k in saved}
        after = {k: after[k] for k in before}
    changes = config_changes(before, after, _defaults())
    why = refusal(changes, accept=cfg.accept_config_changes, where=f"checkpoint {path}")
    if why is not None:
        raise ValueError(why)
    return changes, reshard_plan(saved, Layout.of(topo), path)


def rng_state() -> dict:
    return {
        "torch": torch.get_rng_state(),
        "numpy": torch.from_numpy(
            np.frombuffer(np.random.get_state()[1].tobytes(), dtype=np.uint8).copy()
        ),
    }


def seed_rng(seed: int) -> None:
    """Seed torch's and numpy's global generators (a worker without a saved state)."""
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    keys = np.frombuffer(state["numpy"].numpy().tobytes(), dtype=np.uint32)
    np.random.set_state(("MT19937", keys, 0))


def warm_up_optimizer(cfg: OptimOptions) -> None:
    """Build a throwaway optimizer of the run's class before the clock starts.

    The first ``torch.optim`` optimizer a process builds imports
    ``torch._dynamo``, which takes seconds; a server would otherwise pay that
    inside its first update, and every group would wait for it.
    """
    scratch = torch.nn.Linear(1, 1)
    make_optimizer(cfg, scratch)


def compensation_of(cfg: TrainConfig) -> Compensation:
    """The run's learning-rate rule (``--batch-size``, warm-up, damping, lookahead)."""
    return Compensation(
        reference_batch=cfg.batch_size,
        warmup_updates=cfg.warmup_updates,
        staleness=cfg.damping,
        lookahead=cfg.lookahead,
        lookahead_horizon=cfg.lookahead_horizon,
    )


def make_optimizer(cfg: OptimOptions, model: torch.nn.Module) -> torch.optim.Optimizer:
    """The run's ``torch.optim`` optimizer over ``model``'s parameters."""
    params = model.parameters()
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(
            params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay
        )
    if cfg.optimizer == "adam":
        return torch.optim.Adam(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
