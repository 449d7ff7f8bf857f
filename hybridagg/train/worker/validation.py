"""Validation during training, on rank 0: when, on which weights, time to target."""

from __future__ import annotations

import time

import torch

from ...comm import solo
from ...optimizer import DistributedOptimizer
from ..board import Board
from ..config import EvaluationOptions
from ..evaluate import Evaluator, load_flat
from ..faults import slow_validation
from ..metrics import MetricsWriter
from .clock import TrainClock

__all__ = ["Validation"]


class Validation:
    """Owns validation: every ``--eval-every`` updates and at the end, on rank 0.

    Without an evaluator (every rank but 0) it validates nothing and only
    carries the time to target a resumed run brought along.

    Args:
        cfg: The evaluation options.
        sync: Whether the mode is sync (the local model holds the weights;
            otherwise they are pulled from the servers).
        evaluator: Rank 0's evaluator, ``None`` elsewhere.
        model: The model being trained.
        opt: The distributed optimizer.
        metrics: Where ``eval`` records go.
        clock: The training clock (validation time is not training time).
        first_target: Training seconds to ``--target-accuracy`` of a resumed run.
        first_target_update: The update at which a resumed run reached it.
        board: TensorBoard writers (validation's on rank 0).
    """

    def __init__(
        self,
        cfg: EvaluationOptions,
        *,
        sync: bool,
        evaluator: Evaluator | None,
        model: torch.nn.Module,
        opt: DistributedOptimizer,
        metrics: MetricsWriter,
        clock: TrainClock,
        first_target: float | None,
        first_target_update: int | None = None,
        board: Board | None = None,
    ) -> None:
        self.cfg, self.sync, self.evaluator = cfg, sync, evaluator
        self.board = board
        self.model, self.opt, self.metrics, self.clock = model, opt, metrics, clock
        self.first_target = first_target
        """Training seconds until the accuracy first reached the target."""
        self.first_target_update = first_target_update
        """The update (server version, or sync step) of that validation: the
        field's "steps to result", which tells what larger updates buy."""
        self.last_accuracy: str | None = None
        """The latest accuracy (with --loss mse the loss), formatted for the progress bar."""
        self.final_accuracy: float | None = None
        """The accuracy at the end of training (rank 0; ``None`` with --loss mse)."""
        self.final_loss: float | None = None
        """The validation loss at the end of training (rank 0; the MSE with --loss mse)."""
        self.curve: list[tuple[float, float]] = []
        """(training seconds, accuracy) of every validation of this run (rank 0)."""
        self.curve_updates: list[int] = []
        """The update (sync step or server version) of each point of ``curve``."""
        self._last_bucket = opt.server_version // cfg.eval_every
        self._pulled: torch.Tensor | None = None  # the weights a validation pulls

    def maybe_run(self, final: bool = False, version: int | None = None) -> None:
        """Validate if an ``--eval-every`` boundary was crossed, or at the end.

        Args:
            final: The end of training: validate the final weights.
            version: Their update (the servers' final version, which rank 0
                may not have seen in its last step); default the
                optimizer's.
        """
        if self.evaluator is None:
            return
        opt = self.opt
        seen = opt.server_version if version is None else int(version)
        bucket = seen // self.cfg.eval_every
        if not final and bucket <= self._last_bucket:
            return
        self._last_bucket = bucket
        t0 = time.perf_counter()
        # the others may wait for rank 0 meanwhile: a declared solo phase
        # keeps their waits from timing out, under its own deadline
        with solo("validation"):
            if self.sync or final:
                model = self.model
            else:
                weights, buffers = opt.pull_state(self._pulled)
                self._pulled = weights  # (reused: fresh memory costs page faults)
                model = self.evaluator.scratch(self.model)
                load_flat(model, weights, buffers)
            accuracy, loss = self.evaluator.evaluate(model)
            slow_validation()  # tests only
        seconds = time.perf_counter() - t0
        self.clock.eval_seconds += seconds
        train_time = self.clock.train_time()
        self.last_accuracy = (
            f"{accuracy:.3f}" if accuracy is not None else f"mse {loss:.4g}"
        )
        self.final_accuracy, self.final_loss = accuracy, loss
        if accuracy is not None:
            self.curve.append((train_time, accuracy))
            self.curve_updates.append(seen)
        target = self.cfg.target_accuracy
        if (
            target is not None
            and accuracy is not None
            and accuracy >= target
            and self.first_target is None
        ):
            self.first_target = train_time
            self.first_target_update = seen
        self.metrics.write(
            "eval",
            t=self.clock.since_start(),
            version=seen,
            accuracy=accuracy,
            loss=loss,
            eval_s=seconds,
            train_time_s=train_time,
            final=final,
        )
        if self.board is not None:
            self.board.validation(seen, accuracy, loss)
