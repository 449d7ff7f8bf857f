"""The smallest real hybridagg job: polled collectives and their idle cost.

Run: ``hybridagg run -n 4 -- python examples/comm_demo.py``. Every rank
all-reduces a tensor whose result it checks, then rank 0 waits 2 s on a
barrier that the last rank enters late, and the table shows how much CPU that
wait cost (a blocking MPI_Barrier would have cost a whole core).
"""

import resource
import time

import torch

import hybridagg
from hybridagg.comm import Comm


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    hybridagg.configure_threads()
    hybridagg.install_abort_hook()
    comm = Comm(name="demo")
    x = torch.full((1 << 20,), float(comm.rank + 1))
    comm.Allreduce(x, what="demo allreduce")
    expected = comm.size * (comm.size + 1) / 2
    if not torch.all(x == expected):
        raise RuntimeError(f"allreduce gave {x[0].item()}, expected {expected}")

    late = comm.size - 1
    if comm.rank == late:
        time.sleep(2.0)
    cpu0, wall0 = cpu_seconds(), time.perf_counter()
    comm.barrier(what="demo barrier")
    wall, cpu = time.perf_counter() - wall0, cpu_seconds() - cpu0
    rows = comm.allgather((comm.rank, wall, cpu))
    if comm.rank == 0:
        print(f"allreduce of 4 MiB over {comm.size} ranks: correct ({expected:g})")
        print(f"{'rank':>4} {'waited s':>9} {'cpu s':>7} {'cpu/wall':>9}")
        for rank, w, c in rows:
            ratio = f"{c / w:9.1%}" if w > 0.05 else f"{'-':>9}"
            print(f"{rank:>4} {w:9.3f} {c:7.3f} {ratio}")
    comm.free()


if __name__ == "__main__":
    main()
