"""A user's own model and task, and what a run leaves behind (issue 23).

``--model mymodel:build`` found from the current folder, the factory's
signature checked; ``--loss mse`` on float targets; ``--save-model`` in every
mode (the servers' true weights in hybrid and async); rank-tagged logging;
the final table with ``--no-progress``; ``--tensorboard``; ``efficiency``
without ``--sample-ms``.
"""

from __future__ import annotations

import io
import json
import logging
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from train_helpers import output, run_train, summary

from hybridagg.runtime import logs
from hybridagg.train.config import TrainConfig
from hybridagg.train.losses import check_task, loss_function
from hybridagg.train.metrics import format_table, summary_row
from hybridagg.train.models import build_model, check_fits

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------ the user's model
FACTORIES = """
import torch

def build(sample_shape, num_classes):
    return torch.nn.Sequential(
        torch.nn.Flatten(), torch.nn.Linear(sample_shape[0], num_classes)
    )

def only_classes(num_classes):
    return torch.nn.Linear(4, num_classes)

def no_arguments():
    return torch.nn.Linear(4, 3)

def everything(**kwargs):
    return torch.nn.Linear(kwargs["sample_shape"][0], kwargs["num_classes"])

def needs_width(sample_shape, num_classes, width):
    return torch.nn.Linear(4, num_classes)

def positional(sample_shape, num_classes, /):
    return torch.nn.Linear(4, num_classes)

def not_a_module(sample_shape, num_classes):
    return "a string"

NOT_CALLABLE = 3
"""


@pytest.fixture
def user_folder(tmp_path, monkeypatch):
    """A folder holding the user's module, the current folder, not on sys.path."""
    name = f"usermodels_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(FACTORIES)
    monkeypatch.chdir(tmp_path)
    # what the console script sees: its own folder first, not the current one
    monkeypatch.setattr(
        sys, "path", [p for p in sys.path if p not in ("", os.getcwd(), str(tmp_path))]
    )
    yield name
    sys.modules.pop(name, None)


def test_a_module_in_the_current_folder_is_found(user_folder):
    model = build_model(f"{user_folder}:build", (4,), 3)
    assert model(torch.randn(2, 4)).shape == (2, 3)
    assert os.getcwd() in sys.path  # (for the module's own imports of its neighbours)
    assert build_model(f"{user_folder}:only_classes", (4,), 5).out_features == 5
    assert build_model(f"{user_folder}:no_arguments", (4,), 5).out_features == 3
    assert build_model(f"{user_folder}:everything", (4,), 6).out_features == 6


@pytest.mark.parametrize(
    "factory,match",
    [
        ("needs_width", r"cannot fill 'width'"),
        ("positional", r"positional-only"),
        ("not_a_module", r"returned str, not a torch.nn.Module"),
        ("NOT_CALLABLE", r"is a int, not a callable"),
    ],
)
def test_a_factory_that_does_not_fit_is_a_type_error(user_folder, factory, match):
    with pytest.raises(TypeError, match=match) as err:
        build_model(f"{user_folder}:{factory}", (4,), 3)
    if factory == "needs_width":  # the message shows the signature hybridagg uses
        assert "factory(sample_shape=..., num_classes=...)" in str(err.value)


def test_a_missing_module_or_factory_names_the_folder(user_folder):
    with pytest.raises(ValueError, match="searched the current folder"):
        build_model("no_such_module_here:build", (4,), 3)
    with pytest.raises(ValueError, match="has no 'missing'"):
        build_model(f"{user_folder}:missing", (4,), 3)


# ------------------------------------------------------------ --loss
def test_the_loss_must_fit_the_labels():
    check_task("cross-entropy", False, "d.h5")
    check_task("mse", True, "d.h5")
    with pytest.raises(ValueError, match="--loss mse needs float targets"):
        check_task("mse", False, "d.h5")
    with pytest.raises(ValueError, match="train with --loss mse"):
        check_task("cross-entropy", True, "d.h5")
    with pytest.raises(ValueError, match="--target-accuracy needs --loss"):
        TrainConfig(data="d.h5", loss="mse", target_accuracy=0.5)
    with pytest.raises(ValueError, match="--loss must be one of"):
        TrainConfig(data="d.h5", loss="hinge")


