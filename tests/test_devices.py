"""GPUs without a GPU: the device policies, host staging, and ``--device auto``.

Every policy is pure and takes fake device counts and names. The GPU data
path (a bucket copied into a host buffer, reduced by MPI there, copied
back) is the very code a CPU tensor takes under
``HYBRIDAGG_HOST_STAGING=always`` (the device stand-in), so these tests run
it here and compare it with the plain path. What needs a real GPU is in
tests/test_cuda.py (marked ``cuda``; ``make test-gpu``).
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from train_helpers import output, run_train, summary

from hybridagg.devices import (
    DeviceSlot,
    check_device_spec,
    choose_device,
    device_label,
    device_summary,
    probe_plan,
    reduction_backend,
    resolve_device_spec,
    staging_mode,
)
from hybridagg.topology import RankInfo, plan


# --- --device auto ---------------------------------------------------------
def test_auto_takes_the_node_local_gpu_else_the_cpu():
    assert choose_device(0, 0) == "cpu"
    assert choose_device(5, 0) == "cpu"
    assert [choose_device(r, 4) for r in range(4)] == [f"cuda:{i}" for i in range(4)]
    # more ranks than GPUs on a node: they share, round-robin
    assert [choose_device(r, 2) for r in range(5)] == [
        "cuda:0",
        "cuda:1",
        "cuda:0",
        "cuda:1",
        "cuda:0",
    ]
    with pytest.raises(ValueError, match=">= 0"):
        choose_device(-1, 2)


def test_every_device_spec_resolves_per_rank():
    assert resolve_device_spec("auto", 3, 0) == "cpu"
    assert resolve_device_spec("auto", 3, 2) == "cuda:1"
    assert resolve_device_spec("cpu", 3, 8) == "cpu"  # a GPU node may train on CPU
    assert resolve_device_spec("cuda", 3, 2) == "cuda:1"
    assert resolve_device_spec("cuda:1", 0, 2) == "cuda:1"
    with pytest.raises(ValueError, match="--device cuda: CUDA is not available"):
        resolve_device_spec("cuda", 0, 0)
    with pytest.raises(ValueError, match="sees 2 CUDA device"):
        resolve_device_spec("cuda:2", 0, 2)
    for bad in ("gpu", "cuda:x", "auto:1", "cpu:0", ""):
        with pytest.raises(ValueError, match="unknown --device"):
            check_device_spec(bad)


def test_groups_device_sees_what_each_rank_trains_on():
    """``--groups device`` with ``--device auto`` on two GPU nodes and one
    CPU node: the GPU ranks of one kind together, the CPU ranks together;
    a GPU node's rank told to use the CPU counts as a CPU rank."""
    a100 = device_label("cuda:0", "NVIDIA A100", "Xeon")
    v100 = device_label("cuda:1", "Tesla V100", "Xeon")
    cpu = device_label("cpu", None, "Xeon")
    assert a100 == "cuda:NVIDIA A100" and cpu == "cpu:Xeon"
    assert device_label("cpu", "NVIDIA A100", "Xeon") == cpu
    kinds = [a100, a100, v100, v100, cpu, cpu]
    hosts = ["a", "a", "b", "b", "c", "c"]
    infos = [RankInfo(host=h, device=k) for h, k in zip(hosts, kinds, strict=True)]
    topo = plan("device", [*infos, RankInfo("c", cpu)], 7, servers=1)
    assert topo.groups == ((0, 1), (2, 3), (4, 5))
    assert device_summary(kinds) == (
        "cuda:NVIDIA A100: ranks [0, 1]; cuda:Tesla V100: ranks [2, 3]; "
        "cpu:Xeon: ranks [4, 5]"
    )


# --- which backend a reduction takes ------------------------------------------
def _gpus(*placed):
    return [DeviceSlot(h, "cuda", i) for h, i in placed]


