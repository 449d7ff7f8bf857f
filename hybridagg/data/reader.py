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

Direct chunk reads (posix path): when a samples dataset is stored in
unfiltered chunks of whole rows (what ``hybridagg convert`` writes), the
reader takes each chunk's file address from HDF5's chunk index once, at
open, and reads the bytes with ``os.preadv`` straight into the window
buffer, merging chunks that are adjacent on disk. The bytes are the same
HDF5 would copy, but the call releases the GIL, so the read-ahead thread
overlaps the batch gather on another core, and the per-read Python cost of
h5py's selections is gone. Any other layout (filters, partial-row chunks,
chunks past the end of a truncated file, an index that cannot be read), or
``HYBRIDAGG_DATA_DIRECT_READ=0``, uses h5py's ``read_direct``.
"""

from __future__ import annotations

import os
import time
import weakref
from collections.abc import Sequence

import h5py
import numpy as np

from ..runtime import envvars
from .format import SplitInfo, file_locking, open_file

__all__ = ["ChunkMap", "SplitReader", "mpio_available", "runs_of", "timed_read"]


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


class ChunkMap:
    """File addresses of a dataset's chunks, for reading rows with ``preadv``.

    Args:
        path: The HDF5 file.
        dset: Its samples dataset (chunked, unfiltered, whole rows per chunk).

    Raises:
        ValueError: The dataset's layout does not allow direct reads.
    """

    def __init__(self, path: str, dset: h5py.Dataset) -> None:
        chunks = dset.chunks
        if chunks is None or tuple(chunks[1:]) != tuple(dset.shape[1:]):
            raise ValueError("not chunked by whole rows")
        if dset.id.get_create_plist().get_nfilters() != 0:
            raise ValueError("filtered (compressed) chunks")
        if not dset.dtype.isnative or dset.dtype.kind not in "iufb":
            raise ValueError(f"dtype {dset.dtype} is not a native number")
        self.rows = int(chunks[0])
        self.row_bytes = (
            int(np.prod(dset.shape[1:], dtype=np.int64)) * dset.dtype.itemsize
        )
        n = -(-dset.shape[0] // self.rows) if dset.shape[0] else 0
        offsets = np.full(n, -1, dtype=np.int64)

        def note(info) -> None:
            k = info.chunk_offset[0] // self.rows
            if info.filter_mask != 0 or info.size != self.rows * self.row_bytes:
                raise ValueError("a chunk is filtered or of an unexpected size")
            offsets[k] = info.byte_offset

        if hasattr(dset.id, "chunk_iter"):
            dset.id.chunk_iter(note)
        else:  # HDF5 before 1.13
            for i in range(dset.id.get_num_chunks()):
                note(dset.id.get_chunk_info(i))
        if (offsets < 0).any():
            raise ValueError("a chunk was never written")
        if n and int(offsets.max()) + self.rows * self.row_bytes > os.path.getsize(
            path
        ):
            raise ValueError("chunks end past the end of the file (truncated?)")
        self.offsets = offsets
        self.fd = os.open(path, os.O_RDONLY)
        # closed also when a later file of the split fails to open
        self._close = weakref.finalize(self, os.close, self.fd)

    def segments(self, start: int, stop: int) -> list[tuple[int, int]]:
        """``(file offset, bytes)`` of rows ``start:stop``, merged where adjacent."""
        out: list[tuple[int, int]] = []
        row = start
        while row < stop:
            k, within = divmod(row, self.rows)
            take = min(stop - row, self.rows - within)
            pos = int(self.offsets[k]) + within * self.row_bytes
            nbytes = take * self.row_bytes
            if out and out[-1][0] + out[-1][1] == pos:
                out[-1] = (out[-1][0], out[-1][1] + nbytes)
            else:
                out.append((pos, nbytes))
            row += take
        return out

    def read(self, start: int, stop: int, into: memoryview) -> None:
        """Read rows ``start:stop`` into the bytes ``into`` (exactly their size)."""
        at = 0
        for pos, nbytes in self.segments(start, stop):
            done = 0
            while done < nbytes:
                got = os.preadv(self.fd, [into[at + done : at + nbytes]], pos + done)
                if got <= 0:
                    raise OSError(f"short read at byte {pos + done}")
                done += got
            at += nbytes

    def close(self) -> None:
        self._close()


def _chunk_map(path: str, dset: h5py.Dataset) -> ChunkMap | None:
    if not envvars.get_bool("HYBRIDAGG_DATA_DIRECT_READ"):
        return None
    try:
        return ChunkMap(path, dset)
    except (ValueError, OSError, RuntimeError, KeyError, AttributeError):
        return None  # h5py's read path handles (and reports on) anything else


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
        self.direct: list[ChunkMap | None] = []
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
            direct = None if driver == "mpio" else _chunk_map(info.path, self.dsets[-1])
            self.direct.append(direct)
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
        row_bytes = int(np.prod(out.shape[1:], dtype=np.int64)) * out.itemsize
        raw = (
            memoryview(out.reshape(-1).view(np.uint8))
            if out.flags.c_contiguous
            else None
        )
        for f, s, c in runs_of(blocks):
            n = c - s
            direct = self.direct[f]
            try:
                if (
                    direct is not None
                    and raw is not None
                    and out.dtype == self.dsets[f].dtype
                ):
                    direct.read(s, c, raw[row * row_bytes : (row + n) * row_bytes])
                else:
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
        for direct in self.direct:
            if direct is not None:
                direct.close()
        self.files, self.dsets, self.direct = [], [], []


def timed_read(reader: SplitReader, blocks, out) -> tuple[int, float]:
    """Read a window and return ``(bytes, seconds)``."""
    t0 = time.perf_counter()
    nbytes = reader.read_window(blocks, out)
    return nbytes, time.perf_counter() - t0
