"""ShareSampler: each worker's share of every epoch through the user's own DataLoader.

Pure share logic and one-process samplers in the pytest process; the MPI
counter, the workers' agreement and a user's training loop under real MPI.
"""

import random
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from hybridagg.data import ShareSampler
from hybridagg.data.shares import LocalCounter, intervals_length, split_even_steps
from hybridagg.runtime import runner

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------ pure logic
def test_even_steps_cover_every_sample_with_equal_steps_and_bounded_batches():
    rng = random.Random(0)
    for _ in range(3000):
        workers = rng.randint(1, 6)
        sizes = [rng.randint(1, 9) for _ in range(workers)]
        total = rng.randint(0, 200)
        shares, steps = split_even_steps(total, sizes)
        # what a DataLoader(batch_size=b_r) makes of each share: the same steps
        assert [
            -(-intervals_length(s) // b) for s, b in zip(shares, sizes, strict=True)
        ] == [steps] * workers
        seen = Counter(p for s in shares for a, b in s for p in range(a, b))
        assert set(seen) == set(range(total))
        twice = sum(c - 1 for c in seen.values())
        rem = total % sum(sizes)
        if rem == 0 or rem >= workers:
            assert twice == 0, (total, sizes, shares)  # exactly once
        else:
            assert twice <= workers - rem  # padded like DistributedSampler
        # a last batch never holds more than the worker's batch size
        for s, b in zip(shares, sizes, strict=True):
            assert intervals_length(s) <= steps * b


def test_even_steps_drop_last_reads_nothing_twice_and_refuses_an_empty_epoch():
    shares, steps = split_even_steps(107, [3, 5], drop_last=True)
    assert steps == 13 and [intervals_length(s) for s in shares] == [39, 65]
    with pytest.raises(ValueError, match="leaves no step"):
        split_even_steps(7, [3, 5], drop_last=True)


# ------------------------------------------------------------- one process
def test_static_sampler_alone_is_a_seeded_permutation_per_epoch():
    s = ShareSampler(100, batch_size=8, seed=3)
    e0 = list(s)
    e1 = list(s)  # the epoch advanced by itself
    assert sorted(e0) == sorted(e1) == list(range(100)) and e0 != e1
    assert len(s) == 100 and s.steps_per_epoch == 13 and s.epoch == 2
    s.set_epoch(0)
    assert list(s) == e0 == list(ShareSampler(100, batch_size=8, seed=3))
    assert list(ShareSampler(100, batch_size=8, shuffle=False)) == list(range(100))
    with pytest.raises(ValueError, match="shares must be"):
        ShareSampler(10, batch_size=2, shares="random")
    with pytest.raises(TypeError, match="len"):
        ShareSampler(object(), batch_size=2)


def drain(samplers, speeds, epochs):
    """Interleave dynamic samplers drawing at ``speeds``; indices per (epoch, worker)."""
    got = {}
    iters = [None] * len(samplers)
    while True:
        busy = False
        for r, (s, speed) in enumerate(zip(samplers, speeds, strict=True)):
            if iters[r] is None:
                if s.epoch >= epochs:
                    continue
                iters[r] = (s.epoch, iter(s))
            busy = True
            epoch, it = iters[r]
            for _ in range(speed):
                try:
                    got.setdefault((epoch, r), []).append(next(it))
                except StopIteration:
                    iters[r] = None
                    break
        if not busy:
            return got


def test_dynamic_samplers_sharing_a_counter_take_every_sample_once_per_epoch():
    counter = LocalCounter()
    samplers = [
        ShareSampler(257, batch_size=4, shares="dynamic", seed=5, counter=counter)
        for _ in range(3)
    ]
    speeds = [1, 3, 9]  # worker 2 draws nine samples while worker 0 draws one
    got = drain(samplers, speeds, epochs=3)
    for epoch in range(3):
        every = [i for r in range(3) for i in got.get((epoch, r), [])]
        assert sorted(every) == list(range(257)), epoch
    mine = [sum(len(got.get((e, r), [])) for e in range(3)) for r in range(3)]
    assert mine[0] < mine[1] < mine[2]  # the fast worker took more
    with pytest.raises(TypeError, match="no fixed length"):
        len(samplers[0])


def test_a_dataloader_with_workers_and_a_transform_reads_the_share(tmp_path):
    x = torch.arange(60, dtype=torch.float32).reshape(60, 1)
    data = torch.utils.data.TensorDataset(x, torch.arange(60))

    class Shifted(torch.utils.data.Dataset):
        def __len__(self):
            return len(data)

        def __getitem__(self, i):
            a, y = data[i]
            return a + 1000, y  # an augmentation stand-in

    sampler = ShareSampler(data, batch_size=7, seed=1)
    loader = torch.utils.data.DataLoader(
        Shifted(), batch_size=7, sampler=sampler, num_workers=2
    )
    seen = torch.cat([a for a, _ in loader]).flatten().long() - 1000
    assert sorted(seen.tolist()) == list(range(60)) and len(loader) == 9


# -------------------------------------------------------------- under MPI
@pytest.mark.mpi(ranks=[2, 3, 4], timeout=120)
def test_static_shares_under_mpi_give_equal_steps_and_every_sample_once():
    from hybridagg.comm import Comm

    comm = Comm(name="test")
    batch = 2 + 3 * comm.rank  # uneven: 2, 5, 8, 11
    n = 6 * sum(2 + 3 * r for r in range(comm.size)) + comm.size + 1  # a remainder
    sampler = ShareSampler(n, batch_size=batch, comm=comm, seed=9)
    assert sampler.batch_sizes == [2 + 3 * r for r in range(comm.size)]
    loader = torch.utils.data.DataLoader(
        torch.arange(n), batch_size=batch, sampler=sampler
    )
    for epoch in range(2):
        sampler.set_epoch(epoch)
        batches = [b.tolist() for b in loader]
        views = comm.allgather(batches)
        assert {len(v) for v in views} == {sampler.steps_per_epoch}  # equal steps
        every = sorted(i for v in views for b in v for i in b)
        assert every == list(range(n)), epoch  # rem >= workers: nothing twice
    comm.free()


@pytest.mark.mpi(ranks=[2, 3], timeout=120)
def test_dynamic_shares_under_mpi_let_a_slow_worker_take_less():
    from hybridagg.comm import Comm

    comm = Comm(name="test")
    with ShareSampler(400, batch_size=5, comm=comm, shares="dynamic", seed=2) as s:
        assert s.chunk == 20
        per_epoch = []
        for epoch in range(2):
            s.set_epoch(epoch)
            mine = []
            for i in s:
                mine.append(i)
                if comm.rank == 0:
                    time.sleep(0.002)  # worker 0 is slow
            per_epoch.append(mine)
        views = comm.allgather(per_epoch)
        for epoch in range(2):
            every = sorted(i for v in views for i in v[epoch])
            assert every == list(range(400)), epoch
        counts = [sum(len(e) for e in v) for v in views]
        assert counts[0] < max(counts[1:]), counts
    comm.free()


@pytest.mark.mpi(ranks=4, timeout=120)
def test_dynamic_shares_keep_the_workers_of_a_group_in_step():
    from hybridagg.comm import Comm

    comm = Comm(name="test")
    # two groups: worker 0 alone (slow), workers 1-3 all-reducing together
    group = comm.split(0 if comm.rank == 0 else 1, comm.rank, name="group")
    batch = [4, 3, 5, 4][comm.rank]
    n = 501
    with ShareSampler(
        n,
        batch_size=batch,
        comm=comm,
        group=group,
        shares="dynamic",
        seed=4,
        chunk_samples=10,
    ) as s:
        loader = torch.utils.data.DataLoader(
            torch.arange(n), batch_size=batch, sampler=s
        )
        for epoch in range(2):
            s.set_epoch(epoch)
            batches = []
            for b in loader:
                batches.append(b.tolist())
                if comm.rank == 0:
                    time.sleep(0.01)
            views = comm.allgather(batches)
            steps = [len(v) for v in views]
            assert steps[1] == steps[2] == steps[3], steps  # the group in step
            assert steps[0] < steps[1], steps  # the slow group took less
            for r in (1, 2, 3):  # full batches but the group's last round
                assert all(len(b) == [4, 3, 5, 4][r] for b in views[r][:-1])
            seen = Counter(i for v in views for b in v for i in b)
            assert set(seen) == set(range(n)), epoch
            # at most the group's last round pads: 2 samples for 3 workers
            assert sum(c - 1 for c in seen.values()) <= 2, epoch
    group.free()
    comm.free()


@pytest.mark.mpi(ranks=2, timeout=60)
def test_workers_that_disagree_get_the_same_error():
    from hybridagg.comm import Comm

    comm = Comm(name="test")
    with pytest.raises(ValueError, match="every worker must give the same"):
        ShareSampler(100, batch_size=4, comm=comm, seed=comm.rank)
    with pytest.raises(ValueError, match=r"\[rank 1\] batch_size must be >= 1"):
        ShareSampler(100, batch_size=1 - comm.rank, comm=comm)
    # where dynamic shares draw from: a known counter, one that exists, alike
    dynamic = dict(batch_size=4, comm=comm, shares="dynamic")
    with pytest.raises(ValueError, match="counter must be one of auto, window, server"):
        ShareSampler(100, **dynamic, counter="nope")
    with pytest.raises(ValueError, match="counter='server' needs topology="):
        ShareSampler(100, **dynamic, counter="server")
    with pytest.raises(ValueError, match="every worker must give the same"):
        ShareSampler(100, **dynamic, counter=("auto", "window")[comm.rank])
    with ShareSampler(100, **dynamic, counter="window") as s:  # what auto is here
        every = sorted(i for v in comm.allgather(list(s)) for i in v)
        assert every == list(range(100))
    comm.free()


USER_SCRIPT = """
import sys

import torch

import hybridagg
from hybridagg.data import HDF5Dataset, ShareSampler

mode, counter = sys.argv[2], sys.argv[3]
topo = hybridagg.init(groups="0,1-2" if mode == "hybrid" else "world",
                      servers=1 if mode == "hybrid" else 0)
if topo.is_server:
    hybridagg.serve(topo)
    raise SystemExit
torch.manual_seed(0)
data = HDF5Dataset(sys.argv[1], normalize=True,
                   transform=lambda x: x + 0.05 * torch.randn_like(x))  # augmentation
# static shares in sync mode, dynamic shares by group in hybrid mode (with
# counter "server": drawn from server 0, as across nodes)
def make():
    return ShareSampler(data, batch_size=16, topology=topo, counter=counter)


model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(),
                            torch.nn.Linear(64, 10))
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
opt = hybridagg.DistributedOptimizer(opt, model=model, topology=topo, mode=mode)
seen = 0
# two samplers one after the other (the second continues from epoch 2): the
# second takes server 0's counter over from the first and starts it again
for first in (0, 2):
    sampler = make()
    assert sampler.shares == ("static" if mode == "sync" else "dynamic")
    if counter == "server":  # one sampler at a time holds it
        try:
            make()
            raise AssertionError("a second sampler took server 0's counter")
        except ValueError as exc:
            assert "another ShareSampler holds server 0's counter" in str(exc)
    loader = torch.utils.data.DataLoader(data, batch_size=16, sampler=sampler,
                                         num_workers=1)
    for epoch in range(first, first + 2):
        sampler.set_epoch(epoch)
        for x, y in loader:
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            seen += len(y)
    sampler.free()
opt.finish()
total = topo.comms.workers.allreduce(seen)
if topo.rank == 0:
    val = HDF5Dataset(sys.argv[1], "val", normalize=True)
    x = torch.stack([val[i][0] for i in range(len(val))])
    y = torch.tensor([val[i][1] for i in range(len(val))])
    with torch.no_grad():
        acc = float((model(x).argmax(1) == y).float().mean())
    print(f"samples {total} of {4 * len(data)} accuracy {acc:.3f}")
"""


@pytest.mark.parametrize(
    "mode,nranks,counter",
    [("sync", 3, "auto"), ("hybrid", 4, "auto"), ("hybrid", 4, "server")],
)
def test_a_users_loop_with_the_sampler_and_a_dataloader_learns(
    tmp_path, mode, nranks, counter
):
    from hybridagg.data import convert_digits

    data = convert_digits(tmp_path / "digits.h5", val_fraction=0.2, seed=0)
    script = tmp_path / "user.py"
    script.write_text(USER_SCRIPT)
    argv = runner.mpiexec_argv(
        nranks, [sys.executable, str(script), str(data), mode, counter]
    )
    env = runner.mpiexec_env()
    env["PYTHONPATH"] = str(ROOT)
    env["HYBRIDAGG_TIMEOUT"] = "60"
    env["HYBRIDAGG_LOG_LEVEL"] = "INFO"  # (rank 0's note of the counter)
    result = runner.run_job(argv, timeout=300, env=env)
    text = result.stdout + result.stderr
    assert result.returncode == 0, text[-3000:]
    line = next(ln for ln in result.stdout.splitlines() if ln.startswith("samples"))
    samples, total, acc = (float(w) for w in np.array(line.split())[[1, 3, 5]])
    # every sample of every epoch trained on once (sync: 1438 samples leave a
    # remainder of 46 >= 3 workers, so nothing is padded); hybrid: the group
    # of two pads at most one sample an epoch
    assert total <= samples <= total + (4 if mode == "hybrid" else 0), line
    assert acc > 0.85, line  # chance is 0.1
    if mode == "hybrid":  # rank 0 says where the chunks come from
        home = "parameter server 0" if counter == "server" else "a window on worker 0"
        assert f"the workers draw their chunks from {home}" in text, text[-3000:]
