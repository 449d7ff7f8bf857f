"""The loader's parts on their own, in the pytest process (no MPI, no files)."""

import dataclasses
import gc
import threading
import time

import numpy as np
import pytest
import torch

from hybridagg.data.files import choose_driver
from hybridagg.data.format import SplitInfo
from hybridagg.data.options import LoaderOptions, resolve_paths
from hybridagg.data.parts import PartAttribute
from hybridagg.data.position import PassPosition
from hybridagg.data.readahead import STOP, ReadAhead, read_ahead_threads
from hybridagg.data.share_policy import (
    DynamicShares,
    StaticShares,
    checked_batch_sizes,
)
from hybridagg.data.shares import EpochPlan
from hybridagg.data.split import WorkerView, agree_split
from hybridagg.data.stats import LoaderStats
from hybridagg.runtime import envvars


# ------------------------------------------------------------------ options
def test_options_normalise_their_values(tmp_path):
    opts = LoaderOptions(
        paths=tmp_path / "a.h5",
        batch_size=np.int64(8),
        batch_sizes=(np.int32(8), 4),
        shuffle=0,
        device="cpu",
        timeout=3,
    )
    assert opts.paths == [str(tmp_path / "a.h5")]
    assert type(opts.batch_size) is int and opts.batch_sizes == [8, 4]
    assert opts.shuffle is False and opts.device == torch.device("cpu")
    assert opts.timeout == 3.0 and isinstance(opts.timeout, float)
    # the defaults are HDF5Loader's; the timeout comes from the environment
    plain = LoaderOptions(paths=["a.h5", "b.h5"], batch_size=1)
    assert (plain.shares, plain.window_blocks, plain.prefetch) == ("static", 8, 4)
    assert plain.timeout == envvars.get_float("HYBRIDAGG_TIMEOUT")
    with pytest.raises(dataclasses.FrozenInstanceError):
        plain.batch_size = 2


@pytest.mark.parametrize(
    ("kwargs", "etype", "pattern"),
    [
        ({"batch_size": 0}, ValueError, "batch_size must be >= 1, got 0"),
        ({"batch_size": 2.5}, TypeError, "batch_size must be an int"),
        ({"batch_size": True}, TypeError, "batch_size must be an int, got True"),
        ({"seed": -1}, ValueError, "seed must be >= 0"),
        ({"epoch": -2}, ValueError, "epoch must be >= 0"),
        ({"window_blocks": 0}, ValueError, "window_blocks must be >= 1"),
        ({"prefetch": -1}, ValueError, "prefetch must be >= 0"),
        ({"prefetch": "4"}, TypeError, "prefetch must be an int"),
        ({"shares": "greedy"}, ValueError, "shares must be 'static' or 'dynamic'"),
        ({"driver": "nfs"}, ValueError, "driver must be 'auto', 'mpio' or 'posix'"),
        ({"driver": "mpio"}, ValueError, "driver='mpio' needs"),
        ({"paths": []}, TypeError, "file name or a non-empty list"),
        ({"paths": ["a.h5", 3]}, TypeError, "must be str or os.PathLike"),
        ({"batch_sizes": ["x"]}, ValueError, "invalid literal"),
    ],
)
def test_options_refuse_bad_values(kwargs, etype, pattern):
    with pytest.raises(etype, match=pattern):
        LoaderOptions(**{"paths": "a.h5", "batch_size": 4, **kwargs})


def test_resolve_paths():
    assert resolve_paths("x.h5") == ["x.h5"]
    assert resolve_paths(("x.h5", "y.h5")) == ["x.h5", "y.h5"]
    with pytest.raises(TypeError):
        resolve_paths(None)


# ------------------------------------------------------- agreement on the split
def info(path="a.h5", length=100, shape=(4,), classes=5, norm=True):
    stats = np.zeros(1, np.float32) if norm else None
    return SplitInfo(
        path=path,
        split="train",
        samples_key="train/samples",
        labels_key="train/labels",
        length=length,
        sample_shape=shape,
        dtype=np.dtype(np.float32),
        num_classes=classes,
        block_samples=16,
        norm_mean=stats,
        norm_std=stats,
        labels=np.zeros(length, np.int64),
    )


