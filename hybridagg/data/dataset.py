"""A map-style ``torch.utils.data.Dataset`` over one split of a hybridagg file."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from .format import open_file
from .options import check_statistics
from .split import check_norm_fits, load_split_info

__all__ = ["HDF5Dataset"]


class HDF5Dataset(torch.utils.data.Dataset):
    """A map-style dataset over one split (for ``torch.utils.data.DataLoader``).

    The file is opened lazily in each process that reads (so DataLoader
    workers each get their own handle) and validated at construction. With
    :class:`~hybridagg.data.ShareSampler` each worker of a distributed job
    reads its share of every epoch through its own ``DataLoader``, with its
    transforms and ``num_workers``.

    Args:
        path: An HDF5 file in hybridagg's format.
        split: Split group name.
        normalize: Return float32 ``(x - mean) / std`` (before ``transform``).
        statistics: ``(mean, std)`` for ``normalize`` instead of the file's
            recorded ``norm_mean``/``norm_std``.
        transform: Called on each sample tensor (augmentation), after
            normalisation.
        target_transform: Called on each label (an ``int``; a float32 tensor
            for a file of float regression targets).
        samples_key: Name of the samples dataset.
        labels_key: Name of the labels dataset.
        locking: h5py's ``locking=``.

    Attributes:
        info: The split (:class:`~hybridagg.data.SplitInfo`); its
            ``class_names`` maps labels back to names where the file
            records them.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        split: str = "train",
        *,
        normalize: bool = False,
        statistics: tuple[Any, Any] | None = None,
        transform: Callable[[torch.Tensor], Any] | None = None,
        target_transform: Callable[[Any], Any] | None = None,
        samples_key: str = "samples",
        labels_key: str = "labels",
        locking: bool | str | None = None,
    ) -> None:
        self.path, self.locking = os.fspath(path), locking
        self.info = load_split_info(
            [self.path],
            split,
            samples_key=samples_key,
            labels_key=labels_key,
            locking=locking,
        )[0]
        if statistics is not None:
            if not normalize:
                raise ValueError("statistics= is used only with normalize=True")
            statistics = check_statistics(statistics)
        self.norm = check_norm_fits(self.info, statistics) if normalize else None
        self.normalize = normalize
        self.transform, self.target_transform = transform, target_transform
        self._handle: tuple[int, Any] | None = None

    def __len__(self) -> int:
        return self.info.length

    def _dset(self):
        if self._handle is None or self._handle[0] != os.getpid():
            f = open_file(self.path, locking=self.locking)
            self._handle = (os.getpid(), f, f[self.info.samples_key])
        return self._handle[2]

    def __getitem__(self, i: int) -> tuple[Any, Any]:
        n = self.info.length
        if not -n <= i < n:
            raise IndexError(f"index {i} out of range for {n} samples in {self.path}")
        i %= n
        x = torch.from_numpy(np.asarray(self._dset()[i]))
        if self.norm is not None:
            x = self._norm(x)
        if self.info.regression:  # float targets: a tensor, as a batch holds them
            y = torch.from_numpy(np.array(self.info.labels[i]))
        else:
            y = int(self.info.labels[i])
        if self.transform is not None:
            x = self.transform(x)
        if self.target_transform is not None:
            y = self.target_transform(y)
        return x, y

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        mean, std = self.norm
        if mean.size > 1:
            view = (-1,) + (1,) * (x.dim() - 1)
            return (
                x.float() - torch.from_numpy(mean).reshape(view)
            ) / torch.from_numpy(std).reshape(view)
        return (x.float() - float(mean[0])) / float(std[0])

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_handle"] = None
        return state
