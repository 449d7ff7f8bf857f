"""``--amp`` and ``--accumulate``: autocast, the loss scale, passes per update."""

import json
import math
import time
from types import SimpleNamespace

import pytest
import torch
from train_helpers import output, run_train, summary

from hybridagg.slowdown import parse_slowdown
from hybridagg.train.config import TrainConfig
from hybridagg.train.config.changes import config_changes
from hybridagg.train.emulation import Pacer
from hybridagg.train.precision import LossScale, Precision
from hybridagg.train.worker.step import Stepper, pass_sizes

CPU = torch.device("cpu")


# ------------------------------------------------------------------ pure logic
def test_a_batch_splits_into_passes_of_nearly_equal_size():
    assert pass_sizes(10, 4) == [3, 3, 2, 2]
    assert pass_sizes(8, 4) == [2, 2, 2, 2]
    assert pass_sizes(2, 4) == [1, 1]  # never an empty pass
    assert pass_sizes(7, 1) == [7]
    assert pass_sizes(0, 3) == []
    for n in range(1, 40):
        for k in range(1, 9):
            sizes = pass_sizes(n, k)
            assert sum(sizes) == n and all(s > 0 for s in sizes)
            split = torch.arange(n).tensor_split(len(sizes))
            assert [t.numel() for t in split] == sizes


def test_the_loss_scale_follows_torch_grad_scaler():
    """The same scales as torch.amp.GradScaler, step by step, on one sequence
    of overflows (growth, back-off, a run broken by an overflow)."""
    overflows = [0, 0, 0, 1, 0, 0, 1, 1, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0]
    reference = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3)
    w = torch.zeros(1, requires_grad=True)
    sgd = torch.optim.SGD([w], lr=0.0)
    ours = LossScale(scale=2.0**10, growth_interval=3)
    for step, overflow in enumerate(overflows):
        reference.scale(torch.ones(()))  # (GradScaler's scale starts here)
        w.grad = torch.tensor([float("inf") if overflow else 1.0])
        reference.step(sgd)
        reference.update()
        ours.update(bool(overflow))
        assert ours.scale == reference.get_scale(), step
    # never grows past what a float32 holds (GradScaler's scale is one)
    top = LossScale(scale=2.0**127, growth_interval=1)
    top.update(False)
    assert top.scale == 2.0**127 and top.good_steps == 0


def test_the_loss_scale_state_round_trips_and_checks_its_values():
    a = LossScale()
    assert (a.scale, a.growth_factor, a.backoff_factor, a.growth_interval) == (
        65536.0,
        2.0,
        0.5,
        2000,
    )
    a.update(True)
    a.update(False)
    b = LossScale()
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    assert b == a
    for kw in (
        {"scale": 0.0},
        {"scale": float("inf")},
        {"growth_factor": 1.0},
        {"backoff_factor": 1.0},
        {"growth_interval": 0},
    ):
        with pytest.raises(ValueError, match=next(iter(kw))):
            LossScale(**kw)


def test_fp16_on_a_cpu_is_refused_naming_amp_and_device():
    with pytest.raises(
        ValueError, match=r"--amp fp16 needs a CUDA device.*--device cpu"
    ):
        Precision.for_run("fp16", CPU)
    with pytest.raises(ValueError, match="--amp must be one of none, bf16, fp16"):
        Precision("fp8", CPU)


def test_bf16_autocast_computes_in_bf16_and_keeps_fp32_weights():
    model = torch.nn.Linear(4, 3)
    x = torch.randn(5, 4)
    bf16 = Precision.for_run("bf16", CPU)
    assert bf16.loss_scale is None and bf16.state_dict() == {}
    with bf16.autocast():
        out = model(x)
        loss = torch.nn.functional.cross_entropy(out, torch.zeros(5, dtype=torch.long))
    assert out.dtype == torch.bfloat16 and loss.dtype == torch.float32
    loss.backward()
    assert model.weight.dtype == model.weight.grad.dtype == torch.float32
    plain = Precision.for_run("none", CPU)
    with plain.autocast():
        assert model(x).dtype == torch.float32
    assert plain.scale(loss) is loss
    plain.load_state_dict({"scale": 2.0, "good_steps": 1})  # nothing to load into


def test_accumulate_is_a_harmless_change_on_resume_but_amp_is_not():
    before = TrainConfig(data="x").as_dict()
    after = TrainConfig(data="x", accumulate=4, amp="bf16").as_dict()
    assert [(c.field, c.kind) for c in config_changes(before, after)] == [
        ("amp", "changed")
    ]


