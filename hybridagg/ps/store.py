"""One server's shard: its weights and the user's optimizer over each part."""

from __future__ import annotations

import numpy as np
import torch

from ..comm import WireCodec, alloc
from .compensation import lookahead_factor
from .kernels import KERNEL_KEYS, build_optimizer
from .owners import PartOwners, owner_cuts
from .shards import optimizer_order, part_ranges
from .spec import ServerSpec

__all__ = ["ShardStore"]


class ShardStore:
    """The shard a server owns, and the updates applied to it.

    Owns the shard's weights (``flat``), the memory a pushed gradient lands
    in (``grad``), server 0's copy of the floating buffers, the version (the
    number of updates applied), and one instance of the user's optimizer per
    part (:func:`~hybridagg.ps.shards.part_ranges`), over the pieces of
    parameters in that part, so a part can be updated as soon as it arrives.

    Args:
        spec: This server's start-up settings (:class:`~hybridagg.ps.spec.ServerSpec`).
    """

    def __init__(self, spec: ServerSpec) -> None:
        initial = torch.as_tensor(np.asarray(spec.shard))
        self.flat = alloc(initial.numel(), initial.dtype, zero=False)
        self.flat.copy_(initial)
        self.grad = alloc(initial.numel(), initial.dtype)
        self.wire = spec.wire
        # a pushed part lands here in the wire's type, and is widened into
        # ``grad`` before the check and the update (the master stays float32)
        self.grad_wire = WireCodec(spec.wire, initial.numel(), feedback=False)
        self.version = 0
        lo, hi = spec.shard_range
        self.shard_range = (int(lo), int(hi))
        # the whole flat model's elements (a checkpoint records the cut)
        self.elements = int(sum(spec.numels))
        # (cut at every pipelined group's stage boundary: a part has one owner)
        self.parts = part_ranges(
            hi - lo, spec.part_elems, [c - lo for c in owner_cuts(spec.owners)]
        )
        self.owners = PartOwners(spec.owners, lo, self.parts)
        # per part: its optimizer and the user's group of each of its groups
        self.optimizers: list[tuple[torch.optim.Optimizer, list[int]] | None] = []
        # per part: the flat-model range of each optimizer parameter, in the
        # order of its state_dict (what resharding reads states by)
        self.layout: list[list[tuple[int, int]]] = []
        # per part: each optimizer parameter and its range in the shard, so a
        # gradient that landed elsewhere (another group's push in flight) can
        # be bound as its ``.grad``
        self._slots: list[list[tuple[torch.nn.Parameter, int, int]]] = []
        for a, b in self.parts:
            self._slots.append([])
            order = optimizer_order(spec.numels, spec.group_of, lo + a, lo + b)
            self.layout.append([r for _, ranges in order for r in ranges])
            if not order:
                self.optimizers.append(None)
                continue
            hyper = []
            for g, ranges in order:
                params = []
                for start, stop in ranges:
                    param = torch.nn.Parameter(self.flat[start - lo : stop - lo])
                    param.grad = self.grad[start - lo : stop - lo]
                    params.append(param)
                    self._slots[-1].append((param, start - lo, stop - lo))
                hyper.append({**spec.hyper[g], "params": params})
            groups = [g for g, _ in order]
            self.optimizers.append(
                (build_optimizer(spec.optimizer, hyper, spec.defaults), groups)
            )
        self.buffers = (
            torch.as_tensor(np.asarray(spec.buffers)).clone()
            if spec.buffers is not None
            else None
        )
        self.skip_update = bool(spec.skip_update)

    def apply(
        self,
        part: int,
        lrs: list[float],
        scale: float,
        grad: torch.Tensor | None = None,
    ) -> None:
        """Step part ``part``'s optimizer on a gradient, at rates ``lrs`` times ``scale``.

        Args:
            part: Index of the part.
            lrs: The user's ``lr`` of each of its parameter groups.
            scale: The compensation's factor for this update.
            grad: Where the gradient of the whole shard lies (default
                :attr:`grad`); only this part's range is read.
        """
        entry = self.optimizers[part]
        if entry is None or self.skip_update:
            return
        source = self.grad if grad is None else grad
        for param, a, b in self._slots[part]:
            if param.grad is None or param.grad.data_ptr() != source[a:b].data_ptr():
                param.grad = source[a:b]
        opt, groups = entry
        for group, user_group in zip(opt.param_groups, groups, strict=True):
            group["lr"] = lrs[user_group] * scale
        opt.step()

    def predict(
        self, part: int, out: torch.Tensor, lrs: list[float], staleness: float
    ) -> None:
        """Move ``out``, part ``part``'s weights, along ``staleness`` updates of momentum.

        Each piece moves by ``lr x lookahead_factor(momentum, staleness)`` times
        its momentum buffer; parts without a buffer (no momentum yet, or an
        optimizer without one) stay as they are.

        Args:
            part: Index of the part.
            out: A copy of the part's weights, changed in place.
            lrs: The rate of each of the user's parameter groups.
            staleness: Updates until the next gradient lands (may be fractional).
        """
        entry = self.optimizers[part]
        if entry is None or self.skip_update:
            return
        opt, groups = entry
        lo = self.parts[part][0]
        size = self.flat.element_size()
        base = self.flat.data_ptr()
        for group, user_group in zip(opt.param_groups, groups, strict=True):
            momentum = float(group.get("momentum", 0.0) or 0.0)
            if momentum <= 0.0 or momentum >= 1.0:
                continue
            alpha = lrs[user_group] * lookahead_factor(momentum, staleness)
            for param in group["params"]:
                buf = opt.state.get(param, {}).get("momentum_buffer")
                if buf is None:
                    continue
                # a piece is a view of flat: its place in the part, from its address
                start = (param.data_ptr() - base) // size - lo
                out[start : start + param.numel()].sub_(buf.reshape(-1), alpha=alpha)

    def state(self) -> dict:
        """The shard's weights, buffers and optimizer states (copies), for a checkpoint.

        ``range``, ``parts`` and ``elements`` (the whole flat model's) record
        how this shard was cut, so that a run with another number of servers
        can find each piece's state (:mod:`hybridagg.ps.reshard`).
        """
        return {
            "flat": self.flat.clone(),
            "buffers": None if self.buffers is None else self.buffers.clone(),
            "optimizers": [
                None if e is None else e[0].state_dict() for e in self.optimizers
            ],
            "range": list(self.shard_range),
            "parts": [[a, b] for a, b in self.parts],
            "elements": self.elements,
        }

    def fresh_param_groups(self) -> list[list[dict] | None]:
        """Each part's optimizer ``param_groups`` as ``state_dict`` writes them."""
        return [
            None if e is None else e[0].state_dict()["param_groups"]
            for e in self.optimizers
        ]

    def load(self, state: dict) -> None:
        """Continue from a :meth:`state` saved before.

        Raises:
            ValueError: The saved shard has another size or other parts.
        """
        if state["flat"].shape != self.flat.shape:
            raise ValueError(
                f"checkpointed shard has {state['flat'].numel()} elements, this "
                f"server's shard {self.flat.numel()} (another model or server count?)"
            )
        self.flat.copy_(state["flat"])
        if self.buffers is not None and state.get("buffers") is not None:
            self.buffers.copy_(state["buffers"])
        saved = state["optimizers"]
        if len(saved) != len(self.optimizers):
            raise ValueError("checkpointed shard was cut into other parts")
        for entry, sd in zip(self.optimizers, saved, strict=True):
            if entry is not None and sd is not None:
                opt = entry[0]
                chosen = [
                    {k: g[k] for k in KERNEL_KEYS if k in g} for g in opt.param_groups
                ]
                opt.load_state_dict(sd)
                for group, keys in zip(opt.param_groups, chosen, strict=True):
                    group.update(keys)  # a kernel is this server's choice, not state
