"""Parameter server: the pure logic of its parts (no MPI).

Headers, the staleness bound, the lookahead bookkeeping, the checkpoint
schedule, the batch advice, the start-up spec and the flat copies.
"""

import numpy as np
import pytest
import torch

from hybridagg.ps import protocol as P
from hybridagg.ps.advice import BatchAdvisor
from hybridagg.ps.checkpoints import CheckpointSchedule
from hybridagg.ps.compensation import Compensation
from hybridagg.ps.flat import flatten_into, unflatten_from
from hybridagg.ps.groupweights import GROUP_HEAD_LEN, GroupHeader
from hybridagg.ps.lookahead import TAU_WEIGHT, Lookahead
from hybridagg.ps.spec import ServerSpec, server_specs
from hybridagg.ps.staleness import GroupBook, HeldReply
from hybridagg.ps.store import ShardStore


# ------------------------------------------------------------------ headers
def test_request_and_reply_headers_round_trip():
    assert P.request_len(3) == P.REQUEST_FIELDS + 3
    assert P.server_rank(num_groups=2, server=1) == 3
    push = P.Request(P.PUSH, 7, 32.0, P.FLAG_STOP, 0.125, (0.1, 0.01))
    head = push.encode(P.request_len(2))
    assert head.dtype == np.float64 and head.shape == (P.REQUEST_FIELDS + 2,)
    assert P.Request.decode(head) == push
    # rates not given are sent as zeros; kinds without arguments are zeros
    assert P.Request.decode(P.Request(P.PULL).encode(P.request_len(2))).lrs == (
        0.0,
        0.0,
    )
    reply = P.Reply(version=12, stop=True, staleness=3, lr_scale=0.25, checkpoint=2)
    buf = np.zeros(P.REPLY_LEN, dtype=np.float64)
    assert reply.encode_into(buf) is buf
    assert buf.tolist() == [12.0, 1.0, 3.0, 0.25, 2.0, 0.0, -1.0]  # -1: no NaN stop
    assert P.Reply.decode(buf) == reply


def test_group_header_round_trips_and_has_its_own_length():
    header = GroupHeader(
        stop=True,
        new_weights=True,
        staleness=2,
        lr_scale=0.5,
        checkpoint=4,
        advice=24.0,
        version=99,
    )
    head = torch.zeros(GROUP_HEAD_LEN, dtype=torch.float64)
    assert GroupHeader.decode(header.encode_into(head)) == header
    assert GROUP_HEAD_LEN == 8 and GROUP_HEAD_LEN != P.REQUEST_FIELDS
    # the non-finite stop names its group
    stopped = GroupHeader(stop=True, version=5, nonfinite=1)
    assert GroupHeader.decode(stopped.encode_into(head)) == stopped


# ------------------------------------------------------------------ staleness bound
def test_no_bound_never_holds_a_reply():
    book = GroupBook(2, bound=None)
    for _ in range(50):
        book.record(0, staleness=0)
    assert not book.too_far_ahead(0)


def test_bound_holds_the_group_ahead_of_the_slowest_running_one():
    book = GroupBook(3, bound=1, updates=[0, 0, 0])
    book.record(0, 0)
    assert not book.too_far_ahead(0)  # one ahead: within the bound
    book.record(0, 2)
    assert book.too_far_ahead(0)  # two ahead of groups 1 and 2
    assert book.max_staleness == 2 and book.updates == [2, 0, 0]
    # a pending checkpoint holds nobody: every group must reach it
    assert not book.too_far_ahead(0, checkpoint_pending=True)
    # finished groups do not count as the slowest
    book.finish(1)
    book.finish(2)
    assert not book.too_far_ahead(0) and book.all_done is False
    book.finish(0)
    assert book.all_done


