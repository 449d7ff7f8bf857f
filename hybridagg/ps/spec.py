"""What leader 0 tells each server at start-up (the ``INIT`` message).

Leader 0 builds one :class:`ServerSpec` per server (:func:`server_specs`)
and sends it pickled, once; the server builds its shard and settings from
it. Keeping both sides on one dataclass keeps them in step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from .compensation import Compensation

__all__ = ["ServerSpec", "param_groups_of", "server_specs", "specs_for"]


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
        owners: Per pipelined group, the ``(lo, hi, rank)`` of each stage's
            range of the flat model (:mod:`hybridagg.ps.owners`): those parts
            come from, and go back to, the stage holding them. Empty: every
            group's leader holds the whole model.
        initial_from: ``shard`` is ``None`` and the initial weights arrive in
            pieces from this pipelined group's stages (no rank holds them
            all); ``None``: they are in ``shard``.
        dtype: The weights' numpy dtype name (what pieces arrive in).
    """

    optimizer: type[torch.optim.Optimizer]
    defaults: dict
    hyper: list[dict]
    group_of: list[int]
    numels: list[int]
    shard_range: tuple[int, int]
    shard: np.ndarray | None
    buffers: np.ndarray | None
    compensation: Compensation
    staleness_bound: int | None
    max_updates: int | None
    part_elems: int
    skip_update: bool = False
    batching: dict | None = None
    wire: str = "fp32"
    owners: dict = field(default_factory=dict)
    initial_from: int | None = None
    dtype: str = "float32"


def server_specs(
    params: Sequence[torch.Tensor],
    optimizer: torch.optim.Optimizer,
    flat_weights: torch.Tensor | None,
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
    owners: dict | None = None,
    initial_from: int | None = None,
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
        owners: See :class:`ServerSpec`.
        initial_from: See :class:`ServerSpec` (``flat_weights`` is then
            ``None``).

    Raises:
        ValueError: A parameter is in none of the optimizer's groups.
    """
    return specs_for(
        [p.numel() for p in params],
        param_groups_of(params, optimizer),
        optimizer,
        flat_weights,
        packed_buffers,
        ranges,
        compensation=compensation,
        staleness_bound=staleness_bound,
        max_updates=max_updates,
        part_elems=part_elems,
        skip_update=skip_update,
        batching=batching,
        wire=wire,
        owners=owners,
        initial_from=initial_from,
    )


def param_groups_of(
    params: Sequence[torch.Tensor], optimizer: torch.optim.Optimizer
) -> list[int]:
    """The optimizer's parameter group of each parameter, model order.

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
    return [group_by_id[id(p)] for p in params]


def specs_for(
    numels: Sequence[int],
    group_of: Sequence[int],
    optimizer: torch.optim.Optimizer,
    flat_weights: torch.Tensor | None,
    packed_buffers: torch.Tensor | None,
    ranges: Sequence[tuple[int, int]],
    **settings,
) -> list[ServerSpec]:
    """:func:`server_specs` from each parameter's size and group.

    A pipelined group's stage 0 holds only its own parameters; it learns
    every stage's sizes and groups from its neighbours and builds the specs
    here (``settings``: :class:`ServerSpec`'s remaining fields).
    """
    initial_from = settings.get("initial_from")
    if flat_weights is None and initial_from is None:
        raise ValueError("server specs need the initial weights or initial_from")
    hyper = [
        {k: v for k, v in group.items() if k != "params"}
        for group in optimizer.param_groups
    ]
    owners = settings.pop("owners", None)
    return [
        ServerSpec(
            optimizer=type(optimizer),
            defaults=dict(optimizer.defaults),
            hyper=hyper,
            group_of=list(group_of),
            numels=list(numels),
            shard_range=(lo, hi),
            shard=None
            if initial_from is not None
            else flat_weights[lo:hi].numpy().copy(),
            buffers=(
                packed_buffers.numpy().copy()
                if s == 0 and packed_buffers is not None
                else None
            ),
            owners=dict(owners or {}),
            **settings,
        )
        for s, (lo, hi) in enumerate(ranges)
    ]
