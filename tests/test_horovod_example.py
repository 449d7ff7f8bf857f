"""examples/horovod_style.py, a script written the way Horovod's PyTorch
examples are, runs with only its import line changed: in sync mode, in hybrid
mode, and (where Horovod is installed) under Horovod with the same losses."""

import importlib.util
import re
import sys
from pathlib import Path

import pytest
from train_helpers import output

from hybridagg.runtime import runner

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "horovod_style.py"
IMPORT = "import hybridagg.torch as hvd\n"


def run_script(script: Path, nranks: int, args=(), env=None, timeout=240):
    argv = runner.mpiexec_argv(nranks, [sys.executable, str(script), *args])
    job_env = runner.mpiexec_env()
    job_env["HYBRIDAGG_TIMEOUT"] = "120"
    job_env["PYTHONPATH"] = str(ROOT)
    job_env.update(env or {})
    result = runner.run_job(argv, timeout=timeout, env=job_env, cwd=str(ROOT))
    assert not result.timed_out, output(result)[-3000:]
    assert result.returncode == 0, output(result)[-3000:]
    assert runner.processes_with_token(result.token) == []
    return result


def accuracies(text: str) -> list[float]:
    return [float(a) for a in re.findall(r"test accuracy ([0-9.]+)", text)]


def losses(prefix: Path, ranks: int) -> list[list[tuple[int, int, float]]]:
    out = []
    for r in range(ranks):
        rows = Path(f"{prefix}.rank{r}").read_text().split("\n")
        out.append(
            [(int(e), int(b), float(v)) for e, b, v in (x.split() for x in rows if x)]
        )
    return out


def test_the_script_is_horovods_but_for_its_import_line():
    code = [
        line
        for line in SCRIPT.read_text().splitlines()
        if "hybridagg" in line and not line.lstrip().startswith("#")
    ]
    assert code == [IMPORT.strip()]


def test_sync_mode_learns_on_two_workers(tmp_path):
    result = run_script(SCRIPT, 2, ["--loss-log", str(tmp_path / "loss")])
    acc = accuracies(result.stdout)
    assert len(acc) == 5, output(result)[-2000:]  # rank 0 prints each epoch
    # 0.95-0.97 after 5 epochs; a digits MLP that learned nothing scores 0.1
    assert acc[-1] > 0.9
    per_rank = losses(tmp_path / "loss", 2)
    assert len(per_rank[0]) == len(per_rank[1]) == 5 * 23  # 719 samples / 32


def test_hybrid_mode_learns_with_two_groups_and_a_server(tmp_path):
    result = run_script(
        SCRIPT,
        4,
        ["--loss-log", str(tmp_path / "loss")],
        env={
            "HYBRIDAGG_MODE": "hybrid",
            "HYBRIDAGG_GROUPS": "0-1,2",
            "HYBRIDAGG_SERVERS": "1",
        },
    )
    acc = accuracies(result.stdout)
    assert len(acc) == 5, output(result)[-2000:]
    # asynchronous between the groups, so it varies from run to run
    assert acc[-1] > 0.85
    # three workers (size() does not count the server), each a third of the data
    per_rank = losses(tmp_path / "loss", 3)
    assert [len(r) for r in per_rank] == [5 * 15] * 3  # 479 samples / 32
    assert not Path(f"{tmp_path / 'loss'}.rank3").exists()  # the server trained nothing


@pytest.mark.skipif(
    importlib.util.find_spec("horovod") is None, reason="needs Horovod (make horovod)"
)
def test_losses_equal_horovods_step_by_step(tmp_path):
    """The same script under Horovod, same seeds: the same data order (the
    same DistributedSampler), the same initial weights (broadcast from rank
    0), one thread per rank. With two ranks both libraries average a
    gradient as (a + b) / 2, which is exact in either order, so the losses
    agree to the last bit in practice; the tolerance (1e-6 relative) leaves
    room only for a different order of float32 operations inside a fused
    all-reduce buffer, never for a different algorithm (an update with the
    other worker's gradient missing or counted twice moves the loss by far
    more)."""
    horovod_script = tmp_path / "horovod_style.py"
    horovod_script.write_text(
        SCRIPT.read_text().replace(IMPORT, "import horovod.torch as hvd\n")
    )
    ours = run_script(
        SCRIPT, 2, ["--epochs", "2", "--loss-log", str(tmp_path / "ours")]
    )
    theirs = run_script(
        horovod_script, 2, ["--epochs", "2", "--loss-log", str(tmp_path / "hvd")]
    )
    a, b = losses(tmp_path / "ours", 2), losses(tmp_path / "hvd", 2)
    for r in range(2):
        assert [x[:2] for x in a[r]] == [x[:2] for x in b[r]]
        for (epoch, batch, mine), (_, _, horovods) in zip(a[r], b[r], strict=True):
            assert mine == pytest.approx(horovods, rel=1e-6), (r, epoch, batch)
    assert accuracies(ours.stdout) == pytest.approx(accuracies(theirs.stdout), abs=1e-3)