# ------------------------------------------------------- the step, multi-rank
class Batches:
    """Stands in for the loader and the epoch: the given batches, in order."""

    def __init__(self, batches):
        self.batches = list(batches)
        self.stats = SimpleNamespace(wait_seconds=0.0)

    @property
    def batches_left(self):
        return len(self.batches)

    def next_batch(self):
        return self.batches.pop(0) if self.batches else None


def make_models(dtype):
    torch.manual_seed(0)

    def mlp():
        return torch.nn.Sequential(
            torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)
        ).to(dtype)

    model, ref = mlp(), mlp()
    ref.load_state_dict(model.state_dict())
    return model, ref


def batch_of(step, rank, n, dtype):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(n, 6, generator=g, dtype=dtype), torch.randint(
        0, 3, (n,), generator=g
    )


def train_steps(topo, mode, sizes, accumulate, dtype, precision=None, boost=None):
    """Run ``len(sizes)`` steps of ``Stepper`` on this worker (``sizes[s][w]``:
    worker ``w``'s batch at step ``s``); returns the model, optimizer, results."""
    import hybridagg

    model, _ = make_models(dtype)
    opt = hybridagg.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        model.named_parameters(),
        topo,
        mode=mode,
        model=model,
        bucket_mb=100 / 2**20,  # several buckets
    )
    r = topo.rank
    batches = Batches(batch_of(s, r, sz[r], dtype) for s, sz in enumerate(sizes))
    factor = {"value": 1.0}

    def loss(out, y):  # (boost: a loss whose scaled gradient overflows)
        return torch.nn.functional.cross_entropy(out, y) * factor["value"]

    stepper = Stepper(
        model,
        opt,
        batches,
        Pacer(parse_slowdown(None), r, 0.0, time.perf_counter()),
        SimpleNamespace(local=lambda: 0.0),
        list(range(topo.num_workers)) if mode == "sync" else sorted(topo.groups[0]),
        loss=loss,
        precision=precision,
        accumulate=accumulate,
    )
    results = []
    for step in range(len(sizes)):
        factor["value"] = boost.get((step, r), 1.0) if boost else 1.0
        results.append(stepper.step(batches))
    return model, opt, results


def reference_steps(sizes, dtype, skip=()):
    """Plain torch: each step on the union of the workers' batches."""
    _, ref = make_models(dtype)
    sgd = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for step, sz in enumerate(sizes):
        if step in skip:
            continue
        parts = [batch_of(step, w, n, dtype) for w, n in enumerate(sz) if n]
        x = torch.cat([p[0] for p in parts])
        y = torch.cat([p[1] for p in parts])
        sgd.zero_grad()
        torch.nn.functional.cross_entropy(ref(x), y).backward()
        sgd.step()
    return ref


def assert_same(model, ref, **tol):
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.detach(), q.detach(), msg=name, **tol)


# per step, each worker's batch: uneven passes, a batch below --accumulate,
# and (several workers) a worker without a batch
SIZES = {
    1: [[10], [3], [7]],
    2: [[10, 7], [3, 9], [2, 0]],
    3: [[10, 7, 4], [3, 9, 1], [2, 0, 5]],
}

# (groups, servers) of each mode on 3 ranks: sync, 3 workers; hybrid, one
# group of two and a server; async, one worker and two servers (one worker
# alone keeps the order of pushes, and so the reference, deterministic)
LAYOUTS = {"sync": ("world", 0), "hybrid": ("world", 1), "async": ("each", 2)}


@pytest.mark.mpi(ranks=3, timeout=180)
@pytest.mark.parametrize("mode", ["sync", "hybrid", "async"])
def test_accumulated_passes_give_the_whole_batch_s_update(mode):
    """Stepper with --accumulate 4 equals plain SGD on the union of the
    workers' batches, step by step, in every mode; the step's loss is the
    batch's mean loss."""
    import hybridagg

    groups, servers = LAYOUTS[mode]
    topo = hybridagg.init(groups=groups, servers=servers)
    if topo.is_server:
        hybridagg.serve(topo)
        return
    sizes = SIZES[topo.num_workers]
    model, opt, results = train_steps(topo, mode, sizes, 4, torch.float64)
    ref = reference_steps(sizes, torch.float64)
    assert_same(model, ref, rtol=1e-10, atol=1e-12)
    r = topo.rank
    assert [x.samples for x in results] == [sz[r] for sz in sizes]
    assert [x.total_samples for x in results] == [sum(sz) for sz in sizes]
    assert not any(x.skipped or x.nonfinite for x in results)
    with torch.no_grad():
        _, first = make_models(torch.float64)
        x0, y0 = batch_of(0, r, sizes[0][r], torch.float64)
        loss0 = torch.nn.functional.cross_entropy(first(x0), y0).item()
    assert results[0].loss == pytest.approx(loss0, rel=1e-12)
    opt.finish()


