"""What the converter reads from: samples and labels of one split of the input.

A :class:`Source` is a split's worth of input (the training data, or a given
validation or test set): its length, its labels (small, held whole: integer
classes, or float regression targets), the
shape and dtype of one sample as the file will store it (channels first),
and :meth:`Source.read`, which returns the samples at sorted indices.
:class:`ArraySource` covers numpy arrays, memory-mapped ``.npy`` files and
HDF5 datasets (read as contiguous slices, never whole);
:class:`~hybridagg.data.images.ImageFolder` covers folders of images.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from .layout import channels_first_shape, resolve_layout, to_channels_first

__all__ = [
    "TARGETS",
    "ArraySource",
    "Source",
    "check_finite",
    "check_labels",
    "check_targets",
]

TARGETS = ("classes", "float")
"""What the labels of an input are: integer classes, or float regression targets."""

# Rows read at a time when checking values: about this many bytes.
_CHECK_BYTES = 64 << 20


class Source(Protocol):
    """A split's worth of input.

    Attributes:
        name: What to call it in messages (a file or folder name).
        labels: Every label, int64, ``(n,)``; or float32 regression
            targets, ``(n,)`` or ``(n, k)``.
        sample_shape: One sample's shape as stored (channels first).
        dtype: The samples' dtype as stored.
    """

    name: str
    labels: np.ndarray
    sample_shape: tuple[int, ...]
    dtype: np.dtype

    def __len__(self) -> int:
        """Number of samples."""

    def read(self, idx: np.ndarray) -> np.ndarray:
        """The samples at ``idx`` (sorted, ascending), ``(len(idx), *sample_shape)``."""


def check_labels(y: Any, source: str) -> np.ndarray:
    """``y`` as int64 labels, or a clear error.

    Float labels are taken when every value is a whole number (files written
    by tools that store everything as float).

    Raises:
        TypeError: Labels that are not integers.
        ValueError: Labels that are not 1-d or are negative.
    """
    y = np.asarray(y)
    if y.ndim == 2 and y.shape[1] == 1:
        y = y[:, 0]  # a column vector, as some tools write labels
    if y.ndim != 1:
        raise ValueError(f"{source}: labels must be 1-d, got shape {y.shape}")
    whole = y.dtype.kind == "f" and bool(np.all(np.mod(y, 1) == 0))
    if y.dtype.kind not in "iu" and not whole:
        # (fractional floats are more likely targets than classes)
        hint = (
            "; for regression targets pass --targets float"
            if y.dtype.kind == "f"
            else ""
        )
        raise TypeError(f"{source}: labels have dtype {y.dtype}; need integers{hint}")
    y = y.astype(np.int64)
    if len(y) and y.min() < 0:
        raise ValueError(f"{source}: label {int(y.min())} is negative")
    return y


def check_targets(y: Any, source: str) -> np.ndarray:
    """``y`` as float32 regression targets ``(n,)`` or ``(n, k)``, or a clear error.

    A target is never allowed to be non-finite (the loss would be NaN), with
    or without ``allow_nonfinite`` (which is about samples).

    Raises:
        TypeError: Targets that are not numbers.
        ValueError: Targets that are neither 1-d nor 2-d, or not finite (the
            message names the first).
    """
    y = np.asarray(y)
    if y.dtype.kind not in "biuf":
        raise TypeError(f"{source}: targets have dtype {y.dtype}; need numbers")
    if y.ndim not in (1, 2):
        raise ValueError(
            f"{source}: float targets must be (N,) or (N, k), got shape {y.shape}"
        )
    y = y.astype(np.float32)
    bad = ~np.isfinite(y.reshape(len(y), -1)).all(axis=1)
    if bad.any():
        raise ValueError(
            f"{source}: target {int(np.flatnonzero(bad)[0])} is not finite"
        )
    return y


def check_finite(x: Any, source: str) -> None:
    """Raise ``ValueError`` naming the first sample of ``x`` holding a NaN or an infinity.

    Read in pieces of about 64 MiB, in the source's order, so a memory-mapped
    input or an HDF5 dataset is never loaded whole. Integer samples are
    always finite.
    """
    if x.dtype.kind != "f" or len(x) == 0:
        return
    row_bytes = max(1, int(np.prod(x.shape[1:], dtype=np.int64)) * x.dtype.itemsize)
    step = max(1, _CHECK_BYTES // row_bytes)
    for lo in range(0, len(x), step):
        piece = np.asarray(x[lo : lo + step]).reshape(min(step, len(x) - lo), -1)
        bad = ~np.isfinite(piece).all(axis=1)
        if bad.any():
            first = lo + int(np.argmax(bad))
            values = np.asarray(x[first]).reshape(-1)
            value = values[~np.isfinite(values)][0]
            raise ValueError(
                f"{source}: sample {first} is not finite (holds {value}); "
                "training on it would stop with a non-finite loss. Fix the "
                "data, or pass --allow-nonfinite (allow_nonfinite=True) to keep it"
            )


class ArraySource:
    """Samples in an array-like (numpy array, memory map, HDF5 dataset) and labels.

    Args:
        x: Samples, ``(N, *shape)``, numeric; indexed with slices only.
        y: Labels, ``(N,)`` (or ``(N, 1)``), integers or whole floats; with
            ``targets="float"`` regression targets ``(N,)`` or ``(N, k)``.
        name: For messages.
        layout: ``"auto"``, ``"nchw"`` or ``"nhwc"`` (see
            :mod:`hybridagg.data.layout`); channels-last samples are
            transposed as they are read.
        allow_nonfinite: Keep samples holding NaN or infinite values.
        targets: ``"classes"`` (integer labels) or ``"float"`` (regression
            targets, stored as float32).

    Raises:
        TypeError: Samples that are not numbers, labels that are not integers.
        ValueError: Lengths that differ, no samples, an ambiguous layout, a
            non-finite sample (without ``allow_nonfinite``).
    """

    def __init__(
        self,
        x: Any,
        y: Any,
        *,
        name: str,
        layout: str = "auto",
        allow_nonfinite: bool = False,
        targets: str = "classes",
    ) -> None:
        self.name = name
        if targets not in TARGETS:
            raise ValueError(f"targets must be 'classes' or 'float', got {targets!r}")
        if x.dtype.kind not in "biuf":
            raise TypeError(f"{name}: samples have dtype {x.dtype}; need numbers")
        if len(x.shape) < 1:
            raise ValueError(f"{name}: samples need a sample axis, got shape {x.shape}")
        if targets == "float":
            self.labels = check_targets(y, name)
        else:
            self.labels = check_labels(y, name)
        if x.shape[0] != len(self.labels):
            what = "targets" if targets == "float" else "labels"
            raise ValueError(
                f"{name}: {x.shape[0]} samples but {len(self.labels)} {what}"
            )
        if x.shape[0] == 0:
            raise ValueError(f"{name}: no samples")
        self.layout = resolve_layout(tuple(x.shape[1:]), layout)
        if not allow_nonfinite:
            check_finite(x, name)
        self._x = x
        self.sample_shape = channels_first_shape(tuple(x.shape[1:]), self.layout)
        self.dtype = np.dtype(x.dtype)

    def __len__(self) -> int:
        return len(self.labels)

    def read(self, idx: np.ndarray) -> np.ndarray:
        """The samples at sorted ``idx``, channels first.

        One contiguous slice from the first to the last index is read, then
        the rows wanted are picked: HDF5 reads slices fast and fancy indices
        slowly, and the converter's indices are dense (the training split
        holds most rows).
        """
        idx = np.asarray(idx, dtype=np.int64)
        if len(idx) == 0:
            return np.empty((0, *self.sample_shape), dtype=self.dtype)
        lo, hi = int(idx[0]), int(idx[-1]) + 1
        block = np.asarray(self._x[lo:hi])
        return to_channels_first(block[idx - lo], self.layout)
