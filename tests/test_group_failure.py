"""``--on-group-failure continue``: a lost group is dropped and the others train on.

End-to-end jobs run under the real ``mpirun --with-ft ulfm`` (Open MPI 5's
ULFM) with a rank SIGKILLed mid-run (``HYBRIDAGG_FAULT=kill:N:R``); each
rank's final status line on stderr says how it ended. The pure parts (the
survivors' verdict, the staleness book, the fault spec, the metrics merge)
are tested without MPI.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from train_helpers import output, summary

from hybridagg.ps.staleness import GroupBook, HeldReply
from hybridagg.runtime import runner
from hybridagg.runtime.outcomes import ExitCode
from hybridagg.topology import Topology
from hybridagg.train.config import TrainConfig
from hybridagg.train.faults import kill_at, parse_fault
from hybridagg.train.metrics import MetricsWriter, merge_parts
from hybridagg.train.survival import (
    FATAL,
    GROUP_LOST,
    OK,
    Ending,
    RankStatus,
    settle,
    status_line,
)

ROOT = Path(__file__).resolve().parents[1]
STATUS = re.compile(r"^hybridagg train: rank (\d+): (\w+) \(code (\d+)\)(?:: (.*))?$")


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    from hybridagg.data import convert_digits

    path = tmp_path_factory.mktemp("data") / "digits.h5"
    convert_digits(path, val_fraction=0.2, seed=0, progress=False)
    return str(path)


# ------------------------------------------------------------------ pure logic
HYBRID = Topology(world_size=5, groups=((0, 1), (2, 3)), servers=(4,))


def _ok(rank, role="worker", **kw):
    return Ending(rank, role, OK, report={"role": role}, **kw)


def test_a_dead_non_leader_loses_its_group_and_rank_2_reports():
    endings = [
        Ending(0, "worker", GROUP_LOST, "group 0 lost: rank 1 died", (1,)),
        _ok(2),
        _ok(3),
        _ok(4, "server", lost_groups={0: (1.5, 1)}),
    ]
    v = settle(HYBRID, endings, can_finish=True)
    assert v.outcome == "finished_with_losses"
    assert v.dead == (1,) and v.survivors == (0, 2, 3, 4)
    assert v.lost_groups == [
        {"group": 0, "ranks": [0, 1], "dead_ranks": [1], "t": 1.5, "survivors": [0]}
    ]
    assert v.reporter == 2  # group 0 is lost, so rank 0 does not report
    assert v.status_of(endings[0]).code == ExitCode.GROUP_LOST
    assert v.status_of(endings[1]).code == ExitCode.FINISHED_WITH_LOSSES
    assert v.status_of(endings[3]).code == ExitCode.FINISHED_WITH_LOSSES


def test_no_loss_finishes_and_rank_0_reports():
    v = settle(HYBRID, [_ok(0), _ok(1), _ok(2), _ok(3), _ok(4, "server")], True)
    assert (v.outcome, v.reporter, v.lost_groups, v.dead) == ("finished", 0, [], ())
    assert v.status_of(_ok(1)) == RankStatus(ExitCode.FINISHED, "")


def test_a_group_dropped_by_the_servers_is_lost_even_if_no_survivor_says_so():
    # the leader died; its member had not noticed when the others met
    endings = [_ok(0), _ok(1), _ok(3), _ok(4, "server", lost_groups={1: (2.0, 2)})]
    v = settle(HYBRID, endings, True)
    assert [g["group"] for g in v.lost_groups] == [1] and v.reporter == 0


def test_a_dead_server_or_a_fatal_rank_aborts_every_survivor():
    dead_server = settle(HYBRID, [_ok(0), _ok(1), _ok(2), _ok(3)], can_finish=False)
    assert dead_server.outcome == "aborted" and dead_server.reporter is None
    assert "parameter server rank 4 died" in dead_server.message
    assert dead_server.status_of(_ok(0)).code == ExitCode.ABORTED
    two = Topology(world_size=6, groups=((0, 1), (2, 3)), servers=(4, 5))
    fatal = Ending(0, "worker", FATAL, "parameter server rank 5 died", (5,))
    v = settle(two, [fatal, _ok(1), _ok(2), _ok(3), _ok(4, "server"), _ok(5)], False)
    assert v.outcome == "aborted" and v.message == "parameter server rank 5 died"


def test_losing_every_group_aborts():
    endings = [Ending(1, "worker", GROUP_LOST), Ending(3, "worker", GROUP_LOST)]
    v = settle(HYBRID, [*endings, _ok(4, "server")], True)
    assert v.outcome == "aborted" and "every group was lost" in v.message
    assert v.status_of(endings[0]).code == ExitCode.ABORTED


def test_the_status_line_is_one_parseable_line():
    line = status_line(3, RankStatus(ExitCode.GROUP_LOST, "group 1 lost:\n rank 2"))
    assert STATUS.match(line).groups() == (
        "3",
        "group_lost",
        "6",
        "group 1 lost: rank 2",
    )
    assert status_line(0, RankStatus(ExitCode.FINISHED)) == (
        "hybridagg train: rank 0: finished (code 0)"
    )


def test_a_dropped_group_no_longer_holds_back_the_staleness_bound():
    book = GroupBook(2, bound=1)
    for _ in range(3):
        book.record(0, 0)
    assert book.too_far_ahead(0)  # group 1 has not pushed: group 0 waits
    book.hold(HeldReply(0, 0, 1.0))
    book.hold(HeldReply(1, 0, 1.0))
    assert book.drop(1, when=2.5, dead_rank=3)
    assert not book.too_far_ahead(0) and 1 in book.done and not book.all_done
    assert book.lost == {1: (2.5, 3)}
    assert [h.group for h in book.release()] == [0]  # group 1's reply discarded
    assert not book.drop(1, when=3.0)  # once
    book.finish(0)
    assert book.all_done


def test_the_kill_fault_names_the_step_then_the_rank(monkeypatch):
    # kill:N:R, like checkpoint:N:R: a server counts its updates as steps
    assert parse_fault("kill:12:3") == ("kill", (12.0, 3.0))
    killed = []
    monkeypatch.setattr(os, "kill", lambda pid, sig: killed.append(sig))
    monkeypatch.setenv("HYBRIDAGG_FAULT", "kill:12:3")
    kill_at(3, 11)
    kill_at(12, 3)  # (the order matters)
    assert killed == []
    kill_at(3, 12)
    assert killed == [signal.SIGKILL]


def test_a_torn_last_line_of_a_killed_rank_is_left_out(tmp_path):
    path = tmp_path / "m.jsonl"
    w = MetricsWriter(path, 0)
    w.write("step", t=0.1)
    w.close()
    part = tmp_path / "m.jsonl.rank-00001"  # rank 1 was killed mid-line
    part.write_text('{"event": "step", "rank": 1, "t": 0.2}\n{"event": "st')
    assert merge_parts(path, 2) == 2
    assert [json.loads(x)["rank"] for x in path.read_text().splitlines()] == [0, 1]


def test_continue_is_refused_in_sync_mode_and_with_adaptive_groups():
    TrainConfig(data="x", mode="hybrid", on_group_failure="continue")
    assert TrainConfig(data="x").on_group_failure == "abort"
    with pytest.raises(ValueError, match="continue needs --mode hybrid or async"):
        TrainConfig(data="x", mode="sync", on_group_failure="continue")
    with pytest.raises(ValueError, match="--adaptive-groups"):
        TrainConfig(
            data="x",
            mode="hybrid",
            adaptive_batch=True,
            adaptive_groups=True,
            on_group_failure="continue",
        )
    with pytest.raises(ValueError, match="--on-group-failure must be one of"):
        TrainConfig(data="x", mode="hybrid", on_group_failure="retry")


def test_the_ulfm_check_reads_the_run_time_setting():
    # one process started without mpirun: Open MPI 5 has ULFM built in, but
    # this process does not run with it
    code = (
        "from hybridagg.comm.ulfm import ulfm_status\n"
        "ok, why = ulfm_status()\n"
        "print(ok, why)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={**runner.mpiexec_env(), "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("False"), done.stdout
    assert "started without it" in done.stdout or "without ULFM" in done.stdout


# ------------------------------------------------------------------ end to end
def run_ft(nranks: int, args: list[str], *, fault: str | None, ulfm: bool = True):
    """``mpirun [--with-ft ulfm] -n N hybridagg train ARGS`` with a fault."""
    extra = ["--with-ft", "ulfm"] if ulfm else []
    argv = runner.mpiexec_argv(
        nranks, [sys.executable, "-m", "hybridagg.cli", "train", *args], extra=extra
    )
    env = runner.mpiexec_env()
    env["HYBRIDAGG_TIMEOUT"] = "60"
    env["PYTHONPATH"] = str(ROOT)
    if fault:
        env["HYBRIDAGG_FAULT"] = fault
    result = runner.run_job(argv, timeout=240, env=env)
    assert not result.timed_out, output(result)[-4000:]
    assert runner.processes_with_token(result.token) == []
    return result


def statuses(result) -> dict[int, tuple[str, int, str]]:
    """Each rank's final status line: rank -> (status, exit code, reason)."""
    found = {}
    for line in result.stderr.splitlines():
        m = STATUS.match(line.strip())
        if m:
            found[int(m[1])] = (m[2], int(m[3]), m[4] or "")
    return found


