"""Sync mode: the all-reduced update equals one process training on the union batch."""

import copy
import time

import pytest
import torch

RANKS = [1, 2, 3, 4, 5]
HIERARCHICAL = {1: "0", 2: "0,1", 3: "0,1-2", 4: "0-1,2-3", 5: "0-1,2-4"}


def mlp(seed=0, dtype=torch.float64):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)
    ).to(dtype)


def make_opt(kind, model):
    first, rest = list(model[0].parameters()), list(model[2].parameters())
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return torch.optim.Adam(
        [
            {"params": first, "lr": 0.01},
            {"params": rest, "lr": 0.003, "betas": (0.8, 0.95)},
        ]
    )


def run_against_reference(groups, kind, backend="mpi", steps=5, clip=None, sched=False):
    import hybridagg

    topo = hybridagg.init(groups=groups)
    n, rank = topo.num_workers, topo.rank
    model = mlp()
    ref = copy.deepcopy(model)
    opt = hybridagg.DistributedOptimizer(
        make_opt(kind, model),
        model.named_parameters(),
        topo,
        bucket_mb=200 / 2**20,  # a few parameters per bucket: several buckets
        allreduce_backend=backend,
    )
    assert len(opt.reducer.buckets) >= 3
    ref_opt = make_opt(kind, ref)
    scheds = []
    if sched:
        scheds = [torch.optim.lr_scheduler.StepLR(o, 2, 0.5) for o in (opt, ref_opt)]
    g = torch.Generator().manual_seed(1234)  # the same draws on every rank
    for step in range(steps):
        sizes = torch.randint(0, 5, (n,), generator=g)
        sizes[step % n] = 0  # some rank has no samples in every step
        total = int(sizes.sum())
        x = torch.randn(total, 6, generator=g, dtype=torch.float64)
        y = torch.randn(total, 3, generator=g, dtype=torch.float64)
        lo = int(sizes[:rank].sum())
        mine = slice(lo, lo + int(sizes[rank]))
        opt.set_samples(int(sizes[rank]))
        opt.zero_grad()
        if sizes[rank] > 0:
            torch.nn.functional.mse_loss(model(x[mine]), y[mine]).backward()
        if clip:
            opt.synchronize()
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        if total > 0:
            ref_opt.zero_grad()
            torch.nn.functional.mse_loss(ref(x), y).backward()
            if clip:
                torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
            ref_opt.step()
        for s in scheds:
            s.step()
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12, msg=name)
    if sched:
        assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"] < 0.1
    return opt


@pytest.mark.mpi(ranks=RANKS, timeout=180)
@pytest.mark.parametrize("kind", ["sgd", "adam"])
@pytest.mark.parametrize(
    "layout",
    ["flat", "flat-fused", "flat-shm", "flat-ring", "flat-deferred", "hierarchical"],
)
def test_equals_single_process_on_union_batch(mpi_ranks, kind, layout, monkeypatch):
    from hybridagg.reduce import LastBucketKind as K

    # flat: the small model's one bucket is staged in shared memory with the
    # control vector and every rank reduces all of it; flat-fused: without
    # shared memory it rides in the control all-reduce. The other flat-*:
    # every bucket counts as large (the pipelined ring), and the last
    # bucket is deferred to synchronize(), where it is reduced with the control
    # vector as a count-weighted mean in shared memory (flat-shm) or by
    # messages (flat-ring), or, above the settled size, after the control
    # all-reduce by the pipelined ring (flat-deferred)
    large = layout in ("flat-shm", "flat-ring", "flat-deferred")
    if large:
        monkeypatch.setenv("HYBRIDAGG_RING_MIN_BYTES", "64")
    if layout in ("flat-ring", "flat-fused"):
        monkeypatch.setenv("HYBRIDAGG_SHM_REDUCE", "0")
    if layout == "flat-deferred":
        monkeypatch.setenv("HYBRIDAGG_SETTLED_MAX_BYTES", "1")
    groups = HIERARCHICAL[mpi_ranks] if layout == "hierarchical" else "world"
    opt = run_against_reference(groups, kind)
    reducer = opt.reducer
    expected = {
        "flat": K.STAGED,
        "flat-fused": K.FUSED,
        "flat-shm": K.SHARED_MEAN,
        "flat-ring": K.MEAN_RING,
        "flat-deferred": K.SETTLED,
        "hierarchical": K.EAGER,
    }[layout]
    assert reducer.last_bucket.kind is (expected if mpi_ranks > 1 else K.EAGER)
    # finish() releases the shared memory; the gradients keep their values
    grads = [None if p.grad is None else p.grad.clone() for p in reducer.params]
    opt.finish()
    for p, g in zip(reducer.params, grads, strict=True):
        assert (p.grad is None) == (g is None)
        if g is not None:
            assert torch.equal(p.grad, g)


