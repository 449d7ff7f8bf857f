"""Reading windows of blocks from the files of one split.

Two paths:

* **posix** (a PyPI h5py, or ``driver="posix"``): every worker opens every
  file read-only on its own and reads its blocks independently.
* **mpio** (h5py built against MPI, ``h5py.get_config().mpi``): the files
  are opened with ``driver="mpio"`` on a communicator duplicated for the
  files alone. With ``collective=True`` every read is collective
  (``H5FD_MPIO_COLLECTIVE``): all workers make the same number of read calls
  per file, a worker with nothing left joining with an empty selection, and
  each collective read is preceded by a polled barrier so that the read
  itself, which cannot be polled, does not spin while waiting for a peer.
  Dynamic shares read independently, since workers read different numbers
  of chunks.

A window's blocks are sorted by file position and read into consecutive
rows of one buffer; adjacent blocks are merged into one hyperslab.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import h5py
import numpy as np

from .format import SplitInfo, file_locking, open_file

__all__ = ["SplitReader", "mpio_available", "runs_of", "timed_read"]


def mpio_available() -> bool:
    """Whether this h5py was built against MPI (can open with ``driver="mpio"``)."""
    return bool(h5py.get_config().mpi)


def runs_of(blocks: np.ndarray) -> list[tuple[int, int, int]]:
    """Merge file-ordered ``(file, start, stop)`` blocks that touch on disk."""
    runs: list[list[int]] = []
    for f, s, c in blocks.tolist():
        if runs and runs[-1][0] == f and runs[-1][2] == s:
            runs[-1][2] = c
        else:
            runs.append([f, s, c])
    return [tuple(r) for r in runs]


class SplitReader:
    """Open files of one split and read windows of blocks into buffers.

    Args:
        infos: The validated split of each file.
        driver: ``"posix"`` or ``"mpio"``.
        file_comm: For ``mpio``: a :class:`hybridagg.comm.Comm` reserved for
            the files (the opening is collective over it).
        collective: For ``mpio``: read collectively.
        locking: h5py's ``locking=`` (see :func:`format.file_locking`).
    """

    def __init__(
        self,
        infos: Sequence[SplitInfo],
        *,
        driver: str = "posix",
        file_comm=None,
        collective: bool = False,
        locking: bool | str | None = None,
    ) -> None:
        self.infos = list(infos)
        self.driver = driver
        self.collective = bool(collective and driver == "mpio")
        self.file_comm = file_comm
        self.files: list[h5py.File] = []
        self.dsets: list[h5py.Dataset] = []
        self._dxpl = None
        for info in self.infos:
            if driver == "mpio":
                file_comm.barrier(what=f"collective open of {info.path}")
                f = h5py.File(
                    info.path,
                    "r",
                    driver="mpio",
                    comm=file_comm.mpi,
                    locking=file_locking(locking),
                )
            else:
                f = open_file(info.path, locking=locking)
            self.files.append(f)
            self.dsets.append(f[info.samples_key])
        if self.collective:
            from h5py import h5fd, h5p

            self._dxpl = h5p.create(h5p.DATASET_XFER)
            self._dxpl.set_dxpl_mpio(h5fd.MPIO_COLLECTIVE)

    def read_window(self, blocks: np.ndarray | None, out: np.ndarray) -> int:
        """Read ``blocks`` (file order) into the first rows of ``out``.

        In collective mode every worker must call this the same number of
        times; pass ``blocks=None`` to join with an empty selection.

        Returns:
            Bytes read.
        """
        if self.collective:
            return self._read_collective(blocks, out)
        if blocks is None:
            return 0
        row = 0
        for f, s, c in runs_of(blocks):
            n = c - s
            try:
                self.dsets[f].read_direct(out, np.s_[s:c], np.s_[row : row + n])
            except (OSError, RuntimeError, ValueError) as exc:
                info = self.infos[f]
                raise ValueError(
                    f"data file {info.path}: reading rows {s}:{c} of dataset "
                    f"'{info.samples_key}' failed (truncated or corrupted file?): {exc}"
                ) from None
            row += n
        return row * int(np.prod(out.shape[1:], dtype=np.int64)) * out.itemsize

    def _read_collective(self, blocks: np.ndarray | None, out: np.ndarray) -> int:
        from h5py import h5s

        row, nbytes = 0, 0
        per_file: dict[int, list[tuple[int, int]]] = {}
        if blocks is not None:
            for f, s, c in runs_of(blocks):
                per_file.setdefault(f, []).append((s, c))
        for f, dset in enumerate(self.dsets):
            runs = per_file.get(f, [])
            fspace = dset.id.get_space()
            fspace.select_none()
            tail = tuple(dset.shape[1:])
            n = 0
            for s, c in runs:
                fspace.select_hyperslab(
                    (s,) + (0,) * len(tail), (c - s, *tail), op=h5s.SELECT_OR
                )
                n += c - s
            mspace = h5s.create_simple((max(n, 1), *tail))
            if n == 0:
                mspace.select_none()
            if row + n > len(out):
                raise ValueError(f"window of {row + n} rows does not fit {len(out)}")
            target = out[row : row + n] if n else out[:1]
            self.file_comm.barrier(what=f"collective read of {self.infos[f].path}")
            try:
                dset.id.read(mspace, fspace, target, dxpl=self._dxpl)
            except (OSError, RuntimeError) as exc:
                raise ValueError(
                    f"data file {self.infos[f].path}: collective read of dataset "
                    f"'{self.infos[f].samples_key}' failed: {exc}"
                ) from None
            row += n
            nbytes += n * int(np.prod(tail, dtype=np.int64)) * out.itemsize
        return nbytes

    def close(self) -> None:
        """Close the files (collective for ``mpio``)."""
        for info, f in zip(self.infos, self.files, strict=False):
            if self.driver == "mpio":
                self.file_comm.barrier(what=f"collective close of {info.path}")
            f.close()
        self.files, self.dsets = [], []


def timed_read(reader: SplitReader, blocks, out) -> tuple[int, float]:
    """Read a window and return ``(bytes, seconds)``."""
    t0 = time.perf_counter()
    nbytes = reader.read_window(blocks, out)
    return nbytes, time.perf_counter() - t0
