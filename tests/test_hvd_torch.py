"""``hybridagg.torch``: Horovod's PyTorch API over hybridagg (sync mode here;
the hybrid job and the comparison with Horovod are in test_horovod_example.py)."""

import pytest
import torch

from hybridagg.torch.settings import JobSettings, settings_from_env


# --------------------------------------------------------------- pure logic
@pytest.mark.parametrize(
    ("env", "expect"),
    [
        ({}, JobSettings("sync", "world", 0)),
        ({"HYBRIDAGG_MODE": "hybrid"}, JobSettings("hybrid", "node", 1)),
        ({"HYBRIDAGG_MODE": "async"}, JobSettings("async", "each", 1)),
        (
            {
                "HYBRIDAGG_MODE": "hybrid",
                "HYBRIDAGG_GROUPS": "0-1,2",
                "HYBRIDAGG_SERVERS": "2",
            },
            JobSettings("hybrid", "0-1,2", 2),
        ),
        ({"HYBRIDAGG_MODE": " Sync "}, JobSettings("sync", "world", 0)),
    ],
)
def test_settings_from_the_environment(env, expect):
    assert settings_from_env(env) == expect


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"HYBRIDAGG_MODE": "fast"}, "mode must be one of sync, hybrid, async"),
        ({"HYBRIDAGG_SERVERS": "1"}, "HYBRIDAGG_SERVERS=1.*uses no parameter servers"),
        ({"HYBRIDAGG_MODE": "hybrid", "HYBRIDAGG_SERVERS": "0"}, "needs at least one"),
        ({"HYBRIDAGG_MODE": "hybrid", "HYBRIDAGG_SERVERS": "-1"}, "must be >= 0"),
        ({"HYBRIDAGG_MODE": "hybrid", "HYBRIDAGG_SERVERS": "two"}, "not an integer"),
        (
            {"HYBRIDAGG_MODE": "async", "HYBRIDAGG_GROUPS": "0-1,2"},
            "puts every worker in its own group",
        ),
    ],
)
def test_bad_settings_are_clear_errors(env, message):
    with pytest.raises(ValueError, match=message):
        settings_from_env(env)


def test_compression_maps_onto_the_wire_and_rounds_like_horovod():
    import hybridagg.torch as hvd

    assert hvd.Compression.none.wire == "fp32"
    assert hvd.Compression.fp16.wire == "fp16"
    x = torch.tensor([1.0 / 3.0, 70000.0], dtype=torch.float64)
    sent, ctx = hvd.Compression.fp16.compress(x)
    assert sent.dtype == torch.float16
    back = hvd.Compression.fp16.decompress(sent, ctx)
    assert back.dtype == torch.float64
    assert back[0] == torch.tensor(1.0 / 3.0).half().double()
    assert torch.isinf(back[1])  # beyond fp16's range, as in Horovod
    ints = torch.arange(3)
    assert hvd.Compression.fp16.compress(ints)[0] is ints


def test_queries_before_init_say_so():
    import hybridagg.torch as hvd

    assert not hvd.is_initialized()
    with pytest.raises(ValueError, match=r"not been initialized; use hvd\.init"):
        hvd.rank()
    assert hvd.mpi_built() is True
    assert isinstance(hvd.nccl_built(), bool)


# ------------------------------------------------------------ multi-rank
@pytest.fixture
def hvd():
    """hvd.init() in each rank of an ``mpi`` test (fixtures are also set up in
    the pytest process that launches the job, which must not start MPI)."""
    import hybridagg.torch as hvd
    from hybridagg.runtime import envvars

    if envvars.get_str("HYBRIDAGG_TEST_RESULTS") is None:
        yield None  # the launching process: the test body runs in the job
        return
    hvd.init()
    yield hvd
    hvd.shutdown()
    assert not hvd.is_initialized()


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3)
    ).double()


def _data(n, passes, seed=1):
    g = torch.Generator().manual_seed(seed)
    xs = torch.randn(passes, n, 4, 6, generator=g, dtype=torch.float64)
    ys = torch.randn(passes, n, 4, 3, generator=g, dtype=torch.float64)
    return xs, ys


def _loss(model, x, y):
    return torch.nn.functional.mse_loss(model(x), y)


