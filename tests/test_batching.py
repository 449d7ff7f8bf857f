"""Adaptive batch sizes: the controller (pure) and under MPI."""

import json

import pytest
import torch
from train_helpers import output, run_train

from hybridagg.batching import BatchController, proportional_batches, shift_direction


# ------------------------------------------------------------------ pure logic
def test_proportional_split_keeps_the_total_and_respects_bounds():
    assert proportional_batches([1, 1, 1, 1], 128) == [32, 32, 32, 32]
    assert proportional_batches([4, 4, 1, 1], 100) == [40, 40, 10, 10]
    # worker 0 would get 80 but memory allows 50: the rest goes to the others
    # in proportion to their rates
    out = proportional_batches([8, 1, 1], 100, high=50)
    assert out[0] == 50 and sum(out) == 100 and out[1] == out[2] == 25
    # a floor: no worker below 10
    out = proportional_batches([100, 1], 60, low=10)
    assert out == [50, 10]
    with pytest.raises(ValueError, match="cannot hold"):
        proportional_batches([1, 1], 10, high=4)
    with pytest.raises(ValueError, match="rates must be positive"):
        proportional_batches([1, 0], 10)


def feed(ctrl, speeds, steps):
    """Emulated workers: a step of b samples takes b * s_i seconds."""
    decisions = []
    for _ in range(steps):
        d = ctrl.observe(
            [b * s for b, s in zip(ctrl.batches, speeds, strict=True)], ctrl.batches
        )
        if d is not None:
            decisions.append(d)
    return decisions


def test_dead_band_ignores_small_differences():
    # shift 0: the estimates are smoothed whatever the change (see the next test)
    ctrl = BatchController([32, 32], deadband=0.2, window=2, shift=0)
    assert feed(ctrl, [1.0, 1.15], 10) == []  # 7% apart: inside the dead-band
    assert ctrl.batches == [32, 32]
    d = feed(ctrl, [1.0, 2.0], 20)
    # the smoothed estimate of worker 1 goes 1.15 -> 1.575 -> 1.79 -> ...: the
    # first window past the band moves the batches; the later, smaller
    # corrections (to 42/22: 12%) stay inside the band
    assert [x.new for x in d] == [[39, 25]] and ctrl.batches == [39, 25]
    tight = BatchController([32, 32], deadband=0.05, window=2, shift=0)
    feed(tight, [1.0, 2.0], 20)
    assert tight.batches == [43, 21]
    # with change detection (the default) 1.15 -> 2.0 is a shift: worker 1's
    # estimate restarts at 2.0 and the first step after the change decides
    shifting = BatchController([32, 32], deadband=0.2, window=2)
    assert feed(shifting, [1.0, 1.15], 10) == []
    d = feed(shifting, [1.0, 2.0], 20)
    assert [x.new for x in d] == [[43, 21]] and shifting.estimate == [1.0, 2.0]


def test_batches_converge_to_speed_ratios_and_follow_a_change():
    ctrl = BatchController([32] * 4, deadband=0.05, smoothing=0.5, window=3)
    feed(ctrl, [1, 1, 4, 4], 30)
    b = ctrl.batches
    assert sum(b) == 128 and b[0] / b[2] == pytest.approx(4, rel=0.1)
    feed(ctrl, [4, 4, 1, 1], 30)  # the slow pair became the fast one
    b = ctrl.batches
    assert sum(b) == 128 and b[2] / b[0] == pytest.approx(4, rel=0.1)


def test_first_window_decides_early_then_windows_take_over():
    ctrl = BatchController([32] * 4, deadband=0.05, window=5, first_window=2)
    d = feed(ctrl, [1, 1, 4, 4], 2)
    assert len(d) == 1 and d[0].new == [51, 51, 13, 13]  # after 2 steps
    assert ctrl.steps_to_decide() == 5
    assert feed(ctrl, [1, 1, 4, 4], 4) == []  # balanced, and no window closed yet
    late = BatchController([32] * 4, deadband=0.05, window=5)
    assert feed(late, [1, 1, 4, 4], 4) == [] and len(feed(late, [1, 1, 4, 4], 1)) == 1
    with pytest.raises(ValueError, match="first_window"):
        BatchController([4, 4], first_window=0)


