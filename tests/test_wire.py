"""The compact wire format: the codec, error feedback, the compact collectives,
the parameter server's messages, and the optimizer's keyword."""

import statistics

import pytest
import torch

from hybridagg.comm.wire import (
    WIRE_FORMATS,
    ErrorFeedback,
    WireCodec,
    check_wire,
    wire_dtype,
    wire_view,
)

COMPACT = [torch.bfloat16, torch.float16]


def _unit(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One rounding unit (the spacing of ``dtype``'s values) at each element of ``x``."""
    eps = torch.finfo(dtype).eps
    tiny = torch.finfo(dtype).smallest_normal
    return torch.maximum(x.abs(), torch.full_like(x, tiny)) * eps


def test_wire_names_and_bad_values():
    assert WIRE_FORMATS[0] == "fp32"
    assert wire_dtype("bf16") == torch.bfloat16
    assert wire_dtype("fp16") == torch.float16
    assert wire_dtype("fp32") == torch.float32
    with pytest.raises(
        ValueError, match="unknown wire format 'fp8': use fp32, bf16, fp16"
    ):
        check_wire("fp8")
    with pytest.raises(TypeError, match="wire must be a string"):
        check_wire(torch.bfloat16)


@pytest.mark.parametrize("dtype", COMPACT)
def test_codec_round_trip_is_round_to_nearest_and_halves_bytes(dtype):
    g = torch.Generator().manual_seed(0)
    flat = torch.randn(1000, generator=g) * 3
    name = {torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
    send = WireCodec(name, flat.numel(), feedback=False)
    recv = WireCodec(name, flat.numel(), feedback=False)
    out = torch.zeros_like(flat)
    for lo, hi in [(0, 300), (300, 1000)]:
        bits = send.encode(flat, lo, hi)
        assert bits.dtype == torch.int16  # what MPI is handed: the bits
        assert bits.numel() * bits.element_size() == (hi - lo) * 2
        recv.landing(out, lo, hi).copy_(bits)  # (as a message would)
        recv.decode(out, lo, hi)
    assert torch.equal(out, flat.to(dtype).float())
    # within half a rounding unit: round to nearest
    assert torch.all((out - flat).abs() <= _unit(flat, dtype) / 2)
    assert send.bytes_of(1000) == 2000
    fp32 = WireCodec("fp32", 10, feedback=True)
    assert (
        fp32.buffer is None and fp32.encode(flat, 0, 10).data_ptr() == flat.data_ptr()
    )
    assert fp32.bytes_of(1000) == 4000


@pytest.mark.parametrize("dtype", COMPACT)
def test_error_feedback_loses_nothing_over_many_steps(dtype):
    """The sum of what was sent equals the sum of the true values within one
    rounding unit; without the residual the gap grows with the steps."""
    g = torch.Generator().manual_seed(1)
    n, steps = 4096, 300
    ef = ErrorFeedback(dtype)
    out = torch.empty(n, dtype=dtype)
    # values a fraction of a rounding unit above 1 (the worst case for plain
    # rounding: the same error every step), plus a little noise
    eps = torch.finfo(dtype).eps
    bias = 1.0 + (0.2 + 0.2 * torch.rand(n, generator=g)) * eps
    true_sum = torch.zeros(n, dtype=torch.float64)
    sent_sum = torch.zeros(n, dtype=torch.float64)
    plain_sum = torch.zeros(n, dtype=torch.float64)
    for _ in range(steps):
        x = bias + torch.randn(n, generator=g) * 0.02 * eps
        ef.round(x, out, "bucket")
        true_sum += x.double()
        sent_sum += out.double()
        plain_sum += x.to(dtype).double()
    gap = (sent_sum - true_sum).abs()
    unit = _unit(bias, dtype).double() * 2  # a rounding unit of a value near 1-2
    assert torch.all(gap <= unit), float((gap / unit).max())
    # the residual is exactly what is still owed
    owed = ef.residual("bucket").double()
    torch.testing.assert_close(sent_sum + owed, true_sum, rtol=0, atol=1e-4)
    # plain rounding drifts far beyond one unit
    assert float((plain_sum - true_sum).abs().max()) > 20 * float(unit.max())
    assert ef.nbytes == n * 4


def test_error_feedback_delivers_what_fp16_would_flush_to_zero():
    ef = ErrorFeedback(torch.float16)
    out = torch.empty(1, dtype=torch.float16)
    tiny = torch.tensor([1e-8])  # below fp16's smallest subnormal (6e-8)
    assert tiny.to(torch.float16).item() == 0.0
    sent = 0.0
    for _ in range(1000):
        ef.round(tiny, out, "k")
        sent += out.float().item()
    assert sent == pytest.approx(1000 * 1e-8, rel=0.02)


def test_fp16_overflow_is_an_infinity_and_the_residual_recovers():
    from hybridagg.comm import all_finite

    ef = ErrorFeedback(torch.float16)
    out = torch.empty(3, dtype=torch.float16)
    ef.round(torch.tensor([1.0, 1e5, -1e6]), out, "k")
    assert not all_finite([out.float()])  # the non-finite check sees it
    assert out[1] == float("inf") and out[2] == float("-inf")
    assert torch.all(torch.isfinite(ef.residual("k")))  # not carried on
    ef.round(torch.tensor([1.0, 2.0, 3.0]), out, "k")
    assert out.float().tolist() == [1.0, 2.0, 3.0]


def test_wire_view_only_reinterprets_16_bit_floats():
    b = torch.ones(3, dtype=torch.bfloat16)
    assert wire_view(b).dtype == torch.int16 and wire_view(b).data_ptr() == b.data_ptr()
    f = torch.ones(3)
    assert wire_view(f) is f
    with pytest.raises(ValueError, match="bf16 or fp16"):
        ErrorFeedback(torch.float32)


def test_the_compact_algorithm_is_chosen_for_every_size():
    from hybridagg.collectives import Algorithm, CollectiveSettings, choose_allreduce

    s = CollectiveSettings(
        ring_min_bytes=64, settled_max_bytes=2**20, ring_chunk_bytes=64,
        shared_memory=True,
    )  # fmt: skip
    for nbytes in (4, 1000, 2**24):
        for settled in (False, True):
            got = choose_allreduce(nbytes, 2, settled=settled, settings=s, compact=True)
            assert got is Algorithm.COMPACT
    assert choose_allreduce(4, 1, settled=False, settings=s, compact=True) is (
        Algorithm.NONE
    )


def test_a_compact_last_bucket_is_reduced_like_every_other():
    from hybridagg.collectives import CollectiveSettings
    from hybridagg.reduce.lastbucket import (
        LastBucketFacts,
        LastBucketKind,
        choose_last_bucket,
    )

    s = CollectiveSettings(
        ring_min_bytes=2**20, settled_max_bytes=2**26, ring_chunk_bytes=2**20,
        shared_memory=True,
    )  # fmt: skip
    for nbytes in (1000, 2**22, 2**27):
        facts = dict(
            nbytes=nbytes, floating=True, on_cpu=True, mpi=True, flat=True,
            same_ranks=True,
        )  # fmt: skip
        assert (
            choose_last_bucket(LastBucketFacts(**facts), s, shared_memory=True)
            is not LastBucketKind.EAGER
            or nbytes > 2**26
        )
        got = choose_last_bucket(
            LastBucketFacts(**facts, compact=True), s, shared_memory=True
        )
        assert got is LastBucketKind.EAGER


# --- compact collectives over MPI ----------------------------------------------


@pytest.mark.mpi(ranks=[2, 3], timeout=120)
def test_compact_allreduce_sums_in_fp32_and_halves_the_bytes(mpi_ranks):
    from hybridagg.collectives import Collectives
    from hybridagg.comm import Comm

    comm = Comm(name="compact-allreduce")
    n = comm.size
    collectives = Collectives(comm, wire="bf16")
    for numel in (1, 7, 3 * 1000):
        g = torch.Generator().manual_seed(numel)
        data = torch.randn(3, n, numel, generator=g)
        bufs = [data[i, comm.rank].clone() for i in range(3)]
        before = collectives.bytes_sent
        tests = [collectives.start_allreduce(b) for b in bufs]  # three in flight
        comm.wait_for(lambda ts=tests: all([t() for t in ts]), "compact")
        for i, buf in enumerate(bufs):
            # the sum of the rounded contributions, formed in fp32, rounded once
            exact = data[i].to(torch.bfloat16).float().sum(0)
            assert torch.equal(buf, exact.to(torch.bfloat16).float())
        everyone = comm.allgather(bufs[0].numpy().tobytes())
        assert all(e == everyone[0] for e in everyone)  # replicas identical
        if numel % n == 0:
            sent = collectives.bytes_sent - before
            # each rank sends 2 (n - 1) / n of each buffer, 2 bytes an element:
            # half of what the bandwidth-optimal fp32 ring sends
            fp32_ring = 3 * 2 * (n - 1) * numel // n * 4
            assert sent * 2 == fp32_ring
    comm.free()


@pytest.mark.mpi(ranks=[2, 3], timeout=120)
def test_compact_reduce_and_bcast_through_the_transport(mpi_ranks):
    from hybridagg.comm import Comm
    from hybridagg.reduce import make_transport

    comm = Comm(name="compact-stages")
    t = make_transport("mpi", comm, [], 0, wire="fp16")
    g = torch.Generator().manual_seed(5)
    data = torch.randn(comm.size, 501, generator=g)
    x = data[comm.rank].clone()
    comm.wait_for(t.start_reduce(x, 0), "reduce")
    if comm.rank == 0:
        # the root's own values exact, the others' rounded, summed in fp32
        expected = data[0] + data[1:].to(torch.float16).float().sum(0)
        torch.testing.assert_close(x, expected, rtol=0, atol=1e-6)
    comm.wait_for(t.start_bcast(x, 0), "bcast")
    everyone = comm.allgather(x.numpy().tobytes())
    assert all(e == everyone[0] for e in everyone)
    assert torch.equal(x, x.to(torch.float16).float())  # the rounded values
    comm.free()


# --- the parameter server's messages ---------------------------------------------


@pytest.mark.mpi(ranks=2, timeout=120)
def test_ps_push_and_pull_carry_half_the_bytes():
    """A leader and a server: the gradient parts the client posts and the
    weights the server posts back are 2 bytes an element on bf16, and the
    server's master copy moves by the exact float32 gradient's step."""
    import hybridagg
    from hybridagg.ps.client import PSClient
    from hybridagg.ps.compensation import Compensation

    topo = hybridagg.init(groups="0", servers=1)
    numel = 10_000
    posted: list[int] = []
    if topo.is_server:
        assert hybridagg.serve(topo).version == 3
        return
    comm = topo.comms.leaders.dup("ps")
    original = comm.Isend

    def counting(buf, dest, tag):
        from hybridagg.ps import protocol as P

        if tag >= P.PART_TAG0:  # (a leader sends only gradient parts on these)
            posted.append(buf.numel() * buf.element_size())
        return original(buf, dest, tag)

    comm.Isend = counting
    w = torch.nn.Parameter(torch.zeros(numel))
    opt = torch.optim.SGD([w], lr=1.0)
    client = PSClient(comm, 1, [w], [], opt, Compensation(), wire="bf16")
    g = torch.Generator().manual_seed(3)
    total = torch.zeros(numel)
    for _ in range(3):
        grad = torch.randn(numel, generator=g) * 1e-3 + 1.0
        total += grad
        client.complete(client.push([grad], 1.0, [1.0], client.versions))
    assert sum(posted) == 3 * numel * 2  # bf16: 2 bytes an element
    # the pulled weights are the bf16 rounding of the server's fp32 master,
    # which moved by the sum of what was sent: within a few rounding units
    # of the true sum (error feedback), not three
    weights = client.flat_weights
    assert torch.equal(weights, weights.to(torch.bfloat16).float())
    gap = (weights + total).abs()
    assert float(gap.max()) <= 3 * float(_unit(total, torch.bfloat16).max())
    client.done()
    client.receive_final()  # the final weights stay exact float32
    torch.testing.assert_close(client.flat_weights, -total, rtol=0, atol=1e-2)
    comm.free()


def test_the_optimizer_refuses_a_bad_wire_before_any_communication():
    from hybridagg.optimizer import DistributedOptimizer

    w = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([w], lr=0.1)
    with pytest.raises(ValueError, match="unknown wire format 'int8'"):
        DistributedOptimizer(opt, [("w", w)], None, wire="int8")
    with pytest.raises(ValueError, match="needs allreduce_backend 'mpi' or 'torch'"):
        DistributedOptimizer(
            opt, [("w", w)], None, wire="bf16", allreduce_backend="horovod"
        )


# --- the non-finite check on a compact wire ---------------------------------------


@pytest.mark.mpi(ranks=2, timeout=120)
def test_an_fp16_overflow_stops_sync_like_any_non_finite_gradient():
    """A finite gradient beyond fp16's range becomes an infinity on the wire;
    the reduced gradient's check sees it on every rank and nothing is applied
    (on fp32 the same step is applied)."""
    import hybridagg

    topo = hybridagg.init()
    for wire, overflows in (("fp32", False), ("fp16", True)):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2)
        opt = hybridagg.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=1e-9),
            model.named_parameters(),
            topo,
            wire=wire,
        )
        before = [p.detach().clone() for p in model.parameters()]
        opt.zero_grad()
        scale = 1e6 if topo.rank == 1 else 1.0  # finite, beyond 65504
        (model(torch.full((8, 4), scale)).sum()).backward()
        opt.step()
        changed = any(
            not torch.equal(p.detach(), b)
            for p, b in zip(model.parameters(), before, strict=True)
        )
        if overflows:
            assert opt.should_stop
            assert opt.nonfinite == "the reduced gradient is not finite"
            assert not changed and opt.updates == 0
        else:
            assert opt.nonfinite is None and changed and opt.updates == 1
        opt.finish()


