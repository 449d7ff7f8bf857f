"""Emulated clusters on this machine: hosts in network namespaces, links shaped by tc.

Run by ``make test-cluster`` (root: it creates namespaces, links and qdiscs;
``make test`` does not collect this folder). Each test brings its cluster
up from a file in this folder with ``hybridagg cluster up``, launches with
``hybridagg-run --cluster`` exactly as the README tells a user, and takes
the cluster down afterwards, also on failure; then nothing of it may remain
in ``ip netns list``, the link table, ``/etc/hosts`` or the process table.

What is checked against what:

* the hosts are nodes: host names, node-local communicators and the
  shared-memory path follow the hosts (the kernel is shared by all of them);
* a hybrid job (a group per host, the server on a third host) learns the
  digits, and the bytes between hosts went through the host links (the
  kernel's counters on each host's interface);
* an all-reduce across two hosts moves at the link's rate (the shaper is
  the bound: no implementation may beat it, the best comes within 10%);
  within a host the bytes never touch the link.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hybridagg.cluster import leftovers, load, traffic

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
BIN = Path(sys.executable).parent
JOB_TIMEOUT = 300


def sh(args, timeout=JOB_TIMEOUT, **kw) -> subprocess.CompletedProcess:
    env = dict(os.environ, PATH=f"{BIN}:{os.environ['PATH']}")
    return subprocess.run(
        [str(a) for a in args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        **kw,
    )


def namespaces() -> set[str]:
    return set(sh(["ip", "netns", "list"]).stdout.split())


@pytest.fixture
def cluster(request):
    """Bring the cluster file named by the test's parameter up; take it down after."""
    path = HERE / request.param
    spec = load(path)
    hosts_before = Path("/etc/hosts").read_text()
    up = sh([BIN / "hybridagg", "cluster", "up", path], timeout=60)
    assert up.returncode == 0, up.stdout + up.stderr
    try:
        yield path, spec
    finally:
        down = sh([BIN / "hybridagg", "cluster", "down", path], timeout=60)
        assert down.returncode == 0, down.stdout + down.stderr
        assert leftovers(spec) == []
        assert not any(n.startswith(spec.name + "-") for n in namespaces())
        assert Path("/etc/hosts").read_text() == hosts_before


def run_on(
    path: Path, args: list, nranks: int | None = None
) -> subprocess.CompletedProcess:
    """``hybridagg-run --cluster FILE [-n N] -- ARGS`` in the repository."""
    n = ["-n", str(nranks)] if nranks else []
    return sh([BIN / "hybridagg-run", "--cluster", path, *n, "--", *args], cwd=REPO)


def job_processes(spec) -> list[int]:
    pids = []
    for host in spec.hosts:
        done = sh(["ip", "netns", "pids", f"{spec.name}-{host.name}"])
        pids += [int(p) for p in done.stdout.split()]
    return pids


@pytest.mark.parametrize("cluster", ["three-hosts.toml"], indirect=True)
def test_hosts_are_nodes(cluster):
    path, spec = cluster
    result = run_on(path, [sys.executable, HERE / "probe_nodes.py"])
    assert result.returncode == 0, result.stdout + result.stderr
    ranks = [
        json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")
    ]
    assert [r["host"] for r in ranks] == ["a", "a", "b", "b", "ps"]
    assert [r["node_size"] for r in ranks] == [2, 2, 2, 2, 1]
    # shared memory only among ranks of one host, never across the world
    assert [r["shm_world"] for r in ranks] == [False] * 5
    assert [r["shm_node"] for r in ranks] == [True, True, True, True, False]
    assert {r["sum"] for r in ranks} == {0 + 1 + 2 + 3 + 4}
    assert job_processes(spec) == []


@pytest.mark.parametrize("cluster", ["three-hosts.toml"], indirect=True)
def test_hybrid_job_with_a_group_per_host_learns_the_digits(cluster, tmp_path):
    path, spec = cluster
    from hybridagg.data import convert_digits

    data = tmp_path / "digits.h5"
    convert_digits(data, val_fraction=0.2, seed=0, progress=False)
    out = tmp_path / "summary.json"
    before = traffic(spec)
    result = run_on(
        path,
        [
            sys.executable, "-m", "hybridagg.cli", "train", "--data", data,
            "--mode", "hybrid", "--groups", "node", "--servers", "1",
            "--epochs", "6", "--lr", "0.05", "--no-progress",
            "--target-accuracy", "0.85", "--eval-every", "10", "--summary", out,
        ],
    )  # fmt: skip
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    s = json.loads(out.read_text())
    assert s["groups"] == [[0, 1], [2, 3]] and s["servers"] == 1
    assert s["final_accuracy"] >= 0.85, s  # the stated accuracy, as on one host
    after = traffic(spec)
    moved = {h: (after[h][0] - before[h][0], after[h][1] - before[h][1]) for h in after}
    # the leaders' pushes and pulls of the model (tens of KiB per step) went
    # through the servers' host link, both ways
    assert moved["ps"][0] > 1 << 20 and moved["ps"][1] > 1 << 20, moved
    assert job_processes(spec) == []


def bench(path: Path, nranks: int, tmp_path: Path, name: str) -> list[dict]:
    out = tmp_path / f"{name}.json"
    result = run_on(
        path,
        [
            sys.executable, REPO / "bench" / "allreduce.py", "--min", "16M", "--max", "64M",
            "--impls", "hybridagg-flat,mpi4py,gloo", "--json", out,
        ],
        nranks,
    )  # fmt: skip
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    print(result.stdout)
    return json.loads(out.read_text())


@pytest.mark.parametrize("cluster", ["two-hosts.toml"], indirect=True)
def test_allreduce_across_two_hosts_runs_at_the_links_rate(cluster, tmp_path):
    path, spec = cluster
    rate = spec.hosts[0].link.rate_bytes / 1e9  # GB/s, as the benchmark prints
    before = traffic(spec)
    records = bench(path, 2, tmp_path, "across")
    after = traffic(spec)
    sizes = sorted({r["bytes"] for r in records})
    assert sizes == [16 << 20, 64 << 20]
    for size in sizes:
        busbw = {r["impl"]: r["busbw_GBps"] for r in records if r["bytes"] == size}
        # the shaper is a hard bound: nothing goes past it ...
        assert max(busbw.values()) <= rate * 1.02, (size, busbw)
        # ... and the link delivers its rate to a collective
        assert max(busbw.values()) >= rate * 0.9, (size, busbw)
    # every byte of every repetition crossed host a's link, both ways: a
    # 2-rank all-reduce of S bytes sends and receives S per rank
    reps = sum(r["reps"] for r in records)
    least = sum(r["reps"] * r["bytes"] for r in records)
    sent, got = after["a"][0] - before["a"][0], after["a"][1] - before["a"][1]
    assert sent >= least and got >= least, (sent, got, least, reps)


@pytest.mark.parametrize("cluster", ["three-hosts.toml"], indirect=True)
def test_allreduce_within_a_host_stays_off_the_link(cluster, tmp_path):
    path, spec = cluster
    before = traffic(spec)
    records = bench(path, 2, tmp_path, "within")  # ranks 0 and 1: both on host a
    after = traffic(spec)
    moved = sum(r["reps"] * r["bytes"] for r in records)
    sent = after["a"][0] - before["a"][0]
    # the launcher's control messages cross the link, the data does not
    assert sent < moved / 100, (sent, moved)