@pytest.mark.mpi(ranks=[1, 2, 3], timeout=90)
def test_rank_queries_count_the_workers(hvd, mpi_ranks):
    assert hvd.is_initialized()
    assert hvd.size() == mpi_ranks
    assert 0 <= hvd.rank() < mpi_ranks
    assert hvd.local_size() == mpi_ranks  # one node
    assert hvd.local_rank() == hvd.rank()
    assert (hvd.cross_rank(), hvd.cross_size()) == (0, 1)
    hvd.init()  # a second call does nothing
    assert hvd.size() == mpi_ranks


@pytest.mark.mpi(ranks=[2, 3], timeout=120)
@pytest.mark.parametrize("op", ["average", "sum"])
def test_optimizer_equals_the_union_batch_with_accumulation(hvd, mpi_ranks, op):
    """backward_passes_per_step=2: two local passes, one reduction, with
    Horovod's result (the passes' gradients summed, the ranks' averaged or
    summed). The second pass reaches every parameter but 'extra', which only
    the first uses: its accumulated gradient is reduced all the same."""
    n, r = mpi_ranks, hvd.rank()
    model, ref = _model(), _model()
    extra = torch.nn.Parameter(torch.ones(3, dtype=torch.float64))
    ref_extra = torch.nn.Parameter(torch.ones(3, dtype=torch.float64))
    params = [*model.named_parameters(), ("extra", extra)]
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD([p for _, p in params], lr=0.1, momentum=0.9),
        named_parameters=params,
        backward_passes_per_step=2,
        op=hvd.Average if op == "average" else hvd.Sum,
    )
    ref_opt = torch.optim.SGD([*ref.parameters(), ref_extra], lr=0.1, momentum=0.9)
    xs, ys = _data(n, 2 * 3)
    for step in range(3):
        opt.zero_grad()
        first, second = 2 * step, 2 * step + 1
        (
            _loss(model, xs[first][r], ys[first][r])
            + (extra * xs[first][r][0, :3]).sum()
        ).backward()
        _loss(model, xs[second][r], ys[second][r]).backward()
        opt.step()
        ref_opt.zero_grad()
        weight = 1.0 if op == "sum" else 1.0 / n
        for k in range(n):
            loss = (
                _loss(ref, xs[first][k], ys[first][k])
                + (ref_extra * xs[first][k][0, :3]).sum()
            )
            loss = loss + _loss(ref, xs[second][k], ys[second][k])
            (loss * weight).backward()
        ref_opt.step()
        for p, q in zip(
            [*model.parameters(), extra], [*ref.parameters(), ref_extra], strict=True
        ):
            torch.testing.assert_close(p, q)


@pytest.mark.mpi(ranks=2, timeout=90)
def test_synchronize_then_clip_then_skip_synchronize(hvd):
    r = hvd.rank()
    model, ref = _model(), _model()
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.5),
        named_parameters=model.named_parameters(),
    )
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    xs, ys = _data(2, 2)
    for step in range(2):
        opt.zero_grad()
        (100 * _loss(model, xs[step][r], ys[step][r])).backward()
        opt.synchronize()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
        with opt.skip_synchronize():
            opt.step()
        ref_opt.zero_grad()
        for k in range(2):
            (100 * _loss(ref, xs[step][k], ys[step][k]) / 2).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
        ref_opt.step()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q)
    opt.zero_grad()
    _loss(model, xs[0][r], ys[0][r]).backward()
    with (
        pytest.raises(ValueError, match=r"needs optimizer\.synchronize"),
        opt.skip_synchronize(),
    ):
        opt.step()
    opt.step()  # the reduction under way completes; training goes on