def train_args(digits, tmp_path, *more) -> list[str]:
    return [
        "--data",
        digits,
        "--epochs",
        "5",
        "--lr",
        "0.05",
        "--no-progress",
        "--on-group-failure",
        "continue",
        "--summary",
        str(tmp_path / "summary.json"),
        "--metrics",
        str(tmp_path / "metrics.jsonl"),
        *more,
    ]


HYBRID_ARGS = ["--mode", "hybrid", "--groups", "0-1,2-3"]


def test_a_killed_worker_drops_its_group_and_the_other_trains_to_the_end(
    digits, tmp_path
):
    result = run_ft(5, train_args(digits, tmp_path, *HYBRID_ARGS), fault="kill:10:1")
    st = statuses(result)
    assert st.get(0, ())[:2] == ("group_lost", 6), output(result)[-3000:]
    assert "rank 1 died" in st[0][2]
    assert {r: st[r][:2] for r in (2, 3, 4)} == {
        r: ("finished_with_losses", 4) for r in (2, 3, 4)
    }, st
    assert 1 not in st  # it was killed
    s = summary(tmp_path / "summary.json")
    assert s["outcome"] == "finished_with_losses" and s["reporter"] == 2
    assert s["final_accuracy"] >= 0.9, s
    assert s["epochs"] == 5 and s["dead_ranks"] == [1]
    (lost,) = s["lost_groups"]
    assert (lost["group"], lost["ranks"], lost["dead_ranks"]) == (0, [0, 1], [1])
    assert lost["survivors"] == [0] and 0 < lost["t"] < s["wall_s"] + 60
    # the lost share is recorded: samples of the 5 epochs nobody reports
    assert 0 <= s["samples_unaccounted"] < 1438, s
    assert s["samples"] + s["samples_unaccounted"] == 5 * 1438
    recs = [
        json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()
    ]
    dropped = [r for r in recs if r["event"] == "group_lost"]
    assert {(r["rank"], r["group"]) for r in dropped} == {(4, 0), (0, 0)}
    assert any(r["event"] == "eval" and r.get("final") and r["rank"] == 2 for r in recs)


