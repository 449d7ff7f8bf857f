"""Pieces the training roles share: optimizers, manifests, RNG state."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ..topology import Topology
from .config import OptimOptions, TrainConfig

__all__ = [
    "check_manifest",
    "make_optimizer",
    "manifest",
    "rng_state",
    "seed_rng",
    "set_rng_state",
    "warm_up_optimizer",
]


def manifest(cfg: TrainConfig, topo: Topology, **extra) -> dict:
    return {
        "mode": cfg.mode,
        "model": cfg.model,
        "world_size": topo.world_size,
        "servers": len(topo.servers),
        "groups": [list(g) for g in topo.groups],
        "config": cfg.as_dict(),
        **extra,
    }


def check_manifest(saved: dict, cfg: TrainConfig, topo: Topology, path: Path) -> None:
    """Raise ``ValueError`` if a checkpoint was written by another kind of run.

    The ranks, servers and groups may differ: :func:`.elastic.reshard_plan`
    maps them.
    """
    mine = manifest(cfg, topo)
    for key in ("model", "mode"):
        if saved.get(key) != mine[key]:
            raise ValueError(
                f"checkpoint {path} was written by a run with {key}={saved.get(key)!r}; "
                f"this run has {key}={mine[key]!r}"
            )


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
