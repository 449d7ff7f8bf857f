"""Resuming a loader mid-epoch: no sample lost, none read twice."""

import itertools

import pytest
from test_data_loader import RANKS, run_epoch, shared_file

from hybridagg.data import HDF5Loader
from hybridagg.data.position import merge_states, remaining_pieces


# ------------------------------------------------------------------ pure logic
def test_remaining_pieces_drop_what_was_consumed():
    pieces = [(3, 0, 10), (1, 0, 5), (7, 2, 6)]
    assert remaining_pieces(pieces, 0) == pieces
    assert remaining_pieces(pieces, 12) == [(1, 2, 5), (7, 2, 6)]
    assert remaining_pieces(pieces, 19) == []


def test_merge_hands_out_again_what_no_snapshot_accounts_for():
    # 10 windows per epoch. Worker 0 saved when the counter was at 4, having
    # drawn 0 and 2 (window 2 half read); worker 1 saved at 8, having drawn
    # 1, 3 and 7 (all read). Windows 4, 5 and 6 were drawn after worker 0's
    # snapshot and before worker 1's by worker 0: no snapshot has them.
    states = [
        {
            "epoch": 0,
            "carry": [(0, 2, 5, 9)],
            "taken": [0, 2],
            "counter": 4,
            "n_windows": 10,
        },
        {"epoch": 0, "carry": [], "taken": [1, 3, 7], "counter": 8, "n_windows": 10},
    ]
    carry, epochs, counter = merge_states(states)
    assert counter == 8
    assert carry[0] == [(0, 2, 5, 9), (0, 4, 0, -1), (0, 6, 0, -1)]
    assert carry[1] == [(0, 5, 0, -1)]
    assert epochs == [0, 0]
    # a worker that moved on to epoch 1 goes back for a gap window of epoch 0
    states[1] = {**states[1], "epoch": 1}
    assert merge_states(states)[1] == [0, 0]
    with pytest.raises(ValueError, match="windows per epoch"):
        merge_states([states[0], {**states[1], "n_windows": 11}])


# ------------------------------------------------- one process, both share kinds
@pytest.mark.parametrize("shares", ["static", "dynamic"])
def test_single_process_resume_continues_where_it_stopped(tmp_path, shares):
    import numpy as np

    from hybridagg.data import convert_arrays

    path = tmp_path / "i.h5"
    x = np.repeat(np.arange(500, dtype=np.float32)[:, None], 4, axis=1)
    convert_arrays(
        x,
        np.zeros(500, np.int64),
        path,
        num_classes=1,
        val_fraction=0.0,
        block_samples=16,
    )
    kw = dict(batch_size=24, shares=shares, window_blocks=2, seed=4, prefetch=2)
    with HDF5Loader(path, **kw) as ld:
        whole = [x[:, 0].long().tolist() for x, _ in ld]
    with HDF5Loader(path, **kw) as ld:
        it = iter(ld)
        before = [next(it)[0][:, 0].long().tolist() for _ in range(7)]
        state = ld.state_dict()
        next(it)  # read after the snapshot: lost with the crash, read again later
        del it
    with HDF5Loader(path, **kw) as ld:
        ld.load_state_dict(state)
        after = [x[:, 0].long().tolist() for x, _ in ld]
        assert ld.epoch == 1
    ids = list(itertools.chain(*before, *after))
    assert sorted(ids) == list(range(500))
    if shares == "static":  # the same batches as an uninterrupted pass
        assert before + after == whole
    with (
        HDF5Loader(
            path, **{**kw, "shares": "static" if shares == "dynamic" else "dynamic"}
        ) as other,
        pytest.raises(ValueError, match="loader state is for"),
    ):
        other.load_state_dict(state)


# ------------------------------------------------------------- under MPI
@pytest.mark.mpi(ranks=RANKS, timeout=120)
def test_dynamic_resume_after_snapshots_at_different_moments(mpi_tmp_path):
    from hybridagg.comm import Comm

    comm = Comm(name="test")
    path = shared_file(comm, mpi_tmp_path, n=1200)
    kw = dict(batch_size=10, comm=comm, shares="dynamic", seed=2, window_blocks=2)
    with HDF5Loader(path, **kw) as ld:
        run_epoch(ld)  # epoch 0 complete
        it = iter(ld)
        # every worker saves at its own moment, as groups in hybrid mode do,
        # and reads on after it (those batches die with the job)
        mine = [next(it)[0][:, 0].long().tolist() for _ in range(2 + comm.rank)]
        state = ld.state_dict()
        for _ in range(3):
            next(it, None)
        del it
        comm.barrier(what="before the crash")
    with HDF5Loader(path, **kw) as ld:
        ld.load_state_dict(state)
        rest, _ = run_epoch(ld)
        views = comm.allgather(list(itertools.chain(*mine)) + rest)
        assert sorted(i for v in views for i in v) == list(range(1200))
        # and the epoch after is whole again
        nxt, _ = run_epoch(ld)
        assert sorted(i for v in comm.allgather(nxt) for i in v) == list(range(1200))
    comm.free()


@pytest.mark.mpi(ranks=[2, 3], timeout=120)
def test_static_resume_under_mpi_gives_the_same_batches(mpi_tmp_path):
    from hybridagg.comm import Comm

    comm = Comm(name="test")
    path = shared_file(comm, mpi_tmp_path, n=900)
    kw = dict(batch_size=8 + comm.rank, comm=comm, seed=6, window_blocks=2)
    with HDF5Loader(path, **kw) as ld:
        whole = [x[:, 0].tolist() for x, _ in ld]
    with HDF5Loader(path, **kw) as ld:
        it = iter(ld)
        before = [next(it)[0][:, 0].tolist() for _ in range(5)]
        state = ld.state_dict()
        del it
    with HDF5Loader(path, **kw) as ld:
        ld.load_state_dict(state)
        after = [x[:, 0].tolist() for x, _ in ld]
    assert before + after == whole
    comm.free()
