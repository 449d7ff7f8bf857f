"""Parameter server: compensation, sharding, exactness, convergence, staleness, lifecycle."""

import resource
import sys
import textwrap
import time

import pytest
import torch

from hybridagg.ps.compensation import Compensation, damping, lookahead_factor, lr_scale
from hybridagg.ps.shards import pieces_of, shard_ranges


# ------------------------------------------------------------------ pure logic
def test_linear_scaling_with_warmup_and_damping():
    assert lr_scale(64, 0, reference_batch=32) == 2.0
    assert lr_scale(64, 0, reference_batch=None) == 1.0
    # warm-up ramps the scale from 1 to k over the given updates
    ramp = [lr_scale(128, u, reference_batch=32, warmup_updates=4) for u in range(6)]
    assert ramp == [1.0, 1.75, 2.5, 3.25, 4.0, 4.0]
    assert lr_scale(32, 10, 3, reference_batch=32) == 0.25  # 1 / (1 + 3)
    assert damping(3, "sqrt") == 0.5 and damping(7, "none") == 1.0
    assert Compensation(reference_batch=16).scale(8, 0, 1) == 0.25
    with pytest.raises(ValueError, match="damping rule"):
        damping(1, "exp")
    with pytest.raises(ValueError, match="staleness must be >= 0"):
        damping(-1)
    with pytest.raises(ValueError, match="reference_batch must be positive"):
        Compensation(reference_batch=0)
    with pytest.raises(ValueError, match="staleness damping must be one of"):
        Compensation(staleness="linear")


def test_lookahead_factor_sums_the_decaying_momentum():
    assert lookahead_factor(0.9, 0) == 0.0
    assert lookahead_factor(0.9, 1) == pytest.approx(0.9)
    assert lookahead_factor(0.9, 3) == pytest.approx(0.9 + 0.81 + 0.729)
    assert lookahead_factor(0.0, 5) == 0.0
    # a fractional running mean lies between its neighbours
    assert (
        lookahead_factor(0.9, 1) < lookahead_factor(0.9, 1.5) < lookahead_factor(0.9, 2)
    )
    with pytest.raises(ValueError, match="momentum must be in"):
        lookahead_factor(1.0, 2)
    with pytest.raises(ValueError, match="staleness must be >= 0"):
        lookahead_factor(0.9, -1)
    with pytest.raises(ValueError, match="lookahead_horizon must be >= 0"):
        Compensation(lookahead=True, lookahead_horizon=-1)


def test_shard_prediction_follows_each_pieces_momentum():
    """Parts cut parameters in pieces; each piece moves along its own buffer."""
    import numpy as np

    from hybridagg.ps.spec import ServerSpec
    from hybridagg.ps.store import ShardStore

    torch.manual_seed(0)
    ref = [torch.nn.Parameter(torch.randn(n, dtype=torch.float64)) for n in (5, 7, 3)]
    user = torch.optim.SGD(
        [{"params": ref[:1], "lr": 0.1, "momentum": 0.9}, {"params": ref[1:]}],
        lr=0.2,
        momentum=0.5,
    )
    flat0 = torch.cat([p.detach() for p in ref])
    spec = ServerSpec(
        shard=flat0.numpy().copy(),
        shard_range=(0, 15),
        part_elems=4,  # parts [0,4) [4,8) [8,12) [12,15): pieces straddle them
        optimizer=torch.optim.SGD,
        defaults=dict(user.defaults),
        hyper=[
            {k: v for k, v in g.items() if k != "params"} for g in user.param_groups
        ],
        group_of=[0, 1, 1],
        numels=[5, 7, 3],
        buffers=None,
        compensation=Compensation(),
        staleness_bound=None,
        max_updates=None,
    )
    shard = ShardStore(spec)
    lrs = [0.1, 0.2]
    for _ in range(3):
        grads = [torch.randn(p.numel(), dtype=torch.float64) for p in ref]
        for p, g in zip(ref, grads, strict=True):
            p.grad = g.clone()
        user.step()
        shard.grad.copy_(torch.cat(grads))
        for i in range(len(shard.parts)):
            shard.apply(i, lrs, 1.0)
    torch.testing.assert_close(shard.flat, torch.cat([p.detach() for p in ref]))
    tau, pred_lrs = 2.5, [0.3, 0.05]
    expected = torch.cat(
        [
            p.detach()
            - pred_lrs[gi]
            * lookahead_factor(mom, tau)
            * user.state[p]["momentum_buffer"]
            for p, gi, mom in zip(ref, [0, 1, 1], [0.9, 0.5, 0.5], strict=True)
        ]
    )
    for i, (a, b) in enumerate(shard.parts):
        out = shard.flat[a:b].clone()
        shard.predict(i, out, pred_lrs, tau)
        torch.testing.assert_close(out, expected[a:b], msg=f"part {i}")
    assert np.allclose(shard.flat.numpy(), torch.cat([p.detach() for p in ref]).numpy())


