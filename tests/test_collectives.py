"""hybridagg.collectives: rings, the weighted mean, shared memory, the dispatch."""

import numpy as np
import pytest
import torch

from hybridagg.collectives import (
    Algorithm,
    CollectiveSettings,
    choose_allreduce,
    even_bounds,
    ring_neighbours,
    ring_tags,
)
from hybridagg.ps.shards import part_ranges


def test_tag_rounds_fit_below_the_tag_bound():
    assert ring_tags(32767, 2, 64) == (32767 - 1000) // (2 * 64)
    assert ring_tags(2**31 - 1, 5, 1) > 10**6
    with pytest.raises(ValueError, match="too small"):
        ring_tags(1100, 64, 64)


@pytest.mark.parametrize("nranks", [2, 3, 5])
def test_rings_in_flight_never_share_a_tag(nranks):
    from hybridagg.collectives.ring import MAX_CHUNKS, ring_tag

    ub = 32767  # the least MPI_TAG_UB the standard allows
    stages, rounds = 2 * (nranks - 1), ring_tags(ub, nranks, MAX_CHUNKS)

    def tags(seq, nchunks):
        return {
            ring_tag(seq, k, j, nranks=nranks, tag_ub=ub)
            for k in range(stages)
            for j in range(nchunks)
        }

    # a 4-chunk ring and a 1-chunk ring three rings later (their tags once
    # overlapped, so a receive could match the other ring's message)
    assert not tags(0, 4) & tags(3, 1)
    every = [t for seq in range(rounds) for t in tags(seq, MAX_CHUNKS)]
    assert len(set(every)) == len(every)
    assert min(every) > 904 + 2 and max(every) <= ub  # above the settled rings'


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
    from hybridagg.collectives import RingAllreduce
    from hybridagg.comm import Comm, ScratchPool

    comm = Comm(name="ring-test")
    pool, stages = ScratchPool(), []
    seq = 0
    # sizes smaller than the rank count, uneven segments, several chunks
    for numel in [0, 1, 2, 7, 1001, 50_003]:
        for chunk_bytes in [8, 4096, 2**22]:
            g = torch.Generator().manual_seed(numel + chunk_bytes)
            data = torch.randn(3, comm.size, numel, generator=g, dtype=torch.float64)
            mine = [data[i, comm.rank].clone() for i in range(3)]
            # three rings on one communicator at once, as buckets are, with
            # different chunk counts
            rings = []
            for i, buf in enumerate(mine):
                rings.append(
                    RingAllreduce(
                        comm,
                        buf,
                        seq,
                        chunk_bytes * (1 + 5 * i),
                        pool,
                        lambda: stages.append(1),
                    )
                )
                seq += 1
            comm.wait_for(lambda rs=rings: all([r.test() for r in rs]), "rings")
            for i, buf in enumerate(mine):
                torch.testing.assert_close(buf, data[i].sum(0))
            # bitwise the same result everywhere: replicas stay identical
            everyone = comm.allgather(mine[0].numpy().tobytes())
            assert all(e == everyone[0] for e in everyone)
    assert (len(stages) > 0) == (comm.size > 1)  # progress was reported
    comm.free()


@pytest.mark.mpi(ranks=[2, 3], timeout=120)
def test_collectives_allreduce_takes_the_ring_above_the_threshold(
    mpi_ranks, monkeypatch
):
    from hybridagg.collectives import Collectives
    from hybridagg.comm import Comm

    monkeypatch.setenv("HYBRIDAGG_RING_MIN_BYTES", "64")
    monkeypatch.setenv("HYBRIDAGG_SETTLED_MAX_BYTES", "0")
    comm = Comm(name="ring-threshold")
    collectives = Collectives(comm)
    x = torch.full((1000,), float(comm.rank + 1))
    collectives.allreduce(x)
    assert collectives.events > 0  # stages of the ring completed
    assert torch.all(x == sum(range(1, comm.size + 1)))
    seen = collectives.events
    z = torch.ones(8)  # below the threshold: MPI_Iallreduce, no ring stages
    collectives.allreduce(z)
    assert collectives.events == seen and torch.all(z == comm.size)
    y = np.ones(4)
    comm.Allreduce(y)  # the communicator's own: MPI_Iallreduce on any buffer
    assert np.all(y == comm.size)
    comm.free()