def test_held_replies_are_released_when_the_slow_group_catches_up():
    book = GroupBook(3, bound=0)
    book.record(0, 0)
    book.record(2, 1)
    book.hold(HeldReply(2, 1, 0.5))
    book.hold(HeldReply(0, 0, 1.0))
    assert book.held_count == 2
    assert book.release() == []  # group 1 has not moved
    book.record(1, 0)
    assert book.release() == [HeldReply(0, 0, 1.0), HeldReply(2, 1, 0.5)]
    assert book.held == {}
    book.record(0, 0)
    book.hold(HeldReply(0, 3, 0.25))
    assert book.release(everyone=True) == [HeldReply(0, 3, 0.25)]
    assert book.held_count == 3


def test_a_resumed_book_continues_from_its_counts():
    counts = [4, 2]
    book = GroupBook(2, bound=1, updates=counts)
    book.record(1, 0)
    assert book.updates == [4, 3] and counts == [4, 2]  # a copy


# ------------------------------------------------------------------ lookahead
def test_lookahead_off_never_predicts():
    la = Lookahead(Compensation(), num_groups=2)
    la.observe(0, staleness=5, lrs=[0.1], samples=16, version=3)
    assert not la.enabled and la.tau == [1.0, 1.0] and not la.predicts(0)


def test_lookahead_tracks_running_staleness_and_undamped_rates():
    comp = Compensation(reference_batch=16, lookahead=True)
    la = Lookahead(comp, num_groups=3)
    assert la.horizon == 3.0 and la.tau == [2.0, 2.0, 2.0]  # G - 1: equal speeds
    assert not la.predicts(0)  # no push yet: no rates
    la.observe(0, staleness=4, lrs=[0.1, 0.01], samples=32, version=0)
    assert la.tau[0] == pytest.approx(2.0 + TAU_WEIGHT * (4 - 2.0))
    # the group's own rate, linearly scaled (32 / 16) but not damped
    assert la.rates[0] == pytest.approx([0.2, 0.02])
    assert la.predicts(0) and not la.predicts(1)
    for _ in range(30):  # a slow group drifts past the horizon
        la.observe(0, staleness=10, lrs=[0.1, 0.01], samples=32, version=0)
    assert la.tau[0] > la.horizon and not la.predicts(0)


def test_lookahead_needs_a_positive_running_staleness_within_the_horizon():
    la = Lookahead(Compensation(lookahead=True, lookahead_horizon=0.5), 1)
    la.observe(0, staleness=0, lrs=[0.1], samples=1, version=0)
    assert la.tau == [0.0] and not la.predicts(0)  # one group, never late
    la.observe(0, staleness=1, lrs=[0.1], samples=1, version=1)
    assert la.tau[0] == pytest.approx(TAU_WEIGHT) and la.predicts(0)
    la.observe(0, staleness=1, lrs=[0.1], samples=1, version=2)
    assert la.tau[0] > 0.5 and not la.predicts(0)


# ------------------------------------------------------------------ checkpoints
def test_checkpoints_are_requested_every_n_versions_and_at_the_budget():
    plan = CheckpointSchedule(every=3, enabled=True, budget=7)
    requested = []
    for version in range(1, 9):
        if plan.request_due(version):
            requested.append(version)
            plan.record_save(plan.requested, version)  # saved at once
    assert requested == [3, 6, 7] and plan.requested == 3
    assert plan.stop_flag(6) is False and plan.stop_flag(7) is True


def test_a_pending_checkpoint_is_not_requested_twice():
    plan = CheckpointSchedule(every=2, enabled=True)
    assert plan.request_due(2) and plan.pending and plan.requested == 1
    assert not plan.request_due(4)  # checkpoint 1 not saved yet
    plan.record_save(1, 4)
    assert plan.request_due(5) and plan.requested == 2
    assert plan.next_version == 6  # versions skipped meanwhile do not pile up


def test_a_resumed_schedule_continues_from_its_checkpoint_and_version():
    plan = CheckpointSchedule(every=10, enabled=True, version=25, restored=2)
    assert (plan.requested, plan.saved, plan.committed) == (2, 2, 2)
    assert plan.next_version == 30 and plan.saved_version == 25
    assert not plan.request_due(29) and plan.request_due(30)
    assert plan.requested == 3