def test_shards_are_balanced_and_pieces_cover_the_model():
    assert shard_ranges(10, 3) == [(0, 4), (4, 7), (7, 10)]
    numels = [6, 1, 9]  # 16 elements, one tensor dominates
    covered = []
    for lo, hi in shard_ranges(16, 3):
        assert hi - lo in (5, 6)
        for piece in pieces_of(numels, lo, hi):
            covered.append((piece.param, piece.start, piece.stop))
            assert 0 <= piece.offset < hi - lo
    flat = [(p, i) for p, a, b in covered for i in range(a, b)]
    assert flat == [(p, i) for p, n in enumerate(numels) for i in range(n)]
    with pytest.raises(ValueError, match="cannot split"):
        shard_ranges(2, 3)


# ------------------------------------------------------------------ helpers
def mlp(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)
    ).double()


def make_opt(kind, model):
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return torch.optim.Adam(
        [
            {"params": model[0].parameters(), "lr": 0.01},
            {"params": model[2].parameters(), "lr": 0.003, "betas": (0.8, 0.95)},
        ]
    )


def exactness(kind, servers, steps=5):
    import hybridagg

    topo = hybridagg.init(groups="world", servers=servers)
    if topo.is_server:
        hybridagg.serve(topo)
        return
    n, rank = topo.num_workers, topo.rank
    model, ref = mlp(), mlp()
    opt = hybridagg.DistributedOptimizer(
        make_opt(kind, model),
        model.named_parameters(),
        topo,
        mode="hybrid",
        bucket_mb=200 / 2**20,
    )
    ref_opt = make_opt(kind, ref)
    g = torch.Generator().manual_seed(99)
    for step in range(steps):
        sizes = torch.randint(1, 5, (n,), generator=g)
        total = int(sizes.sum())
        x = torch.randn(total, 6, generator=g, dtype=torch.float64)
        y = torch.randn(total, 3, generator=g, dtype=torch.float64)
        lo = int(sizes[:rank].sum())
        mine = slice(lo, lo + int(sizes[rank]))
        opt.set_samples(int(sizes[rank]))
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x[mine]), y[mine]).backward()
        opt.step()
        ref_opt.zero_grad()
        torch.nn.functional.mse_loss(ref(x), y).backward()
        ref_opt.step()
        for p, q in zip(model.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12, msg=f"step {step}")
        assert opt.last_staleness == 0
    version = opt.finish()
    if rank == 0:
        assert version == steps
        for p, q in zip(model.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12)


@pytest.mark.mpi(ranks=[3, 4, 5], timeout=180)
@pytest.mark.parametrize("kind", ["sgd", "adam"])
@pytest.mark.parametrize("servers", [1, 2])
def test_hybrid_with_one_group_reproduces_sync(mpi_ranks, kind, servers):
    if mpi_ranks - servers < 1:
        pytest.skip("needs a worker")
    exactness(kind, servers)


