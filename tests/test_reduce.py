"""The gradient reducer's pure parts: the last bucket's choice, the control
vector, bucket assignment (no MPI)."""

import itertools

import numpy as np
import pytest
import torch

from hybridagg.collectives import CollectiveSettings
from hybridagg.reduce import (
    FUSE_MAX_BYTES,
    SHARE_SLOTS,
    ControlVector,
    LastBucketFacts,
    assign_buckets,
    choose_last_bucket,
    shared_memory_vote_bytes,
)
from hybridagg.reduce import LastBucketKind as K

SETTINGS = CollectiveSettings(
    ring_min_bytes=2**20,
    settled_max_bytes=32 * 2**20,
    ring_chunk_bytes=4 * 2**20,
    shared_memory=True,
)


def facts(nbytes, **kw):
    base = {
        "nbytes": nbytes,
        "floating": True,
        "on_cpu": True,
        "mpi": True,
        "flat": True,
        "same_ranks": True,
    }
    return LastBucketFacts(**{**base, **kw})


@pytest.mark.parametrize(
    ("nbytes", "changes", "shm", "expect"),
    [
        (4096, {}, False, K.FUSED),
        (4096, {}, True, K.STAGED),
        (FUSE_MAX_BYTES, {}, False, K.FUSED),
        (FUSE_MAX_BYTES + 4, {}, False, K.EAGER),  # mid-size, below the ring
        (FUSE_MAX_BYTES + 4, {}, True, K.EAGER),
        (4096, {"floating": False}, False, K.EAGER),  # integers cannot ride
        (4096, {"same_ranks": False}, False, K.EAGER),
        (2**20, {}, False, K.MEAN_RING),
        (2**20, {}, True, K.SHARED_MEAN),
        (32 * 2**20 - 4, {}, False, K.MEAN_RING),
        (32 * 2**20, {}, False, K.SETTLED),  # too large for blocking calls
        (32 * 2**20, {}, True, K.SETTLED),
        (2**20, {"same_ranks": False}, True, K.SETTLED),
        (2**20, {"mpi": False}, False, K.EAGER),  # torch/horovod transports
        (2**20, {"on_cpu": False}, False, K.EAGER),
        (4096, {"on_cpu": False}, False, K.EAGER),
        (2**20, {"flat": False}, False, K.EAGER),  # hierarchical / one rank
        (4096, {"flat": False}, True, K.EAGER),
    ],
)
def test_the_last_bucket_strategy(nbytes, changes, shm, expect):
    got = choose_last_bucket(facts(nbytes, **changes), SETTINGS, shared_memory=shm)
    assert got is expect


def test_the_choice_follows_the_thresholds():
    low = CollectiveSettings(
        ring_min_bytes=64, settled_max_bytes=1, ring_chunk_bytes=8, shared_memory=True
    )
    assert choose_last_bucket(facts(4096), low, shared_memory=True) is K.SETTLED
    never = CollectiveSettings(
        ring_min_bytes=2**40,
        settled_max_bytes=2**41,
        ring_chunk_bytes=8,
        shared_memory=True,
    )
    assert choose_last_bucket(facts(2**30), never, shared_memory=False) is K.EAGER


def test_every_combination_gets_one_strategy_and_shared_memory_only_where_voted():
    for values in itertools.product([True, False], repeat=5):
        keys = ("floating", "on_cpu", "mpi", "flat", "same_ranks")
        for nbytes in (8, FUSE_MAX_BYTES, 2**20, 2**26):
            f = facts(nbytes, **dict(zip(keys, values, strict=True)))
            plain = choose_last_bucket(f, SETTINGS, shared_memory=False)
            shared = choose_last_bucket(f, SETTINGS, shared_memory=True)
            assert plain not in (K.STAGED, K.SHARED_MEAN)
            vote = shared_memory_vote_bytes(plain, nbytes, header_len=10)
            # a vote is taken exactly where shared memory would change the choice
            assert (vote is not None) == (shared is not plain)


def test_the_vote_asks_for_what_each_shared_variant_holds():
    assert shared_memory_vote_bytes(K.MEAN_RING, 4096, 10) == 4096
    assert shared_memory_vote_bytes(K.FUSED, 4096, 10) == 2 * (4096 + 80)
    for kind in (K.EAGER, K.SETTLED, K.STAGED, K.SHARED_MEAN):
        assert shared_memory_vote_bytes(kind, 4096, 10) is None


def test_the_control_vector_has_named_slices():
    layout = ControlVector(ranks=3, nparams=2, payload=5)
    assert layout.header_len == 1 + 3 + 2 + 3 * SHARE_SLOTS
    assert len(layout) == layout.header_len + 5
    share = np.arange(SHARE_SLOTS, dtype=np.float64)
    payload = np.full(5, 0.5)
    mine = [
        layout.pack(r, 10.0 + r, 2 if r == 1 else 0, [r == 0, True], share + r, payload)
        for r in range(3)
    ]
    total = sum(mine)  # what the all-reduce computes
    assert total[layout.samples] == 33.0
    assert layout.first_misuse(total) == (1, 2)
    assert total[layout.got_grad].tolist() == [1.0, 3.0]
    assert layout.shared_values(total).tolist() == [
        (share + r).tolist() for r in range(3)
    ]
    assert total[layout.payload].tolist() == [1.5] * 5
    assert layout.first_misuse(mine[0]) is None


def test_buckets_are_reverse_order_and_split_by_size_and_dtype():
    params = [
        torch.zeros(10),
        torch.zeros(10),
        torch.zeros(10, dtype=torch.float64),
        torch.zeros(30),
    ]
    # 40 bytes per float32 tensor of 10; the float64 one starts its own bucket
    assert assign_buckets(params, 1000) == [[3], [2], [1, 0]]
    assert assign_buckets(params, 80) == [[3], [2], [1, 0]]
    assert assign_buckets(params, 40) == [[3], [2], [1], [0]]
