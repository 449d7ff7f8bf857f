"""A user's own loop with ShareSampler across hosts (tests/cluster).

Two groups of two workers (one per host), a server on a third host: the
groups draw their chunks of every epoch from server 0, the second group
steps four times slower and so takes less; rank 0 prints, as JSON, which
counter the sampler used, how many samples each worker took and whether
every sample of each epoch was taken, the seconds making the sampler took
(a window across hosts is slow to create) and those the epochs took.
"""

import json
import sys
import time

import torch

import hybridagg
from hybridagg.data import ShareSampler

N, EPOCHS, BATCH = 2000, 2, 10

topo = hybridagg.init(groups="0-1,2-3", servers=1)
if topo.is_server:
    hybridagg.serve(topo)
    raise SystemExit
torch.manual_seed(0)
model = torch.nn.Linear(4, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
opt = hybridagg.DistributedOptimizer(opt, model=model, topology=topo, mode="hybrid")
# (an argument: the counter to use, as ShareSampler's counter=; default auto)
counter = sys.argv[1] if len(sys.argv) > 1 else "auto"
made = time.perf_counter()
sampler = ShareSampler(N, batch_size=BATCH, topology=topo, counter=counter)
loader = torch.utils.data.DataLoader(torch.arange(N), batch_size=BATCH, sampler=sampler)
taken = []
start = time.perf_counter()
sampler_s = start - made
for epoch in range(EPOCHS):
    sampler.set_epoch(epoch)
    mine = []
    for b in loader:
        opt.zero_grad()
        model(torch.randn(len(b), 4)).sum().backward()
        opt.step()
        time.sleep(0.004 if topo.rank < 2 else 0.016)
        mine += b.tolist()
    taken.append(mine)
seconds = time.perf_counter() - start
counter = type(sampler.counter).__name__
sampler.free()
views = topo.comms.workers.allgather(taken)
opt.finish()
if topo.rank == 0:
    epochs = []
    for e in range(EPOCHS):
        every = [i for v in views for i in v[e]]
        epochs.append(
            {"all": sorted(set(every)) == list(range(N)), "extra": len(every) - N}
        )
    print(json.dumps({
        "counter": counter,
        "samples": [sum(len(e) for e in v) for v in views],
        "sampler_s": sampler_s,
        "seconds": seconds,
        "epochs": epochs,
    }))  # fmt: skip
