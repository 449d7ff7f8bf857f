"""The control vector: the small float64 vector every step's reduction carries.

It holds, in named slices, this rank's sample count (summed: the update's
weight), a misuse code per rank (so a misuse on one rank is reported on
every rank), which parameters got a gradient anywhere, a few values per rank
that the caller shares with the others at no extra collective, and
optionally a fused payload (a small gradient bucket riding along).
"""

from __future__ import annotations

import numpy as np

__all__ = ["MISUSE_TEXT", "SHARE_SLOTS", "ControlVector", "Misuse", "MisuseError"]

SHARE_SLOTS = 5
"""Values each rank may share with the others of its reduction at every step."""


class Misuse:
    """Misuse codes (0: none)."""

    NO_BACKWARD = 1
    ZERO_GRAD = 2
    TWICE = 3


MISUSE_TEXT = {
    Misuse.NO_BACKWARD: "step() was called without backward() (a rank with no "
    "samples may skip backward only after set_samples(0))",
    Misuse.ZERO_GRAD: "zero_grad() was called between backward() and step()",
    Misuse.TWICE: "backward() ran more often before step() than the optimizer "
    "accumulates (backward_passes_per_step); for gradient accumulation use "
    "backward_passes_per_step=N or `with optimizer.no_sync():`",
}


class MisuseError(ValueError):
    """The optimizer was used out of order on some rank."""


class ControlVector:
    """The layout of the control vector over ``ranks`` ranks and ``nparams`` parameters.

    Args:
        ranks: Ranks of the reduction.
        nparams: Parameters reduced.
        payload: Elements of a fused payload at the end (0: none).
    """

    def __init__(self, ranks: int, nparams: int, payload: int = 0) -> None:
        self.ranks, self.nparams, self.payload_len = ranks, nparams, payload
        self.samples = 0
        self.misuse = slice(1, 1 + ranks)
        self.got_grad = slice(self.misuse.stop, self.misuse.stop + nparams)
        self.shares = slice(
            self.got_grad.stop, self.got_grad.stop + ranks * SHARE_SLOTS
        )
        self.header_len = self.shares.stop
        """Entries before the payload."""
        self.payload = slice(self.header_len, self.header_len + payload)

    def __len__(self) -> int:
        return self.payload.stop

    def pack(
        self,
        rank: int,
        samples: float,
        misuse: int,
        got_grad: list[bool],
        share: np.ndarray,
        payload: np.ndarray | None = None,
    ) -> np.ndarray:
        """This rank's vector, zeros in every other rank's slots."""
        # (numpy: a torch element assignment costs microseconds, and this
        # runs on every step)
        v = np.zeros(len(self), dtype=np.float64)
        v[self.samples] = samples
        v[self.misuse.start + rank] = misuse
        v[self.got_grad] = got_grad
        at = self.shares.start + rank * SHARE_SLOTS
        v[at : at + SHARE_SLOTS] = share
        if payload is not None:
            v[self.payload] = payload
        return v

    def first_misuse(self, total: np.ndarray) -> tuple[int, int] | None:
        """``(rank, code)`` of the lowest rank that misused the optimizer, if any."""
        for rank, code in enumerate(total[self.misuse].tolist()):
            if code:
                return rank, int(code)
        return None

    def shared_values(self, total: np.ndarray) -> np.ndarray:
        """Every rank's shared values, ``(ranks, SHARE_SLOTS)``."""
        return total[self.shares].reshape(self.ranks, SHARE_SLOTS).copy()
