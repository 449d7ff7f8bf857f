"""The worker role of ``hybridagg train``, one module per concept.

``role`` wires the others: ``setup`` (model, optimizer, loader, the part
resumed), ``step`` (one update), ``epochs`` (the epoch in progress and the
count), ``validation`` (rank 0), ``checkpoints`` and ``stopping`` (the stop
signal), ``progress`` (metrics records, counters, the progress bar),
``clock`` (training time) and ``report`` (the summary).
"""

from .role import WorkerRole

__all__ = ["WorkerRole"]
