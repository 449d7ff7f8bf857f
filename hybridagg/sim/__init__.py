"""Know before you run: the cluster description, the profile, and a SimGrid simulator.

* :mod:`.cluster`: cluster files (node types, links, where servers run);
* :mod:`.profile`: profile files (what a model needs, measured by
  ``hybridagg profile``);
* :mod:`.job`: ``hybridagg train``'s options resolved against both;
* :mod:`.engine`: the simulation on SimGrid's s4u API (a process of its own);
* :mod:`.simulate`: runs it and reads the :class:`~.simulate.Prediction`.

Pure logic apart from :mod:`.engine`, which needs SimGrid (``make simgrid``;
:mod:`._simgrid` loads its extension alone).
"""

from .cluster import ClusterSpec, LinkSpec, NodeType, ServerPlacement, load_cluster
from .job import SimJob, build_job, machine_cluster, ring_allreduce_seconds
from .profile import Profile, load_profile, save_profile
from .simulate import Prediction, simulate

__all__ = [
    "ClusterSpec",
    "LinkSpec",
    "NodeType",
    "Prediction",
    "Profile",
    "ServerPlacement",
    "SimJob",
    "build_job",
    "load_cluster",
    "load_profile",
    "machine_cluster",
    "ring_allreduce_seconds",
    "save_profile",
    "simulate",
]
