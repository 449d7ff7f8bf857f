"""The split the workers read: validated in every file, then agreed on by all.

Each worker validates its files on its own (:func:`load_split_info`); the
workers then exchange what they saw (:class:`WorkerView`) and
:func:`agree_split` checks, on every worker alike, that they all read the
same data and that the batch sizes fit it. Since every worker runs the same
check on the same exchanged views, a bad input fails on every worker with
the same message, and no collective file operation starts before.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .format import SplitInfo, inspect_split, open_file
from .options import LoaderOptions

__all__ = [
    "AgreedSplit",
    "WorkerView",
    "agree_split",
    "check_norm_fits",
    "load_split_info",
]


def load_split_info(
    paths: Sequence[str],
    split: str,
    *,
    samples_key: str = "samples",
    labels_key: str = "labels",
    num_classes: int | None = None,
    locking: bool | str | None = None,
) -> list[SplitInfo]:
    """Validate one split in every file; the files must share one layout.

    Raises:
        FileNotFoundError, ValueError, TypeError: A bad file (see
            :func:`~hybridagg.data.format.inspect_split`), or files of
            different layouts.
    """
    infos = []
    for path in paths:
        with open_file(path, locking=locking) as f:
            infos.append(
                inspect_split(
                    f,
                    split,
                    samples_key=samples_key,
                    labels_key=labels_key,
                    num_classes=num_classes,
                    path=path,
                )
            )
    for info in infos[1:]:
        if info.layout() != infos[0].layout():
            raise ValueError(
                f"data file {info.path} ('{info.samples_key}': samples "
                f"{info.sample_shape} {info.dtype}, {info.num_classes} classes) does "
                f"not match {infos[0].path} ({infos[0].sample_shape} "
                f"{infos[0].dtype}, {infos[0].num_classes} classes)"
            )
    return infos


@dataclass(frozen=True)
class WorkerView:
    """What one worker saw of the data and was asked for (exchanged by all).

    Attributes:
        lengths: Samples of the split in each file.
        layout: :meth:`SplitInfo.layout` of the files.
        paths: The files' absolute paths.
        batch_size: The worker's batch size.
        batch_sizes: The ``batch_sizes`` argument it was given, if any.
    """

    lengths: list[int]
    layout: tuple
    paths: list[str]
    batch_size: int
    batch_sizes: list[int] | None

    @classmethod
    def of(cls, infos: Sequence[SplitInfo], options: LoaderOptions) -> WorkerView:
        """This worker's view, from its validated files and its options."""
        return cls(
            lengths=[i.length for i in infos],
            layout=infos[0].layout(),
            paths=[os.path.abspath(p) for p in options.paths],
            batch_size=options.batch_size,
            batch_sizes=options.batch_sizes,
        )


@dataclass(frozen=True)
class AgreedSplit:
    """The split as every worker agreed on it, with the first batch sizes.

    Attributes:
        infos: This worker's validated files.
        lengths: Samples in each file.
        total: Samples in the split.
        paths_agree: Every worker named the same files (``mpio`` needs it).
        batch_sizes: Every worker's first batch size, in worker order.
    """

    infos: list[SplitInfo]
    lengths: list[int]
    total: int
    paths_agree: bool
    batch_sizes: list[int]

    @property
    def first(self) -> SplitInfo:
        """The first file's description (all files share its layout)."""
        return self.infos[0]

    @property
    def labels(self) -> list[np.ndarray]:
        """All labels of each file."""
        return [i.labels for i in self.infos]


def check_norm_fits(
    info: SplitInfo, statistics: tuple[np.ndarray, np.ndarray] | None
) -> tuple[np.ndarray, np.ndarray]:
    """The statistics that normalise ``info``'s samples: given, else recorded.

    Raises:
        ValueError: None given and none recorded (the message names the
            ways to get them), or one entry per channel of another count.
    """
    if statistics is None:
        if info.norm_mean is None or info.norm_std is None:
            raise ValueError(
                f"normalize=True but data file {info.path} records no norm_mean/"
                "norm_std: write it with 'hybridagg convert', compute them "
                "(hybridagg train --normalize compute; statistics="
                "hybridagg.data.compute_statistics(...)), or train without "
                "(--normalize none, normalize=False)"
            )
        statistics = (info.norm_mean, info.norm_std)
    mean, std = statistics
    channels = info.sample_shape[0] if len(info.sample_shape) == 3 else 1
    if mean.size not in (1, channels) or std.size != mean.size:
        raise ValueError(
            f"normalisation statistics of {mean.size} entries do not fit samples "
            f"of shape {info.sample_shape} in {info.path} (one entry, or one per "
            f"channel: {channels})"
        )
    return statistics


def agree_split(
    views: Sequence[WorkerView],
    *,
    rank: int,
    infos: Sequence[SplitInfo],
    options: LoaderOptions,
) -> AgreedSplit:
    """Check that the workers read the same data and agree on batch sizes.

    Args:
        views: Every worker's :class:`WorkerView`, in worker order.
        rank: This worker's index in ``views``.
        infos: This worker's validated files.
        options: This worker's options.

    Raises:
        ValueError: A worker sees other data; ``batch_sizes`` differs between
            workers or does not list this worker's ``batch_size`` at its
            index; the global batch (static shares) or this worker's batch
            (dynamic) is larger than the split; ``normalize`` without
            recorded statistics.
    """
    head = views[0]
    for r, view in enumerate(views):
        if (view.lengths, view.layout) != (head.lengths, head.layout):
            raise ValueError(
                f"worker {r} sees split '{options.split}' of {view.paths} as "
                f"{sum(view.lengths)} samples {view.layout}, worker 0 sees "
                f"{head.paths} as {sum(head.lengths)} samples {head.layout}; "
                "all workers must read the same data"
            )
    lengths = [i.length for i in infos]
    total = sum(lengths)
    sizes = [int(v.batch_size) for v in views]
    given = options.batch_sizes
    if given is not None:
        if any(v.batch_sizes != given for v in views):
            raise ValueError("batch_sizes must be the same list on every worker")
        if len(given) != len(views) or given[rank] != options.batch_size:
            raise ValueError(
                f"batch_sizes {given} must have one entry per worker "
                f"({len(views)}) with this worker's batch_size at index {rank}"
            )
        sizes = list(given)
    static = options.shares == "static"
    limit = sum(sizes) if static else options.batch_size
    if limit > total:
        what = (
            f"the global batch of {limit} samples (batch sizes {sizes})"
            if static
            else f"batch_size {limit}"
        )
        raise ValueError(
            f"{what} is larger than split '{options.split}' of "
            f"{', '.join(options.paths)} ({total} samples in "
            f"'{infos[0].samples_key}')"
        )
    info = infos[0]
    if options.normalize:
        check_norm_fits(info, options.statistics)
    return AgreedSplit(
        infos=list(infos),
        lengths=lengths,
        total=total,
        paths_agree=all(v.paths == head.paths for v in views),
        batch_sizes=sizes,
    )