@pytest.mark.mpi(ranks=[2, 3], timeout=120)
def test_bucket_thresholds_that_differ_between_ranks_are_an_error_everywhere(
    mpi_ranks, monkeypatch
):
    import hybridagg

    topo = hybridagg.init()
    if topo.rank == mpi_ranks - 1:
        monkeypatch.setenv("HYBRIDAGG_SETTLED_MAX_BYTES", "64")
    model = mlp()
    with pytest.raises(
        ValueError,
        match=rf"HYBRIDAGG_SETTLED_MAX_BYTES differs between rank 0 .* and "
        rf"rank {mpi_ranks - 1} \(64\)",
    ):
        hybridagg.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1),
            model.named_parameters(),
            topo,
        )


@pytest.mark.mpi(ranks=[2, 3], timeout=180)
@pytest.mark.parametrize("dissent", ["env", "room"])
@pytest.mark.parametrize("bucket", ["large", "small"])
def test_shared_memory_is_used_only_when_every_rank_agrees(
    mpi_ranks, dissent, bucket, monkeypatch
):
    """One rank that turns shared memory off, or lacks room, turns it off for all."""
    from mpi4py import MPI

    import hybridagg.collectives.shm
    from hybridagg.reduce import LastBucketKind as K

    if bucket == "large":
        monkeypatch.setenv("HYBRIDAGG_RING_MIN_BYTES", "64")
    if MPI.COMM_WORLD.Get_rank() == mpi_ranks - 1:
        if dissent == "env":
            monkeypatch.setenv("HYBRIDAGG_SHM_REDUCE", "0")
        else:
            monkeypatch.setattr(
                hybridagg.collectives.shm, "_room_for", lambda nbytes: False
            )
    opt = run_against_reference("world", "sgd", steps=3)  # the MPI paths work
    # large: the ring with the control vector; small: in the control all-reduce
    assert opt.reducer.last_bucket.kind is (
        K.MEAN_RING if bucket == "large" else K.FUSED
    )


@pytest.mark.mpi(ranks=[2, 3], timeout=180)
@pytest.mark.parametrize("layout", ["flat", "hierarchical"])
def test_torch_distributed_gloo_backend(mpi_ranks, layout):
    groups = "world" if layout == "flat" else HIERARCHICAL[mpi_ranks]
    run_against_reference(groups, "adam", backend="torch", steps=3)


@pytest.mark.mpi(ranks=3, timeout=120)
@pytest.mark.parametrize("groups", ["0,1-2", "world"])
def test_clipping_and_lr_scheduler_keep_working(groups, monkeypatch):
    # world: the last bucket in shared memory, clipped in place right after
    # synchronize() while the peers may just have copied from it
    if groups == "world":
        monkeypatch.setenv("HYBRIDAGG_RING_MIN_BYTES", "64")
    from hybridagg.reduce import LastBucketKind as K

    opt = run_against_reference(groups, "sgd", clip=0.05, sched=True)
    kind = opt.reducer.last_bucket.kind
    assert kind is (K.SHARED_MEAN if groups == "world" else K.EAGER)


@pytest.mark.mpi(ranks=2, timeout=120)
def test_first_bucket_overlaps_backward():
    import hybridagg

    topo = hybridagg.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(512, 1536),
        torch.nn.ReLU(),
        torch.nn.Linear(1536, 1536),
        torch.nn.ReLU(),
        torch.nn.Linear(1536, 1536),
        torch.nn.ReLU(),
        torch.nn.Linear(1536, 10),
    )
    opt = hybridagg.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01),
        model.named_parameters(),
        topo,
        bucket_mb=2.0,
    )
    assert len(opt.reducer.buckets) >= 4
    x, y = torch.randn(256, 512), torch.randint(0, 10, (256,))
    early = []
    for _ in range(3):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        topo.comms.world.barrier()
        loss.backward()
        backward_done = time.perf_counter()
        first = opt.reducer.buckets[0]
        # posted from a gradient hook, long before backward returned
        assert first.posted_at is not None and first.posted_at < backward_done
        opt.step()
        early.append(first.completed_at < backward_done)
    # hooks drive MPI progress: the first bucket finished during backward
    assert any(early), early


