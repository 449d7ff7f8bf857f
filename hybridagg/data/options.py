"""The loader's keyword arguments, validated once into one immutable record."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import InitVar, dataclass

import numpy as np
import torch

from .reader import mpio_available

__all__ = ["DRIVERS", "SHARES", "LoaderOptions", "check_statistics", "resolve_paths"]

SHARES = ("static", "dynamic")
DRIVERS = ("auto", "mpio", "posix")


def resolve_paths(paths: object) -> list[str]:
    """One file name or a non-empty list of them, as a list of ``str``.

    Raises:
        TypeError: Neither a path nor a non-empty sequence of paths.
    """
    if isinstance(paths, (str, os.PathLike)):
        return [os.fspath(paths)]
    if isinstance(paths, Sequence) and paths:
        out = []
        for p in paths:
            if not isinstance(p, (str, os.PathLike)):
                raise TypeError(f"data paths must be str or os.PathLike, got {type(p)}")
            out.append(os.fspath(p))
        return out
    raise TypeError(
        f"paths must be a file name or a non-empty list of them, got {paths!r}"
    )


def check_statistics(statistics: object) -> tuple[np.ndarray, np.ndarray]:
    """``(mean, std)`` as two float32 arrays of one length, finite, ``std > 0``.

    Raises:
        TypeError: Not a pair.
        ValueError: Lengths that differ, a non-finite value, a ``std <= 0``.
    """
    if not (isinstance(statistics, Sequence) and len(statistics) == 2):
        raise TypeError(
            f"statistics must be a pair (mean, std), got {type(statistics).__name__}"
        )
    mean, std = (
        np.atleast_1d(np.asarray(a, dtype=np.float32)).reshape(-1) for a in statistics
    )
    if mean.shape != std.shape:
        raise ValueError(
            f"statistics: mean has {mean.size} entries, std {std.size}; one each "
            "per channel"
        )
    if not (np.isfinite(mean).all() and np.isfinite(std).all() and (std > 0).all()):
        raise ValueError(
            f"statistics must be finite with std > 0, got mean {mean}, std {std}"
        )
    return mean, std


def _check_int(name: str, value: object, low: int) -> int:
    # bool is an int to Python, never a count or seed to a user
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    return int(value)


@dataclass(frozen=True)
class LoaderOptions:
    """Every keyword of :class:`~hybridagg.data.HDF5Loader` but ``comm``, validated.

    Construction checks and normalises the values (``int``, ``bool``,
    ``torch.device``, a list of paths, the timeout resolved), so the rest of
    the loader never sees a raw argument. What needs the files (a split that
    exists, a batch that fits, recorded statistics for ``normalize``) is
    checked later, once they are open.

    Attributes:
        paths: The HDF5 files of the data set (one or more, one layout).
        batch_size: This worker's first batch size (``>= 1``).
        split: Group of the split (``"train"``, ``"val"``).
        shares: ``"static"`` (contiguous shares by batch size, the same
            number of steps everywhere) or ``"dynamic"`` (chunks on demand
            from a shared counter).
        batch_sizes: Every worker's batch size for static shares, or
            ``None`` to gather them from the workers' ``batch_size``.
        seed: Seed of the shuffle (``>= 0``); with the epoch it fixes the
            order.
        epoch: First epoch (``>= 0``).
        shuffle: Shuffle blocks and within windows.
        window_blocks: Blocks per window: the shuffle buffer and the dynamic
            chunk (``>= 1``).
        prefetch: Batches kept ready by the read-ahead thread (``>= 0``; 0:
            no thread).
        device: Where batches go (a ``torch.device`` once constructed).
        normalize: Return float32 ``(x - mean) / std``.
        statistics: ``(mean, std)`` for ``normalize`` (float32 arrays, one
            entry per channel or one), or ``None`` for the file's recorded
            ``norm_mean``/``norm_std``.
        drop_last: Leave out the final partial step.
        driver: ``"auto"``, ``"mpio"`` or ``"posix"``.
        collective: Ask for collective reads (mpio and static shares only).
        locking: h5py's ``locking=`` (``None``: from the environment).
        samples_key: Name of the samples dataset in a split group.
        labels_key: Name of the labels dataset.
        num_classes: Overrides the file's ``num_classes``.
        timeout: Longest wait for a batch in seconds (``None`` given:
            ``HYBRIDAGG_TIMEOUT``).
        with_comm: Init-only: whether the loader has a communicator
            (``driver="mpio"`` needs one).

    Raises:
        TypeError: A path, count or seed of the wrong type.
        ValueError: A value out of range, an unknown ``shares`` or
            ``driver``, or ``driver="mpio"`` without MPI in h5py or without a
            communicator.
    """

    paths: list[str]
    batch_size: int
    split: str = "train"
    shares: str = "static"
    batch_sizes: list[int] | None = None
    seed: int = 0
    epoch: int = 0
    shuffle: bool = True
    window_blocks: int = 8
    prefetch: int = 4
    device: torch.device | str = "cpu"
    normalize: bool = False
    statistics: tuple[np.ndarray, np.ndarray] | None = None
    drop_last: bool = False
    driver: str = "auto"
    collective: bool = False
    locking: bool | str | None = None
    samples_key: str = "samples"
    labels_key: str = "labels"
    num_classes: int | None = None
    timeout: float | None = None
    with_comm: InitVar[bool] = False

    def __post_init__(self, with_comm: bool) -> None:
        # frozen: normalised values are written past the dataclass's guard
        def put(name: str, value: object) -> None:
            object.__setattr__(self, name, value)

        put("paths", resolve_paths(self.paths))
        for name, low in (
            ("batch_size", 1),
            ("seed", 0),
            ("epoch", 0),
            ("window_blocks", 1),
            ("prefetch", 0),
        ):
            put(name, _check_int(name, getattr(self, name), low))
        if self.shares not in SHARES:
            raise ValueError(
                f"shares must be 'static' or 'dynamic', got {self.shares!r}"
            )
        if self.driver not in DRIVERS:
            raise ValueError(
                f"driver must be 'auto', 'mpio' or 'posix', got {self.driver!r}"
            )
        if self.driver == "mpio" and not mpio_available():
            raise ValueError(
                "driver='mpio' needs h5py built with MPI (h5py.get_config().mpi)"
            )
        if self.driver == "mpio" and not with_comm:
            raise ValueError("driver='mpio' needs a communicator (comm=)")
        if self.batch_sizes is not None:
            put("batch_sizes", [int(b) for b in self.batch_sizes])
        put("device", torch.device(self.device))
        for name in ("shuffle", "normalize", "drop_last", "collective"):
            put(name, bool(getattr(self, name)))
        if self.statistics is not None:
            if not self.normalize:
                raise ValueError("statistics= is used only with normalize=True")
            put("statistics", check_statistics(self.statistics))
        if self.timeout is None:
            # imported here: hybridagg.comm imports mpi4py.MPI, which a loader
            # given its timeout (or the converter) does not need
            from ..comm import default_timeout

            put("timeout", default_timeout())
        else:
            t = float(self.timeout)
            if not (t > 0 and math.isfinite(t)):  # never a wait without an end
                raise ValueError(f"timeout must be a finite positive number, got {t}")
            put("timeout", t)