@pytest.mark.mpi(ranks=[1, 2, 3, 5], timeout=120)
def test_settled_allreduce_equals_the_sum_on_every_rank(mpi_ranks):
    from hybridagg.collectives import settled_allreduce
    from hybridagg.comm import Comm, ScratchPool

    comm = Comm(name="settled-test")
    for numel in [0, 1, 2, 7, 1001]:
        g = torch.Generator().manual_seed(numel)
        data = torch.randn(comm.size, numel, generator=g, dtype=torch.float64)
        buf = data[comm.rank].clone()
        settled_allreduce(comm, buf, ScratchPool())
        torch.testing.assert_close(buf, data.sum(0))
        everyone = comm.allgather(buf.numpy().tobytes())
        assert all(e == everyone[0] for e in everyone)
    comm.free()


@pytest.mark.mpi(ranks=[1, 2, 3, 5], timeout=120)
@pytest.mark.parametrize("impl", ["ring", "shm", "staged"])
def test_weighted_mean_by_the_counts_and_the_header_sum(mpi_ranks, impl):
    """mean_allreduce, SharedBucket.reduce, SharedStaging.reduce: one contract."""
    import time

    from hybridagg.collectives import (
        SharedBucket,
        SharedStaging,
        mean_allreduce,
        shared_memory_usable,
    )
    from hybridagg.comm import Comm, ScratchPool

    comm = Comm(name="mean-test")
    n, r = comm.size, comm.rank
    shm = impl != "ring"
    if shm and n > 1 and not shared_memory_usable(comm, 8 * 1001, True):
        comm.free()
        pytest.skip("no shared memory for the window here")
    dtype = torch.float32 if shm else torch.float64
    sizes = [0, 1, 2, 7, 1001] if shm else []
    if impl == "staged":
        shared = {k: SharedStaging(comm, torch.zeros(k, dtype=dtype), 7) for k in sizes}
    else:
        shared = {k: SharedBucket(comm, k, dtype) for k in sizes}
    cases = [
        [1.0] * n,
        [float(i) for i in range(n)],  # rank 0 weighs 0
        [0.1 * (i + 1) for i in range(n)],  # fractions: their sum has an order
        [0.0] * n,  # nobody has samples: zeros stay zeros
    ]
    for numel in [0, 1, 2, 7, 1001]:
        for c, counts in enumerate(cases):
            g = torch.Generator().manual_seed(numel)
            data = torch.randn(n, numel, generator=g, dtype=torch.float64)
            data[torch.tensor(counts) == 0] = 0.0  # as the reducer hands it over
            if shm:
                buf = shared[numel].flat
                buf.copy_(data[r])
            else:
                buf = data[r].clone()
            header = np.array([counts[r], 1.0, 0.0, 0.0, 0.0, 0.0, 0.0])
            header[2 + r] = 2.5 * r  # a slot only this rank sets
            if c == 1 and r == n - 1:
                time.sleep(0.2)  # a late rank: the others wait for it (polled)
            if shm:
                total = shared[numel].reduce(header, what="mean test")
            else:
                total = mean_allreduce(
                    comm, buf, header, ScratchPool(), what="mean test"
                )
            w = torch.tensor(counts, dtype=torch.float64)[:, None]
            expect = (w * data).sum(0) / w.sum() if w.sum() > 0 else data.sum(0)
            torch.testing.assert_close(buf, expect.to(dtype))
            assert total[0] == pytest.approx(sum(counts))
            assert total[1] == n
            assert total[2 : 2 + n].tolist() == [2.5 * i for i in range(n)]
            assert header[0] == counts[r]  # the caller's header is not touched
            # bitwise the same result and header everywhere
            everyone = comm.allgather((buf.numpy().tobytes(), total.tobytes()))
            assert all(e == everyone[0] for e in everyone)
    for bucket in shared.values():
        bucket.free()
        # a staged bucket is the caller's memory and stays; a window's goes
        assert (bucket.flat is None) == (impl == "shm")
    comm.free()


