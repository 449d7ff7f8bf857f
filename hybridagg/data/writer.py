"""Write the splits of a data set into one file in hybridagg's format.

:func:`write_splits` is the converters' common end: it takes each split's
rows as a function of sorted indices (so no source is ever loaded whole),
writes them in pieces of about 64 MiB into chunked datasets (one chunk is
one block, the loader's unit of reading and shuffling), computes the
normalisation statistics over the training split as it goes, and renames the
file into place only once it is complete.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from .format import DEFAULT_BLOCK_BYTES, FORMAT_NAME, FORMAT_VERSION, block_samples_for
from .moments import Moments

__all__ = ["SplitRows", "split_indices", "write_splits"]

# A chunk of rows generated, permuted or copied at a time; bounds memory.
_COPY_BYTES = 64 << 20
# At least this many blocks in a small data set, so that dynamic shares and
# the block shuffle have units to work with.
_MIN_BLOCKS = 128


def split_indices(
    n: int, val_fraction: float, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """Shuffle ``range(n)`` with ``seed`` and cut it into train and validation.

    Returns:
        Sorted train indices and sorted validation indices (sorted, so that
        copying them reads the source in order).

    Raises:
        ValueError: ``val_fraction`` is outside ``[0, 1)`` or leaves a split
            empty that was asked for.
    """
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    n_val = round(n * val_fraction)
    if val_fraction > 0 and n_val == 0:
        raise ValueError(
            f"val_fraction={val_fraction} of {n} samples leaves the validation "
            "split empty; use more samples or a larger fraction"
        )
    if n - n_val < 1:
        raise ValueError(f"{n} samples leave the training split empty")
    perm = np.random.default_rng(seed).permutation(n)
    return np.sort(perm[n_val:]), np.sort(perm[:n_val])


@dataclass(frozen=True)
class SplitRows:
    """One split to write: which rows, and how to get them.

    Attributes:
        name: The split's group (``"train"``, ``"val"``, ``"test"``).
        indices: Sorted indices into the split's input.
        rows: ``rows(indices) -> (samples, labels)`` for a sorted slice of
            ``indices``.
    """

    name: str
    indices: np.ndarray
    rows: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]]


def _create_split(
    f: h5py.File,
    name: str,
    n: int,
    shape: tuple,
    dtype: np.dtype,
    block: int,
    target_shape: tuple | None = None,
) -> tuple[h5py.Dataset, h5py.Dataset]:
    """A split's datasets; ``target_shape``: float32 targets of that shape, not classes."""
    g = f.create_group(name)
    xs = g.create_dataset(
        "samples", shape=(n, *shape), dtype=dtype, chunks=(min(block, n), *shape)
    )
    ychunk = min(max(block, 4096), n)
    if target_shape is None:
        ys = g.create_dataset("labels", shape=(n,), dtype=np.int64, chunks=(ychunk,))
    else:
        ys = g.create_dataset(
            "labels",
            shape=(n, *target_shape),
            dtype=np.float32,
            chunks=(ychunk, *target_shape),
        )
    return xs, ys


def _progress(total: int, name: str, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=f"writing {name}", unit="sample", disable=not enabled)


def write_splits(
    out: str | os.PathLike,
    splits: Sequence[SplitRows],
    shape: tuple,
    dtype: np.dtype,
    *,
    num_classes: int,
    block_samples: int | None,
    progress: bool,
    attrs: dict[str, Any],
    target_shape: tuple | None = None,
) -> Path:
    """Write ``splits`` (the first is the training split) into ``out``.

    Args:
        out: The file (written to ``out.partial`` first, then renamed).
        splits: The splits; an empty one is left out. The statistics
            (``norm_mean``, ``norm_std``) are the first split's.
        shape: One sample's shape.
        dtype: The samples' dtype.
        num_classes: Recorded as ``num_classes`` (with float targets, the
            number of values per target).
        block_samples: Samples per block (default: about 1 MiB, but at least
            128 blocks in the training split).
        progress: Show a progress bar.
        attrs: More file attributes (``source``, ``seed``, ...).
        target_shape: The labels are float32 regression targets of this
            shape per sample (``()`` or ``(k,)``), not int64 classes.

    Raises:
        ValueError: ``out`` is a directory, or ``block_samples < 1``.
    """
    out = Path(out)
    if out.is_dir():
        raise ValueError(f"output {out} is a directory; give a file name like data.h5")
    sample_bytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    n_train = len(splits[0].indices)
    block = block_samples or min(
        block_samples_for(sample_bytes, DEFAULT_BLOCK_BYTES),
        max(16, -(-n_train // _MIN_BLOCKS)),
    )
    if block < 1:
        raise ValueError(f"block_samples must be >= 1, got {block}")
    step = max(block, (_COPY_BYTES // max(sample_bytes, 1)) // block * block)
    bar = _progress(sum(len(s.indices) for s in splits), out.name, progress)
    tmp = out.with_name(out.name + ".partial")
    moments = Moments(shape)
    try:
        with h5py.File(tmp, "w") as f:
            for k, split in enumerate(splits):
                idx = split.indices
                if len(idx) == 0:
                    continue
                xs, ys = _create_split(
                    f, split.name, len(idx), shape, dtype, block, target_shape
                )
                for lo in range(0, len(idx), step):
                    x, y = split.rows(idx[lo : lo + step])
                    xs[lo : lo + len(x)] = x
                    ys[lo : lo + len(y)] = y
                    if k == 0:
                        moments.add(x)
                    bar.update(len(x))
            mean, std = moments.result()
            f.attrs.update(
                {
                    "hybridagg_format": FORMAT_NAME,
                    "format_version": FORMAT_VERSION,
                    "num_classes": int(num_classes),
                    "sample_shape": np.asarray(shape, dtype=np.int64),
                    "sample_dtype": np.dtype(dtype).str,
                    "norm_mean": mean,
                    "norm_std": std,
                    "block_samples": int(block),
                    **attrs,
                }
            )
        tmp.replace(out)
    finally:
        bar.close()
        if tmp.exists():
            tmp.unlink()
    return out