@pytest.mark.mpi(ranks=2, timeout=120)
@pytest.mark.parametrize("stream_push", [False, True], ids=["whole", "streamed"])
def test_an_fp16_overflow_in_a_push_halts_the_server(stream_push):
    """One worker and one server: the group's gradient is finite, its fp16
    push is not (streamed: each part rounded as its bucket becomes final);
    the server's check of the widened part halts it."""
    import hybridagg

    topo = hybridagg.init(servers=1)
    if topo.is_server:
        stats = hybridagg.serve(topo)
        assert stats.nonfinite == 0  # the group whose push overflowed
        return
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = hybridagg.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=1e-9),
        model.named_parameters(),
        topo,
        mode="async",
        wire="fp16",
        stream_push=stream_push,
    )
    assert (opt._exchange.buckets is not None) == stream_push
    # the reply to the overflowing push may leave before its bad part
    # arrives; the next reply carries the stop and its reason
    for scale in (1.0, 1e6, 1.0, 1.0):
        opt.zero_grad()
        (model(torch.full((8, 4), scale)).sum()).backward()
        opt.step()
        if opt.should_stop:
            break
    assert opt.should_stop and opt.nonfinite is not None
    assert "the push of group 0 (rank 0) was not finite" in opt.nonfinite
    opt.finish()
    assert all(torch.isfinite(p).all() for p in model.parameters())


