"""The harness itself: hangs are killed, failing ranks are reported, errors abort."""

import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from hybridagg.runtime import runner

HERE = Path(__file__).resolve().parent


def run_inner_pytest(tmp_path, body, timeout=120):
    """Run a throw-away test file through this harness in a child pytest."""
    shutil.copy(HERE / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_inner.py").write_text(textwrap.dedent(body))
    start = time.monotonic()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "-rA",
            str(tmp_path / "test_inner.py"),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return proc, time.monotonic() - start


def test_a_deadlocked_job_is_killed_and_reported(tmp_path):
    body = """
        import pytest

        @pytest.mark.mpi(ranks=2, timeout=8)
        def test_deadlock():
            from mpi4py import MPI
            import numpy as np
            comm = MPI.COMM_WORLD
            buf = np.zeros(1)
            # both ranks receive first: a classic deadlock, blocking in MPI
            comm.Recv(buf, source=1 - comm.rank)

        @pytest.mark.mpi(ranks=2, timeout=60)
        def test_after_the_deadlock_still_runs():
            from mpi4py import MPI
            assert MPI.COMM_WORLD.size == 2
    """
    proc, elapsed = run_inner_pytest(tmp_path, body)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "1 failed, 1 passed" in out, out
    assert "timed out after 8 s at 2 ranks" in out, out
    assert elapsed < 8 + 25, f"took {elapsed:.1f} s"
    # no rank of the killed job survives: they would carry the run token
    leftover = [p for p in _python_pids() if _runs(p, "test_inner.py")]
    assert leftover == []


def test_a_failing_rank_shows_its_traceback(tmp_path):
    body = """
        import pytest

        @pytest.mark.mpi(ranks=3, timeout=60)
        def test_one_rank_fails():
            from mpi4py import MPI
            comm = MPI.COMM_WORLD
            if comm.rank == 2:
                assert comm.rank == 0, "rank two disagrees"
            comm.barrier()  # the others wait here and are aborted

        @pytest.mark.mpi(ranks=3, timeout=60)
        def test_next_in_the_batch():
            pass
    """
    proc, _ = run_inner_pytest(tmp_path, body)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "1 failed, 1 passed" in out, out
    assert "======== rank 2 ========" in out, out
    assert "rank two disagrees" in out, out
    assert "1 of 3 ranks failed" in out, out


def test_passing_and_parametrized_ranks(tmp_path):
    body = """
        import pytest

        @pytest.mark.mpi(ranks=[1, 3], timeout=60)
        def test_sizes(mpi_ranks):
            from mpi4py import MPI
            assert MPI.COMM_WORLD.size == mpi_ranks
    """
    proc, _ = run_inner_pytest(tmp_path, body)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "2 passed" in out, out


def test_unhandled_exception_aborts_the_job_with_rank_and_reason(tmp_path):
    script = tmp_path / "boom.py"
    script.write_text(
        textwrap.dedent("""
        import time
        import hybridagg
        from hybridagg.comm import Comm
        hybridagg.install_abort_hook()
        comm = Comm()
        if comm.rank == 1:
            raise RuntimeError("disk on fire")
        comm.barrier(what="waiting for rank 1")  # would hang without the hook
    """)
    )
    argv = runner.mpiexec_argv(3, [sys.executable, str(script)])
    result = runner.run_job(argv, timeout=60, env=runner.mpiexec_env())
    out = result.stdout + result.stderr
    assert not result.timed_out, out
    assert result.returncode != 0
    assert "rank 1: unhandled RuntimeError: disk on fire" in out, out


def _python_pids():
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if (entry / "comm").read_text().startswith("python"):
                    pids.append(int(entry.name))
            except OSError:
                pass
    return pids


def _runs(pid, needle):
    try:
        return needle in Path(f"/proc/{pid}/cmdline").read_text()
    except OSError:
        return False