MID_PUSH = """
import json, os, signal, sys, time
os.environ["HYBRIDAGG_PS_PART_BYTES"] = "8"
import torch
import hybridagg
from hybridagg.ps.client import PSClient
from hybridagg.ps.compensation import Compensation
from hybridagg.ps.streaming import bucket_ranges

topo = hybridagg.init(groups="0,1", servers=1)
if topo.is_server:
    stats = hybridagg.serve(topo, drop_lost=True)
    print("SERVER " + json.dumps({"updates": stats.updates_per_leader, "lost": sorted(stats.lost_groups), "version": stats.version}), flush=True)
    os._exit(0)
torch.manual_seed(0)
params = [torch.nn.Parameter(torch.randn(6)), torch.nn.Parameter(torch.randn(3))]
opt = torch.optim.SGD(params, lr=0.1)
client = PSClient(topo.comms.leaders.dup("ps"), 2, params, [], opt, Compensation())
start = client.flat_weights.clone()
buckets = bucket_ranges([6, 3], [[1], [0]])
if topo.rank == 1:
    push = client.stream(buckets, 1.0, [0.1], [0])
    push.send(0, torch.ones(3))  # the second parameter's parts leave
    time.sleep(1.0)
    os.kill(os.getpid(), signal.SIGKILL)
time.sleep(3.0)  # the server drops group 1
pulled = client.complete(client.pull())
same = torch.equal(client.flat_weights, start)
info = client.complete(client.push([torch.ones(6), torch.ones(3)], 1.0, [0.1], pulled["versions"]))
after = torch.allclose(client.flat_weights, start - 0.1)
client.done()
client.receive_final()
print("LEADER0 " + json.dumps({"pull_unchanged": same, "version_after_pull": pulled["versions"], "push_applied": after}), flush=True)
os._exit(0)
"""


def test_a_leader_killed_in_the_middle_of_a_streamed_push_leaves_nothing_applied(
    tmp_path,
):
    """Leader 1 sends its push's header and first bucket, then dies."""
    script = tmp_path / "mid_push.py"
    script.write_text(MID_PUSH)
    argv = runner.mpiexec_argv(
        3, [sys.executable, str(script)], extra=["--with-ft", "ulfm"]
    )
    env = {**runner.mpiexec_env(), "HYBRIDAGG_TIMEOUT": "30", "PYTHONPATH": str(ROOT)}
    result = runner.run_job(argv, timeout=120, env=env)
    assert not result.timed_out, output(result)[-4000:]
    found = dict(
        line.split(" ", 1)
        for line in result.stdout.splitlines()
        if line.startswith(("SERVER ", "LEADER0 "))
    )
    assert set(found) == {"SERVER", "LEADER0"}, output(result)[-4000:]
    server, leader = json.loads(found["SERVER"]), json.loads(found["LEADER0"])
    # group 1 dropped, its push neither counted nor applied; group 0 goes on
    assert server == {"updates": [1, 0], "lost": [1], "version": 1}, server
    assert leader["pull_unchanged"] and leader["version_after_pull"] == [0]
    assert leader["push_applied"], leader


