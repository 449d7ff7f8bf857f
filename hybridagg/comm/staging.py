"""Tensors of any device through MPI: host staging, or device memory when MPI can.

The PyPI Open MPI (and most site builds) cannot read GPU memory, so a GPU
tensor reaches MPI through a host buffer: copied to pinned memory, moved by
MPI there, copied back. :class:`HostStage` is that mechanism; it keeps one
host buffer per tensor it has staged, so a training step allocates nothing.
Which tensors it stages is the pure :func:`hybridagg.devices.staging_mode`:
GPU tensors unless the MPI library is CUDA-aware (:func:`cuda_aware_mpi`),
and, with ``HYBRIDAGG_HOST_STAGING=always``, CPU tensors too. That last
setting is the *device stand-in*: CI has no GPU, so it runs the staged path,
the very same code, on CPU tensors (which are then copied through a host
buffer of their own).

Copies are ``non_blocking`` (from and to pinned memory they are
asynchronous DMA transfers) followed by one synchronisation of the tensor's
stream: MPI must not read the host buffer before the copy has landed, and
the host buffer must not be reused before the copy back has read it.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from ..devices import staging_mode
from ..runtime import envvars

__all__ = ["HostStage", "cuda_aware_mpi", "staging_setting"]


def staging_setting() -> str:
    """``HYBRIDAGG_HOST_STAGING`` (``auto``, ``always`` or ``never``), checked.

    Raises:
        ValueError: Another value, naming the variable.
    """
    setting = envvars.get_str("HYBRIDAGG_HOST_STAGING").strip().lower()
    staging_mode("cpu", setting, False)  # (validates the spelling)
    return setting


def cuda_aware_mpi() -> bool:
    """Whether the MPI library in this process can read GPU memory.

    Open MPI answers ``MPIX_Query_cuda_support()`` (its ``mpi-ext.h``
    extension, 1 only when it was built with CUDA and the runtime supports
    it); mpi4py does not wrap it, so it is called through ``ctypes`` from the
    ``libmpi`` this process has loaded. Any other MPI, or an Open MPI
    without the extension, counts as not CUDA-aware (host staging is always
    correct). Before MPI is initialised (or after it ended) the answer is
    ``False`` and is not remembered.
    """
    from mpi4py import MPI

    if not MPI.Is_initialized() or MPI.Is_finalized():
        return False
    return _query_cuda_support()


@functools.cache
def _query_cuda_support() -> bool:
    for path in _loaded_mpi_libraries():
        try:
            query = getattr(ctypes.CDLL(path), "MPIX_Query_cuda_support", None)
        except OSError:
            continue
        if query is not None:
            query.restype = ctypes.c_int
            return bool(query())
    return False


def _loaded_mpi_libraries() -> list[str]:
    """Paths of the ``libmpi`` shared objects mapped into this process."""
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return []
    paths = {line.split()[-1] for line in lines if "/libmpi" in line}
    return sorted(p for p in paths if Path(p).name.startswith("libmpi."))


class HostStage:
    """Host buffers for tensors that MPI cannot (or must not) read in place.

    Args:
        setting: ``HYBRIDAGG_HOST_STAGING`` (default: the environment's).
        cuda_aware: Whether MPI reads GPU memory (default: asked of the
            library once it is initialised, :func:`cuda_aware_mpi`).

    Use: ``host = stage.to_host(t)`` before posting MPI on ``host`` (it is
    ``t`` itself when no staging is needed), and ``stage.to_device(host, t)``
    once MPI completed (nothing when ``host is t``). :meth:`free` drops the
    buffers.
    """

    def __init__(self, setting: str | None = None, cuda_aware: bool | None = None):
        self.setting = staging_setting() if setting is None else setting
        staging_mode("cpu", self.setting, False)
        self._cuda_aware = cuda_aware
        self._buffers: dict[tuple, torch.Tensor] = {}
        self.copies = 0
        """Tensors copied to or from a host buffer so far (tests read it)."""

    @property
    def cuda_aware(self) -> bool:
        """Whether device memory goes to MPI directly."""
        if self._cuda_aware is None:
            self._cuda_aware = cuda_aware_mpi()
        return self._cuda_aware

    def mode(self, tensor: torch.Tensor) -> str:
        """``"direct"`` or ``"staged"`` for ``tensor`` (:func:`staging_mode`)."""
        cuda_aware = self.cuda_aware if tensor.device.type != "cpu" else False
        return staging_mode(tensor.device.type, self.setting, cuda_aware)

    def staged(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` goes through a host buffer."""
        return self.mode(tensor) == "staged"

    def buffer(self, tensor: torch.Tensor) -> torch.Tensor:
        """The host buffer kept for ``tensor`` (contiguous, same shape and dtype).

        Pinned when ``tensor`` is on a GPU (copies then run as DMA at full
        speed, and asynchronously). Keyed by the tensor's memory, shape and
        dtype, so a bucket reduced every step reuses one buffer.
        """
        key = (tensor.device, tensor.data_ptr(), tuple(tensor.shape), tensor.dtype)
        host = self._buffers.get(key)
        if host is None:
            host = torch.empty(
                tensor.shape,
                dtype=tensor.dtype,
                pin_memory=tensor.device.type == "cuda",
            )
            self._buffers[key] = host
        return host

    def to_host(self, tensor: torch.Tensor, copy: bool = True) -> torch.Tensor:
        """What MPI should read or write for ``tensor``.

        ``tensor`` itself when it goes to MPI directly (after its stream is
        synchronised: MPI must see the kernels that wrote it finished);
        else its host buffer, filled with ``tensor``'s values unless
        ``copy`` is false (a broadcast's receiver only needs the space).
        """
        if not self.staged(tensor):
            _sync(tensor)
            return tensor
        host = self.buffer(tensor)
        if copy:
            host.copy_(tensor.detach(), non_blocking=True)
            _sync(tensor)
            self.copies += 1
        return host

    def to_device(self, host: torch.Tensor, tensor: torch.Tensor) -> None:
        """Copy MPI's result from ``host`` back into ``tensor`` (no-op if the same)."""
        if host is tensor:
            return
        with torch.no_grad():
            tensor.copy_(host, non_blocking=True)
        _sync(tensor)  # (the host buffer may be written again right after)
        self.copies += 1

    def free(self) -> None:
        """Drop every host buffer."""
        self._buffers.clear()

    def __enter__(self) -> HostStage:
        return self

    def __exit__(self, *exc) -> None:
        self.free()


def _sync(tensor: torch.Tensor) -> None:
    """Wait for the work queued on ``tensor``'s CUDA stream (no-op on the CPU)."""
    if tensor.device.type == "cuda":
        torch.cuda.current_stream(tensor.device).synchronize()
