# A training script written the way Horovod's PyTorch examples are
# (horovod/examples/pytorch/pytorch_mnist.py), on scikit-learn's digits.
# Only the import line is hybridagg's; with `import horovod.torch as hvd`
# it runs under Horovod unchanged.
#
#   mpiexec -n 2 python examples/horovod_style.py
#   HYBRIDAGG_MODE=hybrid HYBRIDAGG_GROUPS=0-1,2 HYBRIDAGG_SERVERS=1 \
#       mpiexec -n 4 python examples/horovod_style.py
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
import torch.utils.data.distributed

import hybridagg.torch as hvd

# Training settings
parser = argparse.ArgumentParser(description="Horovod-style digits example")
parser.add_argument("--batch-size", type=int, default=32, metavar="N")
parser.add_argument("--test-batch-size", type=int, default=100, metavar="N")
parser.add_argument("--epochs", type=int, default=5, metavar="N")
parser.add_argument("--lr", type=float, default=0.025, metavar="LR")
parser.add_argument("--momentum", type=float, default=0.9, metavar="M")
parser.add_argument("--seed", type=int, default=42, metavar="S")
parser.add_argument("--fp16-allreduce", action="store_true", default=False)
parser.add_argument("--loss-log", default=None, help="write each step's loss here")


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(64, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x):
        x = F.relu(self.fc1(x))
        return F.log_softmax(self.fc2(x), dim=1)


def digits_datasets():
    # scikit-learn ships the data set (the "digits" extra: pip install
    # 'hybridagg[digits]'). The message names no hybridagg: apart from its
    # import line, this script is Horovod's.
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise SystemExit(
            "this example trains on scikit-learn's digits: pip install scikit-learn"
        ) from None
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    test, train = order[:360], order[360:]
    return (
        torch.utils.data.TensorDataset(x[train], y[train]),
        torch.utils.data.TensorDataset(x[test], y[test]),
    )


def train(epoch):
    model.train()
    # Horovod: set epoch to sampler for shuffling.
    train_sampler.set_epoch(epoch)
    for batch_idx, (data, target) in enumerate(train_loader):
        optimizer.zero_grad()
        output = model(data)
        loss = F.nll_loss(output, target)
        loss.backward()
        optimizer.step()
        if losses is not None:
            losses.write(f"{epoch} {batch_idx} {loss.item()!r}\n")


def metric_average(val, name):
    tensor = torch.tensor(val)
    avg_tensor = hvd.allreduce(tensor, name=name)
    return avg_tensor.item()


def test():
    model.eval()
    test_loss = 0.0
    test_accuracy = 0.0
    with torch.no_grad():
        for data, target in test_loader:
            output = model(data)
            # sum up batch loss
            test_loss += F.nll_loss(output, target, reduction="sum").item()
            # get the index of the max log-probability
            pred = output.data.max(1, keepdim=True)[1]
            test_accuracy += pred.eq(target.data.view_as(pred)).float().sum().item()

    # Horovod: use test_sampler to determine the number of examples in
    # this worker's partition.
    test_loss /= len(test_sampler)
    test_accuracy /= len(test_sampler)

    # Horovod: average metric values across workers.
    test_loss = metric_average(test_loss, "avg_loss")
    test_accuracy = metric_average(test_accuracy, "avg_accuracy")

    # Horovod: print output only on first rank.
    if hvd.rank() == 0:
        print(f"test loss {test_loss:.4f}, test accuracy {test_accuracy:.4f}")


if __name__ == "__main__":
    args = parser.parse_args()

    # Horovod: initialize library.
    hvd.init()
    torch.manual_seed(args.seed)

    # Horovod: limit # of CPU threads to be used per worker.
    torch.set_num_threads(1)

    train_dataset, test_dataset = digits_datasets()
    # Horovod: use DistributedSampler to partition the training data.
    train_sampler = torch.utils.data.distributed.DistributedSampler(
        train_dataset, num_replicas=hvd.size(), rank=hvd.rank()
    )
    train_loader = torch.utils.data.DataLoader(
        train_dataset, batch_size=args.batch_size, sampler=train_sampler
    )
    # Horovod: use DistributedSampler to partition the test data.
    test_sampler = torch.utils.data.distributed.DistributedSampler(
        test_dataset, num_replicas=hvd.size(), rank=hvd.rank()
    )
    test_loader = torch.utils.data.DataLoader(
        test_dataset, batch_size=args.test_batch_size, sampler=test_sampler
    )

    model = Net()

    # Horovod: scale learning rate by the number of workers.
    optimizer = optim.SGD(
        model.parameters(), lr=args.lr * hvd.size(), momentum=args.momentum
    )

    # Horovod: broadcast parameters & optimizer state.
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    # Horovod: (optional) compression algorithm.
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none

    # Horovod: wrap optimizer with DistributedOptimizer.
    optimizer = hvd.DistributedOptimizer(
        optimizer,
        named_parameters=model.named_parameters(),
        compression=compression,
        op=hvd.Average,
    )

    losses = None
    if args.loss_log:
        losses = open(f"{args.loss_log}.rank{hvd.rank()}", "w")  # noqa: SIM115
    for epoch in range(1, args.epochs + 1):
        train(epoch)
        test()
    if losses is not None:
        losses.close()