# --- hybridagg train, end to end -----------------------------------------------------


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    from hybridagg.data import convert_digits

    path = tmp_path_factory.mktemp("data") / "digits.h5"
    convert_digits(path, val_fraction=0.2, seed=0, progress=False)
    return str(path)


@pytest.mark.parametrize(
    "nranks,mode",
    [
        (2, ["--mode", "sync"]),
        (4, ["--mode", "hybrid", "--groups", "0-1,2"]),  # a group of two, one alone
        # streamed pushes of two groups, the second landing in its own
        # compact buffer on the server
        (4, ["--mode", "hybrid", "--groups", "0-1,2", "--stream-push"]),
    ],
    ids=["sync", "hybrid", "hybrid-streamed"],
)
def test_bf16_learns_the_digits_as_well_as_fp32(digits, tmp_path, nranks, mode):
    from train_helpers import output, run_train, summary

    # Runs reach 0.92-0.98 either way. Hybrid's updates land in the order the
    # busy cores let them, so either wire's run can be the lucky one (CI saw
    # fp32 0.925 beside bf16 0.972, and fp32 0.972 beside bf16 0.942): one
    # run a wire cannot tell 3 points, so hybrid compares the medians of
    # three seeds (sync's runs are repeatable: one seed)
    seeds = (1,) if mode[1] == "sync" else (1, 2, 3)
    accuracy: dict[str, list[float]] = {"fp32": [], "bf16": []}
    for wire in ("fp32", "bf16"):
        for seed in seeds:
            out = tmp_path / f"{wire}-{seed}.json"
            result = run_train(
                nranks,
                [
                    "--data", digits, *mode, "--epochs", "4", "--lr", "0.05",
                    "--no-progress", "--sample-ms", "0.2", "--seed", str(seed),
                    "--summary", str(out), "--wire", wire,
                ],
            )  # fmt: skip
            assert result.returncode == 0, output(result)[-3000:]
            s = summary(out)
            assert s["wire"] == wire
            accuracy[wire].append(s["final_accuracy"])
    median = {wire: statistics.median(got) for wire, got in accuracy.items()}
    # what users rely on is that bf16 costs no more than the stated 3
    # points, so the check is one-sided
    assert min(accuracy["bf16"]) >= 0.9, accuracy
    assert median["bf16"] >= median["fp32"] - 0.03, accuracy