def test_without_checkpoints_nothing_is_requested_but_a_stop_still_stops():
    plan = CheckpointSchedule(every=1, enabled=False, budget=5)
    assert not plan.request_due(5)
    assert plan.request_stop() and not plan.request_stop()
    assert plan.requested == 0 and plan.stop_flag(0)


def test_a_stop_request_asks_for_one_checkpoint():
    plan = CheckpointSchedule(every=None, enabled=True)
    assert plan.request_stop() and plan.requested == 1 and plan.stopping
    assert plan.stop_flag(0)  # told together with its checkpoint
    assert not plan.request_stop() and plan.requested == 1


def test_a_stop_during_a_pending_checkpoint_waits_for_it_then_takes_its_own():
    """The race behind a chain link that resumed with nothing left to train.

    Group 0 saved its part of checkpoint 1 and paused; the stop came before
    group 1 saved its part. Told at once, the stop reached group 0 only
    through its first push after checkpoint 1 (it had nothing left to save),
    so that push landed after the last checkpoint with a worker's part, and
    the servers' last checkpoint at the end held it, no worker's part and
    every group as finished: the resumed run trained nothing.
    """
    plan = CheckpointSchedule(every=40, enabled=True, budget=160)
    assert plan.request_due(40) and plan.requested == 1
    plan.pause(0, 1)
    assert plan.request_stop() and plan.stopping
    assert plan.requested == 1 and not plan.stop_flag(41)  # not told yet
    plan.pause(1, 1)
    assert plan.ready(2, done=set())
    assert sorted(plan.record_save(1, version=41)) == [0, 1]
    # now the stop's own checkpoint, told with the stop: every group saves it
    assert plan.requested == 2 and plan.pending and plan.stop_flag(41)
    assert not plan.request_due(80) and not plan.request_stop()
    plan.pause(0, 2)
    plan.pause(1, 2)
    assert plan.ready(2, done=set()) and plan.snapshot_number() == 2
    plan.record_save(2, version=43)
    assert (plan.requested, plan.saved, plan.saved_version) == (2, 2, 43)
    assert plan.stop_flag(43) and not plan.pending


def test_a_server_other_than_0_never_requests_a_stop_checkpoint():
    plan = CheckpointSchedule(every=40, enabled=True)
    plan.pause(0, 1)  # it learns checkpoint 1 from the leaders' CKPT
    plan.record_save(1, version=40)
    assert (plan.requested, plan.saved) == (1, 1) and not plan.stop_flag(40)


def test_a_snapshot_waits_for_every_running_leader():
    plan = CheckpointSchedule(every=None, enabled=True)
    assert not plan.ready(3, done=set())
    plan.pause(0, 1)
    assert not plan.ready(3, done=set())
    plan.pause(2, 1)
    assert not plan.ready(3, done=set()) and plan.ready(3, done={1})
    plan.pause(1, 1)
    assert plan.ready(3, done=set()) and plan.snapshot_number() == 1
    assert sorted(plan.record_save(1, version=40)) == [0, 1, 2]
    assert plan.paused == {} and (plan.saved, plan.saved_version) == (1, 40)
    assert plan.requested == 1  # a server other than 0 learns it here


def test_server_0_commits_what_every_server_saved_in_order():
    plan = CheckpointSchedule(every=None, enabled=True)
    plan.record_written(1, 0)
    plan.record_written(2, 1)
    assert plan.take_commits(num_servers=2) == []
    plan.record_written(2, 0)
    plan.record_written(1, 1)
    assert plan.take_commits(num_servers=2) == [1, 2]
    assert plan.committed == 2 and plan.take_commits(2) == []


