"""Adaptive batch sizes during training (OmniLearn's controller, all three modes).

``sync``: one :class:`~hybridagg.batching.BatchController` on every worker,
fed with every worker's step time through the gradient all-reduce; every
worker reaches the same decision and the loader re-cuts the rest of the
epoch. ``hybrid``: the controller balances the members of each group (the
group's total kept) and, with ``--adaptive-groups``, server 0 sizes each
group's total so groups reach the server at similar rates. ``async``: server
0 sizes each worker's batch and tells it in its replies.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from contextlib import AbstractContextManager

import torch

from ..batching import BatchController

__all__ = ["AdaptiveBatches", "server_batching"]


def server_batching(cfg, topo) -> dict | None:
    """The options server 0's controller gets (``None``: it sizes nothing)."""
    if not cfg.adaptive_batch or cfg.mode == "sync":
        return None
    if cfg.mode == "hybrid" and not cfg.adaptive_groups:
        return None
    sizes = [len(g) for g in topo.groups]
    return {
        "initial": [n * cfg.batch_size for n in sizes],
        "deadband": cfg.batch_deadband,
        "smoothing": cfg.batch_smoothing,
        "window": cfg.batch_window,
        "first_window": cfg.batch_first_window,
        "shift": cfg.batch_shift,
        "shift_steps": cfg.batch_shift_steps,
        "min_batch": cfg.min_batch * max(sizes),
        "max_group_batch": cfg.max_batch * min(sizes) if cfg.max_batch else None,
    }


class AdaptiveBatches:
    """One worker's side of adaptive batching.

    Args:
        cfg: The run's options.
        topo: The topology.
        opt: The :class:`~hybridagg.optimizer.DistributedOptimizer`.
        loader: The training :class:`~hybridagg.data.HDF5Loader`.
        metrics: Where decisions are logged.
        start: ``perf_counter()`` at the start of training.
    """

    def __init__(self, cfg, topo, opt, loader, metrics, start: float) -> None:
        self.cfg, self.topo, self.opt = cfg, topo, opt
        self.loader, self.metrics, self.start = loader, metrics, start
        self.rank = topo.rank
        self._setup_batching()

    def _setup_batching(self) -> None:
        """The in-scope controller: all workers (sync) or this group (hybrid)."""
        cfg, topo = self.cfg, self.topo
        self.batcher, self.batch_index = None, 0
        self.group_total = len(topo.group_ranks) * cfg.batch_size
        if not cfg.adaptive_batch:
            return
        members = list(topo.workers) if cfg.mode == "sync" else list(topo.group_ranks)
        self.members = members
        self.batch_index = members.index(self.rank)
        if len(members) > 1:
            self.batcher = BatchController(
                batches=[cfg.batch_size] * len(members),
                deadband=cfg.batch_deadband,
                smoothing=cfg.batch_smoothing,
                window=cfg.batch_window,
                first_window=cfg.batch_first_window,
                shift=cfg.batch_shift,
                shift_steps=cfg.batch_shift_steps,
                min_batch=cfg.min_batch,
                max_batch=cfg.max_batch,
            )

    def probe(
        self,
        model: torch.nn.Module,
        loss_fn,
        pacer,
        autocast: Callable[[], AbstractContextManager] = contextlib.nullcontext,
    ) -> None:
        """Split the batch by every member's measured speed before the first step.

        Each member of the controller's scope times a forward and backward of
        ``--batch-probe`` samples of zeros (after one untimed pass; no
        reduction, gradients dropped, model in eval mode so normalisation
        statistics stay untouched, paced like a real step; forward and loss
        under ``autocast``, ``--amp``'s), the times are
        gathered, and they are the controller's first window. Without it the first window runs at the
        slowest worker's pace (measured at 4x: two slow steps cost about 2%
        of a 10-epoch digits run). Collective over the scope.
        """
        cfg = self.cfg
        k = cfg.batch_probe if cfg.batch_probe is not None else cfg.batch_size // 4
        if self.batcher is None or k < 1:
            return
        scope = self.topo.comms.workers if cfg.mode == "sync" else self.topo.comms.group
        param = next(model.parameters())
        x = torch.zeros((k, *self.loader.sample_shape), dtype=param.dtype)
        y = torch.zeros(k, dtype=torch.long)
        x, y = x.to(param.device), y.to(param.device)
        modes = [(m, m.training) for m in model.modules()]  # some may be frozen
        model.eval()
        try:
            with self.opt.no_sync():
                # once untimed: a first pass pays one-time costs (allocations,
                # lazy initialisation) that made fast workers look 2x slower
                with autocast():
                    first = loss_fn(model(x), y)
                first.backward()
                t0 = time.perf_counter()
                with autocast():
                    timed_loss = loss_fn(model(x), y)
                timed_loss.backward()
                compute = time.perf_counter() - t0
        finally:
            for module, training in modes:
                module.training = training
        seconds = compute + pacer.pace(k, compute)
        self.opt.zero_grad()
        timed = dict(scope.allgather((self.rank, seconds), what="batch probe"))
        for i, rank in enumerate(self.members):
            self.batcher.add(i, timed[rank], k)
        self._apply_decision(self.batcher.decide())

    def _apply_decision(self, decision) -> None:
        """Apply the in-scope controller's decision, if it made one."""
        if decision is not None:
            self._apply_batches(
                decision.old,
                decision.new,
                decision.seconds_per_sample,
                "workers" if self.cfg.mode == "sync" else "group",
            )

    def after_step(self) -> None:
        """After a step: feed the controllers, apply their decisions."""
        cfg, opt = self.cfg, self.opt
        shared = opt.shared
        seconds, samples = shared[:, 1].tolist(), shared[:, 2].tolist()
        if self.batcher is not None:
            self._apply_decision(self.batcher.observe(seconds, samples))
        if cfg.mode == "sync":
            return
        if sum(samples) > 0:  # the group's time per sample, for server 0
            opt.report(max(seconds) / sum(samples))
        advice = int(opt.batch_advice)
        if advice and advice != self.group_total:
            self.group_total = advice
            old = self.batcher.batches if self.batcher else [self.loader.batch_size]
            new = self.batcher.set_total(advice) if self.batcher else [advice]
            self._apply_batches(list(old), new, None, "server")

    def _apply_batches(self, old, new, seconds_per_sample, scope: str) -> None:
        loader = self.loader
        if self.cfg.mode == "sync":
            loader.set_batch_sizes(new)  # collective: every worker decided alike
        else:
            sizes = list(loader.batch_sizes)
            sizes[loader.rank] = int(new[self.batch_index])
            loader.set_batch_sizes(sizes)
        self.metrics.write(
            "batch",
            t=time.perf_counter() - self.start,
            scope=scope,
            version=self.opt.server_version,
            old=old,
            new=new,
            seconds_per_sample=seconds_per_sample,
            batch=loader.batch_size,
        )

    # --- the run -----------------------------------------------------------------
