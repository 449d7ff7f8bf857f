"""Emulated compute where it happens (hybridagg.train.pacing), on a fake clock.

The pacer's sleeps go to a fake clock, so the tests read the emulated time
at which each event happened exactly, without timing anything.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hybridagg.slowdown import Slowdown, fastest_ranks, format_slowdown, parse_slowdown
from hybridagg.train.emulation import Pacer
from hybridagg.train.pacing import LayerPacer, module_costs


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0
        self.sleeps: list[float] = []

    def now(self) -> float:
        return self.t

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.t += seconds


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(64, 128),
        nn.ReLU(),
        nn.Linear(128, 64),
        nn.ReLU(),
        nn.Linear(64, 10),
    )


def paced(
    model: nn.Module,
    clock: FakeClock,
    sample_ms: float = 1.0,
    spec: str | None = None,
    **kw,
):
    """A LayerPacer on ``model`` for rank 0, sleeping on ``clock``."""
    pacer = Pacer(parse_slowdown(spec), 0, sample_ms=sample_ms, start=0.0)
    costs = module_costs(model, torch.zeros(1, 64))
    return LayerPacer(model, pacer, costs, clock=clock.now, sleep=clock.sleep, **kw)


def grad_times(model: nn.Module, clock: FakeClock) -> dict[int, float]:
    """Emulated time at which each parameter's gradient becomes ready."""
    ready: dict[int, float] = {}
    for i, p in enumerate(model.parameters()):
        p.register_post_accumulate_grad_hook(
            lambda p, i=i: ready.__setitem__(i, clock.t)
        )
    return ready


def test_costs_are_each_modules_own_multiply_adds():
    costs = module_costs(mlp(), torch.zeros(1, 64))
    # addmm counts 2 per multiply-add; activations count nothing
    assert costs == {"1": 2 * 64 * 128, "3": 2 * 128 * 64, "5": 2 * 64 * 10}


def test_costs_inside_containers_that_are_never_called_count_once():
    from torch.utils.flop_counter import FlopCounterMode

    from hybridagg.train.architectures import GPT2

    model = GPT2((64,), 10, n_layer=2)  # blocks in a ModuleList, in a ModuleDict
    costs = module_costs(model, torch.zeros(1, 64))
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model.eval()(torch.zeros(1, 64))
    # every operation belongs to exactly one module: none is counted twice
    # (once in a block, once more in the model above the uncalled containers)
    assert sum(costs.values()) == counter.get_total_flops()
    assert "" not in costs and "transformer.h.0.attn.c_attn" in costs


def test_a_containers_own_work_is_not_its_childrens():
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = nn.Linear(8, 8)
            self.own = nn.Parameter(torch.ones(8, 8))

        def forward(self, x):
            return self.inner(x) @ self.own  # 2*8*8 of its own

    model = nn.Sequential(Block(), nn.Linear(8, 2))
    costs = module_costs(model, torch.zeros(1, 8))
    assert costs == {"0": 128.0, "0.inner": 128.0, "1": 32.0}


def test_counting_leaves_batch_norm_in_training_mode_untouched():
    model = nn.Sequential(
        nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.AdaptiveAvgPool2d(1)
    )
    before = model[1].running_mean.clone()
    costs = module_costs(model, torch.zeros(1, 1, 8, 8))  # one sample: BN needs eval
    assert model.training and torch.equal(model[1].running_mean, before)
    assert costs == {"0": 2 * 4 * 9 * 36}


def test_the_step_is_spent_in_forward_then_backward_layer_by_layer():
    model, clock = mlp(), FakeClock()
    ready = grad_times(model, clock)
    layers = paced(model, clock)
    layers.begin(30)  # 30 ms emulated
    out = model(torch.randn(30, 64))
    assert clock.t == pytest.approx(0.010)  # forward: a third of the step
    out.sum().backward()
    total = 3 * (16384 + 16384 + 1280)
    # the last layer's gradients first, after its own backward share ...
    assert ready[4] == ready[5] == pytest.approx(0.010 + 0.030 * 2 * 1280 / total)
    # ... the middle layer's next, the first layer's at the end of the step
    assert (
        ready[2]
        == ready[3]
        == pytest.approx(0.010 + 0.030 * 2 * (1280 + 16384) / total)
    )
    assert ready[0] == ready[1] == pytest.approx(0.030)
    compute, slept = layers.end()
    assert (compute, slept) == (pytest.approx(0.0), pytest.approx(0.030))
    assert clock.t == pytest.approx(0.030)


