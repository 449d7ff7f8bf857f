"""The sharded loader under real MPI: shares, determinism, dynamic chunks, prefetch.

With ``HYBRIDAGG_EXPECT_MPIO=1`` (``make test-mpio``) these tests also check
that the loader really read through ``driver="mpio"``.
"""

import time

import numpy as np
import pytest
import torch

from hybridagg.data import HDF5Loader, convert_arrays, mpio_available
from hybridagg.runtime import envvars

RANKS = [1, 2, 3, 4, 5]


def expect_mpio() -> bool:
    return envvars.get_bool("HYBRIDAGG_EXPECT_MPIO")


def shared_file(comm, tmp, n=900, block=16, classes=7):
    """Rank 0 writes a file whose sample i holds the value i; every rank gets its path."""
    path = tmp / f"indexed-{n}-{block}-{classes}.h5"
    if comm.rank == 0 and not path.exists():
        x = np.repeat(np.arange(n, dtype=np.float32)[:, None], 4, axis=1)
        y = np.arange(n, dtype=np.int64) % classes
        convert_arrays(
            x, y, path, num_classes=classes, val_fraction=0.0, block_samples=block
        )
    comm.barrier(what="test file written")
    return path


def check_driver(loader):
    if expect_mpio():
        assert mpio_available(), "make test-mpio needs h5py built with MPI"
        if loader.size > 1:
            assert loader.driver == "mpio"


def run_epoch(loader, sleep=0.0):
    ids, steps = [], 0
    static = loader.shares == "static"
    total = len(loader) if static else None
    for x, y in loader:
        assert torch.equal(y, x[:, 0].long() % loader.num_classes)
        ids += x[:, 0].long().tolist()
        steps += 1
        # static shares count down to 0 at the epoch's last batch
        assert loader.batches_left == (total - steps if static else None)
        if sleep:
            time.sleep(sleep)
    assert loader.batches_left is None  # between epochs
    return ids, steps


@pytest.mark.mpi(ranks=RANKS, timeout=120)
def test_static_shares_cover_every_sample_once_with_uneven_batches(mpi_tmp_path):
    from hybridagg.comm import Comm

    comm = Comm(name="test")
    path = shared_file(comm, mpi_tmp_path)
    batch = 3 + 4 * comm.rank  # uneven: 3, 7, 11, ...
    with HDF5Loader(path, batch_size=batch, comm=comm, seed=11, window_blocks=3) as ld:
        check_driver(ld)
        assert ld.batch_sizes == [3 + 4 * r for r in range(comm.size)]
        ids, steps = run_epoch(ld)
        views = comm.allgather((ids, steps))
        everything = sorted(i for v, _ in views for i in v)
        assert everything == list(range(900))
        assert {s for _, s in views} == {len(ld)}  # same number of steps everywhere
        # shares are proportional to batch sizes: within one batch of the ideal
        ideal = 900 * batch / sum(ld.batch_sizes)
        assert abs(len(ids) - ideal) <= batch
        # epoch 1: another order, again every sample once
        ids1, _ = run_epoch(ld)
        assert sorted(i for v in comm.allgather(ids1) for i in v) == everything
        assert ids1 != ids or (comm.size > 1 and len(ids) < 4)
    # the same (seed, epoch) gives the same order on every rank
    with HDF5Loader(path, batch_size=batch, comm=comm, seed=11, window_blocks=3) as ld:
        assert run_epoch(ld)[0] == ids
        ld.set_epoch(0)
        assert run_epoch(ld)[0] == ids
    with HDF5Loader(path, batch_size=batch, comm=comm, seed=12, window_blocks=3) as ld:
        other = run_epoch(ld)[0]
    assert sorted(i for v in comm.allgather(other) for i in v) == everything
    differs = comm.allgather(other != ids)
    assert any(differs)
    comm.free()


@pytest.mark.mpi(ranks=RANKS, timeout=120)
def test_dynamic_shares_cover_every_sample_once_and_a_fast_rank_takes_more(
    mpi_tmp_path,
):
    from hybridagg.comm import Comm

    comm = Comm(name="test")
    path = shared_file(comm, mpi_tmp_path, n=1200)
    slow = comm.size - 1
    with HDF5Loader(
        path,
        batch_size=16,
        comm=comm,
        shares="dynamic",
        seed=3,
        window_blocks=2,
        prefetch=1,
    ) as ld:
        check_driver(ld)
        with pytest.raises(TypeError, match="no fixed number"):
            len(ld)
        for epoch in range(2):
            ids, _ = run_epoch(ld, sleep=0.03 if comm.rank == slow else 0.0)
            views = comm.allgather(ids)
            assert sorted(i for v in views for i in v) == list(range(1200)), epoch
            if comm.size > 1:
                # the slow rank (sleeping per batch, standing for a slow GPU)
                # took fewer chunks than the fastest rank
                assert len(views[slow]) < max(len(v) for v in views)
    comm.free()