def agree(infos_per_worker, options_per_worker, rank=0):
    views = [
        WorkerView.of(i, o)
        for i, o in zip(infos_per_worker, options_per_worker, strict=True)
    ]
    return agree_split(
        views,
        rank=rank,
        infos=infos_per_worker[rank],
        options=options_per_worker[rank],
    )


def test_agreement_gathers_batch_sizes_and_sees_other_paths():
    opts = [
        LoaderOptions(paths="a.h5", batch_size=8),
        LoaderOptions(paths="copy/a.h5", batch_size=3),
    ]
    split = agree([[info()], [info()]], opts, rank=1)
    assert split.batch_sizes == [8, 3] and split.total == 100
    assert split.lengths == [100] and not split.paths_agree
    assert split.first.block_samples == 16 and len(split.labels) == 1
    same = agree([[info()], [info()]], [opts[0], opts[0]])
    assert same.paths_agree


def test_agreement_refuses_other_data_and_bad_batch_sizes():
    opts = LoaderOptions(paths="a.h5", batch_size=8)
    with pytest.raises(ValueError, match=r"worker 1 sees split 'train' .* 90 samples"):
        agree([[info()], [info(length=90)]], [opts, opts])
    with pytest.raises(ValueError, match="worker 1 sees"):
        agree([[info()], [info(shape=(5,))]], [opts, opts])
    given = [
        LoaderOptions(paths="a.h5", batch_size=8, batch_sizes=[8, 8]),
        LoaderOptions(paths="a.h5", batch_size=8, batch_sizes=[8, 9]),
    ]
    with pytest.raises(ValueError, match="same list on every worker"):
        agree([[info()], [info()]], given)
    wrong = LoaderOptions(paths="a.h5", batch_size=8, batch_sizes=[4, 8])
    with pytest.raises(ValueError, match="this worker's batch_size at index 0"):
        agree([[info()], [info()]], [wrong, wrong])
    assert agree([[info()], [info()]], [wrong, wrong], rank=1).batch_sizes == [4, 8]


def test_agreement_checks_the_batch_against_the_split():
    big = LoaderOptions(paths="a.h5", batch_size=60)
    with pytest.raises(ValueError, match=r"global batch of 120 samples .*100 samples"):
        agree([[info()], [info()]], [big, big])
    dynamic = LoaderOptions(paths="a.h5", batch_size=60, shares="dynamic")
    assert agree([[info()], [info()]], [dynamic, dynamic]).total == 100
    alone = LoaderOptions(paths="a.h5", batch_size=101, shares="dynamic")
    with pytest.raises(ValueError, match="batch_size 101 is larger"):
        agree([[info()]], [alone])
    norm = LoaderOptions(paths="a.h5", batch_size=4, normalize=True)
    with pytest.raises(ValueError, match="records no norm_mean"):
        agree([[info(norm=False)]], [norm])


# ------------------------------------------------------------ driver and threads
def test_driver_choice():
    auto = dict(with_comm=True, mpio=True, paths_agree=True)
    assert choose_driver("auto", **auto) == "mpio"
    assert choose_driver("auto", **{**auto, "with_comm": False}) == "posix"
    assert choose_driver("auto", **{**auto, "mpio": False}) == "posix"
    assert choose_driver("auto", **{**auto, "paths_agree": False}) == "posix"
    assert choose_driver("posix", **auto) == "posix"
    with pytest.raises(ValueError, match="name the same files"):
        choose_driver("mpio", **{**auto, "paths_agree": False})


def test_read_ahead_threads_only_where_mpi_allows():
    assert read_ahead_threads(4, thread_multiple=False, reader_calls_mpi=False)
    assert read_ahead_threads(4, thread_multiple=True, reader_calls_mpi=True)
    assert not read_ahead_threads(4, thread_multiple=False, reader_calls_mpi=True)
    assert not read_ahead_threads(0, thread_multiple=True, reader_calls_mpi=False)


