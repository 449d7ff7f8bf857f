"""Write data sets in hybridagg's HDF5 format (see :mod:`hybridagg.data.format`).

Sources: ``.npy``/``.npz`` arrays, scikit-learn's bundled digits data set
(real data shipped inside the scikit-learn wheel, so tests and demos need no
download), and a generator of large synthetic image-shaped data with
learnable labels for I/O benchmarks. ``hybridagg convert`` is the command
line of this module.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import h5py
import numpy as np

from .format import (
    DEFAULT_BLOCK_BYTES,
    FORMAT_NAME,
    FORMAT_VERSION,
    block_samples_for,
)

__all__ = [
    "convert_arrays",
    "convert_digits",
    "convert_npy",
    "convert_npz",
    "convert_synthetic",
    "digits_file",
    "split_indices",
    "synthetic_batch",
]

# A chunk of rows generated, permuted or copied at a time; bounds memory.
_COPY_BYTES = 64 << 20


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


def _check_arrays(x: np.ndarray, y: np.ndarray, source: str) -> None:
    if x.dtype.kind not in "biuf":
        raise TypeError(f"{source}: samples have dtype {x.dtype}; need numbers")
    if y.dtype.kind not in "iu":
        if y.dtype.kind == "f" and np.all(np.mod(y, 1) == 0):
            return
        raise TypeError(f"{source}: labels have dtype {y.dtype}; need integers")
    if x.ndim < 1 or y.ndim != 1:
        raise ValueError(
            f"{source}: samples need a sample axis and labels must be 1-d, got "
            f"shapes {x.shape} and {y.shape}"
        )
    if len(x) != len(y):
        raise ValueError(f"{source}: {len(x)} samples but {len(y)} labels")
    if len(x) == 0:
        raise ValueError(f"{source}: no samples")


def _check_finite(x: np.ndarray, source: str) -> None:
    """Raise ``ValueError`` naming the first sample of ``x`` holding a NaN or an infinity.

    Read in pieces of about 64 MiB, in the source's order, so a memory-mapped
    input is never loaded whole. Integer samples are always finite.
    """
    if x.dtype.kind != "f" or len(x) == 0:
        return
    row_bytes = max(1, x[0].nbytes)
    step = max(1, _COPY_BYTES // row_bytes)
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


def _norm_axes(shape: tuple) -> tuple[int, ...]:
    # image-shaped (C, H, W): statistics per channel; anything else: one scalar
    return (0, 2, 3) if len(shape) == 3 else tuple(range(len(shape) + 1))


class _Moments:
    """Running per-channel mean and variance over row chunks (float64).

    Over the finite values only: data kept with ``allow_nonfinite`` still
    gets finite statistics, so only its non-finite samples are non-finite
    after normalisation.
    """

    def __init__(self, shape: tuple) -> None:
        self.axes = _norm_axes(shape)
        self.n = 0
        self.s = 0.0
        self.ss = 0.0

    def add(self, x: np.ndarray) -> None:
        x64 = x.astype(np.float64, copy=False)
        finite = np.isfinite(x64)
        if not finite.all():
            x64 = np.where(finite, x64, 0.0)
        self.s = self.s + x64.sum(axis=self.axes)
        self.ss = self.ss + np.square(x64).sum(axis=self.axes)
        self.n = self.n + finite.sum(axis=self.axes)

    def result(self) -> tuple[np.ndarray, np.ndarray]:
        n = np.maximum(self.n, 1)
        mean = np.atleast_1d(self.s / n)
        var = np.atleast_1d(self.ss / n) - mean**2
        std = np.sqrt(np.maximum(var, 0.0))
        std[std == 0] = 1.0
        return mean.astype(np.float32), std.astype(np.float32)


_MIN_BLOCKS = 128


def _write(
    out: str | os.PathLike,
    n: int,
    shape: tuple,
    dtype: np.dtype,
    rows: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]],
    *,
    num_classes: int,
    val_fraction: float,
    seed: int,
    source: str,
    block_samples: int | None,
    progress: bool,
    target_shape: tuple | None = None,
) -> Path:
    """Write ``n`` rows produced by ``rows(indices)`` into train/val splits.

    ``target_shape``: the labels are float32 regression targets of that shape
    per sample (``num_classes`` is then their width), not int64 classes.
    """
    out = Path(out)
    if out.is_dir():
        raise ValueError(f"output {out} is a directory; give a file name like data.h5")
    sample_bytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    train_idx, val_idx = split_indices(n, val_fraction, seed)
    # About 1 MiB per block, but at least _MIN_BLOCKS blocks in a small data
    # set, so dynamic shares and the block shuffle have units to work with.
    block = block_samples or min(
        block_samples_for(sample_bytes, DEFAULT_BLOCK_BYTES),
        max(16, -(-len(train_idx) // _MIN_BLOCKS)),
    )
    if block < 1:
        raise ValueError(f"block_samples must be >= 1, got {block}")
    step = max(block, (_COPY_BYTES // max(sample_bytes, 1)) // block * block)
    bar = _progress(n, out.name, progress)
    tmp = out.with_name(out.name + ".partial")
    moments = _Moments(shape)
    try:
        with h5py.File(tmp, "w") as f:
            for name, idx in (("train", train_idx), ("val", val_idx)):
                if len(idx) == 0:
                    continue
                xs, ys = _create_split(
                    f, name, len(idx), shape, dtype, block, target_shape
                )
                for lo in range(0, len(idx), step):
                    x, y = rows(idx[lo : lo + step])
                    xs[lo : lo + len(x)] = x
                    ys[lo : lo + len(y)] = y
                    if name == "train":
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
                    "source": source,
                    "seed": int(seed),
                    "val_fraction": float(val_fraction),
                }
            )
        tmp.replace(out)
    finally:
        bar.close()
        if tmp.exists():
            tmp.unlink()
    return out


def _progress(total: int, name: str, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=f"writing {name}", unit="sample", disable=not enabled)


def convert_arrays(
    x: np.ndarray,
    y: np.ndarray,
    out: str | os.PathLike,
    *,
    num_classes: int | None = None,
    val_fraction: float = 0.2,
    seed: int = 0,
    source: str = "arrays",
    block_samples: int | None = None,
    progress: bool = False,
    allow_nonfinite: bool = False,
    targets: str = "classes",
) -> Path:
    """Write in-memory (or memory-mapped) arrays as a hybridagg data file.

    Args:
        x: Samples, ``(N, *shape)``, numeric.
        y: Integer labels, ``(N,)``; with ``targets="float"`` regression
            targets, ``(N,)`` or ``(N, k)``, stored as float32 (train with
            ``--loss mse``).
        out: Output file (written to ``out.partial`` first, then renamed).
        num_classes: Default ``max(y) + 1``.
        val_fraction: Fraction of samples in the validation split.
        seed: Seed of the train/validation split.
        source: Recorded in the file's ``source`` attribute.
        block_samples: Samples per block/chunk (default: about 1 MiB).
        progress: Show a progress bar.
        allow_nonfinite: Keep samples holding NaN or infinite values
            (refused by default: they make the training loss non-finite).
        targets: ``"classes"`` (integer labels) or ``"float"`` (regression).

    Raises:
        TypeError: Samples are not numeric or labels not integers.
        ValueError: Shapes disagree, labels are outside the classes, a split
            would be empty, a sample is not finite (without
            ``allow_nonfinite``; the message names the first).
    """
    if targets == "float":
        return _convert_targets(
            x,
            y,
            out,
            num_classes=num_classes,
            val_fraction=val_fraction,
            seed=seed,
            source=source,
            block_samples=block_samples,
            progress=progress,
            allow_nonfinite=allow_nonfinite,
        )
    if targets != "classes":
        raise ValueError(f"targets must be 'classes' or 'float', got {targets!r}")
    _check_arrays(x, y, source)
    if not allow_nonfinite:
        _check_finite(x, source)
    y = np.asarray(y).astype(np.int64)
    classes = int(y.max()) + 1 if num_classes is None else int(num_classes)
    if y.min() < 0 or y.max() >= classes:
        raise ValueError(
            f"{source}: labels span [{y.min()}, {y.max()}], outside the "
            f"{classes} classes [0, {classes})"
        )
    return _write(
        out,
        len(x),
        tuple(x.shape[1:]),
        x.dtype,
        lambda idx: (np.asarray(x[idx]), y[idx]),
        num_classes=classes,
        val_fraction=val_fraction,
        seed=seed,
        source=source,
        block_samples=block_samples,
        progress=progress,
    )


def _convert_targets(
    x: np.ndarray,
    y: np.ndarray,
    out: str | os.PathLike,
    *,
    num_classes: int | None,
    source: str,
    allow_nonfinite: bool,
    **kw,
) -> Path:
    """:func:`convert_arrays` for float regression targets ``(N,)`` or ``(N, k)``."""
    if num_classes is not None:
        raise ValueError("--classes does not apply to float targets")
    if x.dtype.kind not in "biuf":
        raise TypeError(f"{source}: samples have dtype {x.dtype}; need numbers")
    y = np.asarray(y)
    if y.dtype.kind not in "biuf":
        raise TypeError(f"{source}: targets have dtype {y.dtype}; need numbers")
    if x.ndim < 1 or y.ndim not in (1, 2):
        raise ValueError(
            f"{source}: samples need a sample axis and float targets must be "
            f"(N,) or (N, k), got shapes {x.shape} and {y.shape}"
        )
    if len(x) != len(y) or len(x) == 0:
        raise ValueError(f"{source}: {len(x)} samples but {len(y)} targets")
    y = y.astype(np.float32)
    bad = ~np.isfinite(y.reshape(len(y), -1)).all(axis=1)
    if bad.any():  # (a target is never allowed to be: the loss would be NaN)
        raise ValueError(
            f"{source}: target {int(np.flatnonzero(bad)[0])} is not finite"
        )
    if not allow_nonfinite:
        _check_finite(x, source)
    return _write(
        out,
        len(x),
        tuple(x.shape[1:]),
        x.dtype,
        lambda idx: (np.asarray(x[idx]), y[idx]),
        num_classes=1 if y.ndim == 1 else y.shape[1],
        source=source,
        target_shape=tuple(y.shape[1:]),
        **kw,
    )


def _load_npy(path: str | os.PathLike) -> np.ndarray:
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"input file {p} does not exist")
    try:
        return np.load(p, mmap_mode="r", allow_pickle=False)
    except ValueError as exc:
        raise ValueError(f"input file {p} is not a plain .npy array: {exc}") from None


def convert_npy(
    x_path: str | os.PathLike, y_path: str | os.PathLike, out: str | os.PathLike, **kw
) -> Path:
    """Convert a samples ``.npy`` and a labels ``.npy`` (memory-mapped)."""
    x, y = _load_npy(x_path), _load_npy(y_path)
    return convert_arrays(
        x, np.asarray(y), out, source=f"npy:{Path(x_path).name}", **kw
    )


def convert_npz(
    path: str | os.PathLike,
    out: str | os.PathLike,
    *,
    x_key: str = "x",
    y_key: str = "y",
    **kw,
) -> Path:
    """Convert an ``.npz`` holding samples under ``x_key`` and labels under ``y_key``."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"input file {p} does not exist")
    with np.load(p, allow_pickle=False) as z:
        missing = [k for k in (x_key, y_key) if k not in z.files]
        if missing:
            raise ValueError(
                f"input file {p} has no array {missing[0]!r} (has: "
                f"{', '.join(z.files)}); pass --x-key/--y-key"
            )
        x, y = z[x_key], z[y_key]
    return convert_arrays(x, y, out, source=f"npz:{p.name}", **kw)


