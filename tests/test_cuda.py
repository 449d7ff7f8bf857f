"""On a GPU: GPU ranks equal the CPU reference, and CPU and GPU ranks train together.

Every test here is marked ``cuda``: skipped where torch sees no GPU (CI),
run by ``make test-gpu`` on a GPU machine (one GPU is enough: ranks that
share it reduce through MPI and pinned host memory, NCCL serves a rank
alone on it). The data is made from arrays (no scikit-learn needed there).
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from train_helpers import output

pytestmark = pytest.mark.cuda


def _mlp(device):
    torch.manual_seed(0)
    return (
        torch.nn.Sequential(
            torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)
        )
        .to(torch.float64)
        .to(device)
    )


def _against_cpu_reference(mode, servers, devices, steps=4):
    """A few SGD steps; each worker's model (on its device) equals one CPU
    process training on the union batch. Returns the optimizer (workers)."""
    from mpi4py import MPI

    import hybridagg

    rank = MPI.COMM_WORLD.Get_rank()
    topo = hybridagg.init(groups="world", servers=servers, device=devices[rank])
    if topo.is_server:
        hybridagg.serve(topo)
        return None
    n = topo.num_workers
    model = _mlp(topo.device)
    ref = _mlp("cpu")
    opt = hybridagg.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        model.named_parameters(),
        topo,
        mode=mode,
        bucket_mb=200 / 2**20,  # several buckets
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
        dev = topo.device
        loss = torch.nn.functional.mse_loss(model(x[mine].to(dev)), y[mine].to(dev))
        loss.backward()
        opt.step()
        ref_opt.zero_grad()
        torch.nn.functional.mse_loss(ref(x), y).backward()
        ref_opt.step()
        for p, q in zip(model.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(
                p.cpu(), q, rtol=1e-9, atol=1e-11, msg=f"step {step}"
            )
    opt.finish()
    return opt


@pytest.mark.mpi(ranks=[1, 2], timeout=300)
@pytest.mark.parametrize("mode", ["sync", "hybrid"])
def test_a_gpu_step_equals_the_cpu_reference(mpi_ranks, mode):
    """Every worker on the one GPU (``--device auto``): alone, NCCL (when
    torch has it); two ranks sharing it, MPI through pinned host memory."""
    servers = 1 if mode == "hybrid" else 0
    if mpi_ranks - servers < 1:
        pytest.skip("needs a worker")
    opt = _against_cpu_reference(mode, servers, ["auto"] * mpi_ranks)
    if opt is None:
        return
    workers = mpi_ranks - servers
    if workers > 1:
        assert opt.allreduce_backend == "mpi", opt.backend_reason
        assert "share GPU 0" in opt.backend_reason
        assert opt.reducer.transport.stage.copies > 0  # staged through the host
    elif torch.distributed.is_nccl_available():
        assert opt.allreduce_backend == "torch", opt.backend_reason


@pytest.mark.mpi(ranks=[2, 3], timeout=300)
@pytest.mark.parametrize("mode", ["sync", "hybrid"])
def test_a_gpu_rank_and_cpu_ranks_in_one_group_equal_the_reference(mpi_ranks, mode):
    """Rank 0 on the GPU, the other workers on the CPU, one group: MPI, the
    GPU rank's buckets through pinned host memory, the same last-bucket
    strategy on every rank."""
    servers = 1 if mode == "hybrid" else 0
    if mpi_ranks - servers < 2:
        pytest.skip("needs two workers")
    opt = _against_cpu_reference(mode, servers, ["cuda"] + ["cpu"] * (mpi_ranks - 1))
    if opt is not None:
        assert opt.allreduce_backend == "mpi" and not opt._on_cpu
        assert "CPU and GPU ranks" in opt.backend_reason


# --- a mixed CPU+GPU job end to end --------------------------------------------
@pytest.fixture(scope="module")
def blobs(tmp_path_factory):
    """Ten well-separated Gaussian classes of 64 features (digits' shape)."""
    from hybridagg.data import convert_arrays

    rng = np.random.default_rng(0)
    centers = rng.normal(0, 1.0, (10, 64)).astype(np.float32)
    y = rng.integers(0, 10, 3000)
    x = centers[y] + rng.normal(0, 0.6, (3000, 64)).astype(np.float32)
    path = tmp_path_factory.mktemp("data") / "blobs.h5"
    return str(convert_arrays(x, y, path, num_classes=10))


def _mixed_job(args, gpu_ranks, nranks, timeout=300):
    """``hybridagg train`` where only ``gpu_ranks`` see the GPU (the others
    have ``CUDA_VISIBLE_DEVICES`` empty, as a CPU node would)."""
    from hybridagg.runtime import runner

    visible = " ".join(str(r) for r in gpu_ranks)
    script = (
        'case " ' + visible + ' " in *" $OMPI_COMM_WORLD_RANK "*) ;; '
        "*) export CUDA_VISIBLE_DEVICES= ;; esac; "
        f'exec {sys.executable} -m hybridagg.cli train "$@"'
    )
    argv = runner.mpiexec_argv(nranks, ["sh", "-c", script, "sh", *args])
    env = runner.mpiexec_env()
    env["HYBRIDAGG_TIMEOUT"] = "120"
    env["HYBRIDAGG_LOG_RANKS"] = "all"
    result = runner.run_job(argv, timeout=timeout, env=env)
    assert not result.timed_out, output(result)[-3000:]
    return result


@pytest.mark.parametrize(
    "mode",
    [
        # one GPU rank and two CPU ranks in their own groups, one server
        ["--mode", "hybrid", "--groups", "device", "--servers", "1"],
        # the same three workers in one synchronous group
        ["--mode", "sync", "--groups", "world"],
    ],
    ids=["hybrid-groups-by-device", "sync-one-mixed-group"],
)
def test_a_mixed_cpu_and_gpu_job_converges(blobs, tmp_path, mode):
    out = tmp_path / "summary.json"
    nranks = 4 if "--servers" in mode else 3
    args = ["--data", blobs, *mode, "--device", "auto", "--epochs", "4"]
    args += ["--lr", "0.05", "--no-progress", "--summary", str(out)]
    args += ["--log-level", "info"]
    result = _mixed_job(args, gpu_ranks=[0], nranks=nranks)
    text = output(result)
    assert result.returncode == 0, text[-3000:]
    s = json.loads(Path(out).read_text())
    assert s["final_accuracy"] >= 0.9, s
    if "hybrid" in mode:  # (--groups device: the GPU rank alone, the CPU ranks)
        assert "all-reduce of group 1: every rank on the CPU: MPI" in text, text[-3000:]
    else:
        assert "CPU and GPU ranks in one reduction" in text, text[-3000:]


def test_the_speed_probe_times_the_gpu():
    from hybridagg.topology import probe_speed

    gpu = probe_speed(reps=3, device="cuda:0")
    cpu = probe_speed(reps=3, size=2048, device="cpu")
    assert gpu > 0 and cpu > 0
    print(f"probe: GPU {gpu:.1f}/s, CPU {cpu:.1f}/s on 2048x2048")


def test_host_staging_round_trip_on_the_gpu():
    from hybridagg.comm import HostStage

    x = torch.arange(1000.0, device="cuda").reshape(10, 100)
    stage = HostStage("auto", cuda_aware=False)
    host = stage.to_host(x)
    assert host.device.type == "cpu" and host.is_pinned() and torch.equal(host, x.cpu())
    host.add_(1)
    stage.to_device(host, x)
    assert torch.equal(x.cpu(), torch.arange(1000.0).reshape(10, 100) + 1)
    copy.deepcopy(stage.to_host(x))  # (the buffer is reused)
    assert stage.buffer(x) is host
