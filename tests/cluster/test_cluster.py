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
* a pipelined group whose stages sit on two hosts learns the digits;
* a user's own loop with ``ShareSampler`` across hosts draws its chunks
  from server 0 and takes every sample of each epoch;
* servers beside the workers (a server slot on each host) run there, and a
  hybrid job with a group and a server per host learns the digits;
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
    # workers on two hosts draw their chunks from server 0, not from a
    # window that across TCP completes a draw only when worker 0 enters MPI
    assert s["chunk_counter"] == "server"
    assert "draw their data's chunks from parameter server 0" in result.stderr
    assert s["final_accuracy"] >= 0.85, s  # the stated accuracy, as on one host
    after = traffic(spec)
    moved = {h: (after[h][0] - before[h][0], after[h][1] - before[h][1]) for h in after}
    # the leaders' pushes and pulls of the model (tens of KiB per step) went
    # through the servers' host link, both ways
    assert moved["ps"][0] > 1 << 20 and moved["ps"][1] > 1 << 20, moved
    assert job_processes(spec) == []


@pytest.mark.parametrize("cluster", ["three-hosts.toml"], indirect=True)
def test_a_users_share_sampler_across_hosts_draws_from_server_0(cluster):
    path, spec = cluster
    result = run_on(path, [sys.executable, HERE / "share_sampler_probe.py"])
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    (line,) = [ln for ln in result.stdout.splitlines() if ln.startswith("{")]
    got = json.loads(line)
    # not the window, whose draws across TCP wait for worker 0's next MPI call
    assert got["counter"] == "ServedCounter", got
    # every sample of each epoch taken; a group of two pads at most one
    assert all(e["all"] and 0 <= e["extra"] <= 2 for e in got["epochs"]), got
    fast, slow = sum(got["samples"][:2]), sum(got["samples"][2:])
    assert slow < fast, got  # the slower group took less of each epoch
    assert job_processes(spec) == []


@pytest.mark.parametrize("cluster", ["three-hosts.toml"], indirect=True)
def test_a_pipeline_across_two_hosts_learns_the_digits(cluster, tmp_path):
    """Group 1 is a pipeline of rank 1 (host a) and rank 2 (host b): its
    activations and their gradients cross the link, and each stage exchanges
    its own layers with the server on host ps."""
    path, spec = cluster
    from hybridagg.data import convert_digits

    data = tmp_path / "digits.h5"
    convert_digits(data, val_fraction=0.2, seed=0, progress=False)
    out = tmp_path / "summary.json"
    result = run_on(
        path,
        [
            sys.executable, "-m", "hybridagg.cli", "train", "--data", data,
            "--mode", "hybrid", "--groups", "0,1-2,3", "--servers", "1",
            "--pipeline-groups", "1", "--epochs", "6", "--lr", "0.05",
            "--no-progress", "--eval-every", "20", "--summary", out,
        ],
    )  # fmt: skip
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    s = json.loads(out.read_text())
    assert s["groups"] == [[0], [1, 2], [3]] and s["pipeline"]["groups"] == [1]
    bounds = s["pipeline"]["bounds"]
    assert bounds[0] == [0, 3] and len(bounds[1]) == 3  # a cut inside group 1
    # the start-up probe measured the stages' link across hosts: the shaper
    # (1 Gbit/s) bounds it, and it is far below shared memory's
    ((latency, bandwidth),) = s["pipeline"]["links"]["1"]
    assert 0 < latency < 0.01 and 1e7 < bandwidth <= 1.1 * 125e6, (latency, bandwidth)
    assert s["final_accuracy"] >= 0.85, s
    assert job_processes(spec) == []


