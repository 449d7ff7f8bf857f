# mpiexec -n 5 python examples/hybridagg_train.py digits.h5
import sys

import torch

import hybridagg
from hybridagg.data import HDF5Loader

topo = hybridagg.init(groups="0-1,2-3", servers=1)  # + 2 groups, 1 server
if topo.is_server:  # + the server ranks serve
    hybridagg.serve(topo)  # + until every group is done
    raise SystemExit
torch.manual_seed(0)  # the same initial weights on every worker
loader = HDF5Loader(sys.argv[1], batch_size=32, normalize=True, comm=topo.comms.workers)
model = torch.nn.Sequential(
    torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10)
)
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
# + groups all-reduce inside, their leaders meet the server asynchronously
opt = hybridagg.DistributedOptimizer(opt, model=model, topology=topo, mode="hybrid")
for _epoch in range(5):
    for x, y in loader:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
opt.finish()  # + rank 0 now holds the servers' final weights
if topo.rank != 0:  # +
    raise SystemExit
val = HDF5Loader(
    sys.argv[1], split="val", batch_size=100, normalize=True, shuffle=False
)
with torch.no_grad():
    right = sum(int((model(x).argmax(1) == y).sum()) for x, y in val)
print(f"validation accuracy {right / val.total:.3f}")