@pytest.mark.mpi(ranks=[2, 3], timeout=120)
@pytest.mark.parametrize("last_bucket", ["fused", "staged", "shm", "ring"])
def test_misuse_is_an_error_on_every_rank(mpi_ranks, last_bucket, monkeypatch):
    import hybridagg
    from hybridagg.reduce import LastBucketKind as K
    from hybridagg.reduce import MisuseError

    # the flags travel with the last bucket in every case
    if last_bucket in ("shm", "ring"):  # large: reduced after the control vector
        monkeypatch.setenv("HYBRIDAGG_RING_MIN_BYTES", "64")
    shm = last_bucket in ("shm", "staged")
    monkeypatch.setenv("HYBRIDAGG_SHM_REDUCE", str(int(shm)))
    topo = hybridagg.init()
    model = mlp()
    opt = hybridagg.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(), topo
    )
    assert (
        opt.reducer.last_bucket.kind
        is {
            "fused": K.FUSED,
            "staged": K.STAGED,
            "shm": K.SHARED_MEAN,
            "ring": K.MEAN_RING,
        }[last_bucket]
    )
    x, y = (
        torch.randn(4, 6, dtype=torch.float64),
        torch.randn(4, 3, dtype=torch.float64),
    )
    last = mpi_ranks - 1
    # step() without backward() on the last rank only
    opt.zero_grad()
    if topo.rank != last:
        torch.nn.functional.mse_loss(model(x), y).backward()
    with pytest.raises(
        MisuseError, match=rf"\[rank {last}\] step\(\) was called without"
    ):
        opt.step()
    # zero_grad() between backward() and step() on rank 0 only
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    if topo.rank == 0:
        opt.zero_grad()
    with pytest.raises(MisuseError, match=r"\[rank 0\] zero_grad\(\) was called"):
        opt.step()
    # backward() twice on the last rank only (the model's one small bucket is
    # reduced in synchronize(), so nothing is in flight when it happens)
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    if topo.rank == last:
        torch.nn.functional.mse_loss(model(x), y).backward()
    with pytest.raises(
        MisuseError, match=rf"\[rank {last}\] backward\(\) ran more often"
    ):
        opt.step()
    # after the errors the optimizer still works
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    with pytest.raises(ValueError, match="samples must be a number >= 0"):
        opt.set_samples(-1)


@pytest.mark.mpi(ranks=[2, 3], timeout=120)
def test_parameters_differing_across_ranks(mpi_ranks):
    import hybridagg

    topo = hybridagg.init()
    width = 8 if topo.rank == 0 else 9
    model = torch.nn.Linear(4, width)
    with pytest.raises(ValueError, match="parameters differ between rank 0 and rank 1"):
        hybridagg.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(), topo
        )


@pytest.mark.mpi(ranks=3, timeout=120)
def test_bad_arguments():
    import hybridagg

    topo = hybridagg.init()
    model = mlp()
    with pytest.raises(TypeError, match=r"torch\.optim\.Optimizer"):
        hybridagg.DistributedOptimizer(object(), model.named_parameters(), topo)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="mode must be one of"):
        hybridagg.DistributedOptimizer(sgd, model.named_parameters(), topo, mode="fast")
    with pytest.raises(ValueError, match="allreduce_backend"):
        hybridagg.DistributedOptimizer(
            sgd, model.named_parameters(), topo, allreduce_backend="nccl2"
        )
    with_server = hybridagg.init(servers=1)
    if with_server.is_worker:
        with pytest.raises(ValueError, match="mode='sync' uses no parameter servers"):
            hybridagg.DistributedOptimizer(sgd, model.named_parameters(), with_server)


