"""hybridagg-run (hybridagg.launcher): the command it builds for each launcher
and allocation.

Pure logic: ``--dry-run`` of ``python -m hybridagg.launcher`` under fake
launchers (scripts that answer ``--version`` like Open MPI 4/5 or Hydra, and a
fake ``srun``) and fake ``SLURM_*`` environments copied from a real Slurm 22.05
step; then the planning functions called directly with fake probes. One test
runs the real bundled ``mpiexec`` to check that the command also works, and
one the installed console script, if there is one.
"""

from __future__ import annotations

import os
import shlex
import stat
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from hybridagg import launcher
from hybridagg.runtime import runner

REPO = Path(__file__).resolve().parent.parent
LAUNCHER = [sys.executable, "-m", "hybridagg.launcher"]
OPEN_MPI_5 = "mpiexec (Open MPI) 5.0.11"
OPEN_MPI_4 = "mpirun (Open MPI) 4.1.4"
HYDRA = "HYDRA build details:\n    Version: 4.2.0"
ROOT = os.geteuid() == 0

# A heterogeneous allocation of 2 + 1 + 1 tasks, as sbatch sets it (Slurm 22.05).
HET_ALLOCATION = {
    "SLURM_JOB_ID": "7",
    "SLURM_HET_SIZE": "3",
    "SLURM_NTASKS_HET_GROUP_0": "2",
    "SLURM_NTASKS_HET_GROUP_1": "1",
    "SLURM_NTASKS_HET_GROUP_2": "1",
}


def het_segment(k: int, *, servers: int) -> list[str]:
    """One MPMD segment of a heterogeneous srun step running hybridagg train."""
    return [
        "--kill-on-bad-exit=1",
        "--mpi=pmix",
        f"--het-group={k}",
        f"--export=ALL,HYBRIDAGG_HET_COMPONENT={k}",
        "hybridagg",
        "train",
        "--data",
        "d.h5",
        "--groups",
        "slurm",
        "--servers",
        str(servers),
    ]


def _executable(path: Path, text: str) -> str:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


@pytest.fixture
def bin_dir(tmp_path):
    """A folder of fakes, the only one on PATH (the launcher needs no tools)."""
    fakes = tmp_path / "bin"
    fakes.mkdir()
    return fakes


def fake_mpiexec(bin_dir: Path, version_text: str) -> str:
    return _executable(
        bin_dir / "mpiexec", f"#!/bin/sh\nprintf '%s\\n' '{version_text}'\n"
    )


def fake_srun(bin_dir: Path, plugins: tuple[str, ...] = ("pmix", "pmi2", "none")):
    listing = "MPI plugin types are...\n" + "".join(f"\t{p}\n" for p in plugins)
    return _executable(bin_dir / "srun", f"#!/bin/sh\nprintf '%s' '{listing}'\n")


def run(bin_dir: Path, args: list[str], env: dict[str, str] | None = None):
    """Run the launcher with only ``env`` (plus PATH=bin_dir) in its environment."""
    full = {"PATH": str(bin_dir), "PYTHONPATH": str(REPO), **(env or {})}
    return subprocess.run(
        [*LAUNCHER, *args],
        env=full,
        capture_output=True,
        text=True,
        timeout=30,
    )


def dry(bin_dir: Path, args: list[str], env: dict[str, str] | None = None):
    """The command line --dry-run prints, split into words."""
    out = run(bin_dir, ["--dry-run", *args], env)
    assert out.returncode == 0, out.stderr
    return shlex.split(out.stdout)


def segments(words: list[str]) -> list[list[str]]:
    """Split an srun MPMD command line at its ':' separators."""
    parts, current = [], []
    for w in words[1:]:
        if w == ":":
            parts.append(current)
            current = []
        else:
            current.append(w)
    return [*parts, current]


