# python examples/plain_train.py digits.h5
import sys

import torch

from hybridagg.data import HDF5Loader

torch.manual_seed(0)
loader = HDF5Loader(sys.argv[1], batch_size=32, normalize=True)
model = torch.nn.Sequential(
    torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10)
)
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
for _epoch in range(5):
    for x, y in loader:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
val = HDF5Loader(
    sys.argv[1], split="val", batch_size=100, normalize=True, shuffle=False
)
with torch.no_grad():
    right = sum(int((model(x).argmax(1) == y).sum()) for x, y in val)
print(f"validation accuracy {right / val.total:.3f}")
