"""What leader 0 tells each server at start-up (the ``INIT`` message).

Leader 0 builds one :class:`ServerSpec` per server (:func:`server_specs`)
and sends it pickled, once; the server builds its shard and settings from
it. Keeping both sides on one dataclass keeps them in step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .compensation import Compensation

__all__ = ["ServerSpec", "server_specs"]


@dataclass(frozen=True)
class ServerSpec:
    """One server's start-up settings and initial shard.

    Attributes:
        optimizer: The user's optimizer class; each part of the shard gets an
            instance of its own.
        defaults: The optimizer's ``defaults``.
        hyper: Settings of each of the user's parameter groups (without
            ``params``).
        group_of: Parameter group of each parameter (model order).
        numels: Number of elements of each parameter (model order).
        shard_range: ``(lo, hi)``: this server's range of the flat model.
        shard: Initial weights of that range.
        buffers: Server 0: the model's floating buffers, flat, float64;
            ``None`` on the other servers or without buffers.
        compensation: The learning-rate rule.
        staleness_bound: SSP bound in a group's own updates (``None``: none).
        max_updates: Version at which every group is told to stop.
        part_elems: Largest part of the shard, in elements.
        skip_update: Return the weights without applying the optimizer.
        batching: Adaptive batching options (server 0), or ``None``.
        wire: The type gradients arrive in and weights are replied in
            (``fp32``, ``bf16``, ``fp16``).
    """

    optimizer: type[torch.optim.Optimizer]
    defaults: dict
    hyper: list[dict]
    group_of: list[int]
    numels: list[int]
    shard_range: tuple[int, int]
    shard: np.ndarray
    buffers: np.ndarray | None
    compensation: Compensation
    staleness_bound: int | None
    max_updates: int | None
    part_elems: int
    skip_update: bool = False
    batching: dict | None = None
    wire: str = "fp32"


def server_specs(
    params: Sequence[torch.Tensor],
    optimizer: torch.optim.Optimizer,
    flat_weights: torch.Tensor,
    packed_buffers: torch.Tensor | None,
    ranges: Sequence[tuple[int, int]],
    *,
    compensation: Compensation,
    staleness_bound: int | None,
    max_updates: int | None,
    part_elems: int,
    skip_update: bool = False,
    batching: dict | None = None,
    wire: str = "fp32",
) -> list[ServerSpec]:
    """The spec of every server, from the leader's model and optimizer.

    Args:
        params: The model's parameters, model order.
        optimizer: The user's optimizer over them.
        flat_weights: The parameters, flat.
        packed_buffers: The floating buffers, flat, float64 (server 0 holds
            them); ``None``: the model has none.
        ranges: Each server's range of the flat model.
        compensation: See :class:`ServerSpec`; the remaining arguments too.
        staleness_bound: See :class:`ServerSpec`.
        max_updates: See :class:`ServerSpec`.
        part_elems: See :class:`ServerSpec`.
        skip_update: See :class:`ServerSpec`.
        batching: See :class:`ServerSpec`.
        wire: See :class:`ServerSpec`.

    Raises:
        ValueError: A parameter is in none of the optimizer's groups.
    """
    group_by_id = {}
    for g, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            group_by_id[id(p)] = g
    missing = [i for i, p in enumerate(params) if id(p) not in group_by_id]
    if missing:
        raise ValueError(f"parameters {missing} are not in the optimizer")
    hyper = [
        {k: v for k, v in group.items() if k != "params"}
        for group in optimizer.param_groups
    ]
    group_of = [group_by_id[id(p)] for p in params]
    numels = [p.numel() for p in params]
    return [
        ServerSpec(
            optimizer=type(optimizer),
            defaults=dict(optimizer.defaults),
            hyper=hyper,
            group_of=group_of,
            numels=numels,
            shard_range=(lo, hi),
            shard=flat_weights[lo:hi].numpy().copy(),
            buffers=(
                packed_buffers.numpy().copy()
                if s == 0 and packed_buffers is not None
                else None
            ),
            compensation=compensation,
            staleness_bound=staleness_bound,
            max_updates=max_updates,
            part_elems=part_elems,
            skip_update=skip_update,
            batching=batching,
            wire=wire,
        )
        for s, (lo, hi) in enumerate(ranges)
    ]