# ------------------------------------------------------------------ read-ahead
def threads(name):
    return [t for t in threading.enumerate() if t.name == name]


@pytest.mark.parametrize("threaded", [False, True])
def test_read_ahead_hands_out_items_then_stop_and_closes(threaded):
    closed = []

    def gen():
        try:
            yield from range(5)
        finally:
            closed.append(True)

    ra = ReadAhead(threaded=threaded, depth=2, timeout=5.0, name="test-ra")
    ra.start(gen())
    assert [ra.next() for _ in range(5)] == list(range(5))
    assert ra.next() is STOP
    ra.stop()
    assert closed == [True] and not threads("test-ra")
    # stopped midway: the generator is closed, the thread is gone
    ra.start(gen())
    assert ra.next() == 0
    ra.stop()
    assert closed == [True, True] and not threads("test-ra")


@pytest.mark.parametrize("threaded", [False, True])
def test_read_ahead_raises_what_the_generator_raised(threaded):
    def gen():
        yield 1
        raise ValueError("truncated file")

    ra = ReadAhead(threaded=threaded, depth=1, timeout=5.0, name="test-raise")
    ra.start(gen())
    assert ra.next() == 1
    with pytest.raises(ValueError, match="truncated file"):
        ra.next()
    ra.stop()


def test_read_ahead_waits_are_bounded_and_a_dropped_one_stops_its_thread():
    def slow():
        while True:
            time.sleep(0.2)
            yield 0

    ra = ReadAhead(threaded=True, depth=1, timeout=0.05, name="test-slow")
    ra.start(slow())
    with pytest.raises(TimeoutError, match="no batch from the reader thread"):
        ra.next()
    assert threads("test-slow")
    del ra
    gc.collect()
    deadline = time.monotonic() + 5
    while threads("test-slow") and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not threads("test-slow")


# ------------------------------------------------------ position and statistics
def test_pass_position_counts_from_the_start_and_from_a_recut():
    pos = PassPosition()
    assert not pos.active
    pos.start()
    pos.advance(8)
    pos.advance(3)
    assert (pos.active, pos.consumed, pos.steps) == (True, 11, 2)
    pos.recut()
    assert (pos.consumed, pos.steps) == (0, 0) and pos.active
    pos.stop()
    assert not pos.active


def test_stats_record_batches():
    st = LoaderStats()
    st.record_batch(0.5, 8)
    st.record_batch(0.25, 3)
    assert (st.batches, st.samples, st.last_wait, st.max_wait) == (2, 11, 0.25, 0.5)
    assert st.wait_seconds == 0.75 and st.stall_fraction(1.5) == 0.5
    assert st.as_dict()["samples"] == 11


# ---------------------------------------------------------------- share policies
def plan(epoch=0, n=200):
    return EpochPlan([n], 16, 2, seed=3, epoch=epoch)


def rows_of(p, pieces):
    out = []
    for g, lo, hi in pieces:
        start = int(p.offsets[g])
        out += list(range(start + lo, start + hi))
    return out


def test_batch_sizes_are_checked_per_worker():
    assert checked_batch_sizes([np.int64(3), 4], 2) == [3, 4]
    with pytest.raises(ValueError, match="needs 2 positive entries"):
        checked_batch_sizes([3], 2)
    with pytest.raises(ValueError, match="needs 2 positive entries"):
        checked_batch_sizes([3, 0], 2)


def static(**kw):
    args = dict(comm=None, rank=0, workers=1, total=200, batch_sizes=[24])
    return StaticShares(**{**args, "drop_last": False, **kw})


def test_static_shares_one_worker_covers_the_epoch_and_counts_down():
    p, pos = plan(), PassPosition()
    policy = static()
    assert policy.steps_per_epoch() == 9  # 8 full batches of 24, one of 8
    assert static(drop_last=True).steps_per_epoch() == 8
    assert policy.batches_left(pos) is None  # outside a pass
    policy.begin_pass(p, 0)
    pos.start()
    assert rows_of(p, policy.pieces(p)) == list(range(200))
    assert policy.pass_steps() == 9 and policy.collective_calls(p) == p.n_windows
    pos.advance(24)
    assert policy.batches_left(pos) == 8
    assert not policy.moves_on_when_abandoned(0)