# ------------------------------------------------------------- outside Slurm
def test_open_mpi_5_flags_and_variables(bin_dir):
    mpiexec = fake_mpiexec(bin_dir, OPEN_MPI_5)
    words = dry(bin_dir, ["-n", "3", "--", "python", "x.py", "--lr", "0.1"])
    at = words.index(mpiexec)
    assert words[at:] == [
        mpiexec,
        "-n",
        "3",
        "--oversubscribe",
        "--bind-to",
        "none",
        "python",
        "x.py",
        "--lr",
        "0.1",
    ]
    assert "PRTE_MCA_rmaps_default_mapping_policy=:oversubscribe" in words[:at]
    assert ("OMPI_ALLOW_RUN_AS_ROOT=1" in words[:at]) == ROOT
    assert ("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1" in words[:at]) == ROOT


def test_open_mpi_4_hostfile_and_no_prrte_variable(bin_dir, tmp_path):
    mpiexec = fake_mpiexec(bin_dir, OPEN_MPI_4)
    hosts = tmp_path / "hosts"
    hosts.write_text("a slots=2\nb slots=2\n")
    words = dry(bin_dir, ["-n", "4", "--hostfile", str(hosts), "a.out"])
    at = words.index(mpiexec)
    assert words[at:] == [
        mpiexec,
        "-n",
        "4",
        "--oversubscribe",
        "--bind-to",
        "none",
        "--hostfile",
        str(hosts),
        "a.out",
    ]
    assert not any(w.startswith("PRTE_") for w in words[:at])


def test_hydra_takes_dash_f_and_nothing_else(bin_dir, tmp_path):
    mpiexec = fake_mpiexec(bin_dir, HYDRA)
    hosts = tmp_path / "hosts"
    hosts.write_text("a:2\n")
    words = dry(bin_dir, ["--hostfile", str(hosts), "a.out"])
    assert words == [mpiexec, "-f", str(hosts), "a.out"]
    assert dry(bin_dir, ["-n", "2", "a.out"]) == [mpiexec, "-n", "2", "a.out"]


def test_mpiexec_from_the_environment_wins(bin_dir, tmp_path):
    fake_mpiexec(bin_dir, OPEN_MPI_5)
    other = _executable(tmp_path / "mympirun", f"#!/bin/sh\necho '{HYDRA}'\n")
    words = dry(bin_dir, ["-n", "2", "a.out"], {"HYBRIDAGG_MPIEXEC": other})
    assert words == [other, "-n", "2", "a.out"]


@pytest.mark.parametrize(
    "args,env,message",
    [
        (["a.out"], {}, "give -n N"),
        (["-n", "0", "a.out"], {}, "-n needs a positive integer"),
        (["-n"], {}, "-n needs a value"),
        (["-n", "2"], {}, "no command given"),
        (["--hostfile", "/nonexistent/hosts", "a.out"], {}, "/nonexistent/hosts"),
        (
            ["--launcher", "ssh", "-n", "2", "a.out"],
            {},
            "must be auto, srun or mpiexec",
        ),
        (["--bogus", "a.out"], {}, "unknown option --bogus"),
        (["--launcher", "srun", "-n", "2", "a.out"], {}, "needs a Slurm allocation"),
        (["--servers-from", "2", "-n", "2", "a.out"], {}, "heterogeneous Slurm"),
        (["--mode", "fast", "-n", "2", "a.out"], {}, "--mode must be one of"),
        (["--servers", "two", "-n", "2", "a.out"], {}, "--servers needs a count"),
        (
            ["--servers", "1", "-n", "2", "a.out"],
            {},
            "--mode sync uses no parameter servers",
        ),
        (
            ["--mode", "hybrid", "--servers", "0", "-n", "2", "a.out"],
            {},
            "--mode hybrid needs --servers 1 or more",
        ),
        (
            ["--mode", "hybrid", "-n", "3", "hybridagg", "train", "--data", "d.h5"],
            {},
            "put them after 'train'",
        ),
        (
            ["-n", "2", "a.out"],
            {"HYBRIDAGG_MPIEXEC": "/nonexistent/mpiexec"},
            "HYBRIDAGG_MPIEXEC='/nonexistent/mpiexec'",
        ),
    ],
)
def test_bad_input_names_the_problem(bin_dir, args, env, message):
    fake_mpiexec(bin_dir, OPEN_MPI_5)
    out = run(bin_dir, args, env)
    assert out.returncode == 2, out
    assert message in out.stderr