def test_nccl_only_for_gpus_of_their_own_else_mpi_through_host_memory():
    cpus = [DeviceSlot("a"), DeviceSlot("b")]
    choice = reduction_backend("auto", cpus, nccl=True)
    assert (choice.backend, choice.on_cpu) == ("mpi", True)

    distinct = _gpus(("a", 0), ("a", 1), ("b", 0))  # same index on another node
    choice = reduction_backend("auto", distinct, nccl=True)
    assert (choice.backend, choice.on_cpu) == ("torch", False)
    assert "NCCL" in choice.reason

    no_nccl = reduction_backend("auto", distinct, nccl=False)
    assert no_nccl.backend == "mpi" and "without NCCL" in no_nccl.reason

    # two ranks on one GPU: NCCL refuses them in one communicator
    shared = reduction_backend("auto", _gpus(("a", 0), ("a", 0)), nccl=True)
    assert (shared.backend, shared.on_cpu) == ("mpi", False)
    assert "ranks [0, 1] of the reduction share GPU 0 on a" in shared.reason

    # CPU and GPU ranks in one reduction: MPI, and every rank agrees the
    # reduction is not all-CPU (the last bucket's strategy depends on it)
    mixed = reduction_backend("auto", [*_gpus(("a", 0)), DeviceSlot("b")], nccl=True)
    assert (mixed.backend, mixed.on_cpu) == ("mpi", False)
    assert "GPU ranks [0], CPU ranks [1]" in mixed.reason


def test_an_explicit_backend_is_kept_or_refused_with_the_reason():
    gpus = _gpus(("a", 0), ("a", 1))
    assert reduction_backend("mpi", gpus, nccl=True).backend == "mpi"
    assert reduction_backend("horovod", gpus, nccl=True).backend == "horovod"
    assert reduction_backend("torch", gpus, nccl=True).backend == "torch"
    gloo = reduction_backend("torch", [DeviceSlot("a")] * 2, nccl=False)
    assert (gloo.backend, gloo.on_cpu) == ("torch", True)
    with pytest.raises(ValueError, match="mixes CPU and GPU"):
        reduction_backend("torch", [*_gpus(("a", 0)), DeviceSlot("a")], nccl=True)
    with pytest.raises(ValueError, match="one rank per GPU"):
        reduction_backend("torch", _gpus(("a", 0), ("a", 0)), nccl=True)
    with pytest.raises(ValueError, match="unknown all-reduce backend"):
        reduction_backend("nccl", gpus, nccl=True)


# --- host staging ---------------------------------------------------------------
def test_staging_policy():
    assert staging_mode("cpu", "auto", cuda_aware=False) == "direct"
    assert staging_mode("cuda", "auto", cuda_aware=False) == "staged"
    assert staging_mode("cuda", "auto", cuda_aware=True) == "direct"
    assert staging_mode("cpu", "always", cuda_aware=False) == "staged"
    assert staging_mode("cuda", "always", cuda_aware=True) == "staged"
    assert staging_mode("cpu", "never", cuda_aware=False) == "direct"
    assert staging_mode("cuda", "never", cuda_aware=True) == "direct"
    with pytest.raises(ValueError, match="needs a CUDA-aware MPI"):
        staging_mode("cuda", "never", cuda_aware=False)
    with pytest.raises(ValueError, match="HYBRIDAGG_HOST_STAGING must be one of"):
        staging_mode("cpu", "sometimes", cuda_aware=False)


def test_host_stage_round_trip_through_its_own_buffer(monkeypatch):
    from hybridagg.comm import HostStage, staging_setting

    x = torch.arange(12.0).reshape(3, 4).t()  # not contiguous
    with HostStage("always", cuda_aware=False) as stage:
        host = stage.to_host(x)
        assert host is not x and host.is_contiguous()
        assert host.data_ptr() != x.data_ptr() and torch.equal(host, x)
        host.mul_(2)  # what MPI would write there
        stage.to_device(host, x)
        assert torch.equal(x, torch.arange(12.0).reshape(3, 4).t() * 2)
        assert stage.to_host(x) is host  # one buffer per tensor, reused
        assert stage.copies == 3
    plain = HostStage("auto", cuda_aware=False)
    y = torch.ones(4)
    assert plain.to_host(y) is y and plain.copies == 0
    plain.to_device(y, y)  # nothing to copy
    monkeypatch.setenv("HYBRIDAGG_HOST_STAGING", "Always")
    assert staging_setting() == "always"
    monkeypatch.setenv("HYBRIDAGG_HOST_STAGING", "yes")
    with pytest.raises(ValueError, match="HYBRIDAGG_HOST_STAGING"):
        staging_setting()