def streamed_or_not(topo, stream, steps=4, wire="fp32"):
    """A few SGD-with-momentum steps of one group; returns (weights, parts sent early)."""
    import hybridagg

    if topo.is_server:
        hybridagg.serve(topo)
        return None, 0
    n, rank = topo.num_workers, topo.rank
    model = torch.nn.Sequential(
        torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)
    )
    torch.manual_seed(0)
    for p in model.parameters():
        torch.nn.init.normal_(p)
    opt = hybridagg.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
        model.named_parameters(),
        topo,
        mode="hybrid",
        bucket_mb=100 / 2**20,  # several buckets, parts across their bounds
        stream_push=stream,
        wire=wire,
    )
    streamed = opt._exchange.buckets is not None
    assert streamed == (stream and topo.is_leader)
    early = 0
    if streamed:  # count the parts sent before synchronize()
        sent = opt._exchange.bucket_final

        def counting(*args):
            nonlocal early
            before = opt._exchange.streaming
            before = 0 if before is None else before.sent
            sent(*args)
            early += opt._exchange.streaming.sent - before

        opt._exchange.bucket_final = counting
    g = torch.Generator().manual_seed(7)
    for _ in range(steps):
        sizes = torch.randint(1, 5, (n,), generator=g)
        x = torch.randn(int(sizes.sum()), 6, generator=g)
        y = torch.randn(int(sizes.sum()), 3, generator=g)
        lo = int(sizes[:rank].sum())
        mine = slice(lo, lo + int(sizes[rank]))
        opt.set_samples(int(sizes[rank]))
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x[mine]), y[mine]).backward()
        opt.step()
    opt.finish()
    return [p.detach().clone() for p in model.parameters()], early


@pytest.mark.mpi(ranks=[3, 4], timeout=180)
@pytest.mark.parametrize("servers", [1, 2])
def test_a_streamed_push_equals_an_unstreamed_one(mpi_ranks, servers, monkeypatch):
    """Bit for bit: the same divisions by the same totals, only sent earlier."""
    import hybridagg

    # parts of 5 floats: several per bucket, some across two buckets
    monkeypatch.setenv("HYBRIDAGG_PS_PART_BYTES", "20")
    topo = hybridagg.init(groups="world", servers=servers)
    plain, _ = streamed_or_not(topo, stream=False)
    streamed, early = streamed_or_not(topo, stream=True)
    if topo.is_server:
        return
    for a, b in zip(plain, streamed, strict=True):
        assert torch.equal(a, b)
    if topo.is_leader and topo.num_workers == 1:
        # a group of one pushes its buckets as backward fills them
        assert early > 0


@pytest.mark.mpi(ranks=[3, 4], timeout=240)
@pytest.mark.parametrize("servers", [1, 2])
def test_a_streamed_push_on_bf16_equals_an_unstreamed_one(
    mpi_ranks, servers, monkeypatch
):
    """Bit for bit on a compact wire: each part is rounded as its bucket
    becomes final, from bucket memory, with the residual an unstreamed push
    keeps for the same part; the server widens the same bits."""
    import hybridagg

    monkeypatch.setenv("HYBRIDAGG_PS_PART_BYTES", "20")
    topo = hybridagg.init(groups="world", servers=servers)
    exact, _ = streamed_or_not(topo, stream=False)
    plain, _ = streamed_or_not(topo, stream=False, wire="bf16")
    streamed, early = streamed_or_not(topo, stream=True, wire="bf16")
    if topo.is_server:
        return
    for a, b in zip(plain, streamed, strict=True):
        assert torch.equal(a, b)
    # the wire was used: bf16 replies (with residuals carried) moved the
    # weights elsewhere than the float32 run did
    assert any(not torch.equal(a, b) for a, b in zip(exact, plain, strict=True))
    if topo.is_leader and topo.num_workers == 1:
        assert early > 0


