# mpiexec -n 3 python examples/pipeline_train.py digits.h5
"""Two groups, data parallel: a pipeline of ranks 0 and 1, and rank 2 alone.

Ranks 0 and 1 hold consecutive stages of one replica (cut by the
communication-aware partitioner); rank 2, emulated four times slower, holds
a whole replica. Each step the global batch is split between the two
groups by Ling et al.'s linear solve of their measured batch times, and
each layer's gradient is summed over the groups that hold it.
"""

import sys

import torch

from hybridagg.comm import Comm, install_abort_hook
from hybridagg.control import ShareSolver
from hybridagg.data import HDF5Dataset
from hybridagg.pipeline import (
    CrossGroupReducer,
    Link,
    PipelineStage,
    StagePace,
    best_partition,
    model_layers,
    split_layers,
)

BATCH, MICRO, EPOCHS = 64, 4, 8
SPEEDS, SAMPLE_MS = [1.0, 1.0, 0.25], 1.0  # emulated: ms a sample at speed 1


def whole(split):  # a split's samples and labels, read by this process alone
    data = HDF5Dataset(sys.argv[1], split, normalize=True)
    return next(iter(torch.utils.data.DataLoader(data, batch_size=len(data))))


install_abort_hook()  # an error on one rank ends the job, not a hang
world = Comm()
groups = [[0, 1], [2]]  # each group's world ranks, in stage order
g = next(i for i, ranks in enumerate(groups) if world.rank in ranks)
k = groups[g].index(world.rank)  # this rank's stage in its group
torch.manual_seed(0)  # the same initial weights on every rank
model = torch.nn.Sequential(
    torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 128),
    torch.nn.ReLU(), torch.nn.Linear(128, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10),
)  # fmt: skip
layers = model_layers(model)
# stage bounds from each layer's work (its weights here) and the ranks' speeds
work = [float(sum(p.numel() for p in layer.parameters())) for layer in layers]
sizes = [64 * 4.0] * (len(layers) - 1)  # bytes of an activation per sample
bounds = [
    list(best_partition(work, [SPEEDS[r] for r in ranks], sizes, Link()).bounds)
    for ranks in groups
]
mine = split_layers(layers, bounds[g])[k]
share = sum(work[bounds[g][k] : bounds[g][k + 1]]) / sum(work)
per_sample = SAMPLE_MS / 1000 * share / SPEEDS[world.rank]
pace = StagePace(forward_s=per_sample / 3, backward_s=2 * per_sample / 3)
group = world.split(g, k, name=f"group {g}")
x, y = whole("train") if k == 0 else (None, None)  # only first stages read
stage = PipelineStage(
    mine, group, sample=x[:1] if k == 0 else None,
    loss=torch.nn.functional.cross_entropy, pace=pace,
)  # fmt: skip
reducer = CrossGroupReducer(world, groups, bounds, layers)
opt = torch.optim.SGD(mine.parameters(), lr=0.1, momentum=0.9)
shares, solver = [BATCH // 2, BATCH - BATCH // 2], ShareSolver(len(groups), window=4)
n = world.bcast(len(x) if k == 0 and g == 0 else None, 0)
for epoch in range(EPOCHS):
    order = torch.randperm(n, generator=torch.Generator().manual_seed(epoch))
    for start in range(0, n - BATCH + 1, BATCH):
        lo = start + sum(shares[:g])
        batch = order[lo : lo + shares[g]]
        opt.zero_grad()
        _, _, times = stage.step((x[batch], y[batch]) if k == 0 else None, MICRO)
        reducer.allreduce(shares[g] / BATCH)  # the global batch's mean gradient
        opt.step()
        # each group's batch time, the same on every rank: the same decision
        seen = world.allgather((g, times.wall_s) if k == 0 else None)
        for group_id, seconds in filter(None, seen):
            solver.add(group_id, shares[group_id], seconds)
        shares = solver.decide(BATCH) or shares
if g == 0:  # group 0 validates: its first stage feeds, its last one scores
    vx, vy = whole("val")
    out = stage.infer(vx if k == 0 else None, MICRO)
    if out is not None:
        right = int((out.argmax(1) == vy).sum())
        print(f"shares {shares}; validation accuracy {right / len(vy):.3f}")
reducer.free()
group.free()
world.free()
