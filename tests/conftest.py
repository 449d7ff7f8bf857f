"""hybridagg's MPI test harness.

One ``pytest`` command runs everything. A test marked

    @pytest.mark.mpi(ranks=3, timeout=60)        # or ranks=[1, 2, 3, 4, 5]

is not run in the pytest process: the harness starts ``mpiexec -n 3 python -m
pytest <that test>`` (a list of rank counts parametrizes the test, ids
``np1``...), each rank runs the test body and writes its outcome to a shared
folder, and the test passes only if every rank passed. A failure on any rank
fails the test with that rank's traceback and captured output, and aborts the
other ranks so they do not wait in a collective forever. A job that outlives
``timeout`` is killed, every process of it, and reported as failed.

The pytest process itself never initialises MPI (a singleton MPI there would
leak its environment into the jobs it starts), so tests of pure logic run in
it directly and anything that needs MPI is marked ``mpi``.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

import pytest

from hybridagg.runtime import envvars

RESULTS = envvars.get_str("HYBRIDAGG_TEST_RESULTS")
IN_RANK = RESULTS is not None
DEFAULT_RANKS = 2
DEFAULT_TIMEOUT = 120.0

if not IN_RANK:
    import mpi4py

    mpi4py.rc.initialize = False
    mpi4py.rc.finalize = False


# tests/slurm boots a real Slurm cluster (root, minutes): only under
# `make test-slurm`, which sets HYBRIDAGG_TEST_SLURM=1.
# tests/cluster brings emulated clusters up (root): only under `make
# test-cluster`, which sets HYBRIDAGG_TEST_CLUSTER=1.
collect_ignore = [] if envvars.get_bool("HYBRIDAGG_TEST_SLURM") else ["slurm"]
if not envvars.get_bool("HYBRIDAGG_TEST_CLUSTER"):
    collect_ignore.append("cluster")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "mpi(ranks=2, timeout=120): run the test under mpiexec at that many "
        "ranks (an int, or a list to parametrize over)",
    )
    config.addinivalue_line(
        "markers",
        "cuda: needs a CUDA GPU; skipped where torch sees none (`make test-gpu` "
        "runs them on a GPU machine)",
    )


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    marker = metafunc.definition.get_closest_marker("mpi")
    if marker is None:
        return
    ranks = marker.kwargs.get("ranks", DEFAULT_RANKS)
    if isinstance(ranks, (list, tuple)):
        if "mpi_ranks" not in metafunc.fixturenames:
            metafunc.fixturenames.append("mpi_ranks")
        metafunc.parametrize("mpi_ranks", list(ranks), ids=[f"np{n}" for n in ranks])


def _ranks_of(item: pytest.Item) -> int:
    marker = item.get_closest_marker("mpi")
    ranks = marker.kwargs.get("ranks", DEFAULT_RANKS)
    if isinstance(ranks, (list, tuple)):
        return int(item.callspec.params["mpi_ranks"])
    return int(ranks)


@pytest.fixture
def mpi_tmp_path(request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    """A temporary folder that every rank of an ``mpi`` test sees as the same."""
    shared = envvars.get_str("HYBRIDAGG_TEST_SHARED_TMP")
    if not (IN_RANK and shared):
        return tmp_path
    # one folder per test: the tests of a batch share the job's folder
    path = Path(shared) / hashlib.sha1(request.node.nodeid.encode()).hexdigest()[:12]
    path.mkdir(exist_ok=True)
    return path


# --------------------------------------------------------------- parent side
# Starting a rank costs seconds (importing torch), so the harness runs all the
# not-yet-run tests of one file at one rank count in a single job and caches
# their outcomes. Each test keeps its own timeout: the job's deadline moves
# as each test finishes. A test that fails or hangs ends the job; the tests
# after it in the batch then run in a job of their own when their turn comes.
_BATCHES: dict[tuple[str, int], list[pytest.Function]] = {}
_OUTCOMES: dict[str, tuple] = {}


def pytest_collection_modifyitems(session, config, items) -> None:
    if IN_RANK:
        return
    cuda = None
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            cuda = _has_cuda() if cuda is None else cuda
            if not cuda:  # (skipped here, so no MPI job is started for it)
                item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
                continue
        if item.get_closest_marker("mpi") is not None:
            _BATCHES.setdefault((str(item.path), _ranks_of(item)), []).append(item)


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function):
    marker = pyfuncitem.get_closest_marker("mpi")
    if marker is None or IN_RANK:
        return None
    if pyfuncitem.nodeid not in _OUTCOMES:
        _run_batch(pyfuncitem)
    _report(pyfuncitem, *_OUTCOMES.pop(pyfuncitem.nodeid))
    return True


def _timeout_of(item: pytest.Item) -> float:
    return float(item.get_closest_marker("mpi").kwargs.get("timeout", DEFAULT_TIMEOUT))


def _result_name(nodeid: str, rank: int) -> str:
    return f"{hashlib.sha1(nodeid.encode()).hexdigest()[:16]}-rank{rank}.json"


def _run_batch(first: pytest.Function) -> None:
    from hybridagg.runtime import runner

    nranks = _ranks_of(first)
    key = (str(first.path), nranks)
    batch = [it for it in _BATCHES.get(key, [first]) if it.nodeid not in _OUTCOMES]
    if first not in batch:
        batch = [first]
    batch = batch[batch.index(first) :]
    root = str(first.config.rootpath)
    with (
        tempfile.TemporaryDirectory(prefix="hybridagg-test-") as results,
        tempfile.TemporaryDirectory(prefix="hybridagg-shared-") as shared,
    ):
        env = runner.mpiexec_env()
        env["HYBRIDAGG_TEST_RESULTS"] = results
        env["HYBRIDAGG_TEST_SHARED_TMP"] = str(shared)
        # Inner waits time out before the harness kills the job, so a wait
        # that never completes is reported with its own message.
        shortest = min(_timeout_of(it) for it in batch)
        env.setdefault("HYBRIDAGG_TIMEOUT", f"{max(5.0, 0.75 * shortest):g}")
        env["PYTHONPATH"] = os.pathsep.join(
            [root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        )
        cmd = [sys.executable, "-m", "pytest", *(it.nodeid for it in batch)]
        cmd += ["-p", "no:cacheprovider", "-o", "addopts=", "--rootdir", root]
        cmd += ["-q", "--no-header"]
        done = Path(results)
        clock = {"index": 0, "since": time.monotonic()}

        def deadline() -> float:
            # advance past every test all ranks have reported
            while clock["index"] < len(batch) and all(
                (done / _result_name(batch[clock["index"]].nodeid, r)).exists()
                for r in range(nranks)
            ):
                clock["index"] += 1
                clock["since"] = time.monotonic()
            if clock["index"] >= len(batch):
                return clock["since"] + 60.0  # every test done: time to exit
            return clock["since"] + _timeout_of(batch[clock["index"]])

        argv = runner.mpiexec_argv(nranks, cmd)
        total = sum(_timeout_of(it) for it in batch) + 60.0
        for _attempt in range(1 + _LAUNCH_RETRIES):
            clock["since"] = time.monotonic()
            result = runner.run_job(
                argv, timeout=total, env=env, cwd=root, deadline=deadline
            )
            # Open MPI's launcher now and then fails to start its PMIx
            # listener before any rank exists (seen twice in a day on this
            # machine): no test ran, so the job is launched again
            if not (
                result.returncode != 0
                and _LAUNCH_FAILED in result.stderr
                and not any(done.iterdir())
            ):
                break
        deadline()
        # Tests before the clock's index finished on every rank; the one at it
        # was running when the job ended; those after it did not start.
        for item in batch[: clock["index"] + 1]:
            outcomes = {}
            for rank in range(nranks):
                path = done / _result_name(item.nodeid, rank)
                if path.exists():
                    outcomes[rank] = json.loads(path.read_text())
            _OUTCOMES[item.nodeid] = (nranks, _timeout_of(item), result, outcomes)


_LAUNCH_FAILED = "PMIx server's listener thread failed to start"
"""mpiexec's message when it could not start any rank (a launcher fault)."""
_LAUNCH_RETRIES = 2