@pytest.mark.mpi(ranks=[2, 3, 5], timeout=120)
def test_staged_reductions_back_to_back_while_a_rank_reads_late(mpi_ranks):
    """No barrier between reductions: the others run ahead into the next one.

    The last rank reads its peers' copies 20 ms after their flags are up in
    every other reduction (the last one too, right before the release);
    meanwhile the others finish and stage the next reduction's gradients.
    They must land in the other copy, or the late reader would sum the
    wrong step.
    """
    import time

    from hybridagg.collectives import SharedStaging, shared_memory_usable
    from hybridagg.comm import Comm

    comm = Comm(name="staged-test")
    n, r = comm.size, comm.rank
    if not shared_memory_usable(comm, 8 * 4096, True):
        comm.free()
        pytest.skip("no shared memory for the window here")
    flat = torch.zeros(1001, dtype=torch.float64)
    staging = SharedStaging(comm, flat, 2)
    if r == n - 1:
        raised = staging._all_raised

        def late_reader(step):
            ready = raised(step)
            if ready and step % 2:
                time.sleep(0.02)
            return ready

        staging._all_raised = late_reader
    with pytest.raises(ValueError, match="header has 3 entries, expected 2"):
        staging.reduce(np.zeros(3))
    results = []
    for step in range(13):
        data = torch.randn(n, 1001, generator=torch.Generator().manual_seed(step))
        data = data.double()
        counts = [float((step + j) % 3 + 1) for j in range(n)]
        flat.copy_(data[r])
        total = staging.reduce(np.array([counts[r], float(step)]), what="staged")
        w = torch.tensor(counts, dtype=torch.float64)[:, None]
        torch.testing.assert_close(flat, (w * data).sum(0) / w.sum())
        assert total.tolist() == [sum(counts), float(step * n)]
        results.append(flat.numpy().tobytes())
    everyone = comm.allgather(results)
    assert all(e == everyone[0] for e in everyone)  # bitwise, every step
    staging.free()
    assert torch.equal(
        flat, torch.frombuffer(bytearray(results[-1]), dtype=torch.float64)
    )
    with pytest.raises(ValueError, match="freed"):
        staging.reduce(np.zeros(2))
    comm.free()


def test_staging_names_a_bad_bucket_or_header():
    from hybridagg.collectives import SharedStaging

    with pytest.raises(TypeError, match="float32/float64 CPU tensor"):
        SharedStaging(None, torch.zeros(4, dtype=torch.int64), 2)
    with pytest.raises(TypeError, match="float32/float64 CPU tensor"):
        SharedStaging(None, torch.zeros(4, requires_grad=True), 2)
    with pytest.raises(ValueError, match="header_len must be >= 1"):
        SharedStaging(None, torch.zeros(4), 0)


def test_even_bounds_and_ring_neighbours():
    assert even_bounds(10, 4) == [0, 2, 5, 7, 10]
    assert even_bounds(0, 3) == [0, 0, 0, 0]
    assert even_bounds(2, 5) == [0, 0, 0, 1, 1, 2]
    for total, parts in [(10, 4), (7, 7), (1001, 3), (3, 8)]:
        b = even_bounds(total, parts)
        sizes = [b[i + 1] - b[i] for i in range(parts)]
        assert sum(sizes) == total and max(sizes) - min(sizes) <= 1
    with pytest.raises(ValueError, match="parts must be >= 1"):
        even_bounds(3, 0)
    assert ring_neighbours(0, 3) == (2, 1)
    assert ring_neighbours(2, 3) == (1, 0)
    assert ring_neighbours(0, 1) == (0, 0)
    with pytest.raises(ValueError, match="not in a ring"):
        ring_neighbours(3, 3)


def _settings(**kw):
    base = {
        "ring_min_bytes": 1024,
        "settled_max_bytes": 4096,
        "ring_chunk_bytes": 512,
        "shared_memory": True,
    }
    return CollectiveSettings(**{**base, **kw})


@pytest.mark.parametrize(
    ("nbytes", "size", "settled", "expect"),
    [
        (10**6, 1, False, Algorithm.NONE),
        (10**6, 1, True, Algorithm.NONE),
        (100, 2, False, Algorithm.MPI),
        (1023, 4, False, Algorithm.MPI),
        (1024, 4, False, Algorithm.RING),
        (10**6, 2, False, Algorithm.RING),
        (100, 2, True, Algorithm.SETTLED),  # settled: blocking even when small
        (4095, 3, True, Algorithm.SETTLED),
        (4096, 3, True, Algorithm.RING),  # too large for blocking calls
    ],
)
def test_the_dispatch_chooses_by_size_and_arrival(nbytes, size, settled, expect):
    got = choose_allreduce(nbytes, size, settled=settled, settings=_settings())
    assert got is expect


def test_collective_settings_come_from_the_registry_and_are_checked(monkeypatch):
    monkeypatch.delenv("HYBRIDAGG_RING_MIN_BYTES", raising=False)
    monkeypatch.setenv("HYBRIDAGG_RING_CHUNK_BYTES", "4096")
    monkeypatch.setenv("HYBRIDAGG_SHM_REDUCE", "0")
    s = CollectiveSettings.from_env()
    assert s.ring_min_bytes == 2**20 and s.ring_chunk_bytes == 4096
    assert s.shared_memory is False
    with pytest.raises(ValueError, match="HYBRIDAGG_RING_CHUNK_BYTES must be positive"):
        _settings(ring_chunk_bytes=0)
    with pytest.raises(ValueError, match="ring_min_bytes must be an integer >= 0"):
        _settings(ring_min_bytes=-1)