def test_unknown_launcher_with_a_hostfile_is_refused(bin_dir, tmp_path):
    fake_mpiexec(bin_dir, "some other MPI 1.0")
    hosts = tmp_path / "hosts"
    hosts.write_text("a\n")
    out = run(bin_dir, ["--hostfile", str(hosts), "a.out"])
    assert out.returncode == 2 and "hostfile option" in out.stderr
    assert dry(bin_dir, ["-n", "2", "a.out"]) == [
        str(bin_dir / "mpiexec"),
        "-n",
        "2",
        "a.out",
    ]


def test_script_mode_reaches_every_rank(bin_dir):
    """--mode/--groups/--servers become the variables hybridagg.torch.init()
    reads; Open MPI passes them to other hosts only when named with -x."""
    mpiexec = fake_mpiexec(bin_dir, OPEN_MPI_5)
    args = ["--mode", "hybrid", "--groups", "0-1,2", "--servers", "1", "-n", "4"]
    words = dry(bin_dir, [*args, "python", "train.py"])
    at = words.index(mpiexec)
    assert {
        "HYBRIDAGG_MODE=hybrid",
        "HYBRIDAGG_GROUPS=0-1,2",
        "HYBRIDAGG_SERVERS=1",
    } <= set(words[:at])
    assert words[at + 1 : at + 7] == [
        "-x",
        "HYBRIDAGG_MODE",
        "-x",
        "HYBRIDAGG_GROUPS",
        "-x",
        "HYBRIDAGG_SERVERS",
    ]
    assert words[-2:] == ["python", "train.py"]
    # Hydra passes the whole environment
    (bin_dir / "mpiexec").unlink()
    fake_mpiexec(bin_dir, HYDRA)
    words = dry(bin_dir, ["--mode", "async", "-n", "3", "python", "train.py"])
    assert words == ["HYBRIDAGG_MODE=async", mpiexec, "-n", "3", "python", "train.py"]


# ---------------------------------------------------------- plain allocation
def test_srun_inside_an_allocation_with_pmix(bin_dir):
    fake_mpiexec(bin_dir, OPEN_MPI_5)
    fake_srun(bin_dir)
    env = {"SLURM_JOB_ID": "5", "SLURM_NTASKS": "4"}
    assert dry(bin_dir, ["python", "t.py"], env) == [
        "srun",
        "--kill-on-bad-exit=1",
        "--mpi=pmix",
        "python",
        "t.py",
    ]
    words = dry(bin_dir, ["-n", "2", "python", "t.py"], env)
    assert words[-4:] == ["--ntasks", "2", "python", "t.py"]


def test_srun_mpi_plugin_choice(bin_dir):
    fake_srun(bin_dir, plugins=("pmi2", "none"))
    env = {"SLURM_JOB_ID": "5"}
    assert not any(w.startswith("--mpi") for w in dry(bin_dir, ["a.out"], env))
    words = dry(bin_dir, ["a.out"], {**env, "HYBRIDAGG_SRUN_MPI": "pmi2"})
    assert "--mpi=pmi2" in words
    assert "--mpi=none" in dry(bin_dir, ["--mpi", "none", "a.out"], env)


