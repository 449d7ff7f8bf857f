"""What to train: the data, the model, the optimizer, how long (pure logic)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..zoo import MODELS
from .fields import Concern, option

__all__ = [
    "CHUNK_COUNTERS",
    "LOSSES",
    "NORMALIZE",
    "OPTIMIZERS",
    "DataOptions",
    "LengthOptions",
    "ModelOptions",
    "OptimOptions",
]

OPTIMIZERS = ("sgd", "adam", "adamw")
NORMALIZE = ("stored", "compute", "none")
CHUNK_COUNTERS = ("auto", "window", "server")

LOSSES = ("cross-entropy", "mse")
"""``--loss``: classification on integer labels, or regression on float targets."""

WHAT = "what to train"


@dataclass(frozen=True, kw_only=True)
class DataOptions(Concern):
    """The training data and the order it is read in."""

    help_group: ClassVar[str] = WHAT

    data: str
    """HDF5 file from 'hybridagg convert'"""

    seed: int = option(0, at_least=0)
    """seed of the model's initial weights and of the order the data is read in"""

    normalize: str = option("stored", choices=NORMALIZE)
    """how samples are normalised: stored (the per-channel mean and deviation
    the data file records), compute (computed from the training split at
    start, for a file that records none), none (samples as stored)"""

    chunk_counter: str = option("auto", choices=CHUNK_COUNTERS)
    """where hybrid and async workers draw their data's chunks from: window
    (an MPI one-sided window on worker 0; across nodes without RDMA atomics,
    MPI completes a draw only when worker 0 next enters MPI), server
    (parameter server 0 answers each draw between its updates), auto (window
    when every worker is on one node, else server)"""


@dataclass(frozen=True, kw_only=True)
class ModelOptions(Concern):
    """The model."""

    help_group: ClassVar[str] = WHAT

    model: str = option(
        "mlp", help=f"{', '.join(sorted(MODELS))} or package.module:factory"
    )
    """a model of the zoo (hybridagg.train.zoo.MODELS) or package.module:factory"""

    loss: str = option("cross-entropy", choices=LOSSES)
    """the training loss: cross-entropy (integer class labels) or mse (float
    targets, regression; validation then reports the mean squared error, not
    accuracy)

    The data decides which one fits: a file whose labels are integers is a
    classification task, one whose labels are floats (``hybridagg convert
    --targets float``) a regression; the other pairing is refused at set-up.
    """

    def _check(self) -> None:
        if self.model not in MODELS and ":" not in self.model:
            raise ValueError(
                f"unknown --model {self.model!r}: choose one of "
                f"{', '.join(sorted(MODELS))} or give package.module:factory"
            )


@dataclass(frozen=True, kw_only=True)
class OptimOptions(Concern):
    """The optimizer, its hyperparameters and the batch its rate is meant for."""

    help_group: ClassVar[str] = WHAT

    optimizer: str = option("sgd", choices=OPTIMIZERS)
    """the torch.optim optimizer every update applies"""

    lr: float = 0.05
    """learning rate for one worker's batch of --batch-size; each update scales
    it by its samples / --batch-size"""

    momentum: float = option(0.9, at_least=0)
    """SGD momentum"""

    weight_decay: float = option(0.0, at_least=0)
    """weight decay (L2 penalty) of the optimizer"""

    batch_size: int = option(32, at_least=1)
    """per worker"""

    warmup_updates: int = option(0, at_least=0)
    """updates over which the linear lr scaling ramps up"""

    def _check(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"--lr must be positive, got {self.lr}")


@dataclass(frozen=True, kw_only=True)
class LengthOptions(Concern):
    """How long training runs."""

    help_group: ClassVar[str] = WHAT

    epochs: int | None = option(None, at_least=1)
    """passes over the training data by all workers together (default: 1 unless
    --steps is given)"""

    steps: int | None = option(None, at_least=1)
    """model updates: all-reduce steps (sync), server versions (hybrid, async)"""

    @property
    def max_epochs(self) -> int | None:
        """Epochs to run: as given, else 1 when ``--steps`` is not given either."""
        if self.epochs is None and self.steps is None:
            return 1
        return self.epochs