def least_squares_run(
    mode,
    groups,
    servers,
    slowdown,
    steps=60,
    bound=None,
    overlap=False,
    momentum=0.0,
    lookahead=False,
):
    """Train w on y = X w* (+ noise-free); returns (distance to w*, info)."""
    import hybridagg

    topo = hybridagg.init(groups=groups, servers=servers)
    if topo.is_server:
        stats = hybridagg.serve(topo)
        return None, stats
    g = torch.Generator().manual_seed(5)
    w_star = torch.randn(8, 1, generator=g, dtype=torch.float64)
    x_all = torch.randn(512, 8, generator=g, dtype=torch.float64)
    y_all = x_all @ w_star
    model = torch.nn.Linear(8, 1, bias=False).double()
    torch.nn.init.zeros_(model.weight)
    opt = hybridagg.DistributedOptimizer(
        torch.optim.SGD(
            model.parameters(), lr=0.05 * (1 - momentum), momentum=momentum
        ),
        model.named_parameters(),
        topo,
        mode=mode,
        compensation=hybridagg.Compensation(reference_batch=16, lookahead=lookahead),
        staleness_bound=bound,
        overlap=overlap,
    )
    rng = torch.Generator().manual_seed(100 + topo.rank)
    stale, gaps = [], []
    for _ in range(steps):
        idx = torch.randint(0, 512, (16,), generator=rng)
        opt.set_samples(16)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x_all[idx]), y_all[idx]).backward()
        time.sleep(0.002 * slowdown.get(topo.rank, 1.0))
        opt.step()
        stale.append(opt.last_staleness)
        if lookahead and topo.is_leader:
            # the model holds the servers' answer; a pull, the true weights
            gaps.append(
                float((model.weight.detach().reshape(-1) - opt.pull_weights()).norm())
            )
    opt.finish()
    dist = float((model.weight.detach().T - w_star).norm() / w_star.norm())
    return dist, {"stale": stale, "updates": opt.updates, "topo": topo, "gaps": gaps}


@pytest.mark.mpi(ranks=[3, 4, 5], timeout=240)
@pytest.mark.parametrize("mode", ["hybrid", "async"])
def test_convergence_to_the_known_optimum(mpi_ranks, mode):
    servers = 2 if mpi_ranks == 5 else 1
    workers = mpi_ranks - servers
    if mode == "hybrid":
        groups = "0,1-2" if workers == 3 else ("0-1" if workers == 2 else "0,1")
        if workers == 2:
            groups = "0,1"
    else:
        groups = "each"
    slow = {workers - 1: 4.0}  # the last worker is four times slower
    dist, info = least_squares_run(mode, groups, servers, slow)
    if dist is not None and info["topo"].rank == 0:
        # rank 0 holds the servers' final weights after finish()
        assert dist < 0.05, f"relative distance to the optimum {dist:.3g}"


@pytest.mark.mpi(ranks=[3, 4], timeout=240)
def test_lookahead_with_several_groups_predicts_and_converges(mpi_ranks):
    """Async with momentum: each worker is a group; answers to its pushes are
    predictions (not the servers' weights), and training still converges."""
    servers = 2 if mpi_ranks == 4 else 1
    dist, info = least_squares_run(
        "async", "each", servers, {0: 2.0}, steps=80, momentum=0.9, lookahead=True
    )
    if dist is None:
        return
    # both workers see staleness of about 1, within the default horizon (2)
    assert sum(g > 1e-9 for g in info["gaps"]) > len(info["gaps"]) // 2, info["gaps"]
    if info["topo"].rank == 0:
        assert dist < 0.05, f"relative distance to the optimum {dist:.3g}"


