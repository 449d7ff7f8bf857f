"""How to aggregate: the topology, stale gradients, how a step runs (pure logic)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ...devices import check_device_spec
from ...modes import MODES, check_mode
from ...ps.compensation import DAMPING_RULES
from .fields import Concern, option

__all__ = [
    "ALLREDUCE_BACKENDS",
    "WIRE_FORMATS",
    "ExecutionOptions",
    "StalenessOptions",
    "TopologyOptions",
]

# hybridagg.optimizer.backends.BACKENDS, which imports MPI (tests/test_train_config.py
# checks that the two agree)
ALLREDUCE_BACKENDS = ("auto", "mpi", "torch", "horovod")

# hybridagg.comm.wire.WIRE_FORMATS, which imports torch (tests/test_train_config.py
# checks that the two agree)
WIRE_FORMATS = ("fp32", "bf16", "fp16")

HOW = "how to aggregate"


@dataclass(frozen=True, kw_only=True)
class TopologyOptions(Concern):
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

    plan: str | None = None
    """plan file from 'hybridagg plan': sets --mode, --groups, --servers,
    --batch-size and --adaptive-batch (one of them given with another value
    is an error); the job must have the plan's ranks"""

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
class StalenessOptions(Concern):
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
class ExecutionOptions(Concern):
    """Where a step computes and how its communication runs."""

    help_group: ClassVar[str] = HOW

    overlap: bool = False
    """overlap a leader's exchange with its group's next step"""

    stream_push: bool = False
    """hybrid, async: a leader pushes each bucket of its group's gradient as
    soon as the group's reduction of it completes, and the servers update
    and return each part as it arrives (not with --overlap, whose push runs
    during the next step)"""

    allreduce_backend: str = option("auto", choices=ALLREDUCE_BACKENDS)
    """the all-reduce inside a group: mpi, torch (NCCL on CUDA, gloo on CPU) or
    horovod; auto takes NCCL for a reduction whose ranks all train on GPUs
    of their own (decided per group in hybrid and async), else mpi, GPU
    tensors through pinned host memory"""

    wire: str = option("fp32", choices=WIRE_FORMATS)
    """the type gradients and weights travel in, in every mode: fp32, or bf16
    or fp16 (half the bytes; rounding with error feedback, sums formed in
    fp32, the servers' fp32 master weights never leave them; fp16 overflows
    beyond 65504 and the run stops as non-finite)"""

    device: str = "cpu"
    """where each worker trains: auto (its node-local GPU, local rank modulo
    the node's GPUs, where the node has one, else the CPU: the choice for a
    job of GPU and CPU nodes), cpu, cuda (the node-local GPU; fails where
    there is none) or cuda:N"""

    def _check(self) -> None:
        # the spelling here (pure: no torch); whether CUDA is there, at set-up
        check_device_spec(self.device)
        if self.wire != "fp32" and self.allreduce_backend == "horovod":
            raise ValueError(
                f"--wire {self.wire} needs --allreduce-backend mpi or torch, "
                "not horovod"
            )