@pytest.mark.mpi(ranks=2, timeout=120)
def test_the_factory_picks_the_synchronous_implementation():
    import hybridagg
    from hybridagg.optimizer import ServerOptimizer, SyncOptimizer

    topo = hybridagg.init()
    model = mlp()
    opt = hybridagg.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(), topo
    )
    assert type(opt) is SyncOptimizer and not isinstance(opt, ServerOptimizer)
    assert isinstance(opt, hybridagg.DistributedOptimizer)
    assert isinstance(opt, torch.optim.Optimizer)
    # the server-side queries answer as sync mode has no servers
    assert not opt.should_stop and opt.last_staleness == 0 and opt.batch_advice == 0
    for call in (opt.pull_weights, opt.pull_state, opt.refresh_from_servers):
        with pytest.raises(ValueError, match="needs mode='hybrid' or 'async'"):
            call()
    with pytest.raises(ValueError, match="needs mode='hybrid' or 'async'"):
        opt.checkpointed(1)
    opt.finish()
    opt.finish()  # a second finish releases nothing twice


@pytest.mark.mpi(ranks=3, timeout=120)
def test_buffers_are_averaged_and_broadcasts_start_everyone_equal():
    import hybridagg

    topo = hybridagg.init()
    torch.manual_seed(topo.rank)  # deliberately different start on every rank
    model = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.BatchNorm1d(5))
    opt = hybridagg.DistributedOptimizer(
        torch.optim.Adam(model.parameters(), lr=0.01), model=model, topology=topo
    )
    hybridagg.broadcast_parameters(model.state_dict(), root_rank=0, topology=topo)
    x = torch.randn(8, 4) + topo.rank
    opt.zero_grad()
    model(x).pow(2).mean().backward()
    # (a list: the object methods refuse a bare tensor, which is a buffer)
    before = topo.comms.world.allgather([model[1].running_mean.clone()])
    before = [b for (b,) in before]
    opt.step()
    hybridagg.broadcast_optimizer_state(opt, root_rank=0, topology=topo)
    everyone = topo.comms.world.allgather(
        ([p.detach().clone() for p in model.parameters()], model[1].running_mean)
    )
    for params, running in everyone:
        for a, b in zip(params, everyone[0][0], strict=True):
            torch.testing.assert_close(a, b)
        # each rank's running mean is now the average of what every rank saw
        torch.testing.assert_close(running, sum(before) / 3)
    assert not torch.allclose(before[0], before[2])
    assert opt.state_dict()["state"]


@pytest.mark.mpi(ranks=2, timeout=120)
def test_no_sync_accumulation_matches_reference():
    import hybridagg

    topo = hybridagg.init()
    model, ref = mlp(), mlp()
    opt = hybridagg.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(), topo
    )
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(7)
    xs = [torch.randn(2, 4, 6, generator=g, dtype=torch.float64) for _ in range(2)]
    ys = [torch.randn(2, 4, 3, generator=g, dtype=torch.float64) for _ in range(2)]
    opt.zero_grad()
    with opt.no_sync():
        torch.nn.functional.mse_loss(
            model(xs[0][topo.rank]), ys[0][topo.rank]
        ).backward()
    torch.nn.functional.mse_loss(model(xs[1][topo.rank]), ys[1][topo.rank]).backward()
    opt.step()
    ref_opt.zero_grad()
    for x, y in zip(xs, ys, strict=True):
        for r in range(2):
            (torch.nn.functional.mse_loss(ref(x[r]), y[r]) / 2).backward()
    ref_opt.step()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q)


@pytest.mark.mpi(ranks=[1, 3], timeout=90)
def test_horovod_style_primitives(mpi_ranks):
    import hybridagg

    topo = hybridagg.init()
    t = torch.full((10,), float(topo.rank))
    hybridagg.allreduce_(t, topo)
    assert torch.all(t == sum(range(mpi_ranks)) / mpi_ranks)
    h = hybridagg.allreduce_async_(torch.ones(3), topo, op="sum")
    assert torch.all(hybridagg.synchronize(h) == mpi_ranks)
    b = torch.full((4,), float(topo.rank))
    hybridagg.broadcast_(b, mpi_ranks - 1, topo)
    assert torch.all(b == mpi_ranks - 1)
    with pytest.raises(ValueError, match="op must be one of"):
        hybridagg.allreduce(t, topo, op="prod")


@pytest.mark.mpi(ranks=[2, 3], timeout=180)
@pytest.mark.parametrize("layout", ["flat", "hierarchical"])
def test_horovod_backend(mpi_ranks, layout):
    """Runs where Horovod is built (`make horovod`); skipped elsewhere."""
    pytest.importorskip("horovod.torch")
    groups = "world" if layout == "flat" else HIERARCHICAL[mpi_ranks]
    run_against_reference(groups, "adam", backend="horovod", steps=3)
