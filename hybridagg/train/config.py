"""``hybridagg train``'s configuration: one validated dataclass, grouped by concern.

Pure logic (no torch, no MPI), so every rank reaches the same verdict before
any communication starts, and the command line (:mod:`hybridagg.train.flags`)
is generated from these fields: a field's name is its flag (``batch_size`` is
``--batch-size``; a boolean that defaults to true is ``--no-NAME``), its
default is the flag's default, and the first paragraph of its docstring is
the flag's help. ``metadata`` adds what a name, type and default cannot say
(:func:`option`).

Each concern is a frozen dataclass of its own that checks its own fields
(:data:`CONCERNS`, in the order of ``--help``); :class:`TrainConfig` is all of
them together and adds the checks that span concerns. Access stays flat
(``cfg.lr``, ``cfg.mode``): the flags are one flat namespace, so the fields
are too, ``TrainConfig(data=..., lr=...)`` is the public constructor, and the
checkpoint manifest keeps its flat ``config``. A function that needs one
concern takes that concern's type (``make_optimizer(opts: OptimOptions)``).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any, ClassVar

from ..modes import MODES, check_mode
from ..ps.compensation import DAMPING_RULES
from ..slowdown import Slowdown, parse_slowdown
from .zoo import MODELS

__all__ = [
    "ALLREDUCE_BACKENDS",
    "CONCERNS",
    "OPTIMIZERS",
    "AdaptiveOptions",
    "CheckpointOptions",
    "DataOptions",
    "EmulationOptions",
    "EvaluationOptions",
    "ExecutionOptions",
    "LengthOptions",
    "ModelOptions",
    "OptimOptions",
    "OutputOptions",
    "StalenessOptions",
    "TopologyOptions",
    "TrainConfig",
    "flag",
    "option",
]

OPTIMIZERS = ("sgd", "adam", "adamw")
# hybridagg.optimizer.backends.BACKENDS, which imports MPI (tests/test_train_config.py
# checks that the two agree)
ALLREDUCE_BACKENDS = ("auto", "mpi", "torch", "horovod")

WHAT = "what to train"
HOW = "how to aggregate"


def flag(name: str) -> str:
    """The command-line flag of field ``name`` (``batch_size``: ``--batch-size``)."""
    return "--" + name.replace("_", "-")


def option(
    default: Any = MISSING,
    *,
    choices: Collection[str] | None = None,
    at_least: float | None = None,
    help: str | None = None,
) -> Any:
    """A field whose flag or check needs more than its name, type and default.

    Args:
        default: The default value (omit for a required field).
        choices: The only values allowed (checked here and by the parser).
        at_least: Lower bound, checked unless the value is ``None``.
        help: Help text computed at import (``--model`` lists the zoo); the
            docstring then stays the description for readers of the code.
    """
    meta = {"choices": choices, "at_least": at_least, "help": help}
    return field(
        default=default, metadata={k: v for k, v in meta.items() if v is not None}
    )


def _check_declared(cfg: Any, concern: type) -> None:
    """The checks declared in ``concern``'s field metadata, on ``cfg``'s values."""
    for f in fields(concern):
        value = getattr(cfg, f.name)
        choices = f.metadata.get("choices")
        if choices is not None and value not in choices:
            raise ValueError(
                f"{flag(f.name)} must be one of {', '.join(choices)}, got {value!r}"
            )
        low = f.metadata.get("at_least")
        if low is not None and value is not None and not value >= low:
            raise ValueError(f"{flag(f.name)} must be >= {low}, got {value}")


class _Concern:
    """What every concern shares: its ``--help`` group and its own checks."""

    help_group: ClassVar[str]

    def __post_init__(self) -> None:
        _check_declared(self, type(self))
        self._check()

    def _check(self) -> None:
        """Checks beyond the declared ones (none unless a concern adds them)."""


@dataclass(frozen=True, kw_only=True)
class DataOptions(_Concern):
    """The training data and the order it is read in."""

    help_group: ClassVar[str] = WHAT

    data: str
    """HDF5 file from 'hybridagg convert'"""

    seed: int = option(0, at_least=0)
    """seed of the model's initial weights and of the order the data is read in"""


@dataclass(frozen=True, kw_only=True)
class ModelOptions(_Concern):
    """The model."""

    help_group: ClassVar[str] = WHAT

    model: str = option(
        "mlp", help=f"{', '.join(sorted(MODELS))} or package.module:factory"
    )
    """a model of the zoo (hybridagg.train.zoo.MODELS) or package.module:factory"""

    def _check(self) -> None:
        if self.model not in MODELS and ":" not in self.model:
            raise ValueError(
                f"unknown --model {self.model!r}: choose one of "
                f"{', '.join(sorted(MODELS))} or give package.module:factory"
            )