@pytest.mark.parametrize("cluster", ["servers-beside.toml"], indirect=True)
def test_servers_beside_the_workers_of_each_host(cluster, tmp_path):
    path, spec = cluster
    probe = run_on(path, [sys.executable, HERE / "probe_nodes.py"])
    assert probe.returncode == 0, probe.stdout + probe.stderr
    ranks = [json.loads(x) for x in probe.stdout.splitlines() if x.startswith("{")]
    # workers 0-3 fill the hosts' worker slots, the last ranks the server slots
    assert [r["host"] for r in ranks] == ["a", "a", "b", "b", "a", "b"]
    assert [r["node_size"] for r in ranks] == [3] * 6
    from hybridagg.data import convert_digits

    data = tmp_path / "digits.h5"
    convert_digits(data, val_fraction=0.2, seed=0, progress=False)
    out = tmp_path / "summary.json"
    before = traffic(spec)
    result = run_on(
        path,
        [
            sys.executable, "-m", "hybridagg.cli", "train", "--data", data,
            "--mode", "hybrid", "--groups", "node", "--servers", "2",
            "--epochs", "6", "--lr", "0.05", "--no-progress",
            "--target-accuracy", "0.85", "--eval-every", "10", "--summary", out,
        ],
    )  # fmt: skip
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    s = json.loads(out.read_text())
    assert s["groups"] == [[0, 1], [2, 3]] and s["servers"] == 2
    assert s["final_accuracy"] >= 0.85, s
    after = traffic(spec)
    moved = {h: (after[h][0] - before[h][0], after[h][1] - before[h][1]) for h in after}
    # each leader reaches the other host's shard over the links, both ways
    assert all(sent > 1 << 20 and got > 1 << 20 for sent, got in moved.values()), moved
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


@pytest.mark.parametrize("cluster", ["two-hosts.toml"], indirect=True)
def test_bench_ps_across_a_cluster_puts_the_leader_and_the_server_on_two_hosts(
    cluster, tmp_path
):
    # bench/ps.py --cluster: its latency job through hybridagg-run, the
    # leader on host a and the server on host b
    path, spec = cluster
    out = tmp_path / "ps.json"
    before = traffic(spec)
    result = sh(
        [sys.executable, REPO / "bench" / "ps.py", "--cluster", path, "--only",
         "latency", "--servers", "1", "--min", "1048576", "--max", "4194304",
         "--reps", "2", "--json", out],
        cwd=REPO,
    )  # fmt: skip
    after = traffic(spec)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    records = json.loads(out.read_text())
    assert {(r["impl"], r["bytes"]) for r in records} == {
        (impl, size)
        for impl in ("hybridagg-ps", "hybridagg-ps+update", "mpi4py-p2p")
        for size in (1 << 20, 4 << 20)
    }
    # every push and every reply crossed host a's link: (reps + 1) round
    # trips of each size, for each of the three
    least = 3 * 3 * ((1 << 20) + (4 << 20))
    sent, got = after["a"][0] - before["a"][0], after["a"][1] - before["a"][1]
    assert sent >= least and got >= least, (sent, got, least)


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


