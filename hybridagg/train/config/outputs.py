"""Measuring and saving: validation, metrics and summary, checkpoints (pure logic)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .fields import Concern, option

__all__ = ["LOG_LEVELS", "CheckpointOptions", "EvaluationOptions", "OutputOptions"]

MEASURING = "measuring and saving"

LOG_LEVELS = ("debug", "info", "warning", "error")
"""``--log-level``: the names of Python's ``logging`` levels, in lower case."""


@dataclass(frozen=True, kw_only=True)
class EvaluationOptions(Concern):
    """Validation on rank 0."""

    help_group: ClassVar[str] = MEASURING

    eval_every: int = option(50, at_least=1)
    """updates between validations"""

    target_accuracy: float | None = None
    """for time_to_target_s (0-1; classification only: with --loss mse
    validation measures the mean squared error, not accuracy)"""

    def _check(self) -> None:
        target = self.target_accuracy
        if target is not None and not 0 < target <= 1:
            raise ValueError(f"--target-accuracy is a fraction in (0, 1], got {target}")


@dataclass(frozen=True, kw_only=True)
class OutputOptions(Concern):
    """What the run writes and shows besides checkpoints."""

    help_group: ClassVar[str] = MEASURING

    metrics: str | None = None
    """JSON lines: one record per step per rank"""

    summary: str | None = None
    """JSON summary of the run"""

    progress: bool = True
    """the progress bar on rank 0 (the final table is printed either way)"""

    save_model: str | None = None
    """write the trained model's state_dict here at the end (rank 0; in hybrid
    and async the servers' final weights), for torch.load(PATH,
    weights_only=True) and model.load_state_dict"""

    tensorboard: str | None = None
    """TensorBoard folder: loss, accuracy, samples/s, batch sizes and
    staleness per group (needs the tensorboard package: pip install
    'hybridagg[tensorboard]')"""

    log_level: str = option("info", choices=LOG_LEVELS)
    """messages shown on stderr, rank-tagged, from rank 0 only (every rank's
    with HYBRIDAGG_LOG_RANKS=all)"""


@dataclass(frozen=True, kw_only=True)
class CheckpointOptions(Concern):
    """Checkpoints and resuming from them."""

    help_group: ClassVar[str] = MEASURING

    checkpoint: str | None = None
    """checkpoint directory"""

    checkpoint_every: int | None = option(None, at_least=1)
    """updates between checkpoints"""

    resume: bool = False
    """continue the run whose checkpoint in DIR is the newest, from its newest
    checkpoint that loads (start fresh if DIR holds none)"""

    overwrite_checkpoints: bool = False
    """start a fresh run although DIR holds checkpoints of another run: they are
    deleted when this run commits its first checkpoint (without this flag or
    --resume such a run refuses to start)"""

    accept_config_changes: bool = False
    """with --resume: continue although the configuration differs from the
    checkpoint's in a way that changes the training (--lr, --steps, --data, ...;
    each difference is listed); without it such a resume refuses to start"""

    def _check(self) -> None:
        if (
            self.checkpoint_every or self.resume or self.overwrite_checkpoints
        ) and not self.checkpoint:
            raise ValueError(
                "--checkpoint-every, --resume and --overwrite-checkpoints need "
                "--checkpoint DIR"
            )
        if self.resume and self.overwrite_checkpoints:
            raise ValueError(
                "--overwrite-checkpoints starts a fresh run; it cannot be combined "
                "with --resume"
            )
        if self.accept_config_changes and not self.resume:
            raise ValueError("--accept-config-changes needs --resume")
