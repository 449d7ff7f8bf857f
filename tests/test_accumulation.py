"""Gradient accumulation (``backward_passes_per_step``) in every mode."""

import pytest
import torch

PASSES = 3


def model_and_reference():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)
    ).double()
    ref = torch.nn.Sequential(
        torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)
    ).double()
    ref.load_state_dict(model.state_dict())
    return model, ref


@pytest.mark.mpi(ranks=[2, 3], timeout=180)
@pytest.mark.parametrize(
    ("mode", "stream"), [("sync", False), ("hybrid", False), ("hybrid", True)]
)
def test_accumulated_passes_equal_the_union_of_their_batches(mpi_ranks, mode, stream):
    """Each update: PASSES local backward passes, one reduction (one push in
    hybrid mode, with one group and the last rank a server): the weights
    follow SGD on the sum over passes of the workers' mean gradient, and
    nothing is reduced or pushed before the last pass."""
    import hybridagg

    servers = 1 if mode == "hybrid" else 0
    topo = hybridagg.init(servers=servers)
    if topo.is_server:
        hybridagg.serve(topo)
        return
    n, r = topo.num_workers, topo.rank
    model, ref = model_and_reference()
    kwargs = {"stream_push": stream} if mode == "hybrid" else {}
    opt = hybridagg.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        model.named_parameters(),
        mode=mode,
        backward_passes_per_step=PASSES,
        bucket_mb=100 / 2**20,  # several buckets
        **kwargs,
    )
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(5)
    for step in range(3):
        xs = torch.randn(PASSES, n, 4, 6, generator=g, dtype=torch.float64)
        ys = torch.randn(PASSES, n, 4, 3, generator=g, dtype=torch.float64)
        opt.zero_grad()
        for k in range(PASSES):
            torch.nn.functional.mse_loss(model(xs[k][r]), ys[k][r]).backward()
            if k < PASSES - 1:  # held locally: no bucket posted yet
                assert not any(b.test is not None for b in opt.reducer.buckets)
        opt.step()
        assert opt.updates == step + 1
        ref_opt.zero_grad()
        for k in range(PASSES):
            for w in range(n):
                (torch.nn.functional.mse_loss(ref(xs[k][w]), ys[k][w]) / n).backward()
        ref_opt.step()
        for p, q in zip(model.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12, msg=f"step {step}")
    opt.finish()


@pytest.mark.mpi(ranks=2, timeout=90)
def test_a_step_after_fewer_passes_reduces_what_accumulated():
    """As Horovod: step() before the N-th pass reduces the passes made so far
    (before, a reducer whose hooks never fired called that a misuse)."""
    import hybridagg

    topo = hybridagg.init()
    model, ref = model_and_reference()
    opt = hybridagg.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        model.named_parameters(),
        backward_passes_per_step=4,
    )
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    x = torch.randn(
        2, 4, 6, generator=torch.Generator().manual_seed(1), dtype=torch.float64
    )
    opt.zero_grad()
    model(x[topo.rank]).sum().backward()
    opt.step()
    ref_opt.zero_grad()
    (ref(x).sum() / 2).backward()
    ref_opt.step()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q)
    with pytest.raises(ValueError, match="backward_passes_per_step must be a positive"):
        hybridagg.DistributedOptimizer(
            torch.optim.SGD(ref.parameters(), lr=0.1),
            ref.named_parameters(),
            backward_passes_per_step=True,
        )
    opt.finish()