@pytest.mark.mpi(ranks=4, timeout=240)
def test_staleness_bound_holds_and_unbounded_fast_group_runs_ahead():
    import hybridagg

    # groups {0}, {1-2}: rank 0 fast, ranks 1-2 ten times slower; 1 server
    slow = {1: 10.0, 2: 10.0}
    s = 1
    _, bounded = least_squares_run("hybrid", "0,1-2", 1, slow, steps=30, bound=s)
    if bounded is not None and not isinstance(bounded, hybridagg.ps.ServerStats):
        groups = 2
        assert max(bounded["stale"]) <= (groups - 1) * (s + 1), bounded["stale"]
    elif bounded is not None:
        assert bounded.held > 0  # the fast group was made to wait
        counts = bounded.updates_per_leader
        assert counts == [30, 30]


@pytest.mark.mpi(ranks=3, timeout=240)
def test_overlap_counts_the_step_of_delay_and_converges():
    """With one group, each overlapped gradient is exactly one version old."""
    dist, info = least_squares_run("hybrid", "0-1", 1, {}, steps=120, overlap=True)
    if dist is not None:
        # step 1 sees no reply yet, step 2 the first one (staleness 0), then
        # every gradient was computed before the previous update landed
        assert info["stale"][2:] == [1] * (len(info["stale"]) - 2), info["stale"]
        assert info["updates"] == 119  # the last reply is applied by finish()
    if dist is not None and info["topo"].rank == 0:
        assert dist < 0.05, f"relative distance to the optimum {dist:.3g}"


@pytest.mark.mpi(ranks=2, timeout=120)
def test_servers_take_their_own_thread_count(monkeypatch):
    """HYBRIDAGG_SERVER_THREADS gives the server rank its cores; workers keep theirs."""
    monkeypatch.setenv("HYBRIDAGG_NUM_THREADS", "1")
    monkeypatch.setenv("HYBRIDAGG_SERVER_THREADS", "2")
    dist, info = least_squares_run("async", "each", 1, {}, steps=20)
    if dist is None:
        assert info.threads == 2 and torch.get_num_threads() == 2
        assert info.version == 20  # and it served every update
    else:
        assert torch.get_num_threads() == 1


@pytest.mark.mpi(ranks=[2, 3], timeout=120)
@pytest.mark.parametrize("horizon", [None, 0.5])
def test_lookahead_replies_match_a_replay_of_the_server(horizon):
    """One overlapped group: every gradient lands one update late, so the
    servers answer with weights moved along the momentum; the model matches a
    single-process replay step by step, and a pull gives the true weights."""
    import hybridagg
    from hybridagg.ps.lookahead import TAU_WEIGHT

    topo = hybridagg.init(groups="world", servers=1)
    if topo.is_server:
        hybridagg.serve(topo)
        return
    n, rank = topo.num_workers, topo.rank
    model, ref, probe = mlp(), mlp(), mlp()
    opt = hybridagg.DistributedOptimizer(
        make_opt("sgd", model),
        model.named_parameters(),
        topo,
        mode="hybrid",
        compensation=Compensation(lookahead=True, lookahead_horizon=horizon),
        overlap=True,
    )
    ref_opt = make_opt("sgd", ref)  # the servers' weights and momentum
    seen = [p.detach().clone() for p in model.parameters()]  # the workers' weights
    pending, tau = None, 0.0
    g = torch.Generator().manual_seed(7)
    for step in range(8):
        x = torch.randn(4 * n, 6, generator=g, dtype=torch.float64)
        y = torch.randn(4 * n, 3, generator=g, dtype=torch.float64)
        mine = slice(4 * rank, 4 * rank + 4)
        opt.set_samples(4)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x[mine]), y[mine]).backward()
        opt.step()
        # replay: the gradient of the union batch at the weights the group had
        with torch.no_grad():
            for q, w in zip(probe.parameters(), seen, strict=True):
                q.copy_(w)
        probe.zero_grad()
        torch.nn.functional.mse_loss(probe(x), y).backward()
        if pending is not None:
            seen = pending
        staleness = 0 if step == 0 else 1
        tau += TAU_WEIGHT * (staleness - tau)
        ref_opt.param_groups[0]["lr"] = 0.1 / (1 + staleness)
        for r, q in zip(ref.parameters(), probe.parameters(), strict=True):
            r.grad = q.grad.clone()
        ref_opt.step()
        # the default horizon is the number of groups (1); 0.5 stops the
        # prediction once the running staleness passes it (from step 2)
        limit = 1.0 if horizon is None else horizon
        c = lookahead_factor(0.9, tau) if 0 < tau <= limit else 0.0
        pending = [
            r.detach() - 0.1 * c * ref_opt.state[r]["momentum_buffer"]
            for r in ref.parameters()
        ]
        for p, w in zip(model.parameters(), seen, strict=True):
            torch.testing.assert_close(
                p.detach(), w, rtol=1e-10, atol=1e-12, msg=f"step {step}"
            )
        if step >= 2:
            assert opt.last_staleness == 1
    # a pull is not an answer to a push: the servers' true weights
    true = torch.cat([r.detach().reshape(-1) for r in ref.parameters()])
    if rank == 0:
        torch.testing.assert_close(opt.pull_weights(), true, rtol=1e-10, atol=1e-12)
        # into a buffer the caller keeps (validation's), the same weights
        into = torch.empty_like(true)
        weights, _ = opt.pull_state(into)
        assert weights is into
        torch.testing.assert_close(into, true, rtol=1e-10, atol=1e-12)
        with pytest.raises(ValueError, match=r"needs a flat torch\.float64 tensor"):
            opt.pull_state(torch.empty(3, dtype=true.dtype))
        last_reply = torch.cat([w.reshape(-1) for w in pending])
        # the last answer to a push was a prediction unless past the horizon
        assert torch.allclose(true, last_reply) == (horizon is not None)
    opt.finish()
    if rank == 0:
        final = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        torch.testing.assert_close(final, true, rtol=1e-10, atol=1e-12)


