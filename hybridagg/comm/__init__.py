"""How hybridagg talks to MPI: a communicator wrapper, polled waits, buffers.

Three rules live here so no other module has to remember them:

* **Never block inside MPI.** Every operation is posted non-blocking and
  completed through :func:`wait_until` (a short spin, then a back-off
  proportional to the time already waited); every wait has a timeout and
  raises :class:`CommTimeoutError` naming the operation and peer.
* **No copies.** Contiguous CPU tensors and numpy arrays are handed to MPI as
  buffers over their own memory (:func:`as_buffer`); a GPU tensor goes
  through pinned host memory unless MPI is CUDA-aware (:class:`HostStage`).
* **No hangs on errors.** :meth:`Comm.check` turns an error on one rank into
  the same error on every rank; :func:`install_abort_hook` turns an unhandled
  exception into ``MPI_Abort`` with the rank and reason. A
  :class:`Heartbeat` finds a dead or stuck rank within
  ``HYBRIDAGG_FAILURE_TIMEOUT`` even where the launcher keeps the job alive
  (waits then raise a ``PeerFailure``), and :func:`peer_failure_from` turns
  MPI's process-failure errors (ULFM) into one naming the dead ranks.

Algorithms (rings, shared memory, which one for which size) live one layer
up, in :mod:`hybridagg.collectives`.
"""

from .buffers import ScratchPool, alloc, as_buffer, mpi_dtype
from .communicator import Comm, RemoteError
from .failures import failed_world_ranks, is_peer_failure, peer_failure_from
from .finite import all_finite
from .heartbeat import Heartbeat
from .liveness import solo
from .process import (
    configure_threads,
    end_job,
    end_on_peer_failure,
    install_abort_hook,
    peer_failure_of,
)
from .staging import HostStage, cuda_aware_mpi, staging_setting
from .waits import CommTimeoutError, check_timeout, default_timeout, wait, wait_until
from .wire import (
    WIRE_FORMATS,
    ErrorFeedback,
    WireCodec,
    check_wire,
    wire_dtype,
    wire_view,
)

__all__ = [
    "WIRE_FORMATS",
    "Comm",
    "CommTimeoutError",
    "ErrorFeedback",
    "Heartbeat",
    "HostStage",
    "RemoteError",
    "ScratchPool",
    "WireCodec",
    "all_finite",
    "alloc",
    "as_buffer",
    "check_timeout",
    "check_wire",
    "configure_threads",
    "cuda_aware_mpi",
    "default_timeout",
    "end_job",
    "end_on_peer_failure",
    "failed_world_ranks",
    "install_abort_hook",
    "is_peer_failure",
    "mpi_dtype",
    "peer_failure_from",
    "peer_failure_of",
    "solo",
    "staging_setting",
    "wait",
    "wait_until",
    "wire_dtype",
    "wire_view",
]