def digits_file(path: str | os.PathLike) -> Path:
    """``path``, converted from scikit-learn's digits first if it does not exist.

    The demo's and the benchmarks' data set: 20% validation, seed 0.
    """
    path = Path(path)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        convert_digits(path, val_fraction=0.2, seed=0, progress=False)
    return path


def convert_digits(out: str | os.PathLike, *, image: bool = False, **kw) -> Path:
    """Convert scikit-learn's bundled 8x8 digits (1797 samples, 10 classes).

    Args:
        out: Output file.
        image: Store samples as ``(1, 8, 8)`` images instead of 64-vectors.
        **kw: As :func:`convert_arrays`.
    """
    from sklearn.datasets import load_digits

    d = load_digits()
    x = d.data.astype(np.float32)
    if image:
        x = x.reshape(-1, 1, 8, 8)
    return convert_arrays(
        x,
        d.target.astype(np.int64),
        out,
        num_classes=10,
        source="sklearn.datasets.load_digits",
        **kw,
    )


def synthetic_batch(
    idx: np.ndarray, shape: tuple, dtype: np.dtype, num_classes: int, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """Samples ``idx`` of the synthetic data set: a class pattern plus noise.

    The result is a deterministic function of ``(seed, idx)``; the label of
    sample ``i`` depends only on ``(seed, i)``, and is learnable: each class
    adds its own fixed pattern to Gaussian noise.
    """
    idx = np.asarray(idx, dtype=np.int64)
    patterns = np.random.default_rng([seed, 1]).standard_normal(
        (num_classes, *shape), dtype=np.float32
    )
    labels = (idx * 2654435761 + seed) % num_classes
    # one generator per contiguous run keeps generation fast and order-free
    noise = np.random.default_rng([seed, 2, int(idx[0]) if len(idx) else 0])
    x = patterns[labels] + noise.standard_normal((len(idx), *shape), dtype=np.float32)
    if np.dtype(dtype) == np.uint8:
        x = np.clip(x * 40.0 + 128.0, 0, 255).astype(np.uint8)
    else:
        x = x.astype(dtype, copy=False)
    return x, labels.astype(np.int64)


def convert_synthetic(
    out: str | os.PathLike,
    *,
    samples: int,
    shape: tuple[int, ...] = (3, 32, 32),
    dtype: str | np.dtype = "uint8",
    num_classes: int = 10,
    **kw,
) -> Path:
    """Generate image-shaped synthetic data with learnable labels.

    Args:
        out: Output file.
        samples: Number of samples (any; generated in 64 MiB pieces).
        shape: Shape of one sample.
        dtype: ``uint8`` or ``float32``.
        num_classes: Number of classes.
        **kw: As :func:`convert_arrays` (``val_fraction``, ``seed``, ...).

    Raises:
        ValueError: ``samples``, ``shape`` or ``num_classes`` is not positive,
            or ``dtype`` is neither ``uint8`` nor ``float32``.
    """
    dt = np.dtype(dtype)
    if dt not in (np.dtype(np.uint8), np.dtype(np.float32)):
        raise ValueError(f"synthetic dtype must be uint8 or float32, got {dtype}")
    if samples < 1 or num_classes < 1 or not shape or min(shape) < 1:
        raise ValueError(
            f"synthetic data needs samples, shape and classes >= 1, got "
            f"samples={samples}, shape={shape}, classes={num_classes}"
        )
    seed = int(kw.get("seed", 0))
    return _write(
        out,
        samples,
        tuple(shape),
        dt,
        lambda idx: synthetic_batch(idx, tuple(shape), dt, num_classes, seed),
        num_classes=num_classes,
        val_fraction=kw.get("val_fraction", 0.2),
        seed=seed,
        source=f"synthetic {dt.name} {'x'.join(map(str, shape))}",
        block_samples=kw.get("block_samples"),
        progress=kw.get("progress", False),
    )
