"""Running ``hybridagg train`` as a real MPI job from a test."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from hybridagg.runtime import runner


def run_train(
    nranks: int,
    args: list[str],
    *,
    env: dict | None = None,
    timeout: float = 180,
    launcher_flags: list[str] | None = None,
):
    """``mpiexec -n N [FLAGS] python -m hybridagg.cli train ARGS``; returns the RunResult."""
    argv = runner.mpiexec_argv(
        nranks,
        [sys.executable, "-m", "hybridagg.cli", "train", *args],
        extra=launcher_flags,
    )
    job_env = runner.mpiexec_env()
    job_env["HYBRIDAGG_TIMEOUT"] = "60"
    job_env.update(env or {})
    result = runner.run_job(argv, timeout=timeout, env=job_env)
    assert not result.timed_out, result.stdout[-3000:] + result.stderr[-3000:]
    assert runner.processes_with_token(result.token) == []
    return result


def output(result) -> str:
    return result.stdout + result.stderr


def summary(path: Path) -> dict:
    return json.loads(Path(path).read_text())