@pytest.mark.mpi(ranks=4, timeout=240)
def test_fast_group_is_never_blocked_without_a_bound():
    import hybridagg

    topo = hybridagg.init(groups="0,1-2", servers=1)
    if topo.is_server:
        stats = hybridagg.serve(topo)
        # while the slow group made its few updates, the fast one made many
        assert stats.updates_per_leader[1] == 5
        assert stats.updates_per_leader[0] >= 3 * stats.updates_per_leader[1]
        assert stats.held == 0
        return
    model = torch.nn.Linear(4, 1)
    opt = hybridagg.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01),
        model.named_parameters(),
        topo,
        mode="hybrid",
    )
    x = torch.randn(8, 4)
    if topo.group == 1:
        steps, nap = 5, 0.2
    else:
        steps, nap = 0, 0.0
    if topo.group == 0:
        # the fast group keeps stepping until the slow group has finished
        done = topo.comms.workers.mpi.Ibarrier()
        while not done.Test():
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()
        opt.finish()
        return
    for _ in range(steps):
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        time.sleep(nap)
        opt.step()
    topo.comms.workers.wait(topo.comms.workers.mpi.Ibarrier(), "slow group done")
    opt.finish()


def cpu_seconds():
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def process_cpu_seconds(pid):
    """utime + stime of another process on this machine, from /proc."""
    import os

    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.mpi(ranks=2, timeout=120)
def test_idle_server_costs_well_under_a_tenth_of_a_core():
    import os

    import hybridagg

    topo = hybridagg.init(servers=1)
    pids = topo.comms.world.allgather(os.getpid())
    if topo.is_server:
        hybridagg.serve(topo)
        return
    model = torch.nn.Linear(4, 2)
    opt = hybridagg.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        model.named_parameters(),
        topo,
        mode="hybrid",
    )
    for _ in range(2):  # warm the server up: its first update imports lazily
        opt.zero_grad()
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
    # no traffic for 2 s, while this worker watches the server's CPU time
    cpu, wall = process_cpu_seconds(pids[1]), time.perf_counter()
    time.sleep(2.0)
    cpu, wall = process_cpu_seconds(pids[1]) - cpu, time.perf_counter() - wall
    assert cpu / wall < 0.10, f"idle server used {cpu / wall:.1%} of a core"
    assert opt.finish() == 2


