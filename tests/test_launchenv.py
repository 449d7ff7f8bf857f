"""launchenv: rank, size and Slurm component from each launcher's variables.

Pure logic. The environments are copied from real runs on the test cluster
(Slurm 22.05.8, the PyPI Open MPI 5) and trimmed to the variables that matter.
"""

from __future__ import annotations

import os

import pytest

from hybridagg.runtime.launchenv import LaunchEnv, launch_env, slurm_het_component

PREFIXES = ("SLURM_", "OMPI_COMM_WORLD", "PMI_", "PMIX_", "MPI_LOCAL", "HYBRIDAGG_HET")


@pytest.fixture
def env(monkeypatch):
    """Start from an environment without any launcher variable; return a setter."""
    for key in list(os.environ):
        if key.startswith(PREFIXES):
            monkeypatch.delenv(key)

    def set_all(values: dict[str, str]) -> None:
        for key, value in values.items():
            monkeypatch.setenv(key, value)

    return set_all


# Task 3 of `srun --mpi=pmix` on 2 nodes x 2 tasks (plain allocation).
SRUN_TASK_3 = {
    "SLURM_JOB_ID": "5",
    "SLURM_STEP_ID": "0",
    "SLURM_PROCID": "3",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "1",
    "SLURM_NTASKS": "4",
    "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
    "PMIX_RANK": "3",
}

# Rank 3 of `mpirun -n 4` inside the same allocation: Open MPI started its
# daemons with srun (step 1, one task per node), so the Slurm variables
# number daemons: SLURM_PROCID 1 of SLURM_NTASKS 2.
MPIRUN_IN_SLURM_RANK_3 = {
    "SLURM_JOB_ID": "5",
    "SLURM_STEP_ID": "1",
    "SLURM_PROCID": "1",
    "SLURM_NTASKS": "2",
    "OMPI_COMM_WORLD_RANK": "3",
    "OMPI_COMM_WORLD_SIZE": "4",
    "OMPI_COMM_WORLD_LOCAL_RANK": "1",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
    "PMIX_RANK": "3",
}

# A task of `srun --het-group=0-2` in a 2 + 1 + 1 heterogeneous job, as
# inherited from sbatch (SLURM_NTASKS_HET_GROUP_<k>) plus the step's own.
HET_STEP = {
    "SLURM_JOB_ID": "1",
    "SLURM_STEP_ID": "0",
    "SLURM_HET_SIZE": "3",
    "SLURM_NTASKS": "4",
    "SLURM_NTASKS_HET_GROUP_0": "2",
    "SLURM_NTASKS_HET_GROUP_1": "1",
    "SLURM_NTASKS_HET_GROUP_2": "1",
}


def test_nothing_set(env):
    assert launch_env() == LaunchEnv("none")
    assert slurm_het_component() is None


def test_srun_task(env):
    env(SRUN_TASK_3)
    assert launch_env() == LaunchEnv("slurm", 3, 4, 1, 2, None)


def test_mpirun_inside_a_slurm_allocation_is_open_mpi(env):
    env(MPIRUN_IN_SLURM_RANK_3)
    assert launch_env() == LaunchEnv("openmpi", 3, 4, 1, 2, None)


def test_mpirun_in_a_het_allocation_has_no_component(env):
    env({**MPIRUN_IN_SLURM_RANK_3, **{k: v for k, v in HET_STEP.items() if "HET" in k}})
    assert slurm_het_component() is None
    env({"HYBRIDAGG_HET_COMPONENT": "1"})  # stated explicitly: believed
    assert slurm_het_component() == 1


def test_hydra_inside_slurm_is_mpich(env):
    # Hydra's proxies are srun tasks (one per node); PMI_RANK numbers ranks.
    env({"SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "SLURM_NTASKS": "2"})
    env({"PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1"})
    assert launch_env() == LaunchEnv("mpich", 3, 4, 1, None, None)


def test_srun_pmi2_is_slurm(env):
    # srun --mpi=pmi2 sets PMI_RANK/PMI_SIZE equal to Slurm's own numbering.
    env({**SRUN_TASK_3, "PMI_RANK": "3", "PMI_SIZE": "4"})
    assert launch_env().launcher == "slurm"


def test_hydra_alone(env):
    env({"PMI_RANK": "2", "PMI_SIZE": "3", "MPI_LOCALNRANKS": "3"})
    assert launch_env() == LaunchEnv("mpich", 2, 3, None, 3, None)


@pytest.mark.parametrize("procid,component", [(0, 0), (1, 0), (2, 1), (3, 2)])
def test_het_component_from_procid_ranges(env, procid, component):
    env({**HET_STEP, "SLURM_PROCID": str(procid)})
    assert slurm_het_component() == component
    assert launch_env().het_component == component


def test_het_component_stated_by_the_launcher_wins(env):
    # hybridagg-run's srun ... : ... step: each component's --export says it
    env({**HET_STEP, "SLURM_PROCID": "0", "HYBRIDAGG_HET_COMPONENT": "2"})
    assert slurm_het_component() == 2


def test_het_step_over_one_component_only_gives_none(env):
    env({**HET_STEP, "SLURM_PROCID": "0", "SLURM_NTASKS": "1"})  # --het-group=1
    assert slurm_het_component() is None


@pytest.mark.parametrize("value", ["-1", "two", ""])
def test_malformed_explicit_component_is_no_component(env, value):
    env({"SLURM_PROCID": "0", "HYBRIDAGG_HET_COMPONENT": value})
    assert slurm_het_component() is None
