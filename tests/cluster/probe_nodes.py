"""Run on an emulated cluster: what each rank sees of its node (one JSON line per rank)."""

import json
import sys

import numpy as np
from mpi4py import MPI

from hybridagg.collectives.shm import shared_memory_usable
from hybridagg.comm import Comm

world = Comm(MPI.COMM_WORLD)
node = world.split_shared(name="node")
report = {
    "rank": world.rank,
    "host": MPI.Get_processor_name(),
    "node_size": node.size,
    "shm_world": shared_memory_usable(world, 1024, True),
    "shm_node": shared_memory_usable(node, 1024, True),
}
# a message to every other rank: the TCP transport between hosts works
total = np.array([world.rank], dtype=np.int64)
world.mpi.Allreduce(MPI.IN_PLACE, total)
report["sum"] = int(total[0])
for line in world.mpi.gather(json.dumps(report), root=0) or []:
    print(line)
sys.stdout.flush()
