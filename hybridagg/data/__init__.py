"""Parallel HDF5 data: the on-disk format, the converter and the sharded loader.

``hybridagg convert`` writes data sets (:mod:`.convert`: arrays, plain HDF5
files, folders of images); :class:`HDF5Loader` reads them, each worker its
own share, with a background prefetcher and stall accounting;
:class:`HDF5Dataset` is a map-style ``torch`` dataset over the same files,
and :class:`ShareSampler` gives each worker its share of any map-style
dataset through its own ``DataLoader``. See ``docs/architecture.md``
("Data") for the format and design.
"""

from __future__ import annotations

from .convert import (
    convert_arrays,
    convert_digits,
    convert_folder,
    convert_hdf5,
    convert_npy,
    convert_npz,
    convert_sources,
    convert_synthetic,
    digits_file,
)
from .dataset import HDF5Dataset
from .format import FORMAT_NAME, FORMAT_VERSION, SplitInfo, inspect_split, open_file
from .layout import resolve_layout
from .loader import HDF5Loader, workers_comm
from .moments import compute_statistics
from .options import LoaderOptions
from .reader import mpio_available
from .sampler import ShareSampler
from .shares import EpochPlan, resplit_static, split_static
from .split import load_split_info
from .stats import LoaderStats

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "EpochPlan",
    "HDF5Dataset",
    "HDF5Loader",
    "LoaderOptions",
    "LoaderStats",
    "ShareSampler",
    "SplitInfo",
    "compute_statistics",
    "convert_arrays",
    "convert_digits",
    "convert_folder",
    "convert_hdf5",
    "convert_npy",
    "convert_npz",
    "convert_sources",
    "convert_synthetic",
    "digits_file",
    "inspect_split",
    "load_split_info",
    "mpio_available",
    "open_file",
    "resolve_layout",
    "resplit_static",
    "split_static",
    "workers_comm",
]