def test_mpiexec_inside_an_allocation_takes_its_task_count(bin_dir, tmp_path):
    mpiexec = fake_mpiexec(bin_dir, OPEN_MPI_4)
    fake_srun(bin_dir)
    env = {"SLURM_JOB_ID": "5", "SLURM_NTASKS": "6"}
    words = dry(bin_dir, ["--launcher", "mpirun", "a.out"], env)
    assert words[words.index(mpiexec) :][:3] == [mpiexec, "-n", "6"]
    words = dry(bin_dir, ["a.out"], {**env, "HYBRIDAGG_LAUNCHER": "mpiexec"})
    assert words[words.index(mpiexec) :][:3] == [mpiexec, "-n", "6"]
    hosts = tmp_path / "hosts"
    hosts.write_text("a\n")
    out = run(
        bin_dir, ["--launcher", "mpiexec", "--hostfile", str(hosts), "a.out"], env
    )
    assert out.returncode == 2 and "reads the allocation's nodes" in out.stderr


def test_no_srun_on_path_falls_back_to_mpiexec(bin_dir):
    mpiexec = fake_mpiexec(bin_dir, HYDRA)
    words = dry(bin_dir, ["a.out"], {"SLURM_JOB_ID": "5", "SLURM_NTASKS": "3"})
    assert words == [mpiexec, "-n", "3", "a.out"]


# --------------------------------------------------- heterogeneous allocation
def test_het_job_one_step_over_every_component_with_groups_for_train(bin_dir):
    fake_srun(bin_dir)
    words = dry(
        bin_dir,
        ["--servers-from", "2", "--", "hybridagg", "train", "--data", "d.h5"],
        HET_ALLOCATION,
    )
    assert words[0] == "srun"
    parts = segments(words)
    assert len(parts) == 3
    for k, part in enumerate(parts):
        assert part == het_segment(k, servers=1)


def test_het_job_server_count_is_the_components_task_count(bin_dir):
    fake_srun(bin_dir)
    env = {**HET_ALLOCATION, "SLURM_NTASKS_HET_GROUP_2": "3"}
    words = dry(bin_dir, ["--servers-from", "2", "/v/bin/hybridagg", "train"], env)
    assert segments(words)[0][-4:] == ["--groups", "slurm", "--servers", "3"]


@pytest.mark.parametrize(
    "command",
    [
        ["numactl", "--interleave=all", "hybridagg", "train", "--data", "d.h5"],
        ["python3", "-m", "hybridagg", "train", "--data", "d.h5"],
    ],
)
def test_het_job_finds_train_behind_a_wrapper(bin_dir, command):
    fake_srun(bin_dir)
    words = dry(bin_dir, ["--servers-from", "2", "--", *command], HET_ALLOCATION)
    assert segments(words)[1][-len(command) - 4 :] == [
        *command,
        "--groups",
        "slurm",
        "--servers",
        "1",
    ]


def test_het_job_placeholders_for_any_program(bin_dir):
    fake_srun(bin_dir)
    words = dry(
        bin_dir,
        [
            "--servers-from",
            "2",
            "python",
            "my.py",
            "--groups={groups}",
            "-s",
            "{servers}",
        ],
        HET_ALLOCATION,
    )
    assert segments(words)[2][-4:] == ["my.py", "--groups=slurm", "-s", "1"]


def test_het_job_without_server_component_and_async_mode(bin_dir):
    fake_srun(bin_dir)
    words = dry(bin_dir, ["hybridagg", "train", "--mode", "sync"], HET_ALLOCATION)
    assert segments(words)[0][-5:] == ["train", "--mode", "sync", "--groups", "slurm"]
    words = dry(
        bin_dir,
        ["--servers-from", "2", "hybridagg", "train", "--mode", "async"],
        HET_ALLOCATION,
    )
    assert segments(words)[0][-4:] == ["--mode", "async", "--servers", "1"]
    assert "--groups" not in words
    # a program that is not hybridagg train keeps its arguments, and gets the
    # groups as the variables a Horovod-style script (hybridagg.torch) reads
    words = dry(bin_dir, ["--servers-from", "2", "python", "x.py"], HET_ALLOCATION)
    at = words.index("srun")
    assert sorted(words[:at]) == [
        "HYBRIDAGG_GROUPS=slurm",
        "HYBRIDAGG_MODE=hybrid",
        "HYBRIDAGG_SERVERS=1",
    ]
    assert segments(words[at:])[0][-2:] == ["python", "x.py"]
    # what the environment or the flags say stays; async has no groups
    words = dry(
        bin_dir, ["python", "x.py"], {**HET_ALLOCATION, "HYBRIDAGG_MODE": "async"}
    )
    assert words[0] == "srun"
    words = dry(bin_dir, ["--groups", "0-1,2", "python", "x.py"], HET_ALLOCATION)
    assert words[: words.index("srun")] == ["HYBRIDAGG_GROUPS=0-1,2"]