@pytest.mark.mpi(ranks=3, timeout=180)
@pytest.mark.parametrize(
    ("mode", "last_bucket"), [("sync", "small"), ("sync", "ring"), ("hybrid", "small")]
)
def test_an_overflow_skips_the_same_step_everywhere(mode, last_bucket, monkeypatch):
    """A loss scale with the CPU as the device stand-in: one worker's scaled
    gradient overflows at step 1. Every rank of the reduction skips that
    step (sync: every worker; hybrid: the group, which pushes nothing), the
    scale halves on each, nothing halts, and the other steps equal plain
    float32 SGD without that step: the reduction carried true gradients
    (ring: the last bucket weighed raw in the ring, unscaled too)."""
    import hybridagg

    if last_bucket == "ring":
        monkeypatch.setenv("HYBRIDAGG_RING_MIN_BYTES", "64")
    groups, servers = LAYOUTS[mode]
    topo = hybridagg.init(groups=groups, servers=servers)
    if topo.is_server:
        hybridagg.serve(topo)
        return
    sizes = [[8, 6, 5], [5, 7, 6], [6, 6, 4], [4, 8, 7]]
    sizes = [sz[: topo.num_workers] for sz in sizes]
    scale = LossScale(scale=2.0**16, growth_interval=2)
    precision = Precision("none", CPU, loss_scale=scale)
    model, opt, results = train_steps(
        topo, mode, sizes, 2, torch.float32, precision, boost={(1, 1): 1e37}
    )
    assert [x.skipped for x in results] == [False, True, False, False]
    assert all(x.nonfinite is None for x in results) and opt.nonfinite is None
    if topo.rank == 1:  # its loss was finite: an overflow, not a fault
        assert math.isfinite(results[1].loss) and results[1].loss > 1e36
    assert precision.skipped == 1
    # 2**16, halved at the overflow, then two good steps: doubled
    assert scale.scale == 2.0**16 and scale.good_steps == 0
    if mode == "hybrid":
        assert opt.server_version == 3  # the servers saw three pushes
    ref = reference_steps(sizes, torch.float32, skip={1})
    assert_same(model, ref, rtol=1e-5, atol=1e-6)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    everyone = topo.comms.workers.allgather(flat.tolist(), what="parameters")
    assert all(other == everyone[0] for other in everyone)  # bitwise
    opt.finish()


def test_a_streaming_optimizer_refuses_a_loss_scale():
    """A streamed push sends buckets before the step's verdict: refused. (The
    check reads only whether the reducer streams, so the optimizer is made
    without MPI here.)"""
    from hybridagg.optimizer.server import ServerOptimizer

    opt = ServerOptimizer.__new__(ServerOptimizer)
    opt._reducer = SimpleNamespace(early_total=True, loss_scale=1.0)
    with pytest.raises(ValueError, match="stream_push=False"):
        opt.set_loss_scale(1024.0)
    with pytest.raises(ValueError, match="positive finite"):
        opt.set_loss_scale(float("nan"))


# ------------------------------------------------------------- end to end
@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    from hybridagg.data import convert_digits

    path = tmp_path_factory.mktemp("data") / "digits.h5"
    convert_digits(path, val_fraction=0.2, seed=0, progress=False)
    return str(path)


def test_bf16_with_accumulation_learns_the_digits_in_hybrid_mode(digits, tmp_path):
    """hybridagg train --amp bf16 --accumulate 3 (one group of two and a
    server, adaptive batches: the probe runs under autocast too) reaches
    the accuracy the other modes' tests ask for."""
    out, metrics = tmp_path / "summary.json", tmp_path / "metrics.jsonl"
    result = run_train(
        3,
        [
            "--data",
            digits,
            "--mode",
            "hybrid",
            "--groups",
            "0-1",
            "--amp",
            "bf16",
            "--accumulate",
            "3",
            "--adaptive-batch",
            "--epochs",
            "4",
            "--no-progress",
            "--eval-every",
            "10",
            "--target-accuracy",
            "0.85",
            "--summary",
            str(out),
            "--metrics",
            str(metrics),
        ],
    )
    assert result.returncode == 0, output(result)[-3000:]
    s = summary(out)
    assert s["final_accuracy"] >= 0.85, s
    assert (s["amp"], s["accumulate"], s["skipped_updates"]) == ("bf16", 3, 0)
    steps = [json.loads(line) for line in metrics.read_text().splitlines()]
    steps = [r for r in steps if r["event"] == "step"]
    assert steps and not any(r["skipped"] for r in steps)
    # a step's batch is the update's (the passes are inside it)
    assert sum(r["batch"] for r in steps) == s["samples"] == 4 * 1438