@pytest.mark.mpi(ranks=4, timeout=180)
@pytest.mark.parametrize("backend", ["mpi", "torch"])
def test_every_path_of_sync_reduces_on_a_compact_wire(backend):
    """Flat (one group) and hierarchical (two groups: reduce, leaders'
    all-reduce, broadcast) sync on bf16, over MPI and over gloo: the reduced
    gradient is the weighted mean within bf16's rounding, the same on every
    rank, and over repeated steps error feedback keeps the applied sum close."""
    import hybridagg
    from hybridagg.comm import Comm
    from hybridagg.optimizer import init_torch_distributed

    world = Comm(name="test")
    if backend == "torch":
        init_torch_distributed(world, "gloo")
    for groups in ("0-3", "0-1,2-3"):
        topo = hybridagg.init(groups=groups)
        w = torch.nn.Parameter(torch.zeros(1000))
        opt = hybridagg.DistributedOptimizer(
            torch.optim.SGD([w], lr=1.0),
            [("w", w)],
            topo,
            wire="bf16",
            allreduce_backend=backend,
        )
        g = torch.Generator().manual_seed(7)
        grads = [1.0 + torch.rand(4, 1000, generator=g) * 1e-2 for _ in range(20)]
        for step in grads:
            opt.set_samples(topo.rank + 1)
            opt.zero_grad()
            (w * step[topo.rank]).sum().backward()
            opt.step()
        weights = torch.tensor([1.0, 2.0, 3.0, 4.0])
        true = sum((weights[:, None] * s).sum(0) / weights.sum() for s in grads)
        # mpi: contributions and sums rounded with error feedback, summed in
        # fp32: within a few bf16 units of values near 1 after 20 steps.
        # torch: gloo sums the rounded contributions in bf16 itself, and that
        # rounding (a unit of the sum, near 10) has no feedback: it drifts
        gap = float((w.detach() + true).abs().max())
        assert gap < (0.02 if backend == "mpi" else 0.15), gap
        everyone = world.allgather(w.detach().numpy().tobytes())
        assert all(e == everyone[0] for e in everyone)  # replicas identical
        opt.finish()
    world.free()