# ------------------------------------------------------------------ batch advice
def test_batch_advice_follows_the_groups_speeds():
    options = {
        "initial": [16, 16],
        "deadband": 0.2,
        "smoothing": 1.0,
        "window": 2,
        "first_window": 1,
        "min_batch": 1,
    }
    seen = []
    advisor = BatchAdvisor(options, 2, on_batch=lambda v, d: seen.append((v, d.new)))
    assert (advisor.window, advisor.first_window) == (4, 2)  # per group x G
    assert advisor.advice(0) == advisor.advice(1) == 16.0
    advisor.observe(0, 0.0, 16, version=0)  # no time reported: ignored
    advisor.observe(0, 0.01, 16, version=1)
    assert advisor.decisions == []
    advisor.observe(1, 0.03, 16, version=2)  # the first window: two pushes
    assert advisor.advice(0) == 24.0 and advisor.advice(1) == 8.0
    assert seen == [(2, [24, 8])]
    assert advisor.decisions[0][:3] == (2, [16, 16], [24, 8])


def test_batch_advice_follows_a_change_of_speed_at_the_next_push():
    options = {
        "initial": [16, 16],
        "deadband": 0.2,
        "smoothing": 0.5,
        "window": 5,
        "first_window": 1,
        "min_batch": 1,
        "shift": 0.5,
        "shift_steps": 1,
    }
    advisor = BatchAdvisor(options, 2)
    advisor.observe(0, 0.01, 16, version=1)
    advisor.observe(1, 0.03, 16, version=2)
    assert [advisor.advice(g) for g in (0, 1)] == [24.0, 8.0]
    advisor.observe(0, 0.01, 24, version=3)  # no change: the window goes on
    assert len(advisor.decisions) == 1
    # group 0 turns three times slower, as slow as group 1: its next push
    # decides, 8 pushes before the window of 10 would have closed
    advisor.observe(0, 0.03, 24, version=4)
    assert [advisor.advice(g) for g in (0, 1)] == [16.0, 16.0]
    assert advisor.decisions[-1][0] == 4
    assert advisor.controller.estimate[0] == pytest.approx(0.03)


# ------------------------------------------------------------------ start-up spec
def test_server_specs_cut_the_model_and_give_buffers_to_server_0():
    params = [torch.nn.Parameter(torch.arange(float(n))) for n in (3, 4)]
    opt = torch.optim.SGD(
        [{"params": params[:1]}, {"params": params[1:], "lr": 0.5}], lr=0.1
    )
    flat = torch.cat([p.detach() for p in params])
    specs = server_specs(
        params,
        opt,
        flat,
        torch.ones(2, dtype=torch.float64),
        [(0, 4), (4, 7)],
        compensation=Compensation(),
        staleness_bound=1,
        max_updates=None,
        part_elems=2,
    )
    assert [s.shard_range for s in specs] == [(0, 4), (4, 7)]
    assert specs[0].shard.tolist() == [0.0, 1.0, 2.0, 0.0]
    assert specs[1].shard.tolist() == [1.0, 2.0, 3.0]
    assert specs[0].buffers.tolist() == [1.0, 1.0] and specs[1].buffers is None
    assert specs[0].group_of == [0, 1] and specs[0].numels == [3, 4]
    assert specs[1].hyper[1]["lr"] == 0.5 and "params" not in specs[1].hyper[1]
    stray = torch.nn.Parameter(torch.zeros(1))
    with pytest.raises(ValueError, match=r"parameters \[2\] are not in the optimizer"):
        server_specs(
            [*params, stray],
            opt,
            torch.zeros(8),
            None,
            [(0, 8)],
            compensation=Compensation(),
            staleness_bound=None,
            max_updates=None,
            part_elems=2,
        )