def test_controller_validates_its_settings():
    with pytest.raises(ValueError, match="deadband"):
        BatchController([4, 4], deadband=1.5)
    with pytest.raises(ValueError, match="cannot hold"):
        BatchController([4, 4], max_batch=3)
    with pytest.raises(ValueError, match="shift must be >= 0"):
        BatchController([4, 4], shift=-1)
    with pytest.raises(ValueError, match="shift_steps"):
        BatchController([4, 4], shift_steps=0)
    ctrl = BatchController([10, 10], max_batch=15)
    assert ctrl.set_total(24) == [12, 12]


def balanced(ctrl, speeds):
    """A controller that has settled on ``speeds`` (one window past its first)."""
    feed(ctrl, speeds, ctrl.first_window + ctrl.window)
    return ctrl


@pytest.mark.parametrize("shift", [0.5, 0.0])
def test_a_swap_of_speeds_is_followed_within_one_window(shift):
    # the headline's changing level: workers 2-3 four times slower, then 0-1;
    # shift 0 is the controller before change detection, whose smoothed
    # estimate still held half the old speeds after a window (32 each), and
    # took four windows to settle
    ctrl = balanced(
        BatchController([32] * 4, window=5, first_window=2, shift=shift), [1, 1, 4, 4]
    )
    assert ctrl.batches == [51, 51, 13, 13]
    d = feed(ctrl, [4, 4, 1, 1], ctrl.window)
    if shift == 0:
        assert [x.new for x in d] == [[32, 32, 32, 32]]
        return
    assert [x.new for x in d] == [[13, 13, 51, 51]]  # at the swap's first step
    assert ctrl.estimate == [4, 4, 1, 1]  # the new speeds, no old ones mixed in


def test_a_step_across_the_change_is_not_taken_for_the_new_speed():
    ctrl = balanced(BatchController([32] * 4, window=5, first_window=2), [1, 1, 4, 4])
    # the change lands mid-step: workers 0-1 half at 1 and half at 4
    d = feed(ctrl, [2.5, 2.5, 2.5, 2.5], 1)
    assert len(d) == 1 and ctrl.estimate == [2.5, 2.5, 2.5, 2.5]
    d = feed(ctrl, [4, 4, 1, 1], 1)  # the next step corrects it
    assert [x.new for x in d] == [[13, 13, 51, 51]]


def test_only_the_shifted_worker_restarts_its_estimate():
    ctrl = balanced(
        BatchController([32] * 3, deadband=0.05, window=4, first_window=1), [1, 1, 1]
    )
    feed(ctrl, [1, 1.1, 1], 1)  # within the band: no shift, no decision yet
    d = feed(ctrl, [3, 1.1, 1], 1)  # worker 0 three times slower
    assert len(d) == 1 and ctrl.estimate[0] == 3.0  # its shifted step alone
    # worker 1's estimate is smoothed with the window's two steps (1.1 twice)
    assert ctrl.estimate[1] == pytest.approx(0.5 * 1.1 + 0.5 * 1.0)
    assert ctrl.estimate[2] == 1.0


def test_noise_within_the_band_never_moves_the_batches():
    import random

    rng = random.Random(0)
    ctrl = balanced(BatchController([32] * 4, window=5, first_window=2), [1, 1, 4, 4])
    for _ in range(500):
        speeds = [s * rng.uniform(0.75, 1.3) for s in (1, 1, 4, 4)]
        assert feed(ctrl, speeds, 1) == []
    assert ctrl.batches == [51, 51, 13, 13]


