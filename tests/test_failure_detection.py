"""A dead or stuck peer found within HYBRIDAGG_FAILURE_TIMEOUT; solo work has its own deadline."""

import os
import re
import signal
import time

import pytest
from train_helpers import output, run_train, summary

from hybridagg.comm import liveness
from hybridagg.comm.waits import CommTimeoutError
from hybridagg.runtime.outcomes import ExitCode, PeerFailure, exit_code_of
from hybridagg.topology import Topology
from hybridagg.train.faults import parse_fault


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    from hybridagg.data import convert_digits

    path = tmp_path_factory.mktemp("data") / "digits.h5"
    convert_digits(path, val_fraction=0.2, seed=0, progress=False)
    return str(path)


# ------------------------------------------------------------------ pure logic
@pytest.mark.parametrize("timeout", [0.2, 1.0, 5.0, 30.0, 600.0])
def test_a_silence_is_declared_within_the_failure_timeout(timeout):
    period = liveness.beat_period(timeout)
    limit = liveness.silence_limit(timeout)
    # the last beat came up to a period before the death; the watcher looks
    # every quarter period: the verdict falls within the timeout
    assert limit + period + period / 4 <= timeout
    assert limit >= period  # never on one late beat
    assert 0.05 <= period <= 1.0


@pytest.mark.parametrize("bad", ["0", "-1", "inf", "nan", "soon"])
def test_the_timeouts_must_be_finite_and_positive(monkeypatch, bad):
    for name, read in [
        ("HYBRIDAGG_FAILURE_TIMEOUT", liveness.failure_timeout),
        ("HYBRIDAGG_SOLO_WORK_TIMEOUT", liveness.solo_work_timeout),
    ]:
        monkeypatch.setenv(name, bad)
        with pytest.raises(ValueError, match=name):
            read()
    monkeypatch.delenv("HYBRIDAGG_FAILURE_TIMEOUT")
    monkeypatch.delenv("HYBRIDAGG_SOLO_WORK_TIMEOUT")
    assert liveness.failure_timeout() == 30.0
    assert liveness.solo_work_timeout() == 3600.0


def test_messages_name_the_rank_and_its_role():
    topo = Topology(world_size=6, groups=((0, 1), (2, 3, 4)), servers=(5,))
    assert topo.describe_rank(0) == "rank 0 (leader of group 0)"
    assert topo.describe_rank(3) == "rank 3 (worker of group 1)"
    assert topo.describe_rank(5) == "rank 5 (server 0)"


def test_a_stuck_or_dead_peer_exits_aborted():
    assert exit_code_of(PeerFailure("rank 3 died", (3,))) == ExitCode.ABORTED == 5
    # a wait that timed out is an OSError, but no bad input
    assert exit_code_of(CommTimeoutError("stuck")) == ExitCode.ABORTED


def test_fault_specs():
    assert parse_fault("kill:5:3") == ("kill", (5.0, 3.0))
    assert parse_fault("slow-validation:2.5") == ("slow-validation", (2.5,))
    assert parse_fault(None) is None
    for bad in ["kill:5", "explode:1:2", "stop:a:1"]:
        with pytest.raises(ValueError, match="HYBRIDAGG_FAULT"):
            parse_fault(bad)


# ------------------------------------------------------------ the heartbeat
FAILURE_TIMEOUT = 3.0


def _until_verdict(hb, timeout: float = 10.0) -> None:
    # a plain loop: a polled wait would itself raise the verdict
    deadline = time.monotonic() + timeout
    while hb.failure is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert hb.failure is not None, "no verdict"


@pytest.mark.mpi(ranks=[2, 3, 4], timeout=90)
def test_a_peer_that_stops_heartbeating_is_declared_and_waits_raise(mpi_ranks):
    from mpi4py import MPI

    from hybridagg.comm import Heartbeat, wait_until

    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    pids = world.allgather(os.getpid())
    stuck = size - 1  # stopped (SIGSTOP): alive, but silent
    hb = Heartbeat(world, timeout=FAILURE_TIMEOUT, describe=lambda r: f"rank {r} (x)")
    world.Barrier()
    begin = time.monotonic()
    if rank == stuck:
        time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGSTOP)
        _until_verdict(hb)  # resumed by rank 0: told of the verdict against itself
    else:
        # a wait for something the stuck rank will never do ends with the
        # verdict, long before the wait's own timeout
        with pytest.raises(PeerFailure) as err:
            wait_until(lambda: False, what="a reply from the stuck rank", timeout=60)
        elapsed = time.monotonic() - begin
        if rank == 0:
            os.kill(pids[stuck], signal.SIGCONT)
        assert liveness.silence_limit(FAILURE_TIMEOUT) < elapsed
        # a deadline, not a benchmark: far below the wait's own 60 s, with
        # room for an oversubscribed, loaded machine
        assert elapsed < FAILURE_TIMEOUT + 15.0, elapsed
        assert err.value.ranks == (stuck,)
        assert f"rank {stuck} (x) is dead or stuck" in str(err.value)
    # one reporter, the stuck rank's watcher (its successor in the ring)
    assert hb.reporter == (stuck + 1) % size
    assert hb.failure.ranks == (stuck,)
    hb.free()  # after a verdict: local, no wait on the others
    assert liveness.current() is None