@pytest.mark.mpi(ranks=2, timeout=90)
def test_optimizer_arguments_horovod_refuses_or_hybridagg_lacks(hvd):
    model = _model()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    named = list(model.named_parameters())
    with pytest.raises(ValueError, match="op=Adasum is not supported"):
        hvd.DistributedOptimizer(sgd, named_parameters=named, op=hvd.Adasum)
    with pytest.raises(ValueError, match="gradient_predivide_factor not supported"):
        hvd.DistributedOptimizer(
            sgd, named_parameters=named, op=hvd.Sum, gradient_predivide_factor=2.0
        )
    with pytest.raises(ValueError, match="does not name"):
        hvd.DistributedOptimizer(sgd, named_parameters=named[:1])
    with pytest.raises(ValueError, match="must be unique"):
        hvd.DistributedOptimizer(sgd, named_parameters=[named[0], named[0]])
    with pytest.raises(
        ValueError, match=r"Compression\.none or hvd\.Compression\.fp16"
    ):
        hvd.DistributedOptimizer(sgd, named_parameters=named, compression=object())
    with pytest.raises(ValueError, match="backward_passes_per_step must be a positive"):
        hvd.DistributedOptimizer(
            sgd, named_parameters=named, backward_passes_per_step=0
        )
    with pytest.raises(ValueError, match="only the global process set"):
        hvd.DistributedOptimizer(sgd, named_parameters=named, process_set=object())
    opt = hvd.DistributedOptimizer(
        sgd,
        named_parameters=named,
        compression=hvd.Compression.fp16,
        gradient_predivide_factor=2.0,
    )
    assert opt.wire == "fp16" and opt.mode == "sync"
    assert isinstance(opt, torch.optim.Optimizer)


@pytest.mark.mpi(ranks=[2, 3], timeout=90)
def test_collectives_with_horovod_signatures(hvd, mpi_ranks):
    n, r = mpi_ranks, hvd.rank()
    t = torch.tensor([float(r), 1.0])
    avg = hvd.allreduce(t, name="metric")
    assert torch.allclose(avg, torch.tensor([sum(range(n)) / n, 1.0]))
    assert torch.equal(t, torch.tensor([float(r), 1.0]))
    assert hvd.allreduce(t, op=hvd.Sum)[1].item() == n
    assert hvd.allreduce(t, average=False)[1].item() == n
    assert (
        hvd.allreduce(t, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5)[1] == n
    )
    assert hvd.allreduce(t, op=hvd.Max)[0].item() == n - 1
    third = hvd.allreduce(torch.tensor([1.0 / 3.0]), compression=hvd.Compression.fp16)
    assert third.dtype == torch.float32
    assert third.item() == torch.tensor(1.0 / 3.0).half().float().item()
    with pytest.raises(ValueError, match="op=Adasum is not supported"):
        hvd.allreduce(t, op=hvd.Adasum)
    with pytest.raises(ValueError, match="only the global process set"):
        hvd.allreduce(t, process_set=object())
    u = torch.ones(3)
    assert hvd.allreduce_(u, op=hvd.Sum) is u and torch.equal(
        u, torch.full((3,), float(n))
    )
    h = hvd.allreduce_async(torch.ones(2), op=hvd.Sum)
    assert torch.equal(hvd.synchronize(h), torch.full((2,), float(n)))
    gathered = hvd.allgather(torch.full((r + 1,), float(r)))
    assert gathered.tolist() == [float(k) for k in range(n) for _ in range(k + 1)]
    assert hvd.broadcast(torch.tensor([float(r)]), root_rank=n - 1).item() == n - 1
    assert hvd.broadcast_object({"epoch": r}, root_rank=1) == {"epoch": 1}
    assert hvd.allgather_object(r) == list(range(n))
    hvd.barrier()


@pytest.mark.mpi(ranks=2, timeout=90)
def test_broadcasts_start_every_worker_alike(hvd):
    r = hvd.rank()
    model = _model(seed=r)
    opt = torch.optim.Adam(model.parameters(), lr=0.01 * (r + 1))
    if r == 0:  # only rank 0 has optimizer state
        _loss(
            model,
            torch.ones(2, 6, dtype=torch.float64),
            torch.zeros(2, 3, dtype=torch.float64),
        ).backward()
        opt.step()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    assert torch.equal(hvd.broadcast(flat, root_rank=0), flat)
    assert opt.param_groups[0]["lr"] == 0.01
    assert len(opt.state) == len(list(model.parameters()))


