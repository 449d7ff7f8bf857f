"""``--tensorboard DIR``: the run's scalars as TensorBoard event files.

Each group's leader writes its group's training scalars into ``DIR/group-G``
(one TensorBoard *run* per group, so the groups' curves overlay under the
same tags), and rank 0 writes validation into ``DIR/validation``. Every
scalar comes from what the leader already has after a step: the shared
values of its reduction (every member's samples and loss) and the
optimizer's version and staleness, so writing costs no communication. The
step axis is the model version the update produced (sync: the update
count; hybrid and async: the server version), on which the groups' and
validation's curves line up.

Tags (group runs): ``train/loss`` (the group's sample-weighted mean loss;
in sync every worker's), ``train/samples_per_sec`` (the group's samples of
the step over the time since its previous step), ``train/batch`` (the
group's samples of the update), ``batch/rank_R`` (each member's batch),
``train/staleness`` (versions the update's weights were behind; 0 in sync).
Validation run: ``val/accuracy`` (classification only) and ``val/loss``.
Steps whose reduction saw no samples (an epoch's empty end) write nothing.

The leaders write where they run: on a cluster ``DIR`` must be on a file
system every node shares (as ``--metrics``' parts must).

The ``tensorboard`` package is an optional extra (``pip install
'hybridagg[tensorboard]'``); :func:`check_available` makes its absence one
clear error at set-up.
"""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path

import torch

__all__ = ["Board", "check_available"]


def check_available(folder: str | None) -> None:
    """Check that ``--tensorboard`` can be written (no-op without a folder).

    Raises:
        ValueError: The ``tensorboard`` package is not installed.
    """
    if folder and importlib.util.find_spec("tensorboard") is None:
        raise ValueError(
            "--tensorboard needs the tensorboard package: pip install "
            "'hybridagg[tensorboard]' (or pip install tensorboard)"
        )


class Board:
    """This rank's TensorBoard writers: its group's (leaders) and validation's (rank 0).

    A no-op without a folder, and on ranks that are neither a leader nor rank 0.

    Args:
        folder: ``--tensorboard`` (``None``: nothing is written).
        rank: This world rank.
        group: This rank's group.
        is_leader: Whether it leads its group (writes the group's scalars).
        members: The world rank of each row of the shared values.
    """

    def __init__(
        self,
        folder: str | None,
        *,
        rank: int,
        group: int,
        is_leader: bool,
        members: list[int],
    ) -> None:
        self.members = members
        self.train = self.val = None
        self._last: float | None = None
        if not folder:
            return
        from torch.utils.tensorboard import SummaryWriter

        root = Path(folder)
        # (flushed every few seconds: a killed job keeps most of its curves)
        if is_leader:
            self.train = SummaryWriter(str(root / f"group-{group}"), flush_secs=10)
        if rank == 0:
            self.val = SummaryWriter(str(root / "validation"), flush_secs=10)

    def step(
        self,
        version: int,
        shared: torch.Tensor,
        samples_col: int,
        loss_col: int,
        staleness: int,
        busy_s: float,
    ) -> None:
        """Write one step's group scalars (leaders; nothing if no member had samples).

        Args:
            version: The version the update produced (the step axis).
            shared: The reduction's shared values, a row per member.
            samples_col: Column of each member's samples.
            loss_col: Column of each member's loss.
            staleness: The update's staleness.
            busy_s: This step's own time (the rate's interval at the first step).
        """
        now = time.perf_counter()
        interval = busy_s if self._last is None else now - self._last
        self._last = now
        w = self.train
        if w is None:
            return
        samples = shared[:, samples_col].double()
        total = float(samples.sum())
        if total <= 0:
            return
        loss = float((samples * shared[:, loss_col].double()).sum()) / total
        w.add_scalar("train/loss", loss, version)
        w.add_scalar("train/batch", total, version)
        if interval > 0:
            w.add_scalar("train/samples_per_sec", total / interval, version)
        w.add_scalar("train/staleness", float(staleness), version)
        for rank, n in zip(self.members, samples.tolist(), strict=True):
            w.add_scalar(f"batch/rank_{rank}", n, version)

    def validation(self, version: int, accuracy: float | None, loss: float) -> None:
        """Write a validation's scalars (rank 0)."""
        if self.val is None:
            return
        if accuracy is not None:
            self.val.add_scalar("val/accuracy", accuracy, version)
        self.val.add_scalar("val/loss", loss, version)
        self.val.flush()

    def close(self) -> None:
        """Flush and close the writers."""
        for w in (self.train, self.val):
            if w is not None:
                w.close()
        self.train = self.val = None