def test_a_killed_leader_drops_its_group(digits, tmp_path):
    result = run_ft(5, train_args(digits, tmp_path, *HYBRID_ARGS), fault="kill:10:2")
    st = statuses(result)
    assert st.get(3, ())[:2] == ("group_lost", 6), output(result)[-3000:]
    assert {r: st[r][1] for r in (0, 1, 4)} == {0: 4, 1: 4, 4: 4}, st
    s = summary(tmp_path / "summary.json")
    assert s["reporter"] == 0 and s["final_accuracy"] >= 0.85, s
    assert [(g["group"], g["dead_ranks"]) for g in s["lost_groups"]] == [(1, [2])]
    assert s["lost_groups"][0]["t"] is not None  # the server dropped it


def test_a_killed_rank_0_hands_the_report_to_the_next_group(digits, tmp_path):
    result = run_ft(5, train_args(digits, tmp_path, *HYBRID_ARGS), fault="kill:10:0")
    st = statuses(result)
    assert st.get(1, ())[:2] == ("group_lost", 6), output(result)[-3000:]
    assert {r: st[r][1] for r in (2, 3, 4)} == {2: 4, 3: 4, 4: 4}, st
    s = summary(tmp_path / "summary.json")
    assert s["reporter"] == 2 and s["outcome"] == "finished_with_losses"
    assert s["final_accuracy"] >= 0.85, s
    assert [(g["group"], g["dead_ranks"]) for g in s["lost_groups"]] == [(0, [0])]
    assert (tmp_path / "metrics.jsonl").exists()  # merged by rank 2


def test_a_killed_server_ends_the_job_on_every_survivor(digits, tmp_path):
    result = run_ft(5, train_args(digits, tmp_path, *HYBRID_ARGS), fault="kill:15:4")
    st = statuses(result)
    assert sorted(st) == [0, 1, 2, 3], output(result)[-3000:]
    for rank in range(4):
        status, code, why = st[rank]
        assert (status, code) == ("aborted", 5), st
        assert "parameter server rank 4 died" in why
    assert not (tmp_path / "summary.json").exists()


def test_async_mode_survives_a_killed_worker(digits, tmp_path):
    args = train_args(digits, tmp_path, "--mode", "async", "--servers", "1")
    result = run_ft(4, args, fault="kill:8:1")
    st = statuses(result)
    assert {r: st[r][:2] for r in (0, 2, 3)} == {
        r: ("finished_with_losses", 4) for r in (0, 2, 3)
    }, output(result)[-3000:]
    s = summary(tmp_path / "summary.json")
    assert s["reporter"] == 0 and s["final_accuracy"] >= 0.85, s
    assert [(g["group"], g["ranks"], g["survivors"]) for g in s["lost_groups"]] == [
        (1, [1], [])
    ]


def test_continue_without_ulfm_is_refused_on_every_rank(digits, tmp_path):
    result = run_ft(
        3, train_args(digits, tmp_path, *HYBRID_ARGS[:2]), fault=None, ulfm=False
    )
    assert result.returncode == 2, output(result)[-3000:]
    assert "needs MPI fault tolerance (ULFM)" in result.stderr
    assert "mpirun --with-ft ulfm" in result.stderr
    assert not (tmp_path / "summary.json").exists()


def test_nan_data_under_continue_stops_every_rank_with_code_3(tmp_path):
    # surviving losses must not make a NaN silent: every rank, server
    # included, ends as non-finite (code 3) and no summary is written
    import numpy as np
    from sklearn.datasets import load_digits

    from hybridagg.data import convert_arrays

    d = load_digits()
    x = d.data.astype(np.float32)
    x[::60, 5] = np.nan
    data = tmp_path / "nan-digits.h5"
    convert_arrays(x, d.target, data, num_classes=10, allow_nonfinite=True)
    result = run_ft(5, train_args(str(data), tmp_path, *HYBRID_ARGS), fault=None)
    st = statuses(result)
    assert {r: st.get(r, ("", -1))[1] for r in range(5)} == dict.fromkeys(
        range(5), 3
    ), output(result)[-3000:]
    assert all("not finite" in st[r][2] for r in range(5)), st
    assert not (tmp_path / "summary.json").exists()