@pytest.mark.mpi(ranks=5, timeout=180)
def test_one_group_finishing_early_does_not_hang_and_rank0_gets_final_weights():
    import hybridagg

    topo = hybridagg.init(groups="0-1,2-3", servers=1)
    if topo.is_server:
        stats = hybridagg.serve(topo)
        assert stats.updates_per_leader == [2, 12]
        assert stats.version == 14
        return
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    hybridagg.broadcast_parameters(model.state_dict(), topology=topo)
    opt = hybridagg.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        model.named_parameters(),
        topo,
        mode="hybrid",
    )
    steps = 2 if topo.group == 0 else 12
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(3, 4)).sum().backward()
        time.sleep(0.02)
        opt.step()
    version = opt.finish()
    if topo.rank == 0:
        assert version == 14


@pytest.mark.mpi(ranks=3, timeout=120)
def test_pull_gives_the_authoritative_weights_and_stop_budget():
    import hybridagg

    topo = hybridagg.init(groups="each", servers=1)
    if topo.is_server:
        hybridagg.serve(topo)
        return
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    hybridagg.broadcast_parameters(model.state_dict(), topology=topo)
    opt = hybridagg.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        model.named_parameters(),
        topo,
        mode="async",
        max_updates=6,
    )
    steps = 0
    while not opt.should_stop:
        opt.zero_grad()
        model(torch.randn(2, 3)).sum().backward()
        opt.step()
        steps += 1
        assert steps < 100
    flat = opt.pull_weights()
    assert flat.numel() == 4
    from hybridagg.optimizer import ServerOptimizer

    assert type(opt) is ServerOptimizer  # the factory's choice for hybrid/async
    assert isinstance(opt, hybridagg.DistributedOptimizer)
    opt.finish()


@pytest.mark.mpi(ranks=3, timeout=120)
def test_bad_mode_combinations():
    import hybridagg

    model = torch.nn.Linear(2, 1)
    plain = hybridagg.init()
    with pytest.raises(ValueError, match="needs at least one parameter server"):
        hybridagg.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1),
            model.named_parameters(),
            plain,
            mode="hybrid",
        )
    grouped = hybridagg.init(groups="0-1", servers=1)
    if grouped.is_worker:
        with pytest.raises(ValueError, match="mode='async' puts every worker"):
            hybridagg.DistributedOptimizer(
                torch.optim.SGD(model.parameters(), lr=0.1),
                model.named_parameters(),
                grouped,
                mode="async",
            )
        with pytest.raises(ValueError, match="staleness_bound must be"):
            hybridagg.DistributedOptimizer(
                torch.optim.SGD(model.parameters(), lr=0.1),
                model.named_parameters(),
                grouped,
                mode="hybrid",
                staleness_bound=-1,
            )
    else:
        with pytest.raises(ValueError, match="is a parameter server"):
            hybridagg.DistributedOptimizer(
                torch.optim.SGD(model.parameters(), lr=0.1),
                model.named_parameters(),
                grouped,
                mode="hybrid",
            )
    with pytest.raises(ValueError, match="is a worker, not a parameter server"):
        if grouped.is_worker:
            hybridagg.serve(grouped)
        else:
            raise ValueError("rank 2 is a worker, not a parameter server (mirror)")