def test_static_shares_recut_and_resume_read_the_rest_once():
    p, pos = plan(), PassPosition()
    policy = static()
    assert not policy.set_batch_sizes([10], pos)  # between passes: no re-cut
    assert policy.batch_box == [10] and policy.batch_sizes == [10]
    policy.begin_pass(p, 0)
    pos.start()
    pos.advance(10)
    assert policy.set_batch_sizes([50], pos)  # mid-pass: the rest is cut again
    pos.recut()
    assert rows_of(p, policy.pieces(p)) == list(range(10, 200))
    assert policy.pass_steps() == 4 and policy.batch_box == [50]
    pos.advance(50)
    state = policy.state_dict(pos, 0)
    assert state["kind"] == "static" and state["steps_left"] == 3
    fresh = static()
    assert fresh.load_state_dict(state) == 0
    assert fresh.batch_sizes == [50] and fresh.batch_box == [50]
    fresh.begin_pass(p, 0)
    assert rows_of(p, fresh.pieces(p)) == list(range(60, 200))
    assert fresh.pass_steps() == 3
    # a state saved between passes resumes at the start of its epoch
    assert policy.state_dict(PassPosition(), 4) == {
        "kind": "static",
        "epoch": 4,
        "shares": None,
    }
    with pytest.raises(ValueError, match="loader state has 2 workers, this job 1"):
        fresh.load_state_dict({**state, "shares": state["shares"] * 2})
    with pytest.raises(ValueError, match="loader state is for 'dynamic' shares"):
        fresh.load_state_dict({**state, "kind": "dynamic"})


def dynamic():
    return DynamicShares(
        comm=None,
        rank=0,
        workers=1,
        batch_sizes=[8],
        n_windows=plan().n_windows,
        epoch=0,
    )


def test_dynamic_shares_draw_every_window_once_per_epoch():
    policy = dynamic()
    for epoch in range(2):
        p = plan(epoch)
        policy.begin_pass(p, epoch)
        assert policy.pass_steps() is None and policy.steps_per_epoch() is None
        assert policy.batches_left(PassPosition()) is None
        assert sorted(rows_of(p, policy.pieces(p))) == list(range(200))
        assert policy.collective_calls(p) == 0
    assert not policy.set_batch_sizes([5], PassPosition())
    assert policy.batch_box == [5]
    policy.free()
    policy.free()  # a second call does nothing


def test_dynamic_shares_resume_hands_out_what_was_not_consumed():
    p, pos = plan(), PassPosition()
    policy = dynamic()
    policy.begin_pass(p, 0)
    pos.start()
    pieces = iter(policy.pieces(p))
    first = [next(pieces), next(pieces)]
    pos.advance(10)  # 10 rows of the first window went to the loop
    state = policy.state_dict(pos, 0)
    assert state["kind"] == "dynamic" and state["counter"] == 2
    assert policy.moves_on_when_abandoned(0)
    fresh = dynamic()
    assert fresh.load_state_dict(state) == 0
    fresh.begin_pass(p, 0)
    rest = rows_of(p, fresh.pieces(p))
    assert sorted(rows_of(p, first)[:10] + rest) == list(range(200))
    with pytest.raises(ValueError, match="loader state is for 'static' shares"):
        fresh.load_state_dict({**state, "kind": "static"})


# ------------------------------------------------------------ forwarded attributes
def test_part_attributes_read_through_and_refuse_writes():
    class Part:
        seed = 7

    class Owner:
        seed = PartAttribute("_part")

        def __init__(self):
            self._part = Part()

    owner = Owner()
    assert owner.seed == 7 and isinstance(Owner.seed, PartAttribute)
    with pytest.raises(AttributeError, match="seed is read-only"):
        owner.seed = 8
