"""``hybridagg train`` with pipelined groups: model parallelism inside groups.

A group named by ``--pipeline-groups`` holds consecutive stages of one
replica on its ranks (:mod:`hybridagg.pipeline`); across groups the job is
data parallel, synchronously or through the parameter servers, where each
stage exchanges its own layers (:mod:`hybridagg.ps.stage_client`).
"""

from .layout import PipelineLayout, flat_owners, ps_order
from .role import PipelinedWorkerRole
from .stages import (
    StageBuild,
    UnitPlan,
    build_stage,
    cut_stage,
    pipeline_units,
    plan_units,
)

__all__ = [
    "PipelineLayout",
    "PipelinedWorkerRole",
    "StageBuild",
    "UnitPlan",
    "build_stage",
    "cut_stage",
    "flat_owners",
    "pipeline_units",
    "plan_units",
    "ps_order",
]
