"""The slurm/ templates on a real Slurm cluster booted on this machine.

Run by ``make test-slurm`` (root: it installs Debian's Slurm and starts the
daemons; ``make test`` does not collect this folder). Each template is copied
the way a user would, its knobs and #SBATCH lines changed for a small job,
and submitted with ``sbatch --wait``. Every task records where Slurm put it
(``record-task.sh`` as the templates' TASK_WRAPPER), which gives the truth
that the training's summary and metrics are checked against:

* one MPI job of the expected size: ``world_size == SLURM_NTASKS`` (N one-rank
  jobs would each report a world of 1);
* in the heterogeneous job, every rank's group is its component (known from
  the node Slurm put the task on: components get disjoint nodes), and the
  servers are the server component's tasks;
* the resume chain: the first link is stopped by the real ``--signal``
  warning before its time limit, and the link it submitted resumes from its
  checkpoint and finishes.

The cluster is torn down at the end, also on failure (and ``make test-slurm``
runs ``cluster.sh down`` once more after pytest).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
CLUSTER = HERE / "cluster.sh"
RECORD = HERE / "record-task.sh"
VENV = Path(sys.executable).parent.parent
JOB_TIMEOUT = 300  # seconds for any one job; the whole file takes ~3 minutes
CHAIN_STEPS = 160  # > what the first link can reach before its warning


# ------------------------------------------------------------------ helpers
def sh(args: list[str], timeout: float = 60, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, **kw)


def edit(template: Path, dest: Path, knobs: dict[str, str], sbatch: dict[str, str]):
    """Copy a template, replacing knob lines ``NAME=...`` and ``#SBATCH --opt=...``.

    Every knob and option must be present exactly once: the test also checks
    that the template has them where a user looks for them.
    """
    text = template.read_text()
    for name, value in knobs.items():
        text, n = re.subn(rf"(?m)^{name}=.*$", f"{name}={value}", text)
        assert n == 1, f"{template.name}: knob {name} found {n} times"
    for option, value in sbatch.items():
        text, n = re.subn(
            rf"(?m)^#SBATCH --{option}=\S+$", f"#SBATCH --{option}={value}", text
        )
        assert n == 1, f"{template.name}: #SBATCH --{option} found {n} times"
    dest.write_text(text)
    return dest


def submit(script: Path, *options: str, wait: bool = True) -> subprocess.Popen:
    """``sbatch [--wait] OPTIONS SCRIPT`` in the script's folder."""
    args = [
        "sbatch",
        "--parsable",
        *(["--wait"] if wait else []),
        *options,
        script.name,
    ]
    return subprocess.Popen(
        args,
        cwd=script.parent,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(proc: subprocess.Popen, timeout: float = JOB_TIMEOUT) -> tuple[int, str]:
    """Wait for an ``sbatch --wait``; returns (exit code, job id)."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"sbatch --wait did not return within {timeout} s: {out} {err}")
    job = out.strip().split(";")[0].splitlines()[0] if out.strip() else ""
    assert job.isdigit(), f"no job id from sbatch: {out!r} {err!r}"
    return proc.returncode, job


def job_state(job: str) -> str | None:
    """The job's state, or None once slurmctld has forgotten it."""
    out = sh(["scontrol", "-o", "show", "job", job])
    match = re.search(r"JobState=(\w+)", out.stdout)
    return match.group(1) if match else None


def wait_job(job: str, timeout: float = JOB_TIMEOUT) -> str | None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = job_state(job)
        if state not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING"):
            return state
        time.sleep(2)
    sh(["scancel", job])
    pytest.fail(f"job {job} still {job_state(job)} after {timeout} s")


def tasks(folder: Path) -> dict[int, dict[str, str]]:
    """record-task.sh's records: SLURM_PROCID -> that task's variables."""
    found = {}
    for path in sorted(folder.glob("task-*.env")):
        env = dict(
            line.split("=", 1) for line in path.read_text().splitlines() if "=" in line
        )
        found[int(env["SLURM_PROCID"])] = env
    return found


def expand(hostlist: str) -> set[str]:
    """Expand a Slurm host list such as ``n[1-3,5],m2`` (the forms used here)."""
    names = set()
    for prefix, ranges, single in re.findall(
        r"([^,\[]+)\[([^\]]+)\]|([^,\[\]]+)", hostlist
    ):
        if single:
            names.add(single)
            continue
        for part in ranges.split(","):
            lo, _, hi = part.partition("-")
            for i in range(int(lo), int(hi or lo) + 1):
                names.add(f"{prefix}{i:0{len(lo)}d}")
    return names


def summary(path: Path) -> dict:
    assert path.exists(), f"no summary {path}"
    return json.loads(path.read_text())


def metrics(path: Path) -> list[dict]:
    assert path.exists(), f"no metrics {path}"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def log_of(folder: Path, pattern: str, job: str) -> str:
    path = folder / pattern.replace("%j", job)
    assert path.exists(), f"no job log {path}"
    return path.read_text()


# ------------------------------------------------------------------ cluster
@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Boot the cluster, start the resume chain (the longest job) first, yield."""
    if os.geteuid() != 0:
        pytest.fail("make test-slurm needs root (it installs Slurm and starts slurmd)")
    work = tmp_path_factory.mktemp("slurm-jobs")
    env_line = sh(["bash", str(CLUSTER), "env"]).stdout.strip()  # export SLURM_CONF=...
    patch = pytest.MonkeyPatch()
    patch.setenv("SLURM_CONF", env_line.split("=", 1)[1])
    chain_proc = None
    try:
        up = sh(["bash", str(CLUSTER), "up"], timeout=300)
        assert up.returncode == 0, up.stderr
        made = sh(
            [
                str(VENV / "bin" / "hybridagg"),
                "convert",
                "--from",
                "digits",
                "--out",
                str(work / "digits.h5"),
                "--quiet",
            ],
            timeout=120,
        )
        assert made.returncode == 0, made.stderr
        assert shutil.which("hybridagg-run", path=str(VENV / "bin")), "run make install"
        chain_dir = work / "chain"
        chain_dir.mkdir()
        chain_proc = _submit_chain(work, chain_dir)
        yield {"work": work, "chain": (chain_dir, chain_proc)}
    finally:
        if chain_proc is not None and chain_proc.poll() is None:
            chain_proc.kill()
        down = sh(["bash", str(CLUSTER), "down"], timeout=120)
        print(down.stderr, file=sys.stderr)
        patch.undo()


def _common_knobs(work: Path, records: Path) -> dict[str, str]:
    return {
        "VENV": str(VENV),
        "DATA": str(work / "digits.h5"),
        "TASK_WRAPPER": f'"{RECORD} {records}"',
    }


def _submit_chain(work: Path, folder: Path) -> subprocess.Popen:
    script = edit(
        REPO / "slurm" / "chain.sbatch",
        folder / "chain.sbatch",
        {
            **_common_knobs(work, folder / "tasks"),
            "MODE": "hybrid",
            "GROUP_SPEC": "0-1,2",
            "SERVERS": "1",
            "LENGTH": f'"--steps {CHAIN_STEPS}"',
            # paced: 25 ms x 32 samples per worker step, ~2.5 updates/s
            "TRAIN_ARGS": '"--sample-ms 25 --eval-every 50"',
            "CHECKPOINT_EVERY": "40",
            "RUN_DIR": "runs/chain",
            "MAX_LINKS": "4",
        },
        # later links: a limit they never reach
        {"nodes": "2", "ntasks-per-node": "2", "time": "5", "signal": "B:USR1@30"},
    )
    # The first link: a 2-minute limit with the warning 60 s before it (Slurm
    # sends it 30-60 s into the job), on the command line as a user would.
    proc = submit(script, "--time=2", "--signal=B:USR1@60")
    # Let its ranks finish start-up before the other jobs load the machine.
    part = folder / "runs" / "chain" / "metrics-1.jsonl.rank-00000"
    deadline = time.monotonic() + 90
    while not part.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(1)
    return proc


# -------------------------------------------------------------------- tests
def test_plain_job_is_one_mpi_job_over_the_allocation(cluster):
    work = cluster["work"]
    folder = work / "plain"
    folder.mkdir()
    script = edit(
        REPO / "slurm" / "plain.sbatch",
        folder / "plain.sbatch",
        {
            **_common_knobs(work, folder / "tasks"),
            "MODE": "hybrid",
            "GROUP_SPEC": "0-1,2",  # node would give one group: one host here
            "SERVERS": "1",
            "LENGTH": '"--steps 30"',
            "TRAIN_ARGS": '"--sample-ms 1"',
            "RUN_DIR": "runs/plain",
        },
        {"nodes": "2", "ntasks-per-node": "2", "time": "5"},
    )
    rc, job = finish(submit(script))
    log = log_of(folder, "hybridagg-%j.out", job)
    assert rc == 0, log
    assert "hybridagg: done" in log
    recorded = tasks(folder / "tasks")
    ntasks = {int(t["SLURM_NTASKS"]) for t in recorded.values()}
    assert ntasks == {4} and sorted(recorded) == [0, 1, 2, 3], recorded
    assert {t["SLURMD_NODENAME"] for t in recorded.values()} == {"n1", "n2"}
    assert len({t["SLURM_STEP_ID"] for t in recorded.values()}) == 1  # one step
    s = summary(folder / "runs" / "plain" / "summary.json")
    assert s["world_size"] == 4  # == SLURM_NTASKS: one MPI job, not 4
    assert s["groups"] == [[0, 1], [2]] and s["servers"] == 1
    assert s["steps"] >= 30
    steps = [
        r
        for r in metrics(folder / "runs" / "plain" / "metrics.jsonl")
        if r["event"] == "step"
    ]
    assert {r["rank"] for r in steps} == {0, 1, 2}
    assert {(r["rank"], r["group"]) for r in steps} == {(0, 0), (1, 0), (2, 1)}


def test_het_job_groups_are_its_components(cluster):
    work = cluster["work"]
    folder = work / "het"
    folder.mkdir()
    # the template's own components: 2 fast, 2 slow, 1 server task
    script = edit(
        REPO / "slurm" / "hetjob.sbatch",
        folder / "hetjob.sbatch",
        {
            **_common_knobs(work, folder / "tasks"),
            "MODE": "hybrid",
            "SERVER_COMPONENT": "2",
            "LENGTH": '"--steps 30"',
            "TRAIN_ARGS": '"--sample-ms 1"',
            "RUN_DIR": "runs/het",
        },
        {"time": "5"},
    )
    rc, job = finish(submit(script))
    log = log_of(folder, "hybridagg-het-%j.out", job)
    assert rc == 0, log
    recorded = tasks(folder / "tasks")
    assert sorted(recorded) == [0, 1, 2, 3, 4], recorded
    first = recorded[0]
    size = int(first["SLURM_HET_SIZE"])
    assert size == 3
    nodes_of = [expand(first[f"SLURM_JOB_NODELIST_HET_GROUP_{k}"]) for k in range(size)]
    counts = [int(first[f"SLURM_NTASKS_HET_GROUP_{k}"]) for k in range(size)]
    assert counts == [2, 2, 1]
    for a in range(size):  # disjoint nodes: the node tells the component
        for b in range(a + 1, size):
            assert not nodes_of[a] & nodes_of[b], nodes_of
    component = {}
    for procid, t in recorded.items():
        assert int(t["SLURM_NTASKS"]) == sum(counts)  # one step over all
        (k,) = [k for k in range(size) if t["SLURMD_NODENAME"] in nodes_of[k]]
        component[procid] = k
        assert int(t["HYBRIDAGG_HET_COMPONENT"]) == k  # what the launcher said
    ranks_of = [sorted(r for r, k in component.items() if k == c) for c in range(size)]

    s = summary(folder / "runs" / "het" / "summary.json")
    assert s["world_size"] == sum(counts)  # == SLURM_NTASKS: one MPI job
    assert s["groups"] == [ranks_of[0], ranks_of[1]]
    assert s["servers"] == counts[2] and ranks_of[2] == [4]  # the last ranks
    steps = [
        r
        for r in metrics(folder / "runs" / "het" / "metrics.jsonl")
        if r["event"] == "step"
    ]
    assert {r["rank"] for r in steps} == set(ranks_of[0] + ranks_of[1])
    for r in steps:  # every rank's group is its component
        assert s["groups"][r["group"]] == ranks_of[component[r["rank"]]], r


def test_resume_chain_continues_from_the_checkpoint(cluster):
    folder, proc = cluster["chain"]
    rc, first = finish(proc)
    log1 = log_of(folder, "hybridagg-chain-%j.out", first)
    assert rc == 0, log1
    assert "time limit near" in log1, log1
    stopped = re.search(
        r"link 1 stopped for the time limit \(exit 0\); job (\d+) resumes from (\S+)",
        log1,
    )
    assert stopped, log1
    second, checkpoint = stopped.groups()
    assert checkpoint.endswith(tuple(f"ckpt-{i:06d}" for i in range(1, 100))), log1
    s1 = summary(folder / "runs" / "chain" / "summary-1.json")
    assert s1["resumed_from"] is None and s1["world_size"] == 4
    assert 0 < s1["steps"] < CHAIN_STEPS  # the warning stopped it

    state = wait_job(second)
    log2 = log_of(folder, "hybridagg-chain-%j.out", second)
    assert state in ("COMPLETED", None), (state, log2)
    assert f"link 2 is job {second} on 4 tasks" in log2
    finished = re.search(r"training finished in link 2; cancelled job (\d+)", log2)
    assert finished, log2
    assert (folder / "runs" / "chain" / "DONE").exists()
    third = finished.group(1)
    assert wait_job(third, timeout=60) in ("CANCELLED", None)

    s2 = summary(folder / "runs" / "chain" / "summary-2.json")
    assert s2["resumed_from"] == checkpoint and s2["world_size"] == 4
    assert s2["steps"] >= CHAIN_STEPS
    # The checkpoint link 2 started from, as link 1's server (rank 3) saved it.
    number = int(checkpoint.rsplit("-", 1)[1])
    saved = [
        r["version"]
        for r in metrics(folder / "runs" / "chain" / "metrics-1.jsonl")
        if r["event"] == "checkpoint" and r["number"] == number and r["rank"] == 3
    ]
    assert saved, "link 1's metrics do not show the checkpoint it stopped with"
    steps2 = [
        r["version"]
        for r in metrics(folder / "runs" / "chain" / "metrics-2.jsonl")
        if r["event"] == "step"
    ]
    assert min(steps2) >= saved[0] > 0  # continued, did not start over
    assert max(steps2) >= CHAIN_STEPS
