"""A map-style ``torch.utils.data.Dataset`` over one split of a hybridagg file."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch

from .format import open_file
from .split import load_split_info

__all__ = ["HDF5Dataset"]


class HDF5Dataset(torch.utils.data.Dataset):
    """A map-style dataset over one split (for ``torch.utils.data.DataLoader``).

    The file is opened lazily in each process that reads (so DataLoader
    workers each get their own handle) and validated at construction.

    Args:
        path: An HDF5 file in hybridagg's format.
        split: Split group name.
        normalize: Return float32 ``(x - norm_mean) / norm_std``.
        samples_key: Name of the samples dataset.
        labels_key: Name of the labels dataset.
        locking: h5py's ``locking=``.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        split: str = "train",
        *,
        normalize: bool = False,
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
        if normalize and self.info.norm_mean is None:
            raise ValueError(
                f"normalize=True but data file {self.path} records no norm_mean"
            )
        self.normalize = normalize
        self._handle: tuple[int, Any] | None = None

    def __len__(self) -> int:
        return self.info.length

    def _dset(self):
        if self._handle is None or self._handle[0] != os.getpid():
            f = open_file(self.path, locking=self.locking)
            self._handle = (os.getpid(), f, f[self.info.samples_key])
        return self._handle[2]

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int | torch.Tensor]:
        n = self.info.length
        if not -n <= i < n:
            raise IndexError(f"index {i} out of range for {n} samples in {self.path}")
        i %= n
        x = torch.from_numpy(np.asarray(self._dset()[i]))
        if self.normalize:
            x = self._norm(x)
        if self.info.regression:  # float targets: a tensor, as a batch holds them
            return x, torch.from_numpy(np.array(self.info.labels[i]))
        return x, int(self.info.labels[i])

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        mean, std = self.info.norm_mean, self.info.norm_std
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
