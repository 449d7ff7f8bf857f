"""The epoch iteration: one pass of ``for x, y in loader`` over one epoch."""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import torch

from .files import SplitFiles
from .options import LoaderOptions
from .pipeline import Job, generate
from .position import PassPosition
from .readahead import STOP, ReadAhead
from .samplelog import SampleLog
from .share_policy import SharePolicy
from .shares import EpochPlan
from .split import AgreedSplit, check_norm_fits
from .stats import LoaderStats

__all__ = ["EpochLoop"]


class EpochLoop:
    """Owns the epoch number and the pass being iterated: its plan and position.

    A pass begins with the epoch's plan (the sample order), asks the share
    policy for this worker's part, and starts the read-ahead on it; it hands
    out batches (moved to the device, waits counted in the stall
    statistics) until the read-ahead ends, and the epoch number advances. A
    pass left midway stops the read-ahead; under dynamic shares it counts as
    the epoch, since the shared counter has moved on.

    Args:
        options: The loader's validated options.
        split: The split the workers agreed on.
        files: The open files (their ``reader`` is ``None`` once closed).
        policy: The share policy.
        stats: Where waits are counted (the reader counts its reads there).
        readahead: Runs each pass's batch generator.
    """

    def __init__(
        self,
        *,
        options: LoaderOptions,
        split: AgreedSplit,
        files: SplitFiles,
        policy: SharePolicy,
        stats: LoaderStats,
        readahead: ReadAhead,
    ) -> None:
        self.options, self.split, self.files = options, split, files
        self.policy, self.stats, self.readahead = policy, stats, readahead
        self.epoch = options.epoch
        self.position = PassPosition()
        self._plan: EpochPlan | None = None
        self.sample_log: SampleLog | None = None

    def run(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """One pass over ``self.epoch`` (a generator: nothing starts before ``next``).

        Raises:
            ValueError: The files are closed.
            RuntimeError: A pass is already being iterated.
        """
        self._begin()
        try:
            device = self.options.device
            while True:
                t0 = time.perf_counter()
                item = self.readahead.next()
                if item is STOP:
                    break
                x, y = item[0], item[1]
                if self.sample_log is not None:
                    self.sample_log.record(self.epoch, item[2])
                if device.type != "cpu":
                    x = x.to(device, non_blocking=True)
                    y = y.to(device, non_blocking=True)
                # the wait includes the device copy: both keep the loop idle
                self.stats.record_batch(time.perf_counter() - t0, len(y))
                self.position.advance(len(y))
                yield x, y
            self.epoch += 1
        finally:
            self._end()

    def recut(self) -> None:
        """Restart the read-ahead on the pass's pieces, cut again by the policy."""
        self.readahead.stop()
        self.position.recut()
        self.readahead.start(self._batches())

    def _begin(self) -> None:
        if self.files.reader is None:
            raise ValueError("this loader is closed")
        if self.position.active:
            raise RuntimeError("this loader is already being iterated")
        opts, split = self.options, self.split
        self._plan = EpochPlan(
            split.lengths,
            split.first.block_samples,
            opts.window_blocks,
            opts.seed,
            self.epoch,
            shuffle=opts.shuffle,
        )
        self.policy.begin_pass(self._plan, self.epoch)
        self.position.start()
        self.readahead.start(self._batches())

    def _end(self) -> None:
        self.readahead.stop()
        if self.position.active and self.policy.moves_on_when_abandoned(self.epoch):
            self.epoch += 1
        self.position.stop()

    def _batches(self) -> Iterator:
        """The batch generator of this pass (holds no reference to the loader)."""
        plan, policy = self._plan, self.policy
        opts, info = self.options, self.split.first
        return generate(
            Job(
                plan=plan,
                reader=self.files.reader,
                stats=self.stats,
                labels=self.split.labels,
                pieces=policy.pieces(plan),
                steps=policy.pass_steps(),
                collective_calls=(
                    policy.collective_calls(plan) if self.files.collective else 0
                ),
                batch=policy.batch_box,
                capacity=opts.window_blocks * info.block_samples,
                sample_shape=info.sample_shape,
                dtype=info.dtype,
                pinned=opts.device.type == "cuda",
                norm=check_norm_fits(info, opts.statistics) if opts.normalize else None,
                id_offsets=(
                    None
                    if self.sample_log is None
                    else np.cumsum([0, *self.split.lengths[:-1]], dtype=np.int64)
                ),
            ),
            read_ahead=self.readahead.threaded,
        )