@dataclass(frozen=True, kw_only=True)
class OptimOptions(_Concern):
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
class LengthOptions(_Concern):
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


@dataclass(frozen=True, kw_only=True)
class TopologyOptions(_Concern):
    """Who does what: the mode, the groups of workers, the parameter servers."""

    help_group: ClassVar[str] = HOW

    mode: str = option("sync", choices=MODES)
    """sync: one all-reduce over every worker per step; hybrid: groups all-reduce
    inside and meet parameter servers asynchronously; async: every worker alone
    with the servers"""

    groups: str | None = None
    """world, each, node, device, speed[:K], slurm, 0-3,4-5 or a JSON file
    (default: world/node/each by mode)"""

    servers: int | None = None
    """parameter servers: the last K ranks (default 0 in sync, 1 in hybrid and
    async)"""

    def _check(self) -> None:
        check_mode(
            self.mode,
            servers=self.servers,
            singleton_groups=None if self.groups in (None, "each") else False,
            groups=f"--groups {self.groups}",
            cli=True,
        )

    @property
    def num_servers(self) -> int:
        """Servers: as given, else 0 in sync mode and 1 otherwise."""
        if self.servers is not None:
            return self.servers
        return 0 if self.mode == "sync" else 1

    @property
    def group_spec(self) -> str:
        """The grouping policy: as given, else ``world`` (sync), ``node`` (hybrid), ``each`` (async)."""
        if self.groups:
            return self.groups
        return {"sync": "world", "hybrid": "node", "async": "each"}[self.mode]


@dataclass(frozen=True, kw_only=True)
class StalenessOptions(_Concern):
    """How the parameter servers treat stale gradients (hybrid, async)."""

    help_group: ClassVar[str] = HOW

    damping: str = option("inverse", choices=DAMPING_RULES)
    """staleness damping of the lr: inverse 1/(1+staleness), sqrt
    1/sqrt(1+staleness), none"""

    lookahead: bool = True
    """momentum lookahead (hybrid, async): a push is answered with the weights
    expected when the group's next gradient lands, not the current ones"""

    lookahead_horizon: float | None = option(None, at_least=0)
    """groups whose mean staleness exceeds this many updates get the current
    weights (default: the number of groups)"""

    staleness_bound: int | None = option(None, at_least=0)
    """SSP: a group may be at most this many of its updates ahead"""


@dataclass(frozen=True, kw_only=True)
class ExecutionOptions(_Concern):
    """Where a step computes and how its communication runs."""

    help_group: ClassVar[str] = HOW

    overlap: bool = False
    """overlap a leader's exchange with its group's next step"""

    allreduce_backend: str = option("auto", choices=ALLREDUCE_BACKENDS)
    """the all-reduce inside a group: mpi, torch (NCCL on CUDA, gloo on CPU) or
    horovod; auto takes torch for CUDA parameters, else mpi"""

    device: str = "cpu"
    """cpu, or cuda: one GPU per node-local rank"""


@dataclass(frozen=True, kw_only=True)
class EmulationOptions(_Concern):
    """Emulated heterogeneity: how much slower each rank computes."""

    help_group: ClassVar[str] = "heterogeneity emulation"

    slowdown: str | None = None
    """per-rank factors, e.g. '0-1:1,2-3:4' or '0-1:1,2-3:4@0;0-1:3,2-3:1@30'
    (changes at 30 s)"""

    sample_ms: float = option(0.0, at_least=0)
    """base compute milliseconds per sample; steps sleep to MS x batch x factor"""

    def _check(self) -> None:
        self.parsed_slowdown()  # raises on a malformed spec

    def parsed_slowdown(self) -> Slowdown:
        """The ``--slowdown`` schedule."""
        return parse_slowdown(self.slowdown)