@pytest.mark.mpi(ranks=[2, 3], timeout=120)
@pytest.mark.parametrize("spatial", [(), (2, 3)])
def test_sync_batchnorm_equals_batchnorm_of_the_union_batch(hvd, mpi_ranks, spatial):
    n, r = mpi_ranks, hvd.rank()
    sizes = [k + 2 for k in range(n)]  # a batch size of each rank's own
    g = torch.Generator().manual_seed(3)
    x_all = 2.0 + 3.0 * torch.randn(
        sum(sizes), 4, *spatial, generator=g, dtype=torch.float64
    )
    w_all = torch.randn(x_all.shape, generator=g, dtype=torch.float64)
    start = sum(sizes[:r])
    x = x_all[start : start + sizes[r]].clone().requires_grad_(True)
    bn = hvd.SyncBatchNorm(4).double()
    ref = (torch.nn.BatchNorm2d if spatial else torch.nn.BatchNorm1d)(4).double()
    with torch.no_grad():
        for m in (bn, ref):
            m.weight.copy_(torch.linspace(0.5, 2.0, 4))
            m.bias.copy_(torch.linspace(-1.0, 1.0, 4))
    for _ in range(2):  # twice: the running statistics move twice
        x.grad = None
        out = bn(x)
        (out * w_all[start : start + sizes[r]]).sum().backward()
        x_ref = x_all.clone().requires_grad_(True)
        out_ref = ref(x_ref)
        (out_ref * w_all).sum().backward()
        torch.testing.assert_close(out, out_ref[start : start + sizes[r]])
        torch.testing.assert_close(x.grad, x_ref.grad[start : start + sizes[r]])
    torch.testing.assert_close(bn.running_mean, ref.running_mean)
    torch.testing.assert_close(bn.running_var, ref.running_var)
    assert int(bn.num_batches_tracked) == 2
    for p, q in ((bn.weight, ref.weight), (bn.bias, ref.bias)):
        torch.testing.assert_close(hvd.allreduce(p.grad, op=hvd.Sum), q.grad)
    bn.eval()
    ref.eval()
    torch.testing.assert_close(bn(x.detach()), ref(x.detach()))


@pytest.mark.mpi(ranks=[2, 3], timeout=120)
def test_join_lets_workers_with_less_data_finish_first(hvd, mpi_ranks):
    """Worker r has r + 1 batches; each update averages the workers that still
    have data, and the one that joins last is the one with the most."""
    n, r = mpi_ranks, hvd.rank()
    model, ref = _model(), _model()
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        named_parameters=model.named_parameters(),
    )
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    xs, ys = _data(n, n)
    for step in range(r + 1):
        opt.zero_grad()
        _loss(model, xs[step][r], ys[step][r]).backward()
        opt.step()
    assert hvd.join() == n - 1
    for step in range(n):
        active = [k for k in range(n) if k + 1 > step]
        ref_opt.zero_grad()
        for k in active:
            (_loss(ref, xs[step][k], ys[step][k]) / len(active)).backward()
        ref_opt.step()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q)
    # training can go on after a join (all workers again)
    opt.zero_grad()
    _loss(model, xs[0][r], ys[0][r]).backward()
    opt.step()


@pytest.mark.mpi(ranks=2, timeout=90)
def test_a_nan_gradient_stops_every_rank(hvd):
    """Horovod would apply it; hybridagg applies nothing and says so, on every rank."""
    from hybridagg.runtime.outcomes import NonFiniteError

    model = _model()
    before = [p.detach().clone() for p in model.parameters()]
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        named_parameters=model.named_parameters(),
    )
    x = torch.ones(2, 6, dtype=torch.float64)
    if hvd.rank() == 1:
        x[0, 0] = float("nan")
    opt.zero_grad()
    model(x).sum().backward()
    with pytest.raises(
        NonFiniteError, match="update 1: the reduced gradient is not finite"
    ):
        opt.step()
    for p, q in zip(model.parameters(), before, strict=True):
        assert torch.equal(p, q)


@pytest.mark.mpi(ranks=2, timeout=60)
def test_bad_settings_fail_on_every_rank(monkeypatch):
    import hybridagg.torch as hvd

    monkeypatch.setenv("HYBRIDAGG_MODE", "hybrid")
    monkeypatch.setenv("HYBRIDAGG_SERVERS", "0")
    with pytest.raises(ValueError, match="needs at least one parameter server"):
        hvd.init()
    assert not hvd.is_initialized()
