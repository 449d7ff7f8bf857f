"""Gradient reduction inside a group: buckets, transports, the control vector,
the last bucket's strategies, and the reducer that drives them from hooks."""

from .buckets import DEFAULT_BUCKET_BYTES, Bucket, assign_buckets
from .control import SHARE_SLOTS, ControlVector, MisuseError
from .lastbucket import (
    FUSE_MAX_BYTES,
    LastBucketFacts,
    LastBucketKind,
    choose_last_bucket,
    shared_memory_vote_bytes,
)
from .reducer import GradientReducer
from .transports import MPITransport, Transport, make_transport

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "FUSE_MAX_BYTES",
    "SHARE_SLOTS",
    "Bucket",
    "ControlVector",
    "GradientReducer",
    "LastBucketFacts",
    "LastBucketKind",
    "MPITransport",
    "MisuseError",
    "Transport",
    "assign_buckets",
    "choose_last_bucket",
    "make_transport",
    "shared_memory_vote_bytes",
]