@pytest.mark.parametrize(
    "args,env,message",
    [
        (["--servers-from", "1", "a.out"], {}, "is not the last component (2)"),
        (["--servers-from", "3", "a.out"], {}, "components 0-2"),
        (["--servers-from", "x", "a.out"], {}, "needs a component index"),
        (["-n", "4", "a.out"], {}, "-n does not apply"),
        (["--launcher", "mpiexec", "a.out"], {}, "sees only component 0"),
        (["a.out"], {"SLURM_NTASKS_HET_GROUP_1": ""}, "SLURM_NTASKS_HET_GROUP_1=''"),
        (["a.out"], {"SLURM_HET_SIZE": "two"}, "SLURM_HET_SIZE='two'"),
        (
            ["--servers-from", "2", "hybridagg", "train", "--groups", "world"],
            {},
            "already has --groups or --servers",
        ),
        (
            ["--servers-from", "0", "a.out"],
            {"SLURM_HET_SIZE": "1"},
            "needs a worker component",
        ),
    ],
)
def test_het_job_bad_input_names_the_problem(bin_dir, args, env, message):
    fake_srun(bin_dir)
    fake_mpiexec(bin_dir, OPEN_MPI_5)
    out = run(bin_dir, args, {**HET_ALLOCATION, **env})
    assert out.returncode == 2, out
    assert message in out.stderr


# ------------------------------------------------------------------ for real
def test_runs_one_job_with_the_bundled_mpiexec(tmp_path):
    """Not a dry run: the command it builds starts one MPI job of 2 ranks."""
    env = runner.mpiexec_env()
    env = {k: v for k, v in env.items() if not k.startswith("SLURM_")}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env["PATH"]])
    env["PYTHONPATH"] = str(REPO)
    script = "from mpi4py import MPI; c = MPI.COMM_WORLD; print(f'rank {c.rank} of {c.size}')"
    result = runner.run_job(
        [*LAUNCHER, "-n", "2", "--", sys.executable, "-c", script],
        timeout=120,
        env=env,
    )
    assert result.returncode == 0, result.stderr
    assert sorted(result.stdout.split("\n"))[-2:] == ["rank 0 of 2", "rank 1 of 2"]


