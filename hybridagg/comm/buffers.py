"""Tensors and arrays as MPI buffers, communication memory, scratch pools.

Contiguous CPU tensors and numpy arrays are handed to MPI as buffers over
their own memory (:func:`as_buffer`), never copied. hybridagg's own
communication buffers come from :func:`alloc`, and operations that need
temporary space reuse it through a :class:`ScratchPool` that the operation's
owner holds.
"""

from __future__ import annotations

import numpy as np
import torch
from mpi4py import MPI

__all__ = ["ScratchPool", "alloc", "as_buffer", "device_buffer", "mpi_dtype"]

_TORCH_TO_MPI = {
    torch.float32: MPI.FLOAT,
    torch.float64: MPI.DOUBLE,
    torch.int8: MPI.INT8_T,
    torch.uint8: MPI.UINT8_T,
    torch.int16: MPI.INT16_T,
    torch.int32: MPI.INT32_T,
    torch.int64: MPI.INT64_T,
    torch.bool: MPI.C_BOOL,
    torch.complex64: MPI.C_FLOAT_COMPLEX,
    torch.complex128: MPI.C_DOUBLE_COMPLEX,
}
_NUMPY_TO_MPI = {
    np.dtype(np.float32): MPI.FLOAT,
    np.dtype(np.float64): MPI.DOUBLE,
    np.dtype(np.int8): MPI.INT8_T,
    np.dtype(np.uint8): MPI.UINT8_T,
    np.dtype(np.int16): MPI.INT16_T,
    np.dtype(np.int32): MPI.INT32_T,
    np.dtype(np.int64): MPI.INT64_T,
    np.dtype(np.bool_): MPI.C_BOOL,
    np.dtype(np.complex64): MPI.C_FLOAT_COMPLEX,
    np.dtype(np.complex128): MPI.C_DOUBLE_COMPLEX,
}


def mpi_dtype(dtype: torch.dtype | np.dtype) -> MPI.Datatype:
    """Return the MPI datatype for a torch or numpy dtype.

    Raises:
        TypeError: MPI has no reducible type for it (float16, bfloat16, ...).
    """
    if isinstance(dtype, torch.dtype):
        table, key = _TORCH_TO_MPI, dtype
    else:
        table, key = _NUMPY_TO_MPI, np.dtype(dtype)
    try:
        return table[key]
    except KeyError:
        raise TypeError(
            f"dtype {dtype} has no MPI datatype; convert to float32 first"
        ) from None


def as_buffer(x: torch.Tensor | np.ndarray) -> list:
    """Describe a tensor's or array's own memory as an MPI buffer, without a copy.

    The caller keeps ``x`` alive until any request using the buffer completes.

    Args:
        x: A contiguous CPU ``torch.Tensor`` or C-contiguous ``numpy.ndarray``.

    Returns:
        ``[buffer, count, datatype]`` as mpi4py's buffer arguments take it.

    Raises:
        TypeError: ``x`` is neither, lives on a GPU, or has no MPI dtype.
        ValueError: ``x`` is not contiguous.
    """
    if isinstance(x, torch.Tensor):
        if x.device.type != "cpu":
            raise TypeError(
                f"as_buffer needs a CPU tensor, got one on {x.device}; GPU "
                "tensors go through a host buffer (hybridagg.comm.HostStage)"
            )
        if not x.is_contiguous():
            raise ValueError("as_buffer needs a contiguous tensor (call .contiguous())")
        dtype = mpi_dtype(x.dtype)
        mem = MPI.buffer.fromaddress(x.data_ptr(), x.numel() * x.element_size())
        return [mem, x.numel(), dtype]
    if isinstance(x, np.ndarray):
        if not x.flags.c_contiguous:
            raise ValueError("as_buffer needs a C-contiguous array")
        return [x, x.size, mpi_dtype(x.dtype)]
    raise TypeError(f"as_buffer takes a torch.Tensor or numpy.ndarray, got {type(x)}")


def device_buffer(x: torch.Tensor) -> list:
    """Describe a contiguous GPU tensor's memory as an MPI buffer.

    Only for a CUDA-aware MPI (:func:`hybridagg.comm.cuda_aware_mpi`): MPI
    receives the device address, which any other MPI would read as host
    memory. The caller synchronises the tensor's stream first.

    Raises:
        ValueError: ``x`` is not contiguous.
        TypeError: ``x`` has no MPI dtype.
    """
    if not x.is_contiguous():
        raise ValueError("device_buffer needs a contiguous tensor")
    mem = MPI.buffer.fromaddress(x.data_ptr(), x.numel() * x.element_size())
    return [mem, x.numel(), mpi_dtype(x.dtype)]


def alloc(
    numel: int,
    dtype: torch.dtype = torch.float32,
    *,
    zero: bool = True,
    pinned: bool = False,
) -> torch.Tensor:
    """A 1-D CPU tensor for communication, in memory that may use huge pages.

    numpy advises the kernel to back large arrays with transparent huge
    pages and torch's allocator does not; the single-copy shared-memory
    transport walks every page, so moving a large buffer from torch-allocated
    memory is measurably slower (bench/RESULTS.md). hybridagg's own buffers
    (buckets, shards, parameter-server messages, scratch space) therefore
    come from here. Dtypes numpy lacks fall back to torch's allocator.

    ``pinned``: page-locked memory from torch's CUDA host allocator, for a
    buffer that a GPU's tensors are copied to and from (the copies then run
    as asynchronous DMA); ignored where CUDA is not available.

    The pages of numpy-backed memory are touched here (written with zeros,
    whatever ``zero`` says): a communication buffer is used whole, and most
    are made before training starts, so their page faults fall in the
    set-up instead of inside the first step's transfers (with the ResNet-50
    twin's 94 MB they had made a first push take 0.2-0.3 s longer on a
    loaded machine). ``zero=False`` only spares the other paths (pinned
    memory, dtypes numpy lacks) their zero fill.
    """
    if pinned and torch.cuda.is_available():
        return (torch.zeros if zero else torch.empty)(
            numel, dtype=dtype, pin_memory=True
        )
    try:
        np_dtype = torch.empty(0, dtype=dtype).numpy().dtype
    except TypeError:
        return (torch.zeros if zero else torch.empty)(numel, dtype=dtype)
    array = np.empty(numel, dtype=np_dtype)
    array.fill(0)  # (faults every page in now: see above)
    return torch.from_numpy(array)


class ScratchPool:
    """Reusable temporary buffers (fresh memory costs page faults on first touch).

    An operation takes a buffer with :meth:`take` and gives it back with
    :meth:`give` once no request still writes into it. The pool belongs to
    whoever runs the operations (one per communicator's collectives), not
    to the communicator.

    Args:
        keep: How many buffers the pool holds at most.
    """

    def __init__(self, keep: int = 8) -> None:
        self.keep = keep
        self._free: list[torch.Tensor] = []

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A buffer of at least ``numel`` elements of ``dtype``, as a 1-D view."""
        for i, buf in enumerate(self._free):
            if buf.dtype == dtype and buf.numel() >= numel:
                return self._free.pop(i)[:numel]
        return alloc(numel, dtype, zero=False)

    def give(self, buf: torch.Tensor) -> None:
        """Return a buffer :meth:`take` handed out."""
        base = buf if buf._base is None else buf._base
        if len(self._free) < self.keep:
            self._free.append(base)

    def clear(self) -> None:
        """Drop every pooled buffer."""
        self._free.clear()
