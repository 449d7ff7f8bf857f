"""Run one simulation in a child process and read its prediction.

SimGrid allows one engine per process, so every :func:`simulate` call starts
``python -m hybridagg.sim.engine`` (the same interpreter) with the job as a
JSON file and waits for it, at most ``timeout`` seconds.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Any

from ._simgrid import find_extension
from .job import SimJob

__all__ = ["Prediction", "simulate"]


@dataclass(frozen=True)
class Prediction:
    """What the simulator predicts for a job.

    Attributes:
        samples_per_sec: Samples trained per simulated second.
        ideal_samples_per_sec: The sum of the workers' compute-only rates.
        time_s: Simulated seconds to the given steps (or epochs).
        updates: Model updates counted (sync: all-reduces; else server 0's).
        samples: Samples those updates carried.
        group_update_s: Mean seconds per update of each group.
        mean_staleness: Mean staleness of the updates (server 0's count).
        wall_s: Seconds the simulation itself took.
        steady_samples_per_sec: Samples per second over the second half of
            the updates, without the start-up transient of the first rounds
            (with many leaders, every one pushing at once); the whole run's
            mean where there are fewer than two updates.
    """

    samples_per_sec: float
    ideal_samples_per_sec: float
    time_s: float
    updates: int
    samples: int
    group_update_s: tuple[float | None, ...]
    mean_staleness: float
    wall_s: float
    steady_samples_per_sec: float

    def as_dict(self) -> dict[str, Any]:
        """Plain values (``--json``)."""
        return {
            "samples_per_sec": self.samples_per_sec,
            "ideal_samples_per_sec": self.ideal_samples_per_sec,
            "time_s": self.time_s,
            "updates": self.updates,
            "samples": self.samples,
            "group_update_s": list(self.group_update_s),
            "mean_staleness": self.mean_staleness,
            "wall_s": self.wall_s,
            "steady_samples_per_sec": self.steady_samples_per_sec,
        }


def simulate(job: SimJob, *, timeout: float = 600.0) -> Prediction:
    """Simulate ``job`` (in a child process; see the module).

    Raises:
        SimGridMissing: SimGrid's extension is not installed.
        TimeoutError: The simulation ran past ``timeout`` seconds.
        RuntimeError: The engine failed (its error output in the message).
    """
    find_extension()  # the clear message, before starting a child
    with tempfile.TemporaryDirectory(prefix="hybridagg-sim-") as tmp:
        job_path = os.path.join(tmp, "job.json")
        out_path = os.path.join(tmp, "result.json")
        with open(job_path, "w") as f:
            json.dump(job.as_dict(), f)
        try:
            done = subprocess.run(
                [sys.executable, "-m", "hybridagg.sim.engine", job_path, out_path],
                capture_output=True,
                text=True,
                timeout=timeout,
                check=False,
            )
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"the simulation ran past {timeout:g} s") from None
        if done.returncode != 0 or not os.path.exists(out_path):
            tail = (done.stderr or done.stdout).strip().splitlines()[-15:]
            raise RuntimeError(
                f"the simulation failed (exit {done.returncode}):\n" + "\n".join(tail)
            )
        with open(out_path) as f:
            data = json.load(f)
    return Prediction(
        samples_per_sec=data["samples_per_sec"],
        ideal_samples_per_sec=data["ideal_samples_per_sec"],
        time_s=data["time_s"],
        updates=data["updates"],
        samples=data["samples"],
        group_update_s=tuple(data["group_update_s"]),
        mean_staleness=data["mean_staleness"],
        wall_s=data["wall_s"],
        steady_samples_per_sec=data["steady_samples_per_sec"],
    )
