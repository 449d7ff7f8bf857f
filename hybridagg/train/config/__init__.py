"""``hybridagg train``'s configuration: one validated dataclass, grouped by concern.

Pure logic (no torch, no MPI), so every rank reaches the same verdict before
any communication starts, and the command line (:mod:`hybridagg.train.flags`)
is generated from the fields: a field's name is its flag (``batch_size`` is
``--batch-size``; a boolean that defaults to true is ``--no-NAME``), its
default is the flag's default, and the first paragraph of its docstring is
the flag's help (:mod:`.fields`).

Each concern is a frozen dataclass of its own that checks its own fields:
what to train (:mod:`.training`), how to aggregate (:mod:`.aggregation`),
how a worker computes its step (:mod:`.compute`), what a dead rank does to the
run (:mod:`.failures`), heterogeneity (:mod:`.heterogeneity`), measuring and saving
(:mod:`.outputs`). :class:`TrainConfig` is all of them together
(:data:`CONCERNS`, in the order of ``--help``) and adds the checks that span
concerns. :mod:`.changes` compares a checkpoint's configuration with a
resumed run's. Access stays flat (``cfg.lr``, ``cfg.mode``): the flags are one
flat namespace, so the fields are too, ``TrainConfig(data=..., lr=...)`` is
the public constructor, and the checkpoint manifest keeps its flat
``config``. A function that needs one concern takes that concern's type
(``make_optimizer(cfg: OptimOptions, ...)``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from dataclasses import fields as dataclass_fields
from typing import Any

from .aggregation import (
    ALLREDUCE_BACKENDS,
    WIRE_FORMATS,
    ExecutionOptions,
    StalenessOptions,
    TopologyOptions,
)
from .compute import AMP_MODES, ComputeOptions
from .cost import CostOptions
from .failures import ON_GROUP_FAILURE, FailureOptions
from .fields import check_declared, flag, option
from .heterogeneity import AdaptiveOptions, EmulationOptions
from .outputs import LOG_LEVELS, CheckpointOptions, EvaluationOptions, OutputOptions
from .pipeline import PIPELINE_INCOMPATIBLE, PipelineOptions
from .training import (
    LOSSES,
    NORMALIZE,
    OPTIMIZERS,
    DataOptions,
    LengthOptions,
    ModelOptions,
    OptimOptions,
)

__all__ = [
    "ALLREDUCE_BACKENDS",
    "AMP_MODES",
    "CONCERNS",
    "LOG_LEVELS",
    "LOSSES",
    "NORMALIZE",
    "ON_GROUP_FAILURE",
    "OPTIMIZERS",
    "WIRE_FORMATS",
    "AdaptiveOptions",
    "CheckpointOptions",
    "ComputeOptions",
    "CostOptions",
    "DataOptions",
    "EmulationOptions",
    "EvaluationOptions",
    "ExecutionOptions",
    "FailureOptions",
    "LengthOptions",
    "ModelOptions",
    "OptimOptions",
    "OutputOptions",
    "PipelineOptions",
    "StalenessOptions",
    "TopologyOptions",
    "TrainConfig",
    "flag",
    "option",
]


# The concerns are listed last to first: a dataclass collects its bases' fields
# from the last base to the first, so the fields (and repr, and the manifest's
# config) follow the order of --help.
@dataclass(frozen=True, kw_only=True)
class TrainConfig(
    CheckpointOptions,
    OutputOptions,
    EvaluationOptions,
    CostOptions,
    AdaptiveOptions,
    EmulationOptions,
    FailureOptions,
    ComputeOptions,
    PipelineOptions,
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
        # called by class: through the instance, _check would find only the
        # first concern's in the method resolution order
        for concern in CONCERNS:
            check_declared(self, concern)
            concern._check(self)
        if self.mode == "sync" and (self.staleness_bound is not None or self.overlap):
            raise ValueError(
                "--staleness-bound and --overlap need --mode hybrid or async"
            )
        if self.survives_group_loss and self.mode == "sync":
            raise ValueError(
                "--on-group-failure continue needs --mode hybrid or async: in sync "
                "mode every worker is in the one all-reduce, so no group can be "
                "dropped"
            )
        if self.chunk_counter != "auto" and self.mode == "sync":
            raise ValueError(
                "--chunk-counter needs --mode hybrid or async: sync's workers "
                "read fixed shares of the data and draw no chunks"
            )
        if self.survives_group_loss and self.chunk_counter == "window":
            raise ValueError(
                "--on-group-failure continue needs --chunk-counter server (or "
                "auto): a worker dying while it held the window's lock would "
                "stop every other worker's draws"
            )
        if self.survives_group_loss and self.adaptive_groups:
            raise ValueError(
                "--on-group-failure continue does not combine with "
                "--adaptive-groups (workers move between groups through "
                "collectives over every worker)"
            )
        if self.adaptive_groups and not (self.adaptive_batch and self.mode == "hybrid"):
            raise ValueError(
                "--adaptive-groups needs --adaptive-batch and --mode hybrid"
            )
        if self.amp == "fp16" and self.device == "cpu":
            raise ValueError(
                "--amp fp16 needs --device cuda: autocast on the CPU computes in "
                "bf16 (--amp bf16)"
            )
        if self.amp == "fp16" and self.stream_push:
            raise ValueError(
                "--amp fp16 does not combine with --stream-push: a streamed push "
                "sends each bucket to the servers before the step knows whether "
                "a gradient overflowed the loss scale"
            )
        if self.loss == "mse" and self.target_accuracy is not None:
            raise ValueError(
                "--target-accuracy needs --loss cross-entropy: with --loss mse "
                "validation measures the mean squared error, not accuracy"
            )
        if self.pipelined:
            self._check_pipelined()
        if self.cost_budget is not None and not (
            self.pipelined and self.mode == "sync" and self.adaptive_batch
        ):
            # (the controller parks whole groups and re-splits the batch
            # among the others: the pipelined sync loop's group shares)
            raise ValueError(
                "--cost-budget needs --pipeline-groups, --mode sync and "
                "--adaptive-batch: it chooses which groups train and splits "
                "the global batch among them"
            )
        if self.max_batch is not None and not (
            self.min_batch <= self.batch_size <= self.max_batch
        ):
            raise ValueError(
                f"--batch-size {self.batch_size} must lie within --min-batch "
                f"{self.min_batch} and --max-batch {self.max_batch}"
            )

    def _check_pipelined(self) -> None:
        """What a job with pipelined groups refuses (the same on every rank)."""
        defaults = {f.name: f.default for f in dataclass_fields(self)}
        for name, what in PIPELINE_INCOMPATIBLE.items():
            if getattr(self, name) != defaults[name]:
                raise ValueError(
                    f"--pipeline-groups does not combine with {what} yet: drop "
                    f"{flag(name)}"
                )
        if self.amp != "none" or self.accumulate != 1 or self.wire != "fp32":
            raise ValueError(
                "--pipeline-groups needs --amp none, --accumulate 1 and --wire "
                "fp32: a pipelined step splits its batch into micro-batches "
                "itself and its stages push float32 parts"
            )
        if self.survives_group_loss:
            raise ValueError(
                "--pipeline-groups does not combine with --on-group-failure "
                "continue yet"
            )
        if self.mode == "async":
            raise ValueError(
                "--pipeline-groups needs --mode sync or hybrid: async makes every "
                "worker a group of its own (in a job with pipelined groups every "
                "other group is one rank already, so hybrid is async for them)"
            )
        if self.adaptive_batch and self.mode != "sync":
            raise ValueError(
                "--pipeline-groups with --adaptive-batch needs --mode sync (the "
                "groups' shares of the global batch are solved from their "
                "measured batch times); in hybrid mode each group already "
                "steps at its own pace"
            )
        if self.pipeline_init == "meta" and self.sample_ms <= 0 and self.slowdown:
            raise ValueError(
                "--pipeline-init meta with --slowdown needs --sample-ms: a rank "
                "cannot time the whole model it never holds"
            )
        if self.mode == "hybrid" and self.groups == "each":
            raise ValueError(
                "--pipeline-groups needs groups of several ranks to pipeline; "
                "--groups each makes every group one rank"
            )

    def as_dict(self) -> dict[str, Any]:
        """Plain values, flat (for the summary and the checkpoint manifest)."""
        return asdict(self)


CONCERNS: tuple[type, ...] = TrainConfig.__bases__[::-1]
"""The concerns, in the order of ``hybridagg train --help``."""