@pytest.mark.mpi(ranks=[2, 3], timeout=90)
def test_a_long_solo_phase_is_no_failure_and_no_timeout(mpi_ranks, monkeypatch):
    from mpi4py import MPI

    from hybridagg.comm import Comm, Heartbeat, wait

    monkeypatch.setenv("HYBRIDAGG_TIMEOUT", "1")
    world = MPI.COMM_WORLD
    comm = Comm(world, name="test", timeout=60)
    with Heartbeat(world, timeout=FAILURE_TIMEOUT, solo_timeout=30) as hb:
        # rank 0 works alone 2.5 timeouts (and most of a failure timeout)
        # while the others wait for it with the default timeout (1 s)
        comm.barrier()
        if comm.rank == 0:
            with hb.solo("validation"):
                time.sleep(2.5)
        wait(comm.mpi.Ibarrier(), what="rank 0's validation")  # HYBRIDAGG_TIMEOUT
        assert hb.failure is None
        # the control: the same wait without a solo phase times out
        comm.barrier()
        if comm.rank == 0:
            time.sleep(2.5)
            comm.wait(comm.mpi.Ibarrier(), "the others", timeout=30)
        else:
            req = comm.mpi.Ibarrier()
            with pytest.raises(CommTimeoutError, match="raise HYBRIDAGG_TIMEOUT"):
                wait(req, what="rank 0's long work")
            comm.wait(req, "rank 0's long work", timeout=30)
        assert hb.failure is None
    comm.free()
    assert liveness.current() is None


@pytest.mark.mpi(ranks=[2, 3], timeout=90)
def test_solo_work_past_its_deadline_is_declared_naming_the_phase(mpi_ranks):
    from mpi4py import MPI

    from hybridagg.comm import Heartbeat, wait_until

    world = MPI.COMM_WORLD
    hb = Heartbeat(world, timeout=FAILURE_TIMEOUT, solo_timeout=1.0)
    world.Barrier()
    if world.Get_rank() == 0:
        with hb.solo("validation"):
            time.sleep(2.5)
    else:
        with pytest.raises(
            PeerFailure, match=r"rank 0 spent more than .* in validation"
        ):
            wait_until(lambda: False, what="rank 0", timeout=30)
    _until_verdict(hb)
    assert hb.failure.ranks == (0,) and hb.reporter == 0
    hb.free()


# ------------------------------------------------------------- end to end
def _hybrid_args(digits, tmp_path) -> list[str]:
    return [
        "--data",
        digits,
        "--mode",
        "hybrid",
        "--groups",
        "0-1,2-3",
        "--servers",
        "1",
        "--steps",
        "100000",
        "--sample-ms",
        "2",
        "--no-progress",
        "--summary",
        str(tmp_path / "s.json"),
    ]


@pytest.mark.parametrize(
    "flags",
    [
        pytest.param(["--with-ft", "ulfm"], id="ulfm"),
        # keeps the job alive without telling MPI: the heartbeat alone
        pytest.param(["--enable-recovery"], id="recovery"),
    ],
)
def test_a_killed_worker_aborts_every_rank_within_the_failure_timeout(
    digits, tmp_path, flags
):
    timeout = 5.0
    env = {"HYBRIDAGG_FAILURE_TIMEOUT": f"{timeout:g}", "HYBRIDAGG_FAULT": "kill:15:3"}
    result = run_train(
        5, _hybrid_args(digits, tmp_path), env=env, timeout=240, launcher_flags=flags
    )
    end = time.time()
    text = output(result)
    killed = re.search(r"HYBRIDAGG_FAULT: rank 3 kill at step 15 at ([\d.]+)", text)
    assert killed, text[-3000:]
    # a deadline, not a benchmark: the verdict within the timeout, then
    # the grace for every rank to exit and the launcher's teardown
    assert end - float(killed.group(1)) < timeout + 10.0, text[-3000:]
    # the reporter's MPI_Abort(5) is the launcher's exit code
    assert result.returncode == ExitCode.ABORTED, text[-3000:]
    errors = re.findall(r"hybridagg train: error: .*", text)
    assert len(errors) == 1, text[-3000:]
    assert "rank 3 (worker of group 1)" in errors[0]
    for rank in (0, 1, 2, 4):
        assert f"hybridagg train: rank {rank}: aborted (exit 5)" in text, text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    assert not (tmp_path / "s.json").exists()


def test_a_stuck_worker_aborts_the_job(digits, tmp_path):
    """Alive but silent (SIGSTOP): found by the heartbeat, ended by MPI_Abort."""
    env = {"HYBRIDAGG_FAILURE_TIMEOUT": "5", "HYBRIDAGG_FAULT": "stop:15:1"}
    result = run_train(5, _hybrid_args(digits, tmp_path), env=env, timeout=240)
    text = output(result)
    assert result.returncode == ExitCode.ABORTED, text[-3000:]
    errors = re.findall(r"hybridagg train: error: .*", text)
    assert len(errors) == 1, text[-3000:]
    assert "rank 1 (worker of group 0) is dead or stuck" in errors[0], errors


def test_a_validation_longer_than_the_timeout_does_not_abort(digits, tmp_path):
    args = ["--data", digits, "--mode", "sync", "--steps", "30", "--no-progress"]
    args += ["--eval-every", "10", "--summary", str(tmp_path / "s.json")]
    env = {"HYBRIDAGG_TIMEOUT": "4", "HYBRIDAGG_FAULT": "slow-validation:6"}
    result = run_train(3, args, env=env, timeout=240)
    assert result.returncode == 0, output(result)[-3000:]
    s = summary(tmp_path / "s.json")
    assert s["steps"] >= 30 and s["final_accuracy"] is not None