# --- --groups speed times the training device ---------------------------------
def test_the_speed_probe_times_the_device_a_rank_trains_on():
    from hybridagg.topology import probe_speed

    gpu = probe_plan("cuda:1")
    assert (gpu.device, gpu.synchronize) == ("cuda:1", True)
    assert gpu.size > probe_plan("cpu").size  # (a small product times a launch)
    cpu = probe_plan("cpu")
    assert (cpu.device, cpu.synchronize) == ("cpu", False)
    assert probe_speed(reps=2, size=32, device="cpu") > 0


# --- MPI: the staged path equals the plain path ------------------------------------
@pytest.mark.mpi(ranks=[2, 3], timeout=120)
def test_mpi_transport_through_host_buffers_equals_the_plain_path(mpi_ranks):
    from hybridagg.collectives import CollectiveSettings
    from hybridagg.comm import Comm, HostStage, cuda_aware_mpi
    from hybridagg.comm.staging import _loaded_mpi_libraries
    from hybridagg.reduce import MPITransport

    # the detection looks at the MPI library this process runs on (the PyPI
    # Open MPI answers 0: host staging)
    assert _loaded_mpi_libraries(), "no libmpi mapped into this process"
    assert isinstance(cuda_aware_mpi(), bool)
    world = Comm(name="test")
    # large buffers take the ring, small ones MPI_Iallreduce
    settings = dataclasses.replace(CollectiveSettings.from_env(), ring_min_bytes=4096)
    plain = MPITransport(world.dup("plain"), settings, stage=HostStage("auto"))
    staged = MPITransport(world.dup("staged"), settings, stage=HostStage("always"))
    g = torch.Generator().manual_seed(world.rank)
    for n in (7, 5000):  # the small path and the ring
        x = torch.randn(n, generator=g, dtype=torch.float64)
        a, b = x.clone(), x.clone()
        for transport, buf in ((plain, a), (staged, b)):
            test = transport.start_allreduce(buf)
            transport.comm.wait_for(test, "allreduce")
        assert torch.equal(a, b)
        for root in range(world.size):
            a, b = x.clone(), x.clone()
            for transport, buf in ((plain, a), (staged, b)):
                transport.comm.wait_for(transport.start_reduce(buf, root), "reduce")
            if world.rank == root:
                assert torch.equal(a, b)
            a, b = x.clone(), x.clone()
            for transport, buf in ((plain, a), (staged, b)):
                transport.comm.wait_for(transport.start_bcast(buf, root), "bcast")
            assert torch.equal(a, b)
    assert plain.stage.copies == 0 and staged.stage.copies > 0


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)
    ).to(torch.float64)


def _against_reference(mode, groups, servers, backend="auto", steps=4):
    """Train a few steps; every worker's model equals one process on the union batch."""
    import hybridagg

    topo = hybridagg.init(groups=groups, servers=servers, device="auto")
    assert topo.device == "cpu"  # (no GPU here: auto is the CPU)
    if topo.is_server:
        hybridagg.serve(topo)
        return None
    n, rank = topo.num_workers, topo.rank
    model = _mlp()
    ref = copy.deepcopy(model)
    opt = hybridagg.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        model.named_parameters(),
        topo,
        mode=mode,
        bucket_mb=200 / 2**20,  # several buckets: all but the last via the transport
        allreduce_backend=backend,
    )
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(5)
    for step in range(steps):
        sizes = torch.randint(1, 5, (n,), generator=g)
        x = torch.randn(int(sizes.sum()), 6, generator=g, dtype=torch.float64)
        y = torch.randn(int(sizes.sum()), 3, generator=g, dtype=torch.float64)
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
    opt.finish()
    return opt


