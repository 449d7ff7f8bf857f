"""What a run cost the machines: CPU seconds per rank, and the cores' bound.

Emulated compute sleeps and costs no CPU; what remains is the real work of
every rank (compute, reduction, the servers' updates, copies, MPI). Packed
perfectly on the machines' cores it would still take ``cpu_s / cores``
seconds, so no schedule can process more than ``samples / (cpu_s /
cores)`` samples per second: the run's cores' bound.
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

__all__ = ["cores_bound", "machine_usage"]

_BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


def machine_usage(cpu0: float) -> dict:
    """This process's CPU seconds since ``cpu0`` (``time.process_time``, all
    its threads) and the machine it ran on.

    The machine is the kernel's boot id, not the host name: the hosts of an
    emulated cluster share one kernel, and so one set of cores.
    """
    try:
        machine = _BOOT_ID.read_text().strip()
    except OSError:
        machine = socket.gethostname()
    return {
        "cpu_s": time.process_time() - cpu0,
        "machine": machine,
        "cores": os.cpu_count() or 1,
    }


def cores_bound(reports: list[dict], samples: float) -> tuple[float, int, float | None]:
    """``(cpu_s, cores, samples/s bound)`` of a run from every rank's report.

    Reports without ``cpu_s`` are left out; ``cores`` counts each machine once.
    """
    used = [r for r in reports if "cpu_s" in r]
    cpu = sum(r["cpu_s"] for r in used)
    cores = sum({r["machine"]: r["cores"] for r in used}.values())
    bound = samples / (cpu / cores) if cpu > 0 and cores else None
    return cpu, cores, bound
