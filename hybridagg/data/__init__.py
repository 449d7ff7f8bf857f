"""Parallel HDF5 data: the on-disk format, the converter and the sharded loader.

``hybridagg convert`` writes data sets (:mod:`.convert`); :class:`HDF5Loader`
reads them, each worker its own share, with a background prefetcher and stall
accounting; :class:`HDF5Dataset` is a map-style ``torch`` dataset over the
same files. See ``docs/architecture.md`` ("Data") for the format and design.
"""

from __future__ import annotations

from .convert import (
    convert_arrays,
    convert_digits,
    convert_npy,
    convert_npz,
    convert_synthetic,
    digits_file,
)
from .dataset import HDF5Dataset
from .format import FORMAT_NAME, FORMAT_VERSION, SplitInfo, inspect_split, open_file
from .loader import HDF5Loader, workers_comm
from .options import LoaderOptions
from .reader import mpio_available
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
    "SplitInfo",
    "convert_arrays",
    "convert_digits",
    "convert_npy",
    "convert_npz",
    "convert_synthetic",
    "digits_file",
    "inspect_split",
    "load_split_info",
    "mpio_available",
    "open_file",
    "resplit_static",
    "split_static",
    "workers_comm",
]
