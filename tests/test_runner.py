"""Launcher detection and flags (pure logic with fake launchers, no MPI)."""

import os
import stat
import sys
from pathlib import Path

import pytest

from hybridagg.runtime import runner


def fake_launcher(tmp_path, name, version_text):
    path = tmp_path / name
    path.write_text(f"#!/bin/sh\necho '{version_text}'\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


@pytest.mark.parametrize(
    "text,flavor,major",
    [
        ("mpiexec (Open MPI) 5.0.11", "openmpi", 5),
        ("mpirun (Open MPI) 4.1.4", "openmpi", 4),
        ("HYDRA build details:\n    Version: 4.2.0", "mpich", 0),
        ("something else", "unknown", 0),
    ],
)
def test_flavor_detection(tmp_path, text, flavor, major):
    info = runner.mpiexec_info(fake_launcher(tmp_path, "mpiexec", text))
    assert (info.flavor, info.major) == (flavor, major)


def test_open_mpi_gets_oversubscribe_and_no_binding(tmp_path):
    path = fake_launcher(tmp_path, "mpiexec", "mpiexec (Open MPI) 5.0.11")
    argv = runner.mpiexec_argv(5, ["python", "x.py"], mpiexec=path)
    assert argv[:3] == [path, "-n", "5"]
    assert "--oversubscribe" in argv
    assert argv[argv.index("--bind-to") + 1] == "none"
    assert argv[-2:] == ["python", "x.py"]


def test_hydra_needs_no_extra_flags(tmp_path):
    path = fake_launcher(tmp_path, "mpiexec", "HYDRA build details:")
    assert runner.mpiexec_argv(3, ["a"], mpiexec=path) == [path, "-n", "3", "a"]


@pytest.mark.parametrize("n", [0, -2])
def test_bad_rank_count(n):
    with pytest.raises(ValueError, match="nranks"):
        runner.mpiexec_argv(n, ["a"])


def test_a_job_across_an_emulated_cluster_goes_through_hybridagg_run():
    argv = runner.launch_argv(2, ["python", "x.py"], cluster="c.toml")
    run = Path(argv[0])
    assert run.name == "hybridagg-run"
    if (Path(sys.executable).parent / "hybridagg-run").exists():
        assert run.parent == Path(sys.executable).parent  # this venv's own
    assert argv[1:] == ["--cluster", "c.toml", "-n", "2", "--", "python", "x.py"]
    assert runner.launch_argv(2, ["a"]) == runner.mpiexec_argv(2, ["a"])
    with pytest.raises(ValueError, match="nranks"):
        runner.launch_argv(0, ["a"], cluster="c.toml")
    with pytest.raises(ValueError, match="command is empty"):
        runner.launch_argv(2, [], cluster="c.toml")


def test_env_drops_enclosing_job_and_allows_root():
    base = {"PATH": "/bin", "PMIX_RANK": "3", "OMPI_COMM_WORLD_RANK": "3", "X": "1"}
    env = runner.mpiexec_env(base)
    assert "PMIX_RANK" not in env and "OMPI_COMM_WORLD_RANK" not in env
    assert env["X"] == "1"
    assert env["PRTE_MCA_rmaps_default_mapping_policy"] == ":oversubscribe"
    if os.geteuid() == 0:
        assert env["OMPI_ALLOW_RUN_AS_ROOT"] == "1"
        assert env["OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"] == "1"


def test_run_job_kills_a_process_tree_on_timeout():
    # A shell that starts a grandchild in its own process group, like mpiexec
    # does with ranks, then hangs.
    script = "setsid sleep 300 & sleep 300"
    result = runner.run_job(["sh", "-c", script], timeout=1.0, grace=0.5)
    assert result.timed_out
    assert result.elapsed < 10
    assert runner.processes_with_token(result.token) == []


def test_jobs_get_a_tcp_eager_limit_above_a_servers_part_unless_set():
    from hybridagg.runtime import runner as r

    assert r.tcp_eager_env({}) == {r.TCP_EAGER_VAR: str(4 * 2**20 + 2**16)}
    assert r.tcp_eager_env({"HYBRIDAGG_PS_PART_BYTES": "1000"}) == {
        r.TCP_EAGER_VAR: str(1000 + 2**16)
    }
    assert r.tcp_eager_env({r.TCP_EAGER_VAR: "65536"}) == {}
    assert r.mpiexec_env({})[r.TCP_EAGER_VAR] == str(4 * 2**20 + 2**16)
    assert r.mpiexec_env({r.TCP_EAGER_VAR: "1"})[r.TCP_EAGER_VAR] == "1"
