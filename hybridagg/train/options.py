"""``hybridagg train``'s options: a validated dataclass and its command line.

:class:`TrainConfig` checks everything that does not need MPI (modes and
their options, numbers, the model name, the slowdown spec) as pure logic, so
every rank reaches the same verdict before any communication starts.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass, fields

from ..modes import MODES, check_mode
from ..ps.compensation import DAMPING_RULES
from ..slowdown import Slowdown, parse_slowdown
from .models import MODELS

__all__ = ["OPTIMIZERS", "TrainConfig", "add_arguments", "config_from_args"]

OPTIMIZERS = ("sgd", "adam", "adamw")


@dataclass(frozen=True)
class TrainConfig:
    """Everything one training run needs (see ``hybridagg train --help``)."""

    data: str
    mode: str = "sync"
    groups: str | None = None
    servers: int | None = None
    model: str = "mlp"
    optimizer: str = "sgd"
    lr: float = 0.05
    momentum: float = 0.9
    weight_decay: float = 0.0
    batch_size: int = 32
    epochs: int | None = None
    steps: int | None = None
    eval_every: int = 50
    target_accuracy: float | None = None
    seed: int = 0
    slowdown: str | None = None
    sample_ms: float = 0.0
    warmup_updates: int = 0
    damping: str = "inverse"
    lookahead: bool = True
    lookahead_horizon: float | None = None
    staleness_bound: int | None = None
    overlap: bool = False
    allreduce_backend: str = "auto"
    metrics: str | None = None
    summary: str | None = None
    checkpoint: str | None = None
    checkpoint_every: int | None = None
    resume: bool = False
    progress: bool = True
    device: str = "cpu"
    adaptive_batch: bool = False
    adaptive_groups: bool = False
    batch_deadband: float = 0.2
    batch_window: int = 5
    batch_first_window: int = 2
    batch_probe: int | None = None
    batch_smoothing: float = 0.5
    min_batch: int = 1
    max_batch: int | None = None

    def __post_init__(self) -> None:
        check_mode(
            self.mode,
            servers=self.servers,
            singleton_groups=None if self.groups in (None, "each") else False,
            groups=f"--groups {self.groups}",
            cli=True,
        )
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(
                f"--optimizer must be one of {', '.join(OPTIMIZERS)}, got {self.optimizer!r}"
            )
        if self.model not in MODELS and ":" not in self.model:
            raise ValueError(
                f"unknown --model {self.model!r}: choose one of {', '.join(sorted(MODELS))} "
                "or give package.module:factory"
            )
        if self.damping not in DAMPING_RULES:
            raise ValueError(f"--damping must be one of {', '.join(DAMPING_RULES)}")
        for name in ("lr",):
            if not getattr(self, name) > 0:
                raise ValueError(
                    f"--{name} must be positive, got {getattr(self, name)}"
                )
        for name, low in (
            ("batch_size", 1),
            ("epochs", 1),
            ("steps", 1),
            ("eval_every", 1),
            ("warmup_updates", 0),
            ("staleness_bound", 0),
            ("checkpoint_every", 1),
            ("seed", 0),
        ):
            value = getattr(self, name)
            if value is not None and value < low:
                flag = name.replace("_", "-")
                raise ValueError(f"--{flag} must be >= {low}, got {value}")
        if self.lookahead_horizon is not None and not self.lookahead_horizon >= 0:
            raise ValueError(
                f"--lookahead-horizon must be >= 0, got {self.lookahead_horizon}"
            )
        if self.momentum < 0 or self.weight_decay < 0 or self.sample_ms < 0:
            raise ValueError("--momentum, --weight-decay and --sample-ms must be >= 0")
        if self.target_accuracy is not None and not 0 < self.target_accuracy <= 1:
            raise ValueError(
                f"--target-accuracy is a fraction in (0, 1], got {self.target_accuracy}"
            )
        if self.mode == "sync" and (self.staleness_bound is not None or self.overlap):
            raise ValueError(
                "--staleness-bound and --overlap need --mode hybrid or async"
            )
        if (self.checkpoint_every or self.resume) and not self.checkpoint:
            raise ValueError("--checkpoint-every and --resume need --checkpoint DIR")
        if self.adaptive_groups and not (self.adaptive_batch and self.mode == "hybrid"):
            raise ValueError(
                "--adaptive-groups needs --adaptive-batch and --mode hybrid"
            )
        if not 0 <= self.batch_deadband < 1:
            raise ValueError(
                f"--batch-deadband must be in [0, 1), got {self.batch_deadband}"
            )
        if not 0 < self.batch_smoothing <= 1:
            raise ValueError(
                f"--batch-smoothing must be in (0, 1], got {self.batch_smoothing}"
            )
        if self.batch_window < 1 or self.batch_first_window < 1 or self.min_batch < 1:
            raise ValueError(
                "--batch-window, --batch-first-window and --min-batch must be >= 1"
            )
        if self.batch_probe is not None and self.batch_probe < 0:
            raise ValueError(f"--batch-probe must be >= 0, got {self.batch_probe}")
        if self.max_batch is not None and not (
            self.min_batch <= self.batch_size <= self.max_batch
        ):
            raise ValueError(
                f"--batch-size {self.batch_size} must lie within --min-batch "
                f"{self.min_batch} and --max-batch {self.max_batch}"
            )
        self.parsed_slowdown()  # raises on a malformed spec

    def parsed_slowdown(self) -> Slowdown:
        """The ``--slowdown`` schedule."""
        return parse_slowdown(self.slowdown)

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

    @property
    def max_epochs(self) -> int | None:
        """Epochs to run: as given, else 1 when ``--steps`` is not given either."""
        if self.epochs is None and self.steps is None:
            return 1
        return self.epochs

    def as_dict(self) -> dict:
        """Plain values (for the summary and the checkpoint manifest)."""
        return asdict(self)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``hybridagg train``."""
    g = p.add_argument_group("what to train")
    g.add_argument("--data", required=True, help="HDF5 file from 'hybridagg convert'")
    g.add_argument(
        "--model",
        default="mlp",
        help=f"{', '.join(sorted(MODELS))} or package.module:factory (default mlp)",
    )
    g.add_argument("--optimizer", default="sgd", choices=OPTIMIZERS)
    g.add_argument(
        "--lr",
        type=float,
        default=0.05,
        help="learning rate for one worker's batch of --batch-size; each update "
        "scales it by its samples / --batch-size (default 0.05)",
    )
    g.add_argument(
        "--momentum", type=float, default=0.9, help="SGD momentum (default 0.9)"
    )
    g.add_argument("--weight-decay", type=float, default=0.0)
    g.add_argument("--batch-size", type=int, default=32, help="per worker (default 32)")
    g.add_argument(
        "--epochs",
        type=int,
        help="passes over the training data by all workers together",
    )
    g.add_argument(
        "--steps",
        type=int,
        help="model updates: all-reduce steps (sync), server versions (hybrid, async)",
    )
    g.add_argument(
        "--warmup-updates",
        type=int,
        default=0,
        help="updates over which the linear lr scaling ramps up",
    )
    g.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("how to aggregate")
    g.add_argument("--mode", default="sync", choices=MODES)
    g.add_argument(
        "--groups",
        help="world, each, node, device, speed[:K], slurm, "
        "0-3,4-5 or a JSON file (default: world/node/each by mode)",
    )
    g.add_argument(
        "--servers",
        type=int,
        help="parameter servers: the last K ranks "
        "(default 0 in sync, 1 in hybrid and async)",
    )
    g.add_argument(
        "--damping",
        default="inverse",
        choices=DAMPING_RULES,
        help="staleness damping of the lr (default 1/(1+staleness))",
    )
    g.add_argument(
        "--no-lookahead",
        dest="lookahead",
        action="store_false",
        help="answer pushes with the current weights, not the ones expected "
        "when the group's next gradient lands (momentum lookahead; hybrid, async)",
    )
    g.add_argument(
        "--lookahead-horizon",
        type=float,
        help="groups whose mean staleness exceeds this many updates get the "
        "current weights (default: the number of groups)",
    )
    g.add_argument(
        "--staleness-bound",
        type=int,
        help="SSP: a group may be at most this many of its updates ahead",
    )
    g.add_argument(
        "--overlap",
        action="store_true",
        help="overlap a leader's exchange with its group's next step",
    )
    g.add_argument(
        "--allreduce-backend",
        default="auto",
        choices=["auto", "mpi", "torch", "horovod"],
    )
    g.add_argument(
        "--device", default="cpu", help="cpu, or cuda (one GPU per node-local rank)"
    )
    g = p.add_argument_group("heterogeneity emulation")
    g.add_argument(
        "--slowdown",
        help="per-rank factors, e.g. '0-1:1,2-3:4' or "
        "'0-1:1,2-3:4@0;0-1:3,2-3:1@30' (changes at 30 s)",
    )
    g.add_argument(
        "--sample-ms",
        type=float,
        default=0.0,
        help="base compute milliseconds per sample; steps sleep to MS x batch x factor",
    )
    g = p.add_argument_group("adaptive batch sizes (OmniLearn's controller)")
    g.add_argument(
        "--adaptive-batch",
        action="store_true",
        help="move batch from slow workers to fast ones (sync: all workers, "
        "global batch kept; hybrid: inside groups and across groups by "
        "server 0; async: server 0 sizes each worker's batch)",
    )
    g.add_argument(
        "--adaptive-groups",
        action="store_true",
        help="hybrid: server 0 also sizes each group's total batch so groups "
        "reach the server at similar rates",
    )
    g.add_argument(
        "--batch-deadband",
        type=float,
        default=0.2,
        help="act only when some batch changes by more than this fraction",
    )
    g.add_argument(
        "--batch-window",
        type=int,
        default=5,
        help="steps per measurement window (one decision per window)",
    )
    g.add_argument(
        "--batch-first-window",
        type=int,
        default=2,
        help="steps of the first window, before any speed is known (default 2)",
    )
    g.add_argument(
        "--batch-probe",
        type=int,
        default=None,
        help="sync and hybrid: before the first step every worker times this "
        "many samples (a forward and backward on zeros, not trained on) and "
        "the batch is split by the result, so the run does not start at the "
        "slowest worker's pace (default: a quarter of --batch-size; 0: off)",
    )
    g.add_argument(
        "--batch-smoothing",
        type=float,
        default=0.5,
        help="weight of the newest window in the speed estimate",
    )
    g.add_argument(
        "--min-batch", type=int, default=1, help="smallest batch of a worker"
    )
    g.add_argument("--max-batch", type=int, help="largest batch of a worker (memory)")
    g = p.add_argument_group("measuring and saving")
    g.add_argument(
        "--eval-every", type=int, default=50, help="updates between validations"
    )
    g.add_argument("--target-accuracy", type=float, help="for time_to_target_s (0-1)")
    g.add_argument("--metrics", help="JSON lines: one record per step per rank")
    g.add_argument("--summary", help="JSON summary of the run")
    g.add_argument("--checkpoint", help="checkpoint directory")
    g.add_argument("--checkpoint-every", type=int, help="updates between checkpoints")
    g.add_argument(
        "--resume", action="store_true", help="continue from the last checkpoint"
    )
    g.add_argument(
        "--no-progress",
        dest="progress",
        action="store_false",
        help="no progress bar on rank 0",
    )


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """Build and validate a :class:`TrainConfig` from parsed arguments."""
    names = {f.name for f in fields(TrainConfig)}
    return TrainConfig(**{k: v for k, v in vars(args).items() if k in names})