def test_a_worker_that_raises_ends_the_whole_job(tmp_path):
    from hybridagg.runtime import runner

    script = tmp_path / "fail.py"
    script.write_text(
        textwrap.dedent("""
        import torch, hybridagg
        topo = hybridagg.init(groups="0,1", servers=1)
        if topo.is_server:
            hybridagg.serve(topo)
        else:
            model = torch.nn.Linear(2, 1)
            opt = hybridagg.DistributedOptimizer(
                torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                topo, mode="hybrid")
            for step in range(1000):
                opt.zero_grad()
                model(torch.randn(2, 2)).sum().backward()
                if topo.rank == 1 and step == 3:
                    raise RuntimeError("worker 1 lost its data")
                opt.step()
            opt.finish()
    """)
    )
    argv = runner.mpiexec_argv(3, [sys.executable, str(script)])
    env = runner.mpiexec_env()
    env["HYBRIDAGG_TIMEOUT"] = "30"
    result = runner.run_job(argv, timeout=90, env=env)
    out = result.stdout + result.stderr
    assert not result.timed_out, out
    assert result.returncode != 0
    assert "rank 1: unhandled RuntimeError: worker 1 lost its data" in out, out
    assert runner.processes_with_token(result.token) == []


@pytest.mark.mpi(ranks=3, timeout=240)
def test_a_leader_silent_after_an_overlapped_push_does_not_hold_the_others():
    """The server must not wait for one group's reply before serving another.

    1 MiB of weights: a reply too large to be sent eagerly completes only
    inside the receiving leader's MPI calls, and an overlapping leader makes
    none between its push and its next step (here: a nap, like a GPU step).
    """
    import hybridagg

    topo = hybridagg.init(groups="0,1", servers=1)
    if topo.is_server:
        stats = hybridagg.serve(topo)
        assert stats.updates_per_leader[1] == 3
        # while the silent leader napped 3 x 0.5 s, the other one kept going
        assert stats.updates_per_leader[0] >= 30, stats.updates_per_leader
        return
    model = torch.nn.Linear(4096, 64)
    opt = hybridagg.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.001),
        model.named_parameters(),
        topo,
        mode="hybrid",
        overlap=True,
    )
    x = torch.randn(8, 4096)
    workers = topo.comms.workers
    if topo.group == 0:
        done = workers.mpi.Ibarrier()
        while not done.Test():
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()
    else:
        for _ in range(3):
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()
            time.sleep(0.5)  # no MPI call: the reply to this push waits
        workers.wait(workers.mpi.Ibarrier(), "silent leader done")
    opt.finish()


@pytest.mark.mpi(ranks=3, timeout=120)
def test_a_group_averages_its_buffers_before_the_push():
    """BatchNorm statistics: the group's mean goes to the servers, as in sync mode."""
    import hybridagg

    topo = hybridagg.init(groups="0-1", servers=1)
    if topo.is_server:
        hybridagg.serve(topo)
        return
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    opt = hybridagg.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        model=model,
        topology=topo,
        mode="hybrid",
    )
    opt.zero_grad()
    x = torch.randn(8, 3, generator=torch.Generator().manual_seed(topo.rank)) * 3
    model(x + 5 * topo.rank).sum().backward()
    mine = [model[1].running_mean.clone()]
    everyone = [m for (m,) in topo.comms.workers.allgather(mine)]
    opt.step()
    torch.testing.assert_close(model[1].running_mean, sum(everyone) / 2)
    opt.finish()


def test_a_server_makes_every_groups_reply_copy_before_the_first_push():
    # made at a group's first reply instead, the copy's page faults fell
    # inside that push while the other leaders queued behind it
    from types import SimpleNamespace

    from hybridagg.ps.replies import ReplySender

    store = SimpleNamespace(flat=torch.arange(6.0), buffers=None)
    idle = SimpleNamespace(enabled=False, predicts=lambda g: False)
    replies = ReplySender(None, 3, store, idle)
    replies.prepare()
    assert [c[0].tolist() for c in replies.copies] == [[0.0] * 6] * 3
    made = [c[0] for c in replies.copies]
    assert replies._source(1, 0, 6).tolist() == store.flat.tolist()
    assert replies.copies[1][0] is made[1]  # the copy made up front, reused
    # a lone group replies from the shard itself: nothing to make
    lone = ReplySender(None, 1, store, idle)
    lone.prepare()
    assert lone.copies == [None]
