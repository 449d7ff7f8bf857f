"""Write data sets in hybridagg's HDF5 format (see :mod:`hybridagg.data.format`).

Sources: ``.npy``/``.npz`` arrays, datasets of a plain HDF5 file, a folder
of images with one sub-folder per class (:mod:`.images`), scikit-learn's
bundled digits data set (real data shipped inside the scikit-learn wheel, so
tests and demos need no download), and a generator of large synthetic
image-shaped data with learnable labels for I/O benchmarks. ``hybridagg
convert`` is the command line of this module.

Every converter writes a ``train`` split and a ``val`` split: a random cut
of the input (``val_fraction``), or a validation set given beside it
(``val_from``), kept as it is. A given test set (``test_from``) becomes a
``test`` split. Image samples are stored channels first; channels-last
arrays are detected or stated (``layout``, see :mod:`.layout`) and
transposed, so the statistics are per real channel. The labels of arrays and
plain HDF5 files are integer classes, or with ``targets="float"`` (``convert
--targets float``) float32 regression targets ``(N,)`` or ``(N, k)``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from pathlib import Path

import h5py
import numpy as np

from ..runtime.extras import require
from .images import ImageFolder
from .sources import ArraySource, Source
from .writer import SplitRows, split_indices, write_splits

__all__ = [
    "convert_arrays",
    "convert_digits",
    "convert_folder",
    "convert_hdf5",
    "convert_npy",
    "convert_npz",
    "convert_sources",
    "convert_synthetic",
    "digits_file",
    "split_indices",
    "synthetic_batch",
]


def _reader(src: Source, dtype: np.dtype):
    def rows(idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return src.read(idx).astype(dtype, copy=False), src.labels[idx]

    return rows


def _check_beside(train: Source, other: Source, what: str) -> None:
    """A validation or test set must be samples (and labels) of the training data's kind."""
    if tuple(other.sample_shape) != tuple(train.sample_shape):
        raise ValueError(
            f"{what} {other.name}: samples of shape {tuple(other.sample_shape)}, "
            f"the training data's ({train.name}) are {tuple(train.sample_shape)}"
        )
    if other.dtype != train.dtype and not np.can_cast(
        other.dtype, train.dtype, "same_kind"
    ):
        raise TypeError(
            f"{what} {other.name}: samples of dtype {other.dtype} cannot be stored "
            f"as the training data's {train.dtype}"
        )
    if _regression(other) != _regression(train) or (
        other.labels.shape[1:] != train.labels.shape[1:]
    ):
        raise ValueError(
            f"{what} {other.name}: labels {_label_kind(other)}, the training "
            f"data's ({train.name}) are {_label_kind(train)}"
        )


def _regression(src: Source) -> bool:
    """Whether a source's labels are float regression targets."""
    return src.labels.dtype.kind == "f"


def _label_kind(src: Source) -> str:
    if not _regression(src):
        return "integer classes"
    return f"float targets of shape {tuple(src.labels.shape[1:])} per sample"


