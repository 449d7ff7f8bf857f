"""The wire format: gradients and weights sent as bf16 or fp16, with error feedback.

``--wire bf16`` (or ``fp16``) halves the bytes of every gradient and weight
message: a rank rounds what it sends to the compact type and the receiver
widens it back to float32 before adding or applying it. Sums are formed in
float32 wherever the algorithm lets the receiver see the senders' pieces
(:mod:`hybridagg.collectives.compact`), and the servers' float32 master
copy of the weights never leaves them.

**Error feedback** (Seide et al. 2014; Karimireddy et al. 2019, EF-SGD).
Rounding to 8 (bf16) or 11 (fp16) significant bits loses the low bits of
every element. :class:`ErrorFeedback` keeps, per rounded tensor, a float32
*residual*: what the last rounding lost. The next value is rounded after
the residual was added to it, so ``sum(sent) == sum(true) - residual`` at
every step: nothing is lost over time, only delayed, and the gap never
exceeds one rounding unit of the current value. A gradient element too
small for the compact type (fp16 flushes below 6e-8) accumulates in its
residual until it is large enough to be sent.

**Range.** bf16 has float32's exponent range. fp16 does not: an element
larger than 65504 in magnitude rounds to an infinity. The receiver then
sums or applies an infinity, and the non-finite check
(:func:`~hybridagg.comm.all_finite`, on the reduced gradient and on every
server part) stops the run with a ``NonFiniteError``, as for any NaN or
infinity. The residual of a non-finite rounding is reset to zero, so a
caller that skips such a step (as AMP's loss scaler does) starts clean.

MPI has no bf16 or fp16 type it could reduce; compact tensors travel as
their bits (:func:`wire_view`, a same-size integer view) in point-to-point
messages only.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch

from .finite import all_finite

__all__ = [
    "WIRE_DTYPES",
    "WIRE_FORMATS",
    "ErrorFeedback",
    "WireCodec",
    "check_wire",
    "wire_dtype",
    "wire_view",
]

WIRE_FORMATS = ("fp32", "bf16", "fp16")
"""The wire formats (``--wire``); the first is the default."""

WIRE_DTYPES = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}


def check_wire(wire: object) -> str:
    """Return ``wire`` if it names a wire format.

    Raises:
        TypeError: ``wire`` is not a string.
        ValueError: It names no wire format.
    """
    if not isinstance(wire, str):
        raise TypeError(
            f"wire must be a string ({', '.join(WIRE_FORMATS)}), got {wire!r}"
        )
    if wire not in WIRE_DTYPES:
        raise ValueError(f"unknown wire format {wire!r}: use {', '.join(WIRE_FORMATS)}")
    return wire


def wire_dtype(wire: str) -> torch.dtype:
    """The torch dtype a wire format sends (``ValueError`` for an unknown one)."""
    return WIRE_DTYPES[check_wire(wire)]


def wire_view(x: torch.Tensor) -> torch.Tensor:
    """``x`` as MPI can send it: a 16-bit float tensor as its bits (int16), else itself.

    Only for point-to-point messages: an integer sum of the bits is no sum.
    """
    if x.dtype in (torch.bfloat16, torch.float16):
        return x.view(torch.int16)
    return x


class ErrorFeedback:
    """Round float32 tensors to a compact type, keeping what each rounding lost.

    One float32 residual per key (a rounded tensor's identity: the caller
    names it), allocated on the first rounding: the memory cost is one
    float32 copy of every tensor a rank rounds.

    Args:
        dtype: The compact type (``torch.bfloat16`` or ``torch.float16``).
    """

    def __init__(self, dtype: torch.dtype) -> None:
        if dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"error feedback rounds to bf16 or fp16, not {dtype}")
        self.dtype = dtype
        self._residuals: dict[Hashable, torch.Tensor] = {}

    def round(self, x: torch.Tensor, out: torch.Tensor, key: Hashable) -> None:
        """``out = round(x + residual[key])``; the residual becomes what that lost.

        Args:
            x: Float32 values (not changed).
            out: Compact tensor of ``x``'s size, written.
            key: Names the tensor whose residual applies (the same key for
                the same tensor every step).
        """
        residual = self._residuals.get(key)
        if residual is None or residual.shape != x.shape:
            residual = torch.zeros_like(x)
            self._residuals[key] = residual
        residual.add_(x)  # the value to send: the new one plus what was owed
        out.copy_(residual)  # round to nearest
        residual.sub_(out)  # what the rounding lost, owed to the next step
        if not all_finite([residual]):
            # an overflow (fp16) or a NaN in x: the run's non-finite check sees
            # it in what was sent; a residual must not carry it on
            residual.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)

    def residual(self, key: Hashable) -> torch.Tensor | None:
        """The residual kept for ``key`` (``None``: never rounded)."""
        return self._residuals.get(key)

    @property
    def nbytes(self) -> int:
        """Memory the residuals take."""
        return sum(r.numel() * r.element_size() for r in self._residuals.values())

    def clear(self) -> None:
        """Forget every residual."""
        self._residuals.clear()


class WireCodec:
    """One flat float32 vector as it travels in a wire format, part by part.

    Owns the compact copy of the vector (``None`` on the float32 wire, where
    parts travel from and into the vector itself) and, for gradients, the
    error feedback. Senders call :meth:`encode` per part and send what it
    returns; receivers receive into :meth:`landing` and call :meth:`decode`
    once the part has arrived.

    Args:
        wire: ``"fp32"``, ``"bf16"`` or ``"fp16"``.
        numel: Length of the flat vector.
        feedback: Keep a residual for what rounding loses (gradients: yes;
            weights sent from a float32 master copy: no, the master keeps
            the exact values).
    """

    def __init__(self, wire: str, numel: int, *, feedback: bool) -> None:
        self.wire = check_wire(wire)
        self.dtype = WIRE_DTYPES[wire]
        self.compact = self.dtype != torch.float32
        self.buffer: torch.Tensor | None = None
        self.feedback: ErrorFeedback | None = None
        if self.compact:
            self.buffer = torch.empty(numel, dtype=self.dtype)
            if feedback:
                self.feedback = ErrorFeedback(self.dtype)

    def encode(self, flat: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        """Part ``[lo, hi)`` of ``flat`` ready to send (rounded, as bits)."""
        return self.encode_part(flat[lo:hi], lo, hi)

    def encode_part(self, src: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        """Part ``[lo, hi)`` of the vector ready to send, its values in ``src``.

        For a sender whose values do not lie in one flat vector (a leader's
        streamed push sends each part from the memory of the bucket that
        holds it): the rounding and its residual are those of
        :meth:`encode` on the same part.

        Raises:
            ValueError: ``src`` does not have ``hi - lo`` elements.
        """
        if src.numel() != hi - lo:
            raise ValueError(
                f"part [{lo}, {hi}) has {hi - lo} elements, its values {src.numel()}"
            )
        if not self.compact:
            return src
        out = self.buffer[lo:hi]
        if self.feedback is not None:
            self.feedback.round(src, out, (lo, hi))
        else:
            out.copy_(src)
        return wire_view(out)

    def landing(self, flat: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        """Where part ``[lo, hi)`` of ``flat`` is received (as bits)."""
        if not self.compact:
            return flat[lo:hi]
        return wire_view(self.buffer[lo:hi])

    def decode(self, flat: torch.Tensor, lo: int, hi: int) -> None:
        """Widen a received part into ``flat[lo:hi]`` (nothing on float32)."""
        if self.compact:
            flat[lo:hi].copy_(self.buffer[lo:hi])

    def bytes_of(self, numel: int) -> int:
        """Bytes ``numel`` elements take on this wire."""
        return numel * (4 if not self.compact else 2)