@pytest.mark.mpi(ranks=[2, 3, 5], timeout=120)
def test_batch_sizes_change_mid_epoch_and_every_sample_is_still_read_once(
    mpi_tmp_path,
):
    from hybridagg.comm import Comm

    comm = Comm(name="test")
    path = shared_file(comm, mpi_tmp_path, n=1000)
    n = comm.size
    with HDF5Loader(path, batch_size=8, comm=comm, seed=5, window_blocks=2) as ld:
        check_driver(ld)
        ids, steps, lefts = [], 0, []
        for x, _ in ld:
            ids += x[:, 0].long().tolist()
            steps += 1
            if steps == 3:
                # the adaptive-batching controller moves work to rank 0
                ld.set_batch_sizes([8 + 8 * n] + [4] * (n - 1))
            if steps > 3:
                assert len(x) <= ld.batch_size
            lefts.append(ld.batches_left)
        views = comm.allgather((ids, steps, lefts))
        assert sorted(i for v, _, _ in views for i in v) == list(range(1000))
        assert len({s for _, s, _ in views}) == 1
        # after the re-cut, every worker still counts down to 0 at the last
        # batch, alike on every worker (the epoch ends everywhere at once)
        assert lefts[-1] == 0 and min(lefts[:-1]) > 0
        assert all(v[2] == lefts for v in views)
        assert len(views[0][0]) > len(views[1][0])
        with pytest.raises(ValueError, match="different lists"):
            ld.set_batch_sizes([1 + comm.rank] * n)
    comm.free()


@pytest.mark.mpi(ranks=[1, 2], timeout=120)
def test_prefetch_stops_cleanly_with_mpi(mpi_tmp_path):
    import gc
    import threading

    from hybridagg.comm import Comm

    comm = Comm(name="test")
    path = shared_file(comm, mpi_tmp_path)

    def readers():
        return [t for t in threading.enumerate() if t.name.startswith("hybridagg-data")]

    for shares in ("static", "dynamic"):
        ld = HDF5Loader(path, batch_size=4, comm=comm, shares=shares, prefetch=2)
        for i, _ in enumerate(ld):
            if i == 5:
                break
        assert not readers()
        # the next epoch after an abandoned one works (dynamic: counter reset)
        ids, _ = run_epoch(ld)
        assert sorted(i for v in comm.allgather(ids) for i in v) == list(range(900))
        it = iter(ld)
        next(it)
        assert readers()
        del it
        ld.close()
        assert not readers()
    ld = HDF5Loader(path, batch_size=4, comm=comm, prefetch=2)
    it = iter(ld)
    next(it)
    # garbage collection stops the thread (static shares, posix: no MPI in it)
    if ld.driver == "posix":
        del it, ld
        gc.collect()
        assert not readers()
    else:
        del it
        ld.close()
    comm.free()


@pytest.mark.mpi(ranks=[1, 2], timeout=120)
def test_stall_accounting_sees_slow_reads_and_hides_behind_compute(
    mpi_tmp_path, monkeypatch
):
    from hybridagg.comm import Comm
    from hybridagg.data import reader

    comm = Comm(name="test")
    path = shared_file(comm, mpi_tmp_path, n=400)
    real = reader.SplitReader.read_window
    delay = 0.05

    def slow_read(self, blocks, out):
        if blocks is not None:
            time.sleep(delay)
        return real(self, blocks, out)

    # slow storage, no compute: the loop waits for data almost all the time
    monkeypatch.setattr(reader.SplitReader, "read_window", slow_read)
    with HDF5Loader(path, batch_size=20, comm=comm, window_blocks=1) as ld:
        t0 = time.perf_counter()
        run_epoch(ld)
        io_bound = ld.stats.stall_fraction(time.perf_counter() - t0)
        st = ld.stats
        assert st.windows > 0 and st.bytes_read > 0 and st.samples == st.batches * 20
        assert st.wait_seconds >= 0.5 * delay * st.windows
        assert st.max_wait >= st.last_wait >= 0
    monkeypatch.setattr(reader.SplitReader, "read_window", real)
    # fast reads, compute (sleep) per step: prefetch hides the reads
    with HDF5Loader(path, batch_size=20, comm=comm, window_blocks=4) as ld:
        t0 = time.perf_counter()
        run_epoch(ld, sleep=0.02)
        compute_bound = ld.stats.stall_fraction(time.perf_counter() - t0)
    assert io_bound > 0.5
    assert compute_bound < io_bound / 2
    comm.free()


@pytest.mark.mpi(ranks=[2, 3, 4], timeout=120)
def test_mpio_collective_reads_with_ranks_that_run_out(mpi_tmp_path):
    from hybridagg.comm import Comm

    if not mpio_available():
        if expect_mpio():
            pytest.fail("HYBRIDAGG_EXPECT_MPIO=1 but h5py has no MPI")
        pytest.skip("h5py is built without MPI (run make test-mpio)")
    comm = Comm(name="test")
    path = shared_file(comm, mpi_tmp_path, n=700)
    # very uneven batches: rank 0 covers many windows, the others few, so the
    # others join the remaining collective reads with empty selections
    batch = 40 if comm.rank == 0 else 1
    with HDF5Loader(
        path,
        batch_size=batch,
        comm=comm,
        driver="mpio",
        collective=True,
        window_blocks=1,
    ) as ld:
        assert ld.driver == "mpio" and ld.collective
        ids, steps = run_epoch(ld)
        views = comm.allgather((ids, steps))
        assert sorted(i for v, _ in views for i in v) == list(range(700))
        assert len({s for _, s in views}) == 1
    with HDF5Loader(
        path, batch_size=8, comm=comm, driver="mpio", shares="dynamic", window_blocks=2
    ) as ld:
        assert ld.driver == "mpio" and not ld.collective
        ids, _ = run_epoch(ld)
        assert sorted(i for v in comm.allgather(ids) for i in v) == list(range(700))
    comm.free()