@pytest.mark.mpi(ranks=[2, 3], timeout=180)
@pytest.mark.parametrize("mode", ["sync", "hybrid"])
def test_a_step_through_host_staging_equals_the_reference(mpi_ranks, mode, monkeypatch):
    """The GPU ranks' path on CPU tensors: every bucket the transport reduces
    is copied to a host buffer, reduced there and copied back; the update
    equals one process on the union batch, as the plain path does."""
    monkeypatch.setenv("HYBRIDAGG_HOST_STAGING", "always")
    servers = 1 if mode == "hybrid" else 0
    if mpi_ranks - servers < 2:
        pytest.skip("needs a group of two workers")
    opt = _against_reference(mode, "world", servers)
    if opt is not None:
        assert opt.allreduce_backend == "mpi"
        assert opt.reducer.transport.stage.copies > 0  # the staged path ran


@pytest.mark.mpi(ranks=3, timeout=180)
def test_ranks_of_a_mixed_group_agree_on_every_choice(monkeypatch):
    """Rank 0 stands in for a GPU rank (its slot says CUDA): the reduction
    is mixed, so every rank takes MPI and the strategies of a reduction
    that is not all-CPU (the CPU ranks too, though their own buckets are
    on the CPU: else they would post other collectives than the GPU rank),
    and the update still equals the reference."""
    from mpi4py import MPI

    import hybridagg.optimizer.base as base
    from hybridagg.reduce import LastBucketKind

    real = base.device_slot

    def slot(params, host):
        if MPI.COMM_WORLD.Get_rank() == 0:
            return DeviceSlot(host, "cuda", 0)
        return real(params, host)

    monkeypatch.setattr(base, "device_slot", slot)
    opt = _against_reference("sync", "world", 0)
    assert opt.allreduce_backend == "mpi"
    assert "GPU ranks [0], CPU ranks [1, 2]" in opt.backend_reason
    assert opt.reducer.last_bucket.kind is LastBucketKind.EAGER


@pytest.mark.mpi(ranks=3, timeout=180)
def test_a_group_reduces_in_a_torch_world_of_its_own():
    """Hybrid with the torch backend: each group is a torch.distributed world
    of its own (NCCL for a GPU group; gloo here), so groups that reduce
    through MPI never join it; the update equals the reference."""
    opt = _against_reference("hybrid", "world", 1, backend="torch")
    if opt is not None:
        import torch.distributed as dist

        assert opt.allreduce_backend == "torch"
        assert dist.get_world_size() == 2  # the group, not the whole job


# --- end to end: --device auto on a CPU-only machine ----------------------------
@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    from hybridagg.data import convert_digits

    path = tmp_path_factory.mktemp("data") / "digits.h5"
    convert_digits(path, val_fraction=0.2, seed=0, progress=False)
    return str(path)


def test_device_auto_trains_on_a_cpu_only_machine(digits, tmp_path):
    """``--device auto`` in hybrid with ``--groups device`` (one group here:
    every rank is a CPU rank) and every tensor through host buffers."""
    out = tmp_path / "summary.json"
    args = ["--data", digits, "--mode", "hybrid", "--groups", "device"]
    args += ["--device", "auto", "--epochs", "3", "--lr", "0.05", "--no-progress"]
    result = run_train(
        3,
        [*args, "--summary", str(out)],
        env={"HYBRIDAGG_HOST_STAGING": "always"},
    )
    assert result.returncode == 0, output(result)[-3000:]
    s = summary(out)
    assert s["final_accuracy"] >= 0.8, s
    # rank 0 says where every rank trains (servers included: on the CPU)
    assert "[rank 0] devices: cpu:" in result.stderr and "ranks [0, 1, 2]" in (
        result.stderr
    ), result.stderr[-3000:]