def _tail(text: str, lines: int = 40) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def _report(item, nranks, timeout, result, outcomes) -> None:
    failed = {r: o for r, o in outcomes.items() if o["outcome"] == "failed"}
    missing = sorted(set(range(nranks)) - set(outcomes))
    if not failed and not missing:
        if all(o["outcome"] == "skipped" for o in outcomes.values()):
            pytest.skip(outcomes[0].get("longrepr") or "skipped on every rank")
        return
    if failed:
        parts = [f"{len(failed)} of {nranks} ranks failed"]
        for rank in sorted(failed):
            parts.append(f"\n======== rank {rank} ========\n{failed[rank]['longrepr']}")
            if failed[rank].get("output"):
                parts.append(
                    f"-------- rank {rank} output --------\n{failed[rank]['output']}"
                )
        if missing:
            parts.append(f"\nranks {missing} were aborted before reporting")
        pytest.fail("\n".join(parts), pytrace=False)
    if result.timed_out:
        done = sorted(outcomes)
        pytest.fail(
            f"timed out after {timeout:g} s at {nranks} ranks (killed; ranks that "
            f"finished: {done}, ranks that did not: {missing}; "
            f"{result.leftovers_killed} leftover processes killed)\n"
            f"--- stdout ---\n{_tail(result.stdout)}\n--- stderr ---\n{_tail(result.stderr)}",
            pytrace=False,
        )
    pytest.fail(
        f"mpiexec exited with {result.returncode}; ranks without a result: "
        f"{missing}\n--- stdout ---\n{_tail(result.stdout)}\n"
        f"--- stderr ---\n{_tail(result.stderr)}",
        pytrace=False,
    )


