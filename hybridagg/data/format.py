"""The on-disk format of hybridagg data sets, and its validation.

One HDF5 file (or several with the same layout) holds one group per split::

    /                       attrs: hybridagg_format, format_version,
                                   num_classes, sample_shape, sample_dtype,
                                   norm_mean, norm_std, block_samples, source
    /train/samples          (N, *sample_shape), numeric, chunks of
                            (block_samples, *sample_shape): one chunk is one
                            block, the unit of shuffling and of reading
    /train/labels           (N,), int64, values in [0, num_classes); or, for
                            regression, float targets (N,) or (N, k), and
                            num_classes is then k (1 for (N,))
    /val/samples, /val/labels   the same for the validation split

The dataset names (``samples``/``labels``) are configurable, so files written
by other tools can be read as long as they have a group per split. The
attributes are optional for such files: without ``num_classes`` the class
count is inferred from the labels, without ``block_samples`` the dataset's
own chunking (or 1 MiB blocks) is used.

:func:`inspect_split` opens a split, checks everything the loader relies on,
and raises a clear error naming the file and the dataset for anything else.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from ..runtime import envvars

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "SplitInfo",
    "block_samples_for",
    "file_locking",
    "inspect_split",
    "open_file",
]

FORMAT_NAME = "hybridagg.hdf5"
FORMAT_VERSION = 1
# A block (one HDF5 chunk) of about this many bytes is one large contiguous read.
DEFAULT_BLOCK_BYTES = 1 << 20


@dataclass
class SplitInfo:
    """What the loader needs to know about one split of one file.

    Attributes:
        path: The file.
        split: The group name (``"train"``, ``"val"``).
        samples_key: Dataset path of the samples, e.g. ``"train/samples"``.
        labels_key: Dataset path of the labels.
        length: Number of samples.
        sample_shape: Shape of one sample.
        dtype: Sample dtype.
        num_classes: Declared (or inferred) number of classes; with float
            targets the number of values per target.
        block_samples: Samples per block (the shuffle and read unit).
        norm_mean: Per-channel (or scalar) mean recorded by the converter.
        norm_std: Per-channel (or scalar) standard deviation.
        labels: All labels of the split, loaded at validation (int64
            classes, or float32 targets).
    """

    path: str
    split: str
    samples_key: str
    labels_key: str
    length: int
    sample_shape: tuple[int, ...]
    dtype: np.dtype
    num_classes: int
    block_samples: int
    norm_mean: np.ndarray | None = None
    norm_std: np.ndarray | None = None
    labels: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))

    @property
    def sample_bytes(self) -> int:
        """Bytes of one sample."""
        return int(np.prod(self.sample_shape, dtype=np.int64)) * self.dtype.itemsize

    @property
    def regression(self) -> bool:
        """Whether the labels are float targets (regression), not classes."""
        return self.labels.dtype.kind == "f"

    def layout(self) -> tuple:
        """What must agree between files of one data set and between ranks."""
        return (self.sample_shape, self.dtype.str, self.num_classes, self.regression)


def block_samples_for(sample_bytes: int, block_bytes: int = DEFAULT_BLOCK_BYTES) -> int:
    """Samples per block so that a block is about ``block_bytes``."""
    return max(1, int(block_bytes) // max(1, int(sample_bytes)))


def file_locking(locking: bool | str | None = None) -> bool | str:
    """Resolve the ``locking=`` argument of :func:`h5py.File`.

    An explicit argument wins; else ``HDF5_USE_FILE_LOCKING`` (``FALSE`` on
    NFS/Lustre, where locks fail); else ``"best-effort"``, which locks where
    the file system can and carries on where it cannot.
    """
    if locking is not None:
        if locking not in (True, False, "best-effort"):
            raise ValueError(
                f"locking must be True, False or 'best-effort', got {locking!r}"
            )
        return locking
    env = envvars.get_str("HDF5_USE_FILE_LOCKING")
    if env is None:
        return "best-effort"
    low = env.strip().lower()
    if low in ("false", "0", "no", "off"):
        return False
    if low in ("best-effort", "best_effort"):
        return "best-effort"
    return True


def _check_path(path: str) -> None:
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"data file {path} does not exist")
    if p.is_dir():
        raise ValueError(f"data file {path} is a directory, not an HDF5 file")
    size = p.stat().st_size
    if size == 0:
        raise ValueError(f"data file {path} is empty (0 bytes), not an HDF5 file")
    if not h5py.is_hdf5(path):
        raise ValueError(
            f"data file {path} is not an HDF5 file (no HDF5 signature); write "
            "one with 'hybridagg convert'"
        )


def open_file(
    path: str | os.PathLike, *, locking: bool | str | None = None, **kwargs: Any
) -> h5py.File:
    """Open a data file read-only, turning HDF5's errors into clear ones.

    Raises:
        FileNotFoundError: The file does not exist.
        ValueError: It is a directory, empty, not HDF5, truncated or corrupted.
    """
    path = os.fspath(path)
    _check_path(path)
    try:
        return h5py.File(path, "r", locking=file_locking(locking), **kwargs)
    except OSError as exc:
        raise ValueError(
            f"data file {path} cannot be opened as HDF5 (truncated or "
            f"corrupted?): {exc}"
        ) from None


def _dataset(f: h5py.File, path: str, key: str) -> h5py.Dataset:
    try:
        obj = f[key]
    except KeyError:
        obj = None
    except (OSError, RuntimeError) as exc:
        raise ValueError(
            f"data file {path}: dataset '{key}' cannot be read (corrupted?): {exc}"
        ) from None
    if not isinstance(obj, h5py.Dataset):
        group = key.rsplit("/", 1)[0] if "/" in key else ""
        found = _names(f, group)
        what = "is not a dataset" if obj is not None else "does not exist"
        raise ValueError(
            f"data file {path}: dataset '{key}' {what} (found: {found}); pass "
            "samples_key=/labels_key= if your file uses other names"
        )
    return obj


def _names(f: h5py.File, group: str) -> str:
    try:
        g = f[group] if group else f
        if not isinstance(g, h5py.Group):
            return "nothing"
        names = [f"{group}/{k}" if group else k for k in g]
        return ", ".join(sorted(names)) or "nothing"
    except (KeyError, OSError, RuntimeError):
        return "nothing"


def _attr(f: h5py.File, name: str) -> Any:
    try:
        return f.attrs.get(name)
    except (OSError, RuntimeError):
        return None


def _read_checked(dset: h5py.Dataset, path: str, key: str, sel: Any) -> np.ndarray:
    try:
        return np.asarray(dset[sel])
    except (OSError, RuntimeError, ValueError) as exc:
        raise ValueError(
            f"data file {path}: reading dataset '{key}' failed (truncated or "
            f"corrupted file?): {exc}"
        ) from None


def _split_info(
    f: h5py.File,
    path: str,
    split: str,
    samples: h5py.Dataset,
    skey: str,
    lkey: str,
    num_classes: int,
    labels: np.ndarray,
) -> SplitInfo:
    """The :class:`SplitInfo` of a checked split."""
    block = _attr(f, "block_samples")
    if block is None:
        chunks = samples.chunks
        block = (
            chunks[0]
            if chunks
            else block_samples_for(
                int(np.prod(samples.shape[1:], dtype=np.int64)) * samples.dtype.itemsize
            )
        )
    mean, std = _attr(f, "norm_mean"), _attr(f, "norm_std")
    return SplitInfo(
        path=path,
        split=split,
        samples_key=skey,
        labels_key=lkey,
        length=int(samples.shape[0]),
        sample_shape=tuple(int(s) for s in samples.shape[1:]),
        dtype=np.dtype(samples.dtype),
        num_classes=num_classes,
        block_samples=max(1, int(block)),
        norm_mean=None if mean is None else np.asarray(mean, dtype=np.float32),
        norm_std=None if std is None else np.asarray(std, dtype=np.float32),
        labels=labels,
    )


def _regression_split(
    f: h5py.File,
    split: str,
    samples: h5py.Dataset,
    labels: h5py.Dataset,
    skey: str,
    lkey: str,
    path: str,
) -> SplitInfo:
    """Check a split whose labels are float targets ``(N,)`` or ``(N, k)``."""
    if samples.ndim < 1 or labels.ndim not in (1, 2):
        raise ValueError(
            f"data file {path}: dataset '{skey}' must have a sample axis and the "
            f"float targets '{lkey}' must be (N,) or (N, k); got shapes "
            f"{samples.shape} and {labels.shape}"
        )
    n = int(samples.shape[0])
    if int(labels.shape[0]) != n:
        raise ValueError(
            f"data file {path}: dataset '{skey}' has {n} samples but "
            f"'{lkey}' has {labels.shape[0]} targets"
        )
    if n == 0:
        raise ValueError(f"data file {path}: split '{split}' ('{skey}') is empty")
    y = _read_checked(labels, path, lkey, slice(None)).astype(np.float32, copy=False)
    _read_checked(samples, path, skey, slice(0, 1))
    _read_checked(samples, path, skey, slice(n - 1, n))
    bad = ~np.isfinite(y.reshape(n, -1)).all(axis=1)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise ValueError(
            f"data file {path}: dataset '{lkey}' has a non-finite target at index {i}"
        )
    width = 1 if labels.ndim == 1 else int(labels.shape[1])
    return _split_info(f, path, split, samples, skey, lkey, width, y)


def inspect_split(
    f: h5py.File,
    split: str,
    *,
    samples_key: str = "samples",
    labels_key: str = "labels",
    num_classes: int | None = None,
    path: str | None = None,
) -> SplitInfo:
    """Validate one split of an open file and describe it.

    Reads every label (labels are small) and the first and last sample, so a
    truncated file fails here rather than in the middle of an epoch.

    Args:
        f: An open file.
        split: Group name of the split.
        samples_key: Name of the samples dataset inside the split group.
        labels_key: Name of the labels dataset inside the split group.
        num_classes: Overrides the file's ``num_classes`` attribute.
        path: The file's name for messages (default ``f.filename``).

    Raises:
        ValueError: A dataset is missing, the lengths differ, the split is
            empty, a label is outside ``[0, num_classes)``, or a read fails.
        TypeError: Samples are not numeric or labels are neither integers
            nor floats.
    """
    path = path or f.filename
    skey, lkey = f"{split}/{samples_key}", f"{split}/{labels_key}"
    if split not in f:
        raise ValueError(
            f"data file {path} has no split '{split}' (found: {_names(f, '')})"
        )
    samples = _dataset(f, path, skey)
    labels = _dataset(f, path, lkey)
    if samples.dtype.kind not in "biuf":
        raise TypeError(
            f"data file {path}: dataset '{skey}' has dtype {samples.dtype}; "
            "samples must be numeric (bool, int, uint or float)"
        )
    if labels.dtype.kind == "f":
        # float targets: a regression (--loss mse)
        return _regression_split(f, split, samples, labels, skey, lkey, path)
    if labels.dtype.kind not in "iu":
        raise TypeError(
            f"data file {path}: dataset '{lkey}' has dtype {labels.dtype}; "
            "labels must be integers (classes) or floats (regression targets)"
        )
    if samples.ndim < 1 or labels.ndim != 1:
        raise ValueError(
            f"data file {path}: dataset '{skey}' must have a sample axis and "
            f"'{lkey}' must be 1-d; got shapes {samples.shape} and {labels.shape}"
        )
    n = int(samples.shape[0])
    if int(labels.shape[0]) != n:
        raise ValueError(
            f"data file {path}: dataset '{skey}' has {n} samples but "
            f"'{lkey}' has {labels.shape[0]} labels"
        )
    if n == 0:
        raise ValueError(f"data file {path}: split '{split}' ('{skey}') is empty")
    y = _read_checked(labels, path, lkey, slice(None)).astype(np.int64, copy=False)
    _read_checked(samples, path, skey, slice(0, 1))
    _read_checked(samples, path, skey, slice(n - 1, n))
    declared = num_classes if num_classes is not None else _attr(f, "num_classes")
    if declared is None:
        classes = int(y.max()) + 1
    else:
        classes = int(declared)
        if classes < 1:
            raise ValueError(
                f"data file {path}: num_classes must be >= 1, got {classes}"
            )
    bad = (y < 0) | (y >= classes)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise ValueError(
            f"data file {path}: dataset '{lkey}' has label {int(y[i])} at index "
            f"{i}, outside the {classes} declared classes [0, {classes})"
        )
    return _split_info(f, path, split, samples, skey, lkey, classes, y)