def convert_sources(
    train: Source,
    out: str | os.PathLike,
    *,
    val: Source | None = None,
    test: Source | None = None,
    num_classes: int | None = None,
    class_names: Sequence[str] | None = None,
    val_fraction: float = 0.2,
    seed: int = 0,
    source: str = "arrays",
    block_samples: int | None = None,
    progress: bool = False,
) -> Path:
    """Write a training source, and a validation and a test source if given.

    Args:
        train: The training data (:mod:`.sources`).
        out: Output file (written to ``out.partial`` first, then renamed).
        val: A given validation set: kept as it is, no random cut.
        test: A given test set, written as the ``test`` split.
        num_classes: Default: ``len(class_names)``, else the largest label
            of any split + 1. Float targets (a source of ``targets="float"``)
            take none: their width is recorded (1 for ``(N,)``).
        class_names: Recorded in the file (``class_names``), label order.
        val_fraction: Without ``val``: the fraction of ``train`` cut off at
            random (seeded) as the validation split.
        seed: Seed of that cut.
        source: Recorded in the file's ``source`` attribute.
        block_samples: Samples per block/chunk (default: about 1 MiB).
        progress: Show a progress bar.

    Raises:
        TypeError, ValueError: Sets that do not fit together (shape, dtype,
            classes against float targets), labels outside the classes, an
            empty split, classes given for float targets.
    """
    given = [
        (s, w)
        for s, w in ((val, "validation data"), (test, "test data"))
        if s is not None
    ]
    for other, what in given:
        _check_beside(train, other, what)
    target_shape = None
    if _regression(train):
        if num_classes is not None or class_names is not None:
            raise ValueError("--classes does not apply to float targets")
        target_shape = tuple(train.labels.shape[1:])
        classes = 1 if not target_shape else target_shape[0]
    else:
        classes = _classes(train, given, num_classes, class_names)
    dtype = train.dtype
    if val is None:
        train_idx, val_idx = split_indices(len(train), val_fraction, seed)
        splits = [
            SplitRows("train", train_idx, _reader(train, dtype)),
            SplitRows("val", val_idx, _reader(train, dtype)),
        ]
    else:
        val_fraction = 0.0
        splits = [
            SplitRows("train", np.arange(len(train)), _reader(train, dtype)),
            SplitRows("val", np.arange(len(val)), _reader(val, dtype)),
        ]
    if test is not None:
        splits.append(SplitRows("test", np.arange(len(test)), _reader(test, dtype)))
    attrs: dict = {
        "source": source,
        "seed": int(seed),
        "val_fraction": float(val_fraction),
    }
    if class_names is not None:
        attrs["class_names"] = np.array(list(class_names), dtype=h5py.string_dtype())
    layout = getattr(train, "layout", None)
    if layout is not None:
        attrs["source_layout"] = layout
    for s, key in ((val, "val_source"), (test, "test_source")):
        if s is not None:
            attrs[key] = s.name
    return write_splits(
        out,
        splits,
        tuple(train.sample_shape),
        dtype,
        num_classes=classes,
        block_samples=block_samples,
        progress=progress,
        attrs=attrs,
        target_shape=target_shape,
    )


def _classes(
    train: Source,
    given: list[tuple[Source, str]],
    num_classes: int | None,
    class_names: Sequence[str] | None,
) -> int:
    """The number of classes, every split's labels checked against it."""
    if class_names is not None and num_classes is None:
        num_classes = len(class_names)
    top = max(int(s.labels.max()) for s in [train] + [s for s, _ in given])
    classes = top + 1 if num_classes is None else int(num_classes)
    for s, what in [(train, "training data")] + given:
        if int(s.labels.max()) >= classes:
            raise ValueError(
                f"{what} {s.name}: labels span [{int(s.labels.min())}, "
                f"{int(s.labels.max())}], outside the {classes} classes [0, {classes})"
            )
    return classes


def _pair(given, what: str) -> tuple[np.ndarray, np.ndarray] | None:
    if given is None:
        return None
    if not (isinstance(given, Sequence) and len(given) == 2):
        raise TypeError(f"{what} must be a pair (samples, labels), got {type(given)}")
    return given[0], given[1]


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
    layout: str = "auto",
    val: tuple[np.ndarray, np.ndarray] | None = None,
    test: tuple[np.ndarray, np.ndarray] | None = None,
    targets: str = "classes",
) -> Path:
    """Write in-memory (or memory-mapped, or HDF5) arrays as a hybridagg data file.

    Args:
        x: Samples, ``(N, *shape)``, numeric (indexed by slices only).
        y: Integer labels, ``(N,)``; with ``targets="float"`` regression
            targets, ``(N,)`` or ``(N, k)``, stored as float32 (train with
            ``--loss mse``).
        out: Output file (written to ``out.partial`` first, then renamed).
        num_classes: Default ``max(y) + 1`` over every split (none with
            float targets: their width is recorded).
        val_fraction: Fraction of samples cut off as the validation split
            (ignored with ``val``).
        seed: Seed of the train/validation split.
        source: Recorded in the file's ``source`` attribute.
        block_samples: Samples per block/chunk (default: about 1 MiB).
        progress: Show a progress bar.
        allow_nonfinite: Keep samples holding NaN or infinite values
            (refused by default: they make the training loss non-finite).
        layout: Where the channels of 3-d samples are: ``"auto"``,
            ``"nchw"`` or ``"nhwc"`` (:mod:`.layout`); stored channels first.
        val: ``(samples, labels)`` of a given validation set, kept as it is.
        test: ``(samples, labels)`` of a given test set (the ``test`` split).
        targets: ``"classes"`` (integer labels) or ``"float"`` (regression
            targets, of every split).

    Raises:
        TypeError: Samples are not numeric or labels not integers (targets
            not numbers).
        ValueError: Shapes disagree, labels are outside the classes, a split
            would be empty, a sample is not finite (without
            ``allow_nonfinite``; the message names the first), a target is
            not finite, an ambiguous layout.
    """

    val, test = _pair(val, "val"), _pair(test, "test")
    return _convert_pairs(
        (x, y, source),
        out,
        val=None if val is None else (*val, f"{source} (val)"),
        test=None if test is None else (*test, f"{source} (test)"),
        layout=layout,
        allow_nonfinite=allow_nonfinite,
        targets=targets,
        num_classes=num_classes,
        val_fraction=val_fraction,
        seed=seed,
        source=source,
        block_samples=block_samples,
        progress=progress,
    )


