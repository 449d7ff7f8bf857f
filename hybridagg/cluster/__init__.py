"""An emulated cluster on one machine: hosts in network namespaces, links shaped by the kernel.

:mod:`~hybridagg.cluster.spec` reads and checks a cluster file (pure),
:mod:`~hybridagg.cluster.plan` turns it into commands and files (pure), and
:mod:`~hybridagg.cluster.netns` brings it up and down (root). ``hybridagg
cluster up|down|status FILE`` is the command line; ``hybridagg-run --cluster
FILE`` places a job's ranks on the hosts.
"""

from .netns import (
    ClusterError,
    EmulatedCluster,
    down,
    leftovers,
    read_state,
    state_dir,
    traffic,
    up,
)
from .spec import ClusterSpec, Host, Link, load, parse, parse_rate

__all__ = [
    "ClusterError",
    "ClusterSpec",
    "EmulatedCluster",
    "Host",
    "Link",
    "down",
    "leftovers",
    "load",
    "parse",
    "parse_rate",
    "read_state",
    "state_dir",
    "traffic",
    "up",
]