def test_shift_steps_asks_for_steps_in_a_row_the_same_way():
    ctrl = balanced(
        BatchController([32] * 2, window=10, first_window=1, shift_steps=2), [1, 1]
    )
    assert feed(ctrl, [1, 3], 1) == []  # one slow step: an outlier so far
    assert feed(ctrl, [1, 1], 1) == []  # back in the band: the run is broken
    assert feed(ctrl, [1, 3], 1) == []
    assert feed(ctrl, [1, 0.3], 1) == []  # the other way: a new run
    assert feed(ctrl, [1, 3], 1) == []
    d = feed(ctrl, [1, 3], 1)  # twice in a row
    assert [x.new for x in d] == [[48, 16]] and ctrl.estimate == [1, 3]


def test_an_epochs_short_last_step_neither_counts_nor_breaks_a_run():
    ctrl = balanced(
        BatchController([32] * 2, window=10, first_window=1, shift_steps=2), [1, 1]
    )
    assert feed(ctrl, [1, 3], 1) == []
    # a last step of 3 samples whose fixed costs make it look 3x slower, and
    # worker 1's (15 of 32: under half a batch) 1.0: neither counts
    assert ctrl.observe([9.0, 15.0], [3, 15]) is None
    assert ctrl.shifted() == []
    d = feed(ctrl, [1, 3], 1)  # the second slow full step in a row
    assert len(d) == 1 and ctrl.estimate[1] == 3.0


def test_shift_direction():
    assert shift_direction(1.6, 1.0, 0.5) == 1
    assert shift_direction(1.5, 1.0, 0.5) == 0  # the band's edge is inside
    assert shift_direction(0.6, 1.0, 0.5) == -1
    assert shift_direction(0.7, 1.0, 0.5) == 0
    assert shift_direction(100.0, 1.0, 0.0) == 0  # off
    assert shift_direction(0.0, 1.0, 0.5) == 0  # nothing measured


# ------------------------------------------------------------- under MPI
def test_sync_batches_follow_speed_ratios_before_and_after_a_change(tmp_path):
    from hybridagg.data import convert_digits

    data = tmp_path / "digits.h5"
    convert_digits(data, val_fraction=0.2, seed=0, progress=False)
    metrics = tmp_path / "m.jsonl"
    # worker 1 three times slower, then worker 0 after 5 s
    result = run_train(
        2,
        [
            "--data",
            str(data),
            "--steps",
            "90",
            "--sample-ms",
            "2",
            "--no-progress",
            "--slowdown",
            "0:1,1:3@0;0:3,1:1@5",
            "--adaptive-batch",
            "--batch-deadband",
            "0.05",
            "--batch-window",
            "3",
            "--metrics",
            str(metrics),
        ],
    )
    assert result.returncode == 0, output(result)[-3000:]
    recs = [json.loads(line) for line in metrics.read_text().splitlines()]
    decisions = [r for r in recs if r["event"] == "batch" and r["rank"] == 0]
    before = [d for d in decisions if d["t"] < 5]
    after = [d for d in decisions if d["t"] > 5]
    assert before and after, decisions
    b0, b1 = before[-1]["new"]
    assert b0 / b1 == pytest.approx(3, rel=0.1) and b0 + b1 == 64
    b0, b1 = after[-1]["new"]
    assert b1 / b0 == pytest.approx(3, rel=0.1) and b0 + b1 == 64
    # both workers applied the same decisions at the same steps
    other = [
        (r["version"], r["new"])
        for r in recs
        if r["event"] == "batch" and r["rank"] == 1
    ]
    assert other == [(d["version"], d["new"]) for d in decisions]
    steps = [r for r in recs if r["event"] == "step" and r["rank"] == 0 and r["batch"]]
    assert steps[-1]["batch"] == b0  # the loader cut the new size