def _convert_pairs(
    train: tuple,
    out: str | os.PathLike,
    *,
    val: tuple | None,
    test: tuple | None,
    layout: str = "auto",
    allow_nonfinite: bool = False,
    targets: str = "classes",
    **kw,
) -> Path:
    """:func:`convert_sources` over ``(samples, labels, name)`` triples."""

    def make(triple):
        if triple is None:
            return None
        x, y, name = triple
        return ArraySource(
            x,
            y,
            name=name,
            layout=layout,
            allow_nonfinite=allow_nonfinite,
            targets=targets,
        )

    return convert_sources(make(train), out, val=make(val), test=make(test), **kw)


def _load_npy(path: str | os.PathLike) -> np.ndarray:
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"input file {p} does not exist")
    try:
        return np.load(p, mmap_mode="r", allow_pickle=False)
    except ValueError as exc:
        raise ValueError(f"input file {p} is not a plain .npy array: {exc}") from None


def _npy_pair(paths, what: str) -> tuple[np.ndarray, np.ndarray] | None:
    if paths is None:
        return None
    if isinstance(paths, (str, os.PathLike)) or len(paths) != 2:
        raise ValueError(f"{what} of npy data takes two files: X.npy Y.npy")
    return (
        _load_npy(paths[0]),
        np.asarray(_load_npy(paths[1])),
        f"npy:{Path(paths[0]).name}",
    )


def convert_npy(
    x_path: str | os.PathLike,
    y_path: str | os.PathLike,
    out: str | os.PathLike,
    *,
    val_from: Sequence[str | os.PathLike] | None = None,
    test_from: Sequence[str | os.PathLike] | None = None,
    **kw,
) -> Path:
    """Convert a samples ``.npy`` and a labels ``.npy`` (memory-mapped).

    Args:
        val_from: ``(X.npy, Y.npy)`` of a given validation set.
        test_from: ``(X.npy, Y.npy)`` of a given test set.
        **kw: As :func:`convert_arrays`.
    """
    x, y = _load_npy(x_path), _load_npy(y_path)
    source = f"npy:{Path(x_path).name}"
    return _convert_pairs(
        (x, np.asarray(y), source),
        out,
        val=_npy_pair(val_from, "--val-from"),
        test=_npy_pair(test_from, "--test-from"),
        source=source,
        **kw,
    )


def _npz_arrays(path: str | os.PathLike, x_key: str, y_key: str) -> tuple:
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
        return z[x_key], z[y_key], f"npz:{p.name}"


def convert_npz(
    path: str | os.PathLike,
    out: str | os.PathLike,
    *,
    x_key: str = "x",
    y_key: str = "y",
    val_from: str | os.PathLike | None = None,
    test_from: str | os.PathLike | None = None,
    **kw,
) -> Path:
    """Convert an ``.npz`` holding samples under ``x_key`` and labels under ``y_key``.

    Args:
        val_from: An ``.npz`` of a given validation set (the same keys).
        test_from: An ``.npz`` of a given test set (the same keys).
        **kw: As :func:`convert_arrays`.
    """
    train = _npz_arrays(path, x_key, y_key)
    return _convert_pairs(
        train,
        out,
        val=None if val_from is None else _npz_arrays(val_from, x_key, y_key),
        test=None if test_from is None else _npz_arrays(test_from, x_key, y_key),
        source=train[2],
        **kw,
    )


