"""Know before you run: the cluster description, the profile, and a SimGrid simulator.

* :mod:`.cluster`: cluster files (node types, links, where servers run);
* :mod:`.profile`: profile files (what a model needs, measured by
  ``hybridagg profile``);
* :mod:`.calibrate`: the model's parameters fitted on ``bench/allreduce.py``
  and ``bench/ps.py`` records, stored in the profile;
* :mod:`.job`: ``hybridagg train``'s options resolved against both;
* :mod:`.engine`: the simulation on SimGrid's s4u API (a process of its own);
* :mod:`.simulate`: runs it and reads the :class:`~.simulate.Prediction`;
* the planner (``hybridagg plan``): :mod:`.analytic` (a job's samples/s in
  closed form), :mod:`.space` (candidates, the search space, the cost
  model), :mod:`.search` (objectives, the exact searcher), :mod:`.policy`
  (the REINFORCE searcher, torch), :mod:`.planner` (search and confirm),
  :mod:`.planfile` (the plan file ``hybridagg train --plan`` reads),
  :mod:`.convergence` (updates to the target per samples per update and
  staleness: ``--objective time``).

Pure logic apart from :mod:`.engine`, which needs SimGrid (``make simgrid``;
:mod:`._simgrid` loads its extension alone).
"""

from .analytic import Estimate, estimate
from .calibrate import calibrate
from .cluster import (
    ClusterSpec,
    LinkSpec,
    MachineSpec,
    NodeType,
    ServerPlacement,
    load_cluster,
)
from .convergence import ConvergenceTable, load_convergence
from .job import SimJob, build_job, machine_cluster, ring_allreduce_seconds
from .planfile import Plan, load_plan
from .profile import Profile, load_profile, save_profile
from .search import Objective, exact_search
from .simulate import Prediction, simulate
from .space import Candidate, CostModel, Space

__all__ = [
    "Candidate",
    "ClusterSpec",
    "ConvergenceTable",
    "CostModel",
    "Estimate",
    "LinkSpec",
    "MachineSpec",
    "NodeType",
    "Objective",
    "Plan",
    "Prediction",
    "Profile",
    "ServerPlacement",
    "SimJob",
    "Space",
    "build_job",
    "calibrate",
    "estimate",
    "exact_search",
    "load_cluster",
    "load_convergence",
    "load_plan",
    "load_profile",
    "machine_cluster",
    "ring_allreduce_seconds",
    "save_profile",
    "simulate",
]
