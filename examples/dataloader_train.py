# mpiexec -n 5 python examples/dataloader_train.py digits.h5
import sys

import torch

import hybridagg
from hybridagg.data import HDF5Dataset, ShareSampler


def jitter(x):  # your augmentation: any transform of one sample
    return x + 0.05 * torch.randn_like(x)


topo = hybridagg.init(groups="0-1,2-3", servers=1)
if topo.is_server:
    hybridagg.serve(topo)
    raise SystemExit
torch.manual_seed(0)
dataset = HDF5Dataset(sys.argv[1], normalize=True, transform=jitter)
# each worker its share of every epoch; a fast group takes more of it
sampler = ShareSampler(dataset, batch_size=32, topology=topo)
loader = torch.utils.data.DataLoader(
    dataset, batch_size=32, sampler=sampler, num_workers=2
)
model = torch.nn.Sequential(
    torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10)
)
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
opt = hybridagg.DistributedOptimizer(opt, model=model, topology=topo, mode="hybrid")
for epoch in range(5):
    sampler.set_epoch(epoch)
    for x, y in loader:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
sampler.free()
opt.finish()
if topo.rank == 0:
    val = HDF5Dataset(sys.argv[1], split="val", normalize=True)
    x, y = torch.stack([v[0] for v in val]), torch.tensor([int(v[1]) for v in val])
    with torch.no_grad():
        print(f"validation accuracy {(model(x).argmax(1) == y).float().mean():.3f}")