def test_installed_console_script_runs_help():
    """The ``hybridagg-run`` installed beside this Python is the console script.

    ``make install`` puts it in the venv's ``bin`` (pip writes console
    scripts there); it must run without a shell script behind it.
    """
    path = Path(sys.executable).parent / "hybridagg-run"
    if not path.exists():
        pytest.skip(f"hybridagg is not installed beside {sys.executable}")
    assert "hybridagg.launcher" in path.read_text(errors="replace"), (
        f"{path} is not the console script: reinstall (make install)"
    )
    out = subprocess.run(
        [str(path), "--help"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert "hybridagg-run [options] [--] CMD [ARGS...]" in out.stdout


# ------------------------------------------------- the planning, called directly
@dataclass
class Machine:
    """A fake machine for the planning functions: programs on PATH (nothing
    else is executable), what srun and mpiexec print, the user id; ``asked``
    records the programs the plan ran."""

    on_path: dict[str, str] = field(default_factory=dict)
    version: str = ""
    mpi_list: str = ""
    euid: int = 1000
    asked: list[str] = field(default_factory=list)

    def probes(self) -> launcher.Probes:
        def srun_mpi_list() -> str:
            self.asked.append("srun --mpi=list")
            return self.mpi_list

        def mpiexec_version(path: str) -> str:
            self.asked.append(f"{path} --version")
            return self.version

        return launcher.Probes(
            which=self.on_path.get,
            executable=lambda path: path in self.on_path.values(),
            srun_mpi_list=srun_mpi_list,
            mpiexec_version=mpiexec_version,
            euid=self.euid,
        )


def plan(args: list[str], env: dict[str, str], machine: Machine) -> launcher.Plan:
    return launcher.plan_launch(
        launcher.parse_options(args, env), env, machine.probes()
    )


@pytest.mark.parametrize("euid", [1000, 0])
def test_plan_open_mpi_5_outside_slurm(euid):
    machine = Machine({"mpiexec": "/opt/ompi/bin/mpiexec"}, OPEN_MPI_5, euid=euid)
    got = plan(["-n", "3", "--", "python", "x.py"], {}, machine)
    assert got.argv == (
        "/opt/ompi/bin/mpiexec",
        "-n",
        "3",
        "--oversubscribe",
        "--bind-to",
        "none",
        "python",
        "x.py",
    )
    consent = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    assert got.env == {
        **(consent if euid == 0 else {}),
        # a server's 4 MiB part goes eagerly over TCP (runner.tcp_eager_env)
        "OMPI_MCA_btl_tcp_eager_limit": str(4 * 2**20 + 64 * 2**10),
        "PRTE_MCA_rmaps_default_mapping_policy": ":oversubscribe",
    }
    assert machine.asked == ["/opt/ompi/bin/mpiexec --version"]
    # a policy and a limit the user set are kept; the --dry-run line puts
    # variables first
    env = {
        "PRTE_MCA_rmaps_default_mapping_policy": "core:oversubscribe",
        "OMPI_MCA_btl_tcp_eager_limit": "65536",
    }
    got = plan(["-n", "3", "a b"], env, Machine({"mpiexec": "/m"}, OPEN_MPI_5))
    assert got.command_line() == (
        "PRTE_MCA_rmaps_default_mapping_policy=core:oversubscribe "
        "/m -n 3 --oversubscribe --bind-to none 'a b'"
    )
    # the limit follows the servers' part size
    env = {"HYBRIDAGG_PS_PART_BYTES": "1048576"}
    got = plan(["-n", "3", "a"], env, Machine({"mpiexec": "/m"}, OPEN_MPI_5))
    assert got.env["OMPI_MCA_btl_tcp_eager_limit"] == str(2**20 + 2**16)


def test_plan_hydra_with_a_hostfile_beside_python3():
    machine = Machine(
        {"python3": "/venv/bin/python3", "mpiexec": "/venv/bin/mpiexec"}, HYDRA
    )
    options = launcher.Options(command=("a.out",), hostfile="/etc/hosts")
    got = launcher.plan_launch(options, {}, machine.probes())
    assert got == launcher.Plan(("/venv/bin/mpiexec", "-f", "/etc/hosts", "a.out"))
    # the same hostfile for Open MPI 4: --hostfile, and no PRRTE variable
    info = runner.identify_mpiexec("/m", OPEN_MPI_4)
    got = launcher.mpiexec_plan(
        info, ["a.out"], {}, nranks=None, hostfile="/etc/hosts", euid=1000
    )
    assert got.env == {"OMPI_MCA_btl_tcp_eager_limit": str(4 * 2**20 + 2**16)}
    assert got.argv == (
        "/m",
        "--oversubscribe",
        "--bind-to",
        "none",
        "--hostfile",
        "/etc/hosts",
        "a.out",
    )


def test_plan_het_allocation_with_servers_from():
    machine = Machine({"srun": "/usr/bin/srun"}, mpi_list="\tpmi2\n\tpmix\n")
    got = plan(
        ["--servers-from", "2", "--", "hybridagg", "train", "--data", "d.h5"],
        {**HET_ALLOCATION, "SLURM_NTASKS_HET_GROUP_2": "2"},
        machine,
    )
    assert got.env == {}
    assert got.argv[0] == "srun"
    parts = segments(list(got.argv))
    assert len(parts) == 3
    for k, part in enumerate(parts):
        assert part == het_segment(k, servers=2)
    assert machine.asked == ["srun --mpi=list"]
    groups = launcher.het_groups(
        launcher.Options(command=("a",), servers_from="2"),
        HET_ALLOCATION,
        components=3,
        launcher="srun",
    )
    assert groups == launcher.HetGroups(task_counts=(2, 1, 1), servers=1)
    # a plugin given is used as is: srun is not asked
    machine = Machine({"srun": "/usr/bin/srun"}, mpi_list="\tpmix\n")
    got = plan(["--mpi", "pmi2", "a.out"], HET_ALLOCATION, machine)
    assert "--mpi=pmi2" in got.argv and machine.asked == []


def test_hand_groups_placeholders_and_train():
    groups = launcher.HetGroups(task_counts=(2, 1), servers=1)
    assert launcher.hand_groups(
        ["p", "--g={groups}", "-s{servers}"], groups, with_servers=True
    ) == ["p", "--g=slurm", "-s1"]
    assert launcher.hand_groups(
        ["python", "-m", "hybridagg", "train", "--mode=async"],
        groups,
        with_servers=True,
    )[-2:] == ["--servers", "1"]
    assert launcher.hand_groups(["x", "train"], groups, with_servers=False) == [
        "x",
        "train",
    ]


@pytest.mark.parametrize(
    "args,env,on_path,status,message",
    [
        (
            ["--servers-from", "1", "a"],
            HET_ALLOCATION,
            {"srun": "/s"},
            2,
            "is not the last component (2)",
        ),
        (
            ["--launcher", "srun", "a"],
            {},
            {"srun": "/s"},
            2,
            "needs a Slurm allocation",
        ),
        (["-n", "2", "a"], {}, {}, 127, "no mpiexec found"),
        (
            ["-n", "2", "a"],
            {"HYBRIDAGG_MPIEXEC": "mine"},
            {},
            2,
            "HYBRIDAGG_MPIEXEC='mine'",
        ),
        (
            ["--hostfile", "/etc/hosts", "a"],
            {},
            {"mpiexec": "/m"},
            2,
            "/m is neither Open MPI",
        ),
    ],
)
def test_plan_refusals(args, env, on_path, status, message):
    with pytest.raises(launcher.LaunchError) as refused:
        plan(args, env, Machine(on_path, "some MPI 1.0"))
    assert refused.value.status == status
    assert message in str(refused.value)


@pytest.mark.parametrize(
    "args,message,usage",
    [
        (["--np"], "--np needs a value", False),
        (["--bogus", "a"], "unknown option --bogus", True),
        (["-5"], "unknown option -5", True),
        (["--dry-run"], "no command given", True),
        (["-n", "1.5", "a"], "-n needs a positive integer, got '1.5'", False),
    ],
)
def test_parse_refusals(args, message, usage):
    with pytest.raises(launcher.LaunchError) as refused:
        launcher.parse_options(args, {})
    assert str(refused.value) == message and refused.value.usage == usage


def test_parse_options_stop_at_the_command():
    options = launcher.parse_options(
        ["-n", "2", "--launcher", "mpirun", "--", "a", "-n", "3"],
        {"HYBRIDAGG_SRUN_MPI": "pmi2"},
    )
    assert options == launcher.Options(
        command=("a", "-n", "3"), nranks=2, launcher="mpiexec", srun_mpi="pmi2"
    )
    assert (
        launcher.parse_options(["a"], {"HYBRIDAGG_LAUNCHER": "srun"}).launcher == "srun"
    )