@dataclass(frozen=True, kw_only=True)
class AdaptiveOptions(_Concern):
    """Adaptive batch sizes (OmniLearn's controller, :mod:`hybridagg.batching`)."""

    help_group: ClassVar[str] = "adaptive batch sizes (OmniLearn's controller)"

    adaptive_batch: bool = False
    """move batch from slow workers to fast ones (sync: all workers, global batch
    kept; hybrid: inside groups and across groups by server 0; async: server 0
    sizes each worker's batch)"""

    adaptive_groups: bool = False
    """hybrid: server 0 also sizes each group's total batch so groups reach the
    server at similar rates"""

    batch_deadband: float = 0.2
    """act only when some batch changes by more than this fraction"""

    batch_window: int = option(5, at_least=1)
    """steps per measurement window (one decision per window)"""

    batch_first_window: int = option(2, at_least=1)
    """steps of the first window, before any speed is known"""

    batch_probe: int | None = option(None, at_least=0)
    """sync and hybrid: before the first step every worker times this many
    samples (a forward and backward on zeros, not trained on) and the batch is
    split by the result, so the run does not start at the slowest worker's pace
    (default: a quarter of --batch-size; 0: off)"""

    batch_smoothing: float = 0.5
    """weight of the newest window in the speed estimate"""

    min_batch: int = option(1, at_least=1)
    """smallest batch of a worker"""

    max_batch: int | None = None
    """largest batch of a worker (memory)"""

    def _check(self) -> None:
        if not 0 <= self.batch_deadband < 1:
            raise ValueError(
                f"--batch-deadband must be in [0, 1), got {self.batch_deadband}"
            )
        if not 0 < self.batch_smoothing <= 1:
            raise ValueError(
                f"--batch-smoothing must be in (0, 1], got {self.batch_smoothing}"
            )


@dataclass(frozen=True, kw_only=True)
class EvaluationOptions(_Concern):
    """Validation on rank 0."""

    help_group: ClassVar[str] = "measuring and saving"

    eval_every: int = option(50, at_least=1)
    """updates between validations"""

    target_accuracy: float | None = None
    """for time_to_target_s (0-1)"""

    def _check(self) -> None:
        target = self.target_accuracy
        if target is not None and not 0 < target <= 1:
            raise ValueError(f"--target-accuracy is a fraction in (0, 1], got {target}")


@dataclass(frozen=True, kw_only=True)
class OutputOptions(_Concern):
    """What the run writes and shows besides checkpoints."""

    help_group: ClassVar[str] = "measuring and saving"

    metrics: str | None = None
    """JSON lines: one record per step per rank"""

    summary: str | None = None
    """JSON summary of the run"""

    progress: bool = True
    """the progress bar and the final table on rank 0"""


@dataclass(frozen=True, kw_only=True)
class CheckpointOptions(_Concern):
    """Checkpoints and resuming from them."""

    help_group: ClassVar[str] = "measuring and saving"

    checkpoint: str | None = None
    """checkpoint directory"""

    checkpoint_every: int | None = option(None, at_least=1)
    """updates between checkpoints"""

    resume: bool = False
    """continue from the last checkpoint"""

    def _check(self) -> None:
        if (self.checkpoint_every or self.resume) and not self.checkpoint:
            raise ValueError("--checkpoint-every and --resume need --checkpoint DIR")


# The concerns are listed last to first: a dataclass collects its bases' fields
# from the last base to the first, so the fields (and repr, and the manifest's
# config) follow the order of --help.
@dataclass(frozen=True, kw_only=True)
class TrainConfig(
    CheckpointOptions,
    OutputOptions,
    EvaluationOptions,
    AdaptiveOptions,
    EmulationOptions,
    ExecutionOptions,
    StalenessOptions,
    TopologyOptions,
    LengthOptions,
    OptimOptions,
    ModelOptions,
    DataOptions,
):
    """Everything one training run needs (see ``hybridagg train --help``).

    Raises:
        ValueError: A bad value, naming its flag.
    """

    def __post_init__(self) -> None:
        for concern in CONCERNS:  # explicitly: each concern's own _check
            _check_declared(self, concern)
            concern._check(self)
        if self.mode == "sync" and (self.staleness_bound is not None or self.overlap):
            raise ValueError(
                "--staleness-bound and --overlap need --mode hybrid or async"
            )
        if self.adaptive_groups and not (self.adaptive_batch and self.mode == "hybrid"):
            raise ValueError(
                "--adaptive-groups needs --adaptive-batch and --mode hybrid"
            )
        if self.max_batch is not None and not (
            self.min_batch <= self.batch_size <= self.max_batch
        ):
            raise ValueError(
                f"--batch-size {self.batch_size} must lie within --min-batch "
                f"{self.min_batch} and --max-batch {self.max_batch}"
            )

    def as_dict(self) -> dict[str, Any]:
        """Plain values, flat (for the summary and the checkpoint manifest)."""
        return asdict(self)


CONCERNS: tuple[type, ...] = TrainConfig.__bases__[::-1]
"""The concerns, in the order of ``hybridagg train --help``."""