def test_mse_meets_scalar_and_vector_targets():
    mse = loss_function("mse")
    out = torch.tensor([[1.0], [3.0]])
    assert float(mse(out, torch.tensor([0.0, 1.0]))) == pytest.approx((1 + 4) / 2)
    out2 = torch.zeros(2, 2)
    assert float(mse(out2, torch.ones(2, 2))) == pytest.approx(1.0)


def test_a_regression_model_must_give_one_value_per_target():
    model = torch.nn.Linear(4, 3)
    check_fits(model, (4,), 3, "m", torch.device("cpu"), "mse")
    with pytest.raises(
        ValueError, match="outputs 3 values per sample, but the targets have 1"
    ):
        check_fits(model, (4,), 1, "m", torch.device("cpu"), "mse")
    check_fits(model, (4,), 2, "m", torch.device("cpu"))  # (logits may be more)


def regression_arrays(n: int = 600, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``y = x . w + 0.5``, with a little noise: a linear model can learn it."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, 8)).astype(np.float32)
    w = rng.standard_normal(8).astype(np.float32)
    y = x @ w + 0.5 + 0.01 * rng.standard_normal(n).astype(np.float32)
    return x, y


def test_float_targets_are_converted_read_and_evaluated(tmp_path):
    from hybridagg.data import HDF5Loader, convert_arrays
    from hybridagg.data.loader import load_split_info
    from hybridagg.train.evaluate import Evaluator

    x, y = regression_arrays()
    path = convert_arrays(x, y, tmp_path / "reg.h5", targets="float", val_fraction=0.2)
    info = load_split_info([str(path)], "train")[0]
    assert info.regression and info.num_classes == 1 and info.labels.dtype == np.float32
    with HDF5Loader(str(path), batch_size=50, split="val", shuffle=False) as loader:
        _, yb = next(iter(loader))
    assert yb.dtype == torch.float32 and yb.shape == (50,)
    from hybridagg.data import HDF5Dataset

    _, target = HDF5Dataset(path)[3]  # (a DataLoader's collate stacks these)
    assert target.dtype == torch.float32 and target.shape == ()
    # validation reports the mean squared error and no accuracy
    cfg = TrainConfig(data=str(path), loss="mse")
    model = torch.nn.Linear(8, 1)
    ev = Evaluator(cfg, model, torch.device("cpu"), loss="mse")
    accuracy, loss = ev.evaluate(model)
    ev.close()
    assert accuracy is None
    with HDF5Loader(
        str(path), batch_size=120, split="val", shuffle=False, normalize=True
    ) as loader:
        xv, yv = next(iter(loader))
    with torch.no_grad():
        expected = float(((model(xv).squeeze(1) - yv) ** 2).mean())
    assert loss == pytest.approx(expected, rel=1e-5)
    # vector targets (N, 2): two values per sample
    path2 = convert_arrays(
        x, np.stack([y, -y], 1), tmp_path / "reg2.h5", targets="float"
    )
    assert load_split_info([str(path2)], "train")[0].num_classes == 2
    with pytest.raises(ValueError, match="target 3 is not finite"):
        y_bad = y.copy()
        y_bad[3] = np.nan
        convert_arrays(x, y_bad, tmp_path / "bad.h5", targets="float")


# ------------------------------------------------------------ the final table
def test_the_table_shows_a_dash_for_figures_a_run_has_not():
    # without --sample-ms there is no ideal: efficiency is None (null in JSON)
    row = summary_row(
        {
            "mode": "hybrid",
            "samples_per_sec": 100.0,
            "ideal_samples_per_sec": None,
            "efficiency": None,
            "final_accuracy": None,
            "final_loss": 0.25,
            "steps": 4,
        }
    )
    assert row["efficiency"] == row["ideal/s"] == row["final acc"] == "-"
    assert row["final loss"] == "0.25"
    assert "| hybrid |" in format_table([row]).replace("  ", " ")


def test_publish_prints_the_table_without_progress(tmp_path, capsys):
    from hybridagg.train.worker.report import publish

    cfg = TrainConfig(data="d.h5", progress=False, summary=str(tmp_path / "s.json"))
    publish(cfg, {"mode": "sync", "samples_per_sec": 5.0, "efficiency": None})
    out = capsys.readouterr().out
    assert out.startswith("| mode ") and "efficiency" in out
    assert json.loads((tmp_path / "s.json").read_text())["efficiency"] is None


# ------------------------------------------------------------ logging
@pytest.fixture
def fresh_logger():
    logger = logging.getLogger(logs.LOGGER)
    saved = (logger.handlers[:], logger.level, logger.propagate)
    yield logger
    logger.handlers[:], logger.level, logger.propagate = saved


def _capture(logger: logging.Logger) -> io.StringIO:
    """Point the installed handler at a buffer."""
    buf = io.StringIO()
    (handler,) = logger.handlers
    handler.setStream(buf)
    return buf


def test_log_lines_are_rank_tagged_and_rank_0s_by_default(fresh_logger, monkeypatch):
    monkeypatch.delenv("HYBRIDAGG_LOG_RANKS", raising=False)
    child = logging.getLogger("hybridagg.train.something")
    logs.configure(0, "info")
    buf = _capture(fresh_logger)
    child.info("hello")
    child.debug("not shown at info")
    assert buf.getvalue() == "[rank 0] hello\n"
    logs.configure(3, "debug")
    buf = _capture(fresh_logger)
    child.info("from rank 3")  # dropped: rank 0's only
    child.error("only rank 3 knows", extra={"any_rank": True})
    assert buf.getvalue() == "[rank 3] only rank 3 knows\n"
    monkeypatch.setenv("HYBRIDAGG_LOG_RANKS", "all")
    logs.configure(3, "info")
    buf = _capture(fresh_logger)
    child.info("every rank")
    assert buf.getvalue() == "[rank 3] every rank\n"
    assert len(fresh_logger.handlers) == 1  # (reconfiguring replaces, not adds)


def test_bad_log_settings_are_named(fresh_logger, monkeypatch):
    with pytest.raises(ValueError, match="--log-level must be one of"):
        logs.configure(0, "loud")
    monkeypatch.setenv("HYBRIDAGG_LOG_LEVEL", "chatty")
    with pytest.raises(ValueError, match="HYBRIDAGG_LOG_LEVEL must be one of"):
        logs.configure(0)
    monkeypatch.setenv("HYBRIDAGG_LOG_LEVEL", "info")
    monkeypatch.setenv("HYBRIDAGG_LOG_RANKS", "some")
    with pytest.raises(ValueError, match="HYBRIDAGG_LOG_RANKS must be 0 or all"):
        logs.configure(0)


def test_the_library_keeps_a_scripts_own_logging(fresh_logger, monkeypatch):
    root = logging.getLogger()
    mine = logging.StreamHandler(io.StringIO())
    root.addHandler(mine)
    try:
        fresh_logger.handlers[:] = []
        monkeypatch.setenv("HYBRIDAGG_LOG_LEVEL", "info")
        logs.configure(0, force=False)  # what hybridagg.init() does
        assert fresh_logger.handlers == [] and fresh_logger.propagate
        logging.getLogger("hybridagg.x").info("to the script's handler")
        assert "to the script's handler" in mine.stream.getvalue()
    finally:
        root.removeHandler(mine)


# ------------------------------------------------------------ saving the model
def test_the_saved_file_is_whole_and_loads_with_weights_only(tmp_path):
    from hybridagg.train.export import check_destination, save_state_dict

    model = build_model("resnet", (64,), 10)
    path = save_state_dict(model.state_dict(), tmp_path / "out" / "model.pt")
    assert not list(path.parent.glob("*.partial"))
    other = build_model("resnet", (64,), 10)
    other.load_state_dict(torch.load(path, weights_only=True), strict=True)
    for key, value in model.state_dict().items():
        assert torch.equal(other.state_dict()[key], value), key
    with pytest.raises(ValueError, match="is a directory"):
        check_destination(tmp_path)


# ------------------------------------------------------------ tensorboard
def test_tensorboard_missing_is_one_clear_error(monkeypatch):
    import importlib.util

    from hybridagg.train import board

    real = importlib.util.find_spec
    monkeypatch.setattr(
        board.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "tensorboard" else real(name, *a),
    )
    with pytest.raises(ValueError, match=r"pip install 'hybridagg\[tensorboard\]'"):
        board.check_available("tb")
    board.check_available(None)  # (nothing asked, nothing needed)


def read_scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar tag of one TensorBoard run folder: ``[(step, value), ...]``."""
    from tensorboard.backend.event_processing.event_accumulator import (
        EventAccumulator,
    )

    acc = EventAccumulator(str(folder))
    acc.Reload()
    return {
        tag: [(e.step, e.value) for e in acc.Scalars(tag)]
        for tag in acc.Tags()["scalars"]
    }


def test_the_board_writes_a_groups_scalars(tmp_path):
    pytest.importorskip("tensorboard")
    from hybridagg.train.board import Board

    b = Board(str(tmp_path), rank=0, group=0, is_leader=True, members=[0, 1])
    shared = torch.tensor([[0, 0.1, 8, 1, 2.0], [0, 0.1, 24, 1, 1.0]])
    b.step(5, shared, 2, 4, staleness=1, busy_s=0.5)
    b.step(6, torch.zeros(2, 5), 2, 4, staleness=0, busy_s=0.5)  # (no samples)
    b.validation(6, 0.75, 0.5)
    b.close()
    group = read_scalars(tmp_path / "group-0")
    assert group["train/loss"] == [(5, pytest.approx((8 * 2.0 + 24 * 1.0) / 32))]
    assert group["train/batch"] == [(5, 32.0)]
    assert group["train/samples_per_sec"] == [(5, pytest.approx(64.0))]
    assert group["train/staleness"] == [(5, 1.0)]
    assert group["batch/rank_0"] == [(5, 8.0)] and group["batch/rank_1"] == [(5, 24.0)]
    val = read_scalars(tmp_path / "validation")
    assert val == {"val/accuracy": [(6, 0.75)], "val/loss": [(6, 0.5)]}


# ------------------------------------------------------------ end to end
@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    from hybridagg.data import convert_digits

    path = tmp_path_factory.mktemp("data") / "digits.h5"
    convert_digits(path, val_fraction=0.2, seed=0, progress=False)
    return str(path)


def flat_of(state: dict, model: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """``state``'s parameters and floating buffers, flat, in the optimizer's order."""
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    buffers = [n for n, b in model.named_buffers() if b.is_floating_point()]
    return (
        torch.cat([state[n].reshape(-1) for n in names]),
        torch.cat([state[n].reshape(-1).float() for n in buffers]),
    )


def evaluate_saved(model: torch.nn.Module, data: str) -> tuple[float, float]:
    """The accuracy and loss rank 0's final validation computes, here."""
    from hybridagg.train.evaluate import Evaluator

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # (as each rank: the same order of the sums)
    ev = Evaluator(TrainConfig(data=data), model, torch.device("cpu"))
    try:
        return ev.evaluate(model)
    finally:
        ev.close()
        torch.set_num_threads(threads)


@pytest.mark.parametrize(
    "nranks,mode",
    [
        (3, ["--mode", "sync"]),
        (5, ["--mode", "hybrid", "--groups", "0-1,2-3"]),
        (3, ["--mode", "async", "--servers", "1"]),
    ],
    ids=["sync", "hybrid", "async"],
)
def test_the_saved_model_is_the_final_model(digits, tmp_path, nranks, mode):
    from hybridagg.train.checkpoint import latest_checkpoint, load_part

    saved, ck = tmp_path / "out" / "model.pt", tmp_path / "ck"
    args = ["--data", digits, *mode, "--model", "resnet", "--steps", "24"]
    args += ["--lr", "0.05", "--batch-size", "16", "--eval-every", "1000"]
    args += ["--no-progress", "--summary", str(tmp_path / "s.json")]
    args += ["--save-model", str(saved), "--checkpoint", str(ck)]
    result = run_train(nranks, args, timeout=240)
    assert result.returncode == 0, output(result)[-3000:]
    s = summary(tmp_path / "s.json")
    # --no-progress: no bar, but the final table (once, rank 0's)
    assert result.stdout.count("| mode ") == 1, result.stdout[-2000:]
    # no --sample-ms: no ideal, so no efficiency, and the table says "-"
    assert s["efficiency"] is None and s["ideal_samples_per_sec"] is None
    head, _, row = [ln for ln in result.stdout.splitlines() if ln.startswith("|")]
    cells = dict(zip(head.split("|"), row.split("|"), strict=True))
    cells = {k.strip(): v.strip() for k, v in cells.items()}
    assert cells["efficiency"] == cells["ideal/s"] == "-", cells
    assert s["saved_model"] == str(saved)
    assert "[rank 0] hybridagg train: saved the model's state_dict" in result.stderr
    state = torch.load(saved, weights_only=True)
    model = build_model("resnet", (64,), 10)
    model.load_state_dict(state, strict=True)  # parameters and buffers, all
    assert all(v.device.type == "cpu" for v in state.values())
    bn = model[2]  # the stem's BatchNorm: trained statistics, not the initial ones
    assert not torch.equal(bn.running_var, torch.ones_like(bn.running_var))
    # the model the final validation measured
    accuracy, loss = evaluate_saved(model, digits)
    assert accuracy == pytest.approx(s["final_accuracy"], abs=1.5 / 360), s
    assert loss == pytest.approx(s["final_loss"], rel=1e-3), s
    latest = latest_checkpoint(ck)
    if s["mode"] == "sync":  # rank 0's model, which every worker holds
        ranks = load_part(latest, 0)["model"]
        assert ranks.keys() == state.keys()
        for key, value in ranks.items():
            assert torch.equal(value, state[key]), key
        return
    # hybrid/async: what the servers hold at the end (their final checkpoint
    # part), with the lookahead on, so the weights of a push's reply were a
    # prediction, never saved
    assert s["lookahead"] is True
    shard = load_part(latest, nranks - 1)["server"]["shard"]
    assert shard["range"] == [0, shard["elements"]]  # (one server: the whole model)
    weights, buffers = flat_of(state, model)
    assert torch.equal(shard["flat"], weights)
    assert torch.equal(shard["buffers"].float(), buffers)


def test_tensorboard_has_each_groups_scalars(digits, tmp_path):
    pytest.importorskip("tensorboard")
    board, metrics = tmp_path / "tb", tmp_path / "m.jsonl"
    args = ["--data", digits, "--mode", "hybrid", "--groups", "0-1,2-3"]
    args += ["--epochs", "2", "--eval-every", "10", "--no-progress"]
    args += ["--tensorboard", str(board), "--metrics", str(metrics)]
    result = run_train(5, args, timeout=240)
    assert result.returncode == 0, output(result)[-3000:]
    assert sorted(p.name for p in board.iterdir()) == [
        "group-0",
        "group-1",
        "validation",
    ]
    recs = [json.loads(line) for line in metrics.read_text().splitlines()]
    for g, members in enumerate([[0, 1], [2, 3]]):
        totals: dict[int, int] = {}
        for r in recs:
            if r["event"] == "step" and r["rank"] in members:
                totals[r["step"]] = totals.get(r["step"], 0) + r["batch"]
        updates = sum(1 for n in totals.values() if n > 0)
        scalars = read_scalars(board / f"group-{g}")
        tags = {"train/loss", "train/batch", "train/samples_per_sec", "train/staleness"}
        tags |= {f"batch/rank_{m}" for m in members}
        assert set(scalars) == tags, scalars.keys()
        for tag in tags:
            assert len(scalars[tag]) == updates, (g, tag, len(scalars[tag]), updates)
        versions = [v for v, _ in scalars["train/batch"]]
        assert versions == sorted(set(versions))  # one point per server version
        batches = sorted(n for n in totals.values() if n > 0)
        assert sorted(b for _, b in scalars["train/batch"]) == batches
    evals = [r for r in recs if r["event"] == "eval"]
    val = read_scalars(board / "validation")
    assert len(val["val/accuracy"]) == len(val["val/loss"]) == len(evals) >= 2
    assert val["val/accuracy"][-1][1] == pytest.approx(evals[-1]["accuracy"])


LINEAR = """
import torch

def build(sample_shape, num_classes):
    return torch.nn.Linear(sample_shape[0], num_classes)
"""

ENTRY = "import sys\nfrom hybridagg.cli import main\nsys.exit(main())\n"


@pytest.mark.parametrize(
    "nranks,mode",
    [(2, ["--mode", "sync"]), (3, ["--mode", "async", "--servers", "1"])],
    ids=["sync", "async"],
)
def test_a_users_regression_model_from_the_current_folder(tmp_path, nranks, mode):
    from hybridagg.data import convert_arrays
    from hybridagg.runtime import runner

    x, y = regression_arrays(n=1500)
    data = convert_arrays(x, y, tmp_path / "reg.h5", targets="float")
    work, bin_ = tmp_path / "work", tmp_path / "bin"
    work.mkdir()
    bin_.mkdir()
    (work / "linreg.py").write_text(LINEAR)
    # a script elsewhere, as the console script `hybridagg` is: the current
    # folder is not on its sys.path (python -m would put it there)
    (bin_ / "entry.py").write_text(ENTRY)
    saved = work / "model.pt"
    args = ["train", "--data", str(data), *mode, "--model", "linreg:build"]
    args += ["--loss", "mse", "--epochs", "4", "--lr", "0.02", "--no-progress"]
    args += ["--summary", "s.json", "--save-model", "model.pt"]
    argv = runner.mpiexec_argv(nranks, [sys.executable, str(bin_ / "entry.py"), *args])
    env = runner.mpiexec_env()
    env["HYBRIDAGG_TIMEOUT"] = "60"
    env["PYTHONPATH"] = str(ROOT)  # (hybridagg itself; not the current folder)
    result = runner.run_job(argv, timeout=240, env=env, cwd=work)
    assert result.returncode == 0, output(result)[-3000:]
    s = summary(work / "s.json")
    assert s["loss"] == "mse" and s["final_accuracy"] is None
    assert s["accuracy_curve"] == [] and s["time_to_target_s"] is None
    # the targets' variance is about 8; a fitted line leaves the noise
    assert s["final_loss"] < 0.05 * float(np.var(y)), s
    assert "| mode " in result.stdout
    sys.path.insert(0, str(work))
    try:
        import linreg

        model = linreg.build((8,), 1)
    finally:
        sys.path.remove(str(work))
        sys.modules.pop("linreg", None)
    model.load_state_dict(torch.load(saved, weights_only=True), strict=True)
    xs = torch.from_numpy(x[:100])
    with torch.no_grad():  # (the data are normalised: compare on the fitted scale)
        assert model(xs).shape == (100, 1)


def test_mse_on_class_labels_is_one_message(digits):
    result = run_train(
        2, ["--data", digits, "--loss", "mse", "--steps", "2"], timeout=90
    )
    text = output(result)
    assert result.returncode == 2, text[-2000:]
    assert text.count("--loss mse needs float targets") == 1, text[-2000:]
    assert "[rank 0] hybridagg train: error:" in text and "Traceback" not in text


@pytest.mark.mpi(ranks=3, timeout=120)
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_final_state_dict_is_the_servers_model_not_a_prediction(mode):
    """The library's export: after finish(), rank 0's final_state_dict() holds
    what the servers hold (weights and BatchNorm statistics), although with
    the lookahead on the model held a prediction before finish()."""
    import hybridagg

    servers = 1 if mode == "async" else 0
    topo = hybridagg.init(groups="each" if servers else "world", servers=servers)
    if topo.is_server:
        hybridagg.serve(topo)
        return
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 8),
        torch.nn.BatchNorm1d(8),
        torch.nn.ReLU(),
        torch.nn.Linear(8, 1),
    )
    opt = hybridagg.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
        model.named_parameters(),
        topo,
        mode=mode,
        model=model,
        compensation=hybridagg.Compensation(reference_batch=16, lookahead=True),
    )
    with pytest.raises(ValueError, match=r"call finish\(\) first"):
        opt.final_state_dict()
    rng = torch.Generator().manual_seed(10 + topo.rank)
    for _ in range(12):
        x = torch.randn(16, 8, generator=rng)
        opt.set_samples(16)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), x[:, :1]).backward()
        opt.step()
    topo.comms.workers.barrier(what="every worker's last update")
    truth = None
    if servers and topo.rank == 0:  # no push can follow: this is the end state
        truth = opt.pull_state()
        held, _ = flat_of(model.state_dict(), model)
        assert not torch.equal(held, truth[0])  # the last reply: a prediction
    opt.finish()
    if servers and topo.rank != 0:
        with pytest.raises(ValueError, match="does not hold the final weights"):
            opt.final_state_dict()
        return
    state = opt.final_state_dict()
    assert state.keys() == model.state_dict().keys()
    weights, buffers = flat_of(state, model)
    if truth is not None:
        assert torch.equal(weights, truth[0])
        assert torch.equal(buffers, truth[1].float())
    else:  # sync: every worker's model, the same everywhere
        everyone = topo.comms.workers.allgather(weights.tolist(), what="final weights")
        assert all(w == weights.tolist() for w in everyone)
    fresh = torch.nn.Sequential(
        torch.nn.Linear(8, 8),
        torch.nn.BatchNorm1d(8),
        torch.nn.ReLU(),
        torch.nn.Linear(8, 1),
    )
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    fresh.load_state_dict(torch.load(buf, weights_only=True), strict=True)
    assert torch.equal(flat_of(fresh.state_dict(), fresh)[0], weights)
