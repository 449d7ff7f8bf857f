"""The settings that choose a collective's algorithm, read once from the environment."""

from __future__ import annotations

from dataclasses import dataclass

from ..runtime import envvars

__all__ = ["CollectiveSettings"]


@dataclass(frozen=True)
class CollectiveSettings:
    """Size thresholds and switches of :mod:`hybridagg.collectives`.

    Defaults live in the environment registry (:mod:`hybridagg.runtime.envvars`);
    :meth:`from_env` is the usual constructor.

    Every rank of a communicator must hold the same settings: ranks that
    differ would post different collectives (the optimizer checks this at
    construction).
    """

    ring_min_bytes: int
    """The smallest sum all-reduce that takes the pipelined ring
    (``HYBRIDAGG_RING_MIN_BYTES``); smaller ones take ``MPI_Iallreduce``."""

    settled_max_bytes: int
    """Settled all-reduces below this size use blocking calls
    (``HYBRIDAGG_SETTLED_MAX_BYTES``); larger ones the pipelined ring."""

    ring_chunk_bytes: int
    """The pipelined ring's granularity (``HYBRIDAGG_RING_CHUNK_BYTES``)."""

    shared_memory: bool
    """Whether a group on one node may reduce in MPI shared memory
    (``HYBRIDAGG_SHM_REDUCE``)."""

    def __post_init__(self) -> None:
        for name in ("ring_min_bytes", "settled_max_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        chunk = self.ring_chunk_bytes
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
            raise ValueError(
                f"HYBRIDAGG_RING_CHUNK_BYTES must be positive, got {chunk!r}"
            )

    @classmethod
    def from_env(cls) -> CollectiveSettings:
        """The settings as the environment gives them (the registry's defaults
        where unset)."""
        return cls(
            ring_min_bytes=envvars.get_int("HYBRIDAGG_RING_MIN_BYTES"),
            settled_max_bytes=envvars.get_int("HYBRIDAGG_SETTLED_MAX_BYTES"),
            ring_chunk_bytes=envvars.get_int("HYBRIDAGG_RING_CHUNK_BYTES"),
            shared_memory=envvars.get_bool("HYBRIDAGG_SHM_REDUCE"),
        )