# ----------------------------------------------------------------- rank side
if IN_RANK:
    _state: dict = {}

    def pytest_sessionstart(session: pytest.Session) -> None:
        from mpi4py import MPI

        _state["rank"] = MPI.COMM_WORLD.Get_rank()
        _state["size"] = MPI.COMM_WORLD.Get_size()

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(item: pytest.Item, call):
        outcome = yield
        report = outcome.get_result()
        rec = _state.setdefault(item.nodeid, {"outcome": "passed", "longrepr": ""})
        if report.failed:
            rec["outcome"] = "failed"
            rec["longrepr"] += f"[{report.when}] {report.longreprtext}\n"
            rec["output"] = "\n".join(
                f"{name}:\n{content}" for name, content in report.sections
            )
        elif (
            report.skipped
            and report.when in ("setup", "call")
            and rec["outcome"] != "failed"
        ):
            rec["outcome"] = "skipped"
            rec["longrepr"] = str(report.longrepr[-1]) if report.longrepr else ""

    def pytest_runtest_logfinish(nodeid: str, location) -> None:
        rec = dict(_state.get(nodeid, {"outcome": "failed", "longrepr": "no report"}))
        rank, size = _state["rank"], _state["size"]
        rec["rank"] = rank
        path = Path(RESULTS) / _result_name(nodeid, rank)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(rec))
        tmp.replace(path)
        if rec["outcome"] == "failed" and size > 1:
            # The other ranks may be waiting for this one in a collective.
            from mpi4py import MPI

            sys.stderr.write(f"rank {rank} failed; aborting the job\n")
            sys.stderr.flush()
            MPI.COMM_WORLD.Abort(1)

    def pytest_internalerror(excrepr, excinfo) -> None:
        sys.stderr.write("".join(traceback.format_exception(excinfo.value)))