def _store(**changes) -> ShardStore:
    fields = {
        "optimizer": torch.optim.SGD,
        "defaults": {"lr": 0.1},
        "hyper": [{"lr": 0.1, "momentum": 0.0}],
        "group_of": [0],
        "numels": [6],
        "shard_range": (0, 6),
        "shard": np.arange(6.0),
        "buffers": None,
        "compensation": Compensation(),
        "staleness_bound": None,
        "max_updates": None,
        "part_elems": 4,
    }
    return ShardStore(ServerSpec(**{**fields, **changes}))


def test_shard_store_updates_part_by_part_and_restores_its_state():
    store = _store()
    assert store.parts == [(0, 3), (3, 6)] and store.version == 0
    store.grad.fill_(1.0)
    store.apply(1, [0.1], scale=2.0)  # only the second part moves
    assert store.flat.tolist() == pytest.approx([0, 1, 2, 2.8, 3.8, 4.8])
    saved = store.state()
    store.apply(0, [0.1], scale=1.0)
    store.load(saved)
    assert store.flat.tolist() == pytest.approx([0, 1, 2, 2.8, 3.8, 4.8])
    with pytest.raises(
        ValueError, match="checkpointed shard has 6 elements, this server's shard 7"
    ):
        _store(numels=[7], shard_range=(0, 7), shard=np.zeros(7)).load(saved)


def test_shard_store_skip_update_leaves_the_weights():
    store = _store(skip_update=True)
    store.grad.fill_(1.0)
    store.apply(0, [0.1], scale=1.0)
    assert store.flat.tolist() == list(np.arange(6.0))


# ------------------------------------------------------------------ flat copies
def test_flat_copies_keep_model_order_and_zero_missing_gradients():
    params = [torch.ones(2, 2), torch.full((3,), 2.0)]
    flat = torch.full((7,), -1.0)
    flatten_into(flat, [None, params[1]], like=params)
    assert flat.tolist() == [0, 0, 0, 0, 2, 2, 2]
    flatten_into(flat, params)
    assert flat.tolist() == [1, 1, 1, 1, 2, 2, 2]
    out = [torch.zeros(2, 2, requires_grad=True), torch.zeros(3)]
    unflatten_from(torch.arange(7.0), out)
    assert out[0].tolist() == [[0, 1], [2, 3]] and out[1].tolist() == [4, 5, 6]


def test_a_streamed_push_sends_every_part_once_from_the_bucket_that_completes_it():
    from hybridagg.ps.shards import part_ranges, shard_ranges
    from hybridagg.ps.streaming import bucket_ranges, plan_stream

    numels = [5, 3, 7, 2, 6]  # 23 elements
    # buckets in the reducer's order: the last parameters first
    buckets = bucket_ranges(numels, [[4, 3], [2], [0, 1]])
    assert buckets == [(15, 23), (8, 15), (0, 8)]
    parts = [
        [(lo + a, lo + b) for a, b in part_ranges(hi - lo, 3)]
        for lo, hi in shard_ranges(23, 2)
    ]
    plan = plan_stream(parts, buckets)
    planned = sorted((p.server, p.index) for row in plan for p in row)
    assert planned == sorted(
        (s, i) for s, row in enumerate(parts) for i in range(len(row))
    )
    for b, row in enumerate(plan):
        # within a bucket, backward order: the last parameters first
        assert [p.lo for p in row] == sorted((p.lo for p in row), reverse=True)
        for p in row:
            touched = [
                k for k, (lo, hi) in enumerate(buckets) if lo < p.hi and p.lo < hi
            ]
            assert b == max(touched)  # sent once every bucket it covers is final
            assert p.direct == (len(touched) == 1)
            # the pieces, read from the buckets in model order, are the part
            flat = [buckets[k][0] + i for k, a, z in p.pieces for i in range(a, z)]
            assert flat == list(range(p.lo, p.hi))
    assert any(not p.direct for row in plan for p in row)
    with pytest.raises(ValueError, match="not a contiguous run"):
        bucket_ranges(numels, [[4, 2], [3], [0, 1]])
    with pytest.raises(ValueError, match="not covered"):
        plan_stream(parts, buckets[:2])