def test_real_compute_counts_toward_the_schedule():
    """Deadlines, not durations: a step lasts max(target, real compute)."""
    model, clock = mlp(), FakeClock()
    layers = paced(model, clock)
    model[1].register_forward_pre_hook(lambda *a: setattr(clock, "t", clock.t + 0.004))
    layers.begin(10)  # 10 ms emulated; the first layer really takes 4 ms
    model(torch.randn(10, 64)).sum().backward()
    compute, slept = layers.end()
    assert clock.t == pytest.approx(0.010)
    assert compute == pytest.approx(0.004) and slept == pytest.approx(0.006)

    model[3].register_forward_pre_hook(lambda *a: setattr(clock, "t", clock.t + 0.020))
    layers.begin(10)  # now the real compute (24 ms) exceeds the target
    model(torch.randn(10, 64)).sum().backward()
    compute, slept = layers.end()
    assert compute == pytest.approx(0.024) and slept == pytest.approx(0.0)


def test_a_bare_factor_stretches_each_stretch_of_compute_where_it_ran():
    model, clock = mlp(), FakeClock()
    layers = paced(model, clock, sample_ms=0.0, spec="0:3")
    model[1].register_forward_pre_hook(lambda *a: setattr(clock, "t", clock.t + 0.002))
    layers.begin(8)
    model(torch.randn(8, 64))
    # the first layer's 2 ms became 6 ms before the next layer ran
    assert clock.t == pytest.approx(0.006) and clock.sleeps == [pytest.approx(0.004)]
    compute, slept = layers.end()
    assert compute == pytest.approx(0.002) and slept == pytest.approx(0.004)


def test_progress_runs_while_the_rank_sleeps():
    model, clock = mlp(), FakeClock()
    calls = []
    layers = paced(model, clock, progress=lambda: calls.append(clock.t))
    layers.begin(30)
    model(torch.randn(30, 64)).sum().backward()
    layers.end()
    # in slices of at most a millisecond, from the first sleep to the last
    assert len(calls) >= 30 and max(clock.sleeps) <= 0.001 + 1e-12
    assert calls[0] < 0.001 and calls[-1] <= 0.030


def test_no_batch_no_emulation_and_free_removes_the_hooks():
    model, clock = mlp(), FakeClock()
    layers = paced(model, clock)
    layers.begin(0)
    model(torch.randn(4, 64)).sum().backward()
    assert layers.end() == (0.0, 0.0) and clock.t == 0.0
    model(torch.randn(4, 64))  # outside a step (validation): nothing slept
    assert clock.t == 0.0
    layers.free()
    layers.begin(30)
    model(torch.randn(30, 64)).sum().backward()
    assert clock.t == 0.0  # no hook left: the whole step is slept at its end
    layers.end()
    assert clock.t == pytest.approx(0.030)


def test_emulating_only_with_a_base_time_or_a_factor_for_this_rank():
    assert not Pacer(Slowdown(), 0, 0.0, 0.0).emulating
    assert Pacer(Slowdown(), 0, 1.0, 0.0).emulating
    assert Pacer(parse_slowdown("1:4"), 1, 0.0, 0.0).emulating
    assert not Pacer(parse_slowdown("1:4"), 0, 0.0, 0.0).emulating
    assert Pacer(parse_slowdown("0:1@0;0:2@30"), 0, 0.0, 0.0).emulating


def test_for_model_hooks_only_when_emulating():
    model = mlp()
    idle = LayerPacer.for_model(
        model, Pacer(Slowdown(), 0, 0.0, 0.0), torch.zeros(1, 64)
    )
    assert idle.shares == {} and idle._handles == []
    busy = LayerPacer.for_model(
        model, Pacer(Slowdown(), 0, 1.0, 0.0), torch.zeros(1, 64)
    )
    assert set(busy.shares) == {"1", "3", "5"} and len(busy._handles) == 3
    busy.free()


def test_the_fastest_ranks_are_the_lowest_factors_then_the_lowest_ranks():
    s = parse_slowdown("0:4,1:1,2:2,4:2")  # rank 3 is unnamed: factor 1
    assert fastest_ranks(s, 5, 2) == [1, 3]
    assert fastest_ranks(s, 5, 3) == [1, 2, 3]
    assert fastest_ranks(s, 5, 5) == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="count 6 must be within 1 and the 5"):
        fastest_ranks(s, 5, 6)
    with pytest.raises(ValueError, match="changing slowdown"):
        fastest_ranks(parse_slowdown("0:2@0;1:2@5"), 2, 1)


@pytest.mark.parametrize(
    "factors,spec",
    [
        ({}, ""),
        ({0: 1.0, 1: 1.0, 2: 4.0, 3: 4.0}, "0-1:1,2-3:4"),
        ({2: 2.0, 3: 2.0, 4: 2.0, 6: 2.0}, "2-4:2,6:2"),
        ({0: 1.5, 1: 1 / 3}, f"0:1.5,1:{1 / 3!r}"),
    ],
)
def test_a_formatted_slowdown_reads_back_as_the_same_factors(factors, spec):
    assert format_slowdown(factors) == spec
    back = parse_slowdown(spec)
    assert {r: back.factor(r) for r in factors} == factors