@pytest.mark.parametrize("probe", ["8", "0"])
def test_probe_splits_the_batch_before_the_first_step(tmp_path, probe):
    from hybridagg.data import convert_digits

    data = tmp_path / "digits.h5"
    convert_digits(data, val_fraction=0.2, seed=0, progress=False)
    metrics = tmp_path / "m.jsonl"
    result = run_train(
        2,
        [
            "--data",
            str(data),
            "--steps",
            "3",
            "--sample-ms",
            "2",
            "--no-progress",
            "--slowdown",
            "0:1,1:3",
            "--adaptive-batch",
            "--batch-deadband",
            "0.05",
            "--batch-window",
            "100",
            "--batch-first-window",
            "100",
            "--batch-probe",
            probe,
            "--metrics",
            str(metrics),
        ],
    )
    assert result.returncode == 0, output(result)[-3000:]
    recs = [json.loads(line) for line in metrics.read_text().splitlines()]
    decisions = [r for r in recs if r["event"] == "batch"]
    first = {
        r["rank"]: r["batch"] for r in recs if r["event"] == "step" and r["step"] == 1
    }
    if probe == "0":  # nothing measured yet: the even split
        assert decisions == [] and first == {0: 32, 1: 32}
        return
    assert {d["version"] for d in decisions} == {0} and len(decisions) == 2
    b0, b1 = decisions[0]["new"]
    assert b0 / b1 == pytest.approx(3, rel=0.1) and b0 + b1 == 64
    assert first == {0: b0, 1: b1}  # the very first step already has them


@pytest.mark.mpi(ranks=[2, 3], timeout=180)
def test_reduced_gradient_is_the_union_batch_gradient_as_batches_change(
    mpi_tmp_path, mpi_ranks
):
    import hybridagg
    from hybridagg.comm import Comm
    from hybridagg.data import HDF5Loader, convert_digits

    path = mpi_tmp_path / "digits.h5"
    comm = Comm(name="test")
    if comm.rank == 0:
        convert_digits(path, val_fraction=0.0, seed=0, progress=False)
    comm.barrier(what="file")
    topo = hybridagg.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 16), torch.nn.Tanh(), torch.nn.Linear(16, 10)
    ).double()
    hybridagg.broadcast_parameters(model.state_dict(), topology=topo)
    opt = hybridagg.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01), model=model, topology=topo
    )
    ctrl = BatchController([16] * comm.size, deadband=0.05, window=2)
    speeds = [1.0 + 2.0 * r for r in range(comm.size)]  # rank r is 1+2r times slower
    changed = 0
    with HDF5Loader(path, batch_size=16, comm=topo.comms.workers, normalize=True) as ld:
        for step, (x, y) in enumerate(ld):
            x = x.double()
            opt.set_samples(len(y))
            opt.zero_grad()
            if len(y):
                torch.nn.functional.cross_entropy(
                    model(x), y, reduction="mean"
                ).backward()
            opt.synchronize()
            # the union batch, from every rank's share
            xs = torch.cat(
                [torch.as_tensor(a) for (a,) in comm.allgather((x.numpy(),))]
            )
            ys = torch.cat(
                [torch.as_tensor(a) for (a,) in comm.allgather((y.numpy(),))]
            )
            ref = torch.nn.Sequential(
                torch.nn.Linear(64, 16), torch.nn.Tanh(), torch.nn.Linear(16, 10)
            ).double()
            ref.load_state_dict(model.state_dict())
            torch.nn.functional.cross_entropy(ref(xs), ys).backward()
            for p, q in zip(model.parameters(), ref.parameters(), strict=True):
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-9, atol=1e-12)
            opt.step()
            shared = opt.shared  # every rank's compute seconds and samples
            d = ctrl.observe(
                [s * n for s, n in zip(speeds, shared[:, 2].tolist(), strict=True)],
                shared[:, 2].tolist(),
            )
            if d is not None:
                ld.set_batch_sizes(d.new)
                changed += 1
            opt.share([0.0, 0.0, float(ld.batch_size), 0.0])
            if step > 40:
                break
    assert changed >= 1 and ctrl.batches[0] > ctrl.batches[-1]
    opt.finish()
    comm.free()