def _hdf5_arrays(
    stack: contextlib.ExitStack, path: str | os.PathLike, x_key: str, y_key: str
) -> tuple:
    from .format import open_file

    f = stack.enter_context(open_file(path))
    found: list[str] = []
    f.visititems(
        lambda name, obj: found.append(name) if isinstance(obj, h5py.Dataset) else None
    )
    arrays = []
    for key in (x_key, y_key):
        obj = f.get(key)
        if not isinstance(obj, h5py.Dataset):
            raise ValueError(
                f"input file {path} has no dataset {key!r} (has: "
                f"{', '.join(sorted(found)) or 'none'}); pass --x-key/--y-key"
            )
        arrays.append(obj)
    # the samples stay on disk, read in slices; the labels are small
    return arrays[0], np.asarray(arrays[1][()]), f"hdf5:{Path(path).name}"


def convert_hdf5(
    path: str | os.PathLike,
    out: str | os.PathLike,
    *,
    x_key: str = "x",
    y_key: str = "y",
    val_from: str | os.PathLike | None = None,
    test_from: str | os.PathLike | None = None,
    **kw,
) -> Path:
    """Convert datasets of a plain HDF5 file: samples at ``x_key``, labels at ``y_key``.

    The samples are read in slices of about 64 MiB, never whole.

    Args:
        path: The HDF5 file.
        x_key: Path of the samples dataset in it (``"x"``, ``"train/images"``).
        y_key: Path of the labels dataset.
        val_from: An HDF5 file of a given validation set (the same keys).
        test_from: An HDF5 file of a given test set (the same keys).
        **kw: As :func:`convert_arrays`.
    """
    with contextlib.ExitStack() as stack:
        train = _hdf5_arrays(stack, path, x_key, y_key)
        val = None if val_from is None else _hdf5_arrays(stack, val_from, x_key, y_key)
        test = (
            None if test_from is None else _hdf5_arrays(stack, test_from, x_key, y_key)
        )
        return _convert_pairs(train, out, val=val, test=test, source=train[2], **kw)


def convert_folder(
    root: str | os.PathLike,
    out: str | os.PathLike,
    *,
    size: tuple[int, int] | None = None,
    val_from: str | os.PathLike | None = None,
    test_from: str | os.PathLike | None = None,
    val_fraction: float = 0.2,
    seed: int = 0,
    block_samples: int | None = None,
    progress: bool = False,
) -> Path:
    """Convert a folder of images with one sub-folder per class (:mod:`.images`).

    Labels follow the sorted class names, which the file records as
    ``class_names``. Samples are ``uint8`` ``(C, H, W)``: one channel if
    every training image is grey, else three.

    Args:
        root: The folder.
        out: Output file.
        size: ``(height, width)`` to resize every image to (default: keep
            them, they must agree).
        val_from: A folder of the validation images (the same class
            folders, or some of them), kept as it is.
        test_from: A folder of the test images.
        val_fraction: Without ``val_from``: the fraction cut off at random.
        seed: Seed of that cut.
        block_samples: Samples per block/chunk.
        progress: Show a progress bar.

    Raises:
        ImportError: Pillow is not installed (the ``images`` extra).
        FileNotFoundError, ValueError: A bad folder or image (named).
    """
    train = ImageFolder(root, size=size)

    def beside(folder):
        if folder is None:
            return None
        return ImageFolder(
            folder,
            size=train.size,
            classes=train.class_names,
            channels=train.sample_shape[0],
        )

    return convert_sources(
        train,
        out,
        val=beside(val_from),
        test=beside(test_from),
        class_names=train.class_names,
        val_fraction=val_fraction,
        seed=seed,
        source=f"folder:{Path(root).name}",
        block_samples=block_samples,
        progress=progress,
    )


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

    Raises:
        MissingExtraError: scikit-learn is not installed (the ``digits`` extra).
    """
    datasets = require("sklearn.datasets", "converting the digits data set")
    d = datasets.load_digits()
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
    val_fraction = kw.get("val_fraction", 0.2)
    train_idx, val_idx = split_indices(samples, val_fraction, seed)

    def rows(idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return synthetic_batch(idx, tuple(shape), dt, num_classes, seed)

    return write_splits(
        out,
        [SplitRows("train", train_idx, rows), SplitRows("val", val_idx, rows)],
        tuple(shape),
        dt,
        num_classes=num_classes,
        block_samples=kw.get("block_samples"),
        progress=kw.get("progress", False),
        attrs={
            "source": f"synthetic {dt.name} {'x'.join(map(str, shape))}",
            "seed": seed,
            "val_fraction": float(val_fraction),
        },
    )
