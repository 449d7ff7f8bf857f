"""A pipelined group computes what one process computes.

The model has no BatchNorm and no dropout, so micro-batches change nothing
but rounding: the last stage's outputs and every stage's gradients must
equal a single-process model's on the same batch, at 2, 3 and 4 stages,
with micro-batches of uneven size, under both schedules.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hybridagg.pipeline import micro_sizes, model_layers, split_layers


def _model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(10, 16),
        nn.Tanh(),
        nn.Linear(16, 16),
        nn.GELU(),
        nn.Linear(16, 12),
        nn.LayerNorm(12),
        nn.Linear(12, 5),
    ).double()


def _bounds(layers: int, stages: int) -> list[int]:
    # uneven on purpose: the first stage holds one layer
    inner = [1] + [1 + (layers - 1) * k // (stages - 1) for k in range(1, stages - 1)]
    return [0, *inner[: stages - 1], layers] if stages > 1 else [0, layers]


def test_micro_sizes_split_like_tensor_split():
    for n in range(0, 20):
        for m in range(1, 7):
            want = (
                [len(p) for p in torch.arange(n).tensor_split(min(n, m))] if n else []
            )
            assert micro_sizes(n, m) == want


def test_split_layers_checks_bounds_and_model_layers_names_the_model():
    layers = model_layers(_model())
    assert [len(s) for s in split_layers(layers, [0, 1, 4, 7])] == [1, 3, 3]
    for bad in ([0, 7, 7], [1, 7], [0, 3, 6], [0]):
        with pytest.raises(ValueError, match="stage bounds"):
            split_layers(layers, bad)

    class Plain(nn.Module):
        def forward(self, x):
            return x

    with pytest.raises(TypeError, match="Plain has neither"):
        model_layers(Plain())


@pytest.mark.mpi(ranks=[2, 3, 4], timeout=120)
@pytest.mark.parametrize("name", ["1f1b", "gpipe"])
def test_pipelined_outputs_and_gradients_equal_one_process(mpi_ranks, name):
    from hybridagg.comm import Comm
    from hybridagg.pipeline import PipelineStage

    comm = Comm(name="pipeline-test")
    reference = _model()
    layers = model_layers(_model())
    bounds = _bounds(len(layers), comm.size)
    stage_module = split_layers(layers, bounds)[comm.rank]
    g = torch.Generator().manual_seed(1)
    x = torch.randn(11, 10, generator=g, dtype=torch.float64)
    y = torch.randint(0, 5, (11,), generator=g)
    stage = PipelineStage(
        stage_module,
        comm,
        sample=x[:1] if comm.rank == 0 else None,
        loss=nn.functional.cross_entropy,
        schedule=name,
    )
    for micro in (4, 3, 11, 1):  # 3,3,3,2 / 4,4,3 / ones / whole
        reference.zero_grad()
        want_out = reference(x)
        want_loss = nn.functional.cross_entropy(want_out, y)
        want_loss.backward()
        stage_module.zero_grad()
        loss, out, times = stage.step(
            (x, y) if comm.rank == 0 else None, micro, keep_outputs=True
        )
        if comm.rank == comm.size - 1:
            torch.testing.assert_close(out, want_out.detach(), rtol=1e-12, atol=1e-12)
            assert loss == pytest.approx(float(want_loss), rel=1e-12)
        else:
            assert loss is None and out is None
        ref_layers = list(reference.children())[
            bounds[comm.rank] : bounds[comm.rank + 1]
        ]
        ref_params = [p for m in ref_layers for p in m.parameters()]
        mine = list(stage_module.parameters())
        assert len(mine) == len(ref_params)
        for p, q in zip(mine, ref_params, strict=True):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12)
        assert times.wall_s >= times.compute_s >= 0
    # forward only (validation): the outputs, on the last stage
    got = stage.infer(x if comm.rank == 0 else None, 4)
    if comm.rank == comm.size - 1:
        with torch.no_grad():
            torch.testing.assert_close(got, reference(x), rtol=1e-12, atol=1e-12)
    else:
        assert got is None
    comm.free()


@pytest.mark.mpi(ranks=[2, 3], timeout=120)
def test_pipeline_with_integer_input_and_emulated_compute(mpi_ranks):
    from hybridagg.comm import Comm
    from hybridagg.pipeline import PipelineStage, StagePace

    comm = Comm(name="pipeline-int")
    torch.manual_seed(3)
    model = nn.Sequential(
        nn.Embedding(20, 8),
        nn.Flatten(),
        nn.Linear(24, 16),
        nn.ReLU(),
        nn.Linear(16, 4),
    )
    layers = model_layers(model)
    bounds = [0, 2, 5] if comm.size == 2 else [0, 1, 3, 5]
    mine = split_layers(layers, bounds)[comm.rank]
    x = torch.randint(0, 20, (7, 3))
    y = torch.randint(0, 4, (7,))
    pace = StagePace(forward_s=0.002, backward_s=0.004)
    stage = PipelineStage(
        mine,
        comm,
        sample=x[:1] if comm.rank == 0 else None,
        loss=nn.functional.cross_entropy,
        pace=pace,
    )
    model.zero_grad()
    loss, _, times = stage.step((x, y) if comm.rank == 0 else None, 3)
    # each stage spends at least its emulated compute: 7 samples x 6 ms
    assert times.compute_s + times.pace_s >= 7 * 0.006 * 0.99
    want = nn.functional.cross_entropy(model(x), y)
    if comm.rank == comm.size - 1:
        assert loss == pytest.approx(float(want), rel=1e-6)
    ref = {id(p): p.grad.clone() for p in mine.parameters()}
    model.zero_grad()
    want.backward()
    for p in mine.parameters():
        torch.testing.assert_close(ref[id(p)], p.grad, rtol=1e-5, atol=1e-6)
    # an empty batch is a step with nothing to do, on every stage
    empty = (x[:0], y[:0]) if comm.rank == 0 else None
    assert stage.step(empty, 2)[0] is None
    comm.free()


@pytest.mark.mpi(ranks=3, timeout=60)
def test_a_bad_batch_is_the_same_error_on_every_stage():
    from hybridagg.comm import Comm
    from hybridagg.pipeline import PipelineStage

    comm = Comm(name="pipeline-bad")
    layers = model_layers(_model())
    mine = split_layers(layers, [0, 3, 5, 7])[comm.rank]
    x = torch.randn(4, 10, dtype=torch.float64)
    y = torch.zeros(4, dtype=torch.long)
    stage = PipelineStage(
        mine,
        comm,
        sample=x[:1] if comm.rank == 0 else None,
        loss=nn.functional.cross_entropy,
    )
    with pytest.raises(ValueError, match="stage 0, and only stage 0"):
        stage.step(None if comm.rank == 0 else (x, y), 2)
    cases = [
        ((x.float(), y), 2, "set up for \\(10,\\) torch.float64"),
        ((x[:, :9], y), 2, "set up for"),
        ((x, y[:3]), 2, "4 inputs and 3 labels"),
        ((x, y), 0, "micro_batches must be >= 1"),
    ]
    for batch, micro, message in cases:
        with pytest.raises(ValueError, match=message):
            stage.step(batch if comm.rank == 0 else None, micro)
    for batch, kind, message in (
        (x, TypeError, "as \\(inputs, labels\\)"),
        ((x, None), TypeError, "labels must be a tensor"),
        ((x, y), TypeError, "micro_batches must be an int"),
    ):
        with pytest.raises(kind, match=message):
            stage.step(batch if comm.rank == 0 else None, 2.5 if batch[1] is y else 2)
    # and the stages go on together after a refused batch
    loss, _, _ = stage.step((x, y) if comm.rank == 0 else None, 2)
    assert (loss is not None) == (comm.rank == comm.size - 1)
    comm.free()


@pytest.mark.mpi(ranks=3, timeout=60)
def test_a_bad_stage_is_the_same_error_on_every_stage_and_a_failed_step_ends_it():
    from hybridagg.comm import Comm
    from hybridagg.pipeline import PipelineStage

    comm = Comm(name="pipeline-setup", timeout=3.0)
    layers = model_layers(_model())
    mine = split_layers(layers, [0, 3, 5, 7])[comm.rank]
    x = torch.randn(4, 10, dtype=torch.float64)
    y = torch.zeros(4, dtype=torch.long)
    first = x[:1] if comm.rank == 0 else None
    ce = nn.functional.cross_entropy
    # one stage given another schedule: refused on every stage
    with pytest.raises(ValueError, match="must share a schedule"):
        PipelineStage(mine, comm, sample=first, loss=ce,
                      schedule="gpipe" if comm.rank == 1 else "1f1b")  # fmt: skip
    # a cut whose layers do not take their neighbour's output
    wrong = nn.Linear(7, 5).double() if comm.rank == 1 else mine
    with pytest.raises(RuntimeError, match="rank 1"):
        PipelineStage(wrong, comm, sample=first, loss=ce)

    # a step that fails half-way (the last stage's loss) ends the stages:
    # the others time out waiting for its gradients, then every stage
    # refuses the next call at once instead of pairing stale messages
    def bad_loss(out, labels):
        raise ValueError("this loss fails")

    stage = PipelineStage(mine, comm, sample=first, loss=bad_loss)
    with pytest.raises((ValueError, TimeoutError)):
        stage.step((x, y) if comm.rank == 0 else None, 2)
    comm.barrier(timeout=60)  # (the last stage failed at once, the others in 3 s)
    with pytest.raises(RuntimeError, match="an earlier call failed"):
        stage.step((x, y) if comm.rank == 0 else None, 2)
    comm.free()


def test_segments_are_the_union_of_every_groups_cuts():
    from hybridagg.pipeline import holders, segments

    bounds = [[0, 2, 7], [0, 7], [0, 1, 4, 7]]
    assert segments(bounds) == [(0, 1), (1, 2), (2, 4), (4, 7)]
    groups = [[0, 1], [2], [3, 4, 5]]
    assert holders(groups, bounds, (1, 2)) == [0, 2, 4]
    assert holders(groups, bounds, (4, 7)) == [1, 2, 5]
    with pytest.raises(ValueError, match="different depths"):
        segments([[0, 3], [0, 2, 4]])


@pytest.mark.mpi(ranks=[3, 4], timeout=120)
def test_groups_cut_differently_reduce_to_the_whole_batchs_gradient(mpi_ranks):
    """Data parallel across pipelined groups: uneven shares, different cuts."""
    from hybridagg.comm import Comm
    from hybridagg.pipeline import CrossGroupReducer, PipelineStage

    world = Comm(name="cross-groups")
    if world.size == 3:
        groups, bounds, shares = [[0], [1, 2]], [[0, 7], [0, 4, 7]], [4, 9]
    else:
        groups, bounds, shares = [[0, 1], [2, 3]], [[0, 2, 7], [0, 5, 7]], [10, 3]
    g = next(i for i, r in enumerate(groups) if world.rank in r)
    k = groups[g].index(world.rank)
    layers = model_layers(_model())
    mine = split_layers(layers, bounds[g])[k]
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(sum(shares), 10, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 5, (sum(shares),), generator=gen)
    lo = sum(shares[:g])
    xg, yg = x[lo : lo + shares[g]], y[lo : lo + shares[g]]
    group = world.split(g, k, name="group")
    stage = PipelineStage(
        mine,
        group,
        sample=xg[:1] if k == 0 else None,
        loss=nn.functional.cross_entropy,
    )
    reducer = CrossGroupReducer(world, groups, bounds, layers)
    mine.zero_grad()
    stage.step((xg, yg) if k == 0 else None, 3)
    reducer.allreduce(shares[g] / sum(shares))
    reference = _model()
    nn.functional.cross_entropy(reference(x), y).backward()
    ref = list(reference.children())[bounds[g][k] : bounds[g][k + 1]]
    for p, q in zip(
        mine.parameters(), [p for m in ref for p in m.parameters()], strict=True
    ):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12)
    reducer.free()
    group.free()
    world.free()


def test_layer_costs_sum_module_costs_per_pipeline_layer():
    from hybridagg.pipeline import layer_costs
    from hybridagg.train.architectures import GPT2
    from hybridagg.train.pacing import module_costs

    model = GPT2((64,), 10, n_layer=3)
    costs = module_costs(model, torch.zeros(1, 64))
    per_layer = layer_costs(model, costs)
    assert len(per_layer) == 5 and sum(per_layer) == pytest.approx(sum(costs.values()))
    # the three blocks are alike; the embedding and head are cheaper
    assert (
        per_layer[1] == per_layer[2] == per_layer[3] > max(per_layer[0], per_layer[4])
    )
    with pytest.raises(ValueError, match="does not have"):
        layer_costs(model, {"nope": 1.0})


def test_stage_pace_refuses_what_is_not_a_duration():
    from hybridagg.pipeline import StagePace

    with pytest.raises(TypeError, match="forward_s must be a number"):
        StagePace(True, 0.0)
    with pytest.raises(TypeError, match="backward_s must be a number"):
        StagePace(0.0, "1")
    with pytest.raises(ValueError, match="finite and >= 0"):
        StagePace(-1.0, 0.0)


@pytest.mark.mpi(ranks=2, timeout=60)
def test_the_reducer_refuses_groups_it_cannot_sum_over():
    from hybridagg.comm import Comm
    from hybridagg.pipeline import CrossGroupReducer

    world = Comm(name="cross-bad")
    layers = model_layers(_model())
    with pytest.raises(ValueError, match="distinct ranks"):
        CrossGroupReducer(world, [[0, 1], [1]], [[0, 3, 7], [0, 7]], layers)
    with pytest.raises(ValueError, match="bounds must rise strictly"):
        CrossGroupReducer(world, [[0], [1]], [[0, 7], [0, 6]], layers)
    with pytest.raises(ValueError, match="cut points for 2 stages"):
        CrossGroupReducer(world, [[0, 1]], [[0, 7]], layers)
    world.free()


@pytest.mark.mpi(ranks=[2, 3], timeout=60)
def test_neighbour_links_are_measured_once_and_the_same_on_every_stage(mpi_ranks):
    from hybridagg.comm import Comm
    from hybridagg.pipeline.probe import measure_link, neighbour_links

    comm = Comm(name="probe")
    links = neighbour_links(comm, nbytes=1 << 16, repeats=3)
    assert len(links) == comm.size - 1
    seen = comm.allgather([(x.latency_s, x.bandwidth_Bps) for x in links])
    assert all(s == seen[0] for s in seen)  # every stage holds the same links
    for x in links:
        # shared memory here: microseconds, and more than 10 MB/s
        assert 0 < x.latency_s < 0.05 and x.bandwidth_Bps > 1e7
    with pytest.raises(ValueError, match="another rank"):
        measure_link(comm, comm.rank)
    comm.free()
