"""Normalisation statistics: per-channel mean and standard deviation of a split.

The converter records them in the file while it writes (:class:`Moments`);
:func:`compute_statistics` computes them from a split that records none (a
file written by another tool, or ``hybridagg train --normalize compute``),
each worker over its own part of the split, then summed on every worker in
the same order, so every worker gets the same values.

Image-shaped samples ``(C, H, W)`` get one mean and deviation per channel;
samples of any other shape one scalar each.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["Moments", "compute_statistics", "norm_axes"]

# Rows read at a time: about this many bytes.
_PIECE_BYTES = 16 << 20


def norm_axes(sample_shape: tuple) -> tuple[int, ...]:
    """Axes of a batch ``(n, *sample_shape)`` the statistics sum over.

    Image-shaped ``(C, H, W)`` samples: all but the channel axis; anything
    else: every axis (one scalar).
    """
    return (0, 2, 3) if len(sample_shape) == 3 else tuple(range(len(sample_shape) + 1))


class Moments:
    """Running per-channel mean and variance over batches of rows (float64).

    Over the finite values only: data kept with ``allow_nonfinite`` still
    gets finite statistics, so only its non-finite samples are non-finite
    after normalisation. Two partial results combine with ``+``.

    Args:
        sample_shape: Shape of one sample.
    """

    def __init__(self, sample_shape: tuple) -> None:
        self.axes = norm_axes(tuple(sample_shape))
        self.n: Any = 0
        self.s: Any = 0.0
        self.ss: Any = 0.0

    def add(self, x: np.ndarray) -> None:
        """Count the rows of ``x`` (``(n, *sample_shape)``)."""
        x64 = x.astype(np.float64, copy=False)
        finite = np.isfinite(x64)
        if not finite.all():
            x64 = np.where(finite, x64, 0.0)
        self.s = self.s + x64.sum(axis=self.axes)
        self.ss = self.ss + np.square(x64).sum(axis=self.axes)
        self.n = self.n + finite.sum(axis=self.axes)

    def __add__(self, other: Moments) -> Moments:
        out = Moments.__new__(Moments)
        out.axes = self.axes
        out.n, out.s, out.ss = self.n + other.n, self.s + other.s, self.ss + other.ss
        return out

    def result(self) -> tuple[np.ndarray, np.ndarray]:
        """``(mean, std)`` as float32 arrays (a zero deviation becomes 1)."""
        n = np.maximum(self.n, 1)
        mean = np.atleast_1d(self.s / n)
        var = np.atleast_1d(self.ss / n) - mean**2
        std = np.sqrt(np.maximum(var, 0.0))
        std[std == 0] = 1.0
        return mean.astype(np.float32), std.astype(np.float32)


def compute_statistics(
    paths: str | os.PathLike | Sequence[str | os.PathLike],
    split: str = "train",
    *,
    comm: Any = None,
    samples_key: str = "samples",
    labels_key: str = "labels",
    locking: bool | str | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Per-channel ``(mean, std)`` of one split, read from its files.

    With ``comm`` the work is shared: worker ``r`` of ``W`` reads pieces
    ``r, r + W, ...`` of about 16 MiB, and the partial sums are gathered and
    added in worker order, so every worker returns the same arrays.
    Collective over ``comm``; a bad file is the same error on every worker.

    Args:
        paths: The split's file or files.
        split: The split's group.
        comm: The workers' :class:`hybridagg.comm.Comm`, or ``None`` (this
            process reads everything).
        samples_key: Name of the samples dataset in the split group.
        labels_key: Name of the labels dataset.
        locking: h5py's ``locking=``.

    Returns:
        float32 ``mean`` and ``std`` (one entry per channel of image-shaped
        samples, else one), in the form :class:`HDF5Loader`'s
        ``statistics=`` takes.

    Raises:
        FileNotFoundError, ValueError, TypeError: A bad file or split.
    """
    from .format import open_file
    from .options import resolve_paths
    from .split import load_split_info

    rank, size = (comm.rank, comm.size) if comm else (0, 1)
    part: Moments | None = None
    err: BaseException | None = None
    try:
        files = resolve_paths(paths)
        infos = load_split_info(
            files,
            split,
            samples_key=samples_key,
            labels_key=labels_key,
            locking=locking,
        )
        part = Moments(infos[0].sample_shape)
        step = max(1, _PIECE_BYTES // max(1, infos[0].sample_bytes))
        pieces = [
            (i, lo)
            for i, info in enumerate(infos)
            for lo in range(0, info.length, step)
        ]
        mine = pieces[rank::size]
        for i, info in enumerate(infos):
            los = [lo for j, lo in mine if j == i]
            if not los:
                continue
            with open_file(info.path, locking=locking) as f:
                dset = f[info.samples_key]
                for lo in los:
                    part.add(np.asarray(dset[lo : lo + step]))
    except (ValueError, TypeError, OSError) as exc:
        err = exc
    if comm:
        comm.check(err, what="computing the normalisation statistics")
        parts = comm.allgather(part, what="normalisation statistics")
        total = parts[0]
        for other in parts[1:]:
            total = total + other
        return total.result()
    if err is not None:
        raise err
    return part.result()
