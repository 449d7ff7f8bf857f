"""The pipelined ring all-reduce and the communication buffers behind it."""

import numpy as np
import pytest
import torch

from hybridagg.ps.shards import part_ranges
from hybridagg.ring import ring_tags


def test_tag_rounds_fit_below_the_tag_bound():
    assert ring_tags(32767, 2, 64) == (32767 - 1000) // (2 * 64)
    assert ring_tags(2**31 - 1, 5, 1) > 10**6
    with pytest.raises(ValueError, match="too small"):
        ring_tags(1100, 64, 64)


def test_parts_cover_a_shard_evenly():
    assert part_ranges(10, 4) == [(0, 3), (3, 6), (6, 10)]
    assert part_ranges(0, 4) == []
    assert part_ranges(3, 100) == [(0, 3)]
    with pytest.raises(ValueError, match="part size"):
        part_ranges(10, 0)


def test_alloc_gives_writable_tensors_of_any_dtype():
    from hybridagg.comm import alloc

    t = alloc(5, torch.float64)
    assert t.dtype == torch.float64 and t.tolist() == [0.0] * 5
    t += 1
    b = alloc(3, torch.bfloat16)  # numpy has no bfloat16: torch's allocator
    assert b.dtype == torch.bfloat16 and b.sum() == 0


@pytest.mark.mpi(ranks=[1, 2, 3, 5], timeout=120)
def test_ring_equals_the_sum_on_every_rank_with_rings_in_flight(mpi_ranks):
    from hybridagg.comm import Comm
    from hybridagg.ring import RingAllreduce

    comm = Comm(name="ring-test")
    seq = 0
    # sizes smaller than the rank count, uneven segments, several chunks
    for numel in [0, 1, 2, 7, 1001, 50_003]:
        for chunk_bytes in [8, 4096, 2**22]:
            g = torch.Generator().manual_seed(numel + chunk_bytes)
            data = torch.randn(3, comm.size, numel, generator=g, dtype=torch.float64)
            mine = [data[i, comm.rank].clone() for i in range(3)]
            # three rings on one communicator at once, as buckets are
            rings = []
            for buf in mine:
                rings.append(RingAllreduce(comm, buf, seq, chunk_bytes))
                seq += 1
            comm.wait_for(lambda rs=rings: all([r.test() for r in rs]), "rings")
            for i, buf in enumerate(mine):
                torch.testing.assert_close(buf, data[i].sum(0))
            # bitwise the same result everywhere: replicas stay identical
            everyone = comm.allgather_obj(mine[0].numpy().tobytes())
            assert all(e == everyone[0] for e in everyone)
    comm.free()


@pytest.mark.mpi(ranks=[2, 3], timeout=120)
def test_comm_allreduce_takes_the_ring_above_the_threshold(mpi_ranks, monkeypatch):
    from hybridagg.comm import Comm

    monkeypatch.setenv("HYBRIDAGG_RING_MIN_BYTES", "64")
    comm = Comm(name="ring-threshold")
    x = torch.full((1000,), float(comm.rank + 1))
    comm.allreduce(x)
    assert comm.events > 0  # stages of the ring completed
    assert torch.all(x == sum(range(1, comm.size + 1)))
    y = np.ones(4)
    comm.allreduce(y)  # small numpy buffers: MPI_Iallreduce
    assert np.all(y == comm.size)
    comm.free()


@pytest.mark.mpi(ranks=[1, 2, 3, 5], timeout=120)
def test_settled_allreduce_fuses_the_weights_into_the_sum(mpi_ranks):
    from hybridagg.comm import Comm
    from hybridagg.ring import settled_allreduce

    comm = Comm(name="settled-test")
    n = comm.size
    cases = [
        None,
        [1.0 / n] * n,  # an average (at 2 ranks: one lerp)
        [float(i) / (n * (n - 1) / 2 or 1) for i in range(n)],  # rank 0 weighs 0
        [0.5 + i for i in range(n)],  # weights that do not sum to 1
    ]
    for numel in [0, 1, 2, 7, 1001]:
        for weights in cases:
            g = torch.Generator().manual_seed(numel)
            data = torch.randn(n, numel, generator=g, dtype=torch.float64)
            buf = data[comm.rank].clone()
            settled_allreduce(comm, buf, weights)
            w = torch.ones(n, 1) if weights is None else torch.tensor(weights)[:, None]
            expect = (w.to(torch.float64) * data).sum(0)
            torch.testing.assert_close(buf, expect)
            everyone = comm.allgather_obj(buf.numpy().tobytes())
            assert all(e == everyone[0] for e in everyone)
    with pytest.raises(ValueError, match=f"needs {n} weights, got {n + 1}"):
        settled_allreduce(comm, torch.zeros(3), [1.0] * (n + 1))
    comm.free()
