"""Collective algorithms over a :class:`hybridagg.comm.Comm`.

Partition helpers (:mod:`.partition`), the pipelined and settled rings
(:mod:`.ring`), sums and broadcasts in bf16/fp16 formed in float32
(:mod:`.compact`), the weighted mean with a header (:mod:`.mean`), reductions
in node-shared memory (:mod:`.shm`), and one dispatch (:mod:`.dispatch`),
the only reader of the size thresholds (:mod:`.settings`). This package
depends on :mod:`hybridagg.comm` only.
"""

from .compact import CompactAllreduce, CompactBcast, CompactReduce, compact_tag
from .dispatch import Algorithm, Collectives, choose_allreduce
from .mean import mean_allreduce
from .partition import even_bounds, ring_neighbours
from .ring import RingAllreduce, ring_tag, ring_tags, settled_allreduce
from .settings import CollectiveSettings
from .shm import SharedBucket, SharedStaging, shared_memory_usable

__all__ = [
    "Algorithm",
    "CollectiveSettings",
    "Collectives",
    "CompactAllreduce",
    "CompactBcast",
    "CompactReduce",
    "RingAllreduce",
    "SharedBucket",
    "SharedStaging",
    "choose_allreduce",
    "compact_tag",
    "even_bounds",
    "mean_allreduce",
    "ring_neighbours",
    "ring_tag",
    "ring_tags",
    "settled_allreduce",
    "shared_memory_usable",
]