# ------------------------------------------------------- failures and teardown
def test_a_failed_up_removes_what_it_made(tmp_path):
    from hybridagg.cluster import ClusterError, plan, up
    from hybridagg.cluster.netns import _run

    spec = load(HERE / "three-hosts.toml")
    commands = plan.up_commands(spec)
    environ = {"HYBRIDAGG_CLUSTER_DIR": str(tmp_path)}
    for fail_at in (len(commands) // 2, len(commands) - 1):
        calls = []

        def failing(argv, fail_at=fail_at, calls=calls):
            if list(argv) in commands:
                calls.append(argv)
                if len(calls) == fail_at + 1:  # the real command is not run
                    return subprocess.CompletedProcess(argv, 2, "", "injected failure")
            return _run(argv)

        with pytest.raises(ClusterError, match="injected failure"):
            up(spec, environ, run=failing)
        assert len(calls) == fail_at + 1
        assert leftovers(spec) == []
        assert not (tmp_path / spec.name).exists()


def test_up_refuses_a_cluster_that_is_up_and_a_subnet_in_use(tmp_path):
    spec = load(HERE / "two-hosts.toml")
    path = HERE / "two-hosts.toml"
    assert sh([BIN / "hybridagg", "cluster", "up", path]).returncode == 0
    try:
        again = sh([BIN / "hybridagg", "cluster", "up", path])
        assert again.returncode == 1 and "seems up already" in again.stderr
        other = tmp_path / "same-subnet.toml"
        other.write_text(path.read_text().replace('name = "hxb"', 'name = "hxo"'))
        clash = sh([BIN / "hybridagg", "cluster", "up", other])
        assert clash.returncode == 1 and "overlaps" in clash.stderr, clash.stderr
        assert leftovers(load(other)) == []
    finally:
        assert sh([BIN / "hybridagg", "cluster", "down", path]).returncode == 0
    assert leftovers(spec) == []


def test_latency_needs_netem(tmp_path):
    """Latency is netem's; a kernel without it is refused before anything is made."""
    from hybridagg.cluster import up
    from hybridagg.cluster.netns import ClusterError, _check_netem, _run

    path = tmp_path / "slow.toml"
    path.write_text(
        (HERE / "two-hosts.toml")
        .read_text()
        .replace('bandwidth = "1gbit"', 'bandwidth = "1gbit"\nlatency_ms = 20')
    )
    spec = load(path)
    environ = {"HYBRIDAGG_CLUSTER_DIR": str(tmp_path / "state")}
    try:
        _check_netem(spec, _run)
        has_netem = True
    except ClusterError:
        has_netem = False
    if not has_netem:
        with pytest.raises(ClusterError, match="netem"):
            up(spec, environ)
        assert leftovers(spec) == [] and f"{spec.name}-probe" not in namespaces()
        return
    # a kernel with netem: a TCP handshake between the hosts takes two link
    # latencies each way (a's and b's), so at least 2 * 2 * 20 ms
    up(spec, environ)
    try:
        probe = (
            "import socket,time;s=socket.socket();t=time.perf_counter();"
            f"s.connect(('{spec.address('b')}',9));print(time.perf_counter()-t)"
        )
        server = subprocess.Popen(
            ["ip", "netns", "exec", f"{spec.name}-b", sys.executable, "-c",
             "import socket;s=socket.socket();s.bind(('',9));s.listen();s.accept()"]
        )  # fmt: skip
        try:
            import time

            time.sleep(0.5)
            rtt = float(
                sh(
                    [
                        "ip",
                        "netns",
                        "exec",
                        f"{spec.name}-a",
                        sys.executable,
                        "-c",
                        probe,
                    ]
                ).stdout
            )
        finally:
            server.kill()
            server.wait()
        assert rtt >= 0.08, rtt
    finally:
        from hybridagg.cluster import down

        down(spec, environ)
    assert leftovers(spec) == []


@pytest.mark.parametrize("cluster", ["three-hosts.toml"], indirect=True)
def test_down_stops_a_job_left_running_on_the_hosts(cluster, tmp_path):
    """A launcher killed hard leaves its ranks behind; down stops every one of them."""
    import signal
    import time

    path, spec = cluster
    marker = tmp_path / "started"
    script = (
        "import pathlib, time\n"
        "from mpi4py import MPI\n"
        f"pathlib.Path('{marker}', str(MPI.COMM_WORLD.rank)).touch()\n"
        "time.sleep(600)\n"
    )
    marker.mkdir()
    env = dict(os.environ, PATH=f"{BIN}:{os.environ['PATH']}")
    job = subprocess.Popen(
        [BIN / "hybridagg-run", "--cluster", path, "--", sys.executable, "-c", script],
        cwd=REPO, env=env, start_new_session=True,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while len(list(marker.iterdir())) < spec.total_ranks:
            assert time.monotonic() < deadline, "the job did not start"
            assert job.poll() is None
            time.sleep(0.2)
        assert len(job_processes(spec)) >= spec.total_ranks
        os.kill(
            job.pid, signal.SIGKILL
        )  # the launcher dies; its daemons and ranks may not
        job.wait(timeout=10)
    finally:
        if job.poll() is None:
            job.kill()
    down = sh([BIN / "hybridagg", "cluster", "down", path], timeout=60)
    assert down.returncode == 0, down.stderr
    assert job_processes(spec) == [] and leftovers(spec) == []
    gone = sh(["pgrep", "-f", str(marker)])
    assert gone.stdout.strip() == "", gone.stdout
    # the fixture's own down must find nothing left and succeed
    up = sh([BIN / "hybridagg", "cluster", "up", path], timeout=60)
    assert up.returncode == 0, up.stderr
