"""``hybridagg train``: options, models, emulation, metrics, checkpoints, end to end."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from train_helpers import output, run_train, summary

from hybridagg.slowdown import parse_slowdown
from hybridagg.train.checkpoint import Checkpointer, latest_checkpoint, load_part
from hybridagg.train.config import TrainConfig
from hybridagg.train.emulation import Pacer, ideal_samples_per_sec
from hybridagg.train.metrics import (
    MetricsWriter,
    format_table,
    merge_parts,
    summary_row,
)
from hybridagg.train.models import build_model, image_shape


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    from hybridagg.data import convert_digits

    path = tmp_path_factory.mktemp("data") / "digits.h5"
    convert_digits(path, val_fraction=0.2, seed=0, progress=False)
    return str(path)


# ------------------------------------------------------------------ pure logic
@pytest.mark.parametrize(
    "kw,match",
    [
        ({"mode": "ring"}, "--mode must be one of"),
        ({"mode": "sync", "servers": 1}, "uses no parameter servers"),
        ({"mode": "hybrid", "servers": 0}, "needs --servers 1 or more"),
        ({"mode": "async", "groups": "0-1,2-3"}, "own group"),
        ({"model": "vgg"}, "unknown --model"),
        ({"optimizer": "lamb"}, "--optimizer must be one of"),
        ({"lr": 0}, "--lr must be positive"),
        ({"batch_size": 0}, "--batch-size must be >= 1"),
        ({"target_accuracy": 90}, "fraction in"),
        ({"slowdown": "0-1:fast"}, "slowdown factor"),
        ({"checkpoint_every": 5}, "need --checkpoint DIR"),
        ({"mode": "sync", "overlap": True}, "need --mode hybrid or async"),
        ({"batch_probe": -1}, "--batch-probe must be >= 0"),
        ({"lookahead_horizon": -1}, "--lookahead-horizon must be >= 0"),
    ],
)
def test_bad_options_are_named(kw, match):
    with pytest.raises(ValueError, match=match):
        TrainConfig(data="x.h5", **kw)


def test_every_config_field_has_a_command_line_flag():
    from hybridagg.cli import build_parser
    from hybridagg.train.flags import config_from_args

    argv = ["train", "--data", "x.h5", "--mode", "async"]
    cfg = config_from_args(build_parser().parse_args(argv))
    assert cfg.lookahead and cfg.lookahead_horizon is None
    argv += ["--no-lookahead", "--lookahead-horizon", "2.5"]
    cfg = config_from_args(build_parser().parse_args(argv))
    assert not cfg.lookahead and cfg.lookahead_horizon == 2.5
    # a field the parser does not fill would silently keep its default
    from dataclasses import fields

    parsed = vars(build_parser().parse_args(["train", "--data", "x.h5"]))
    missing = {f.name for f in fields(TrainConfig)} - set(parsed)
    assert not missing, f"TrainConfig fields without a flag: {sorted(missing)}"


def test_defaults_by_mode():
    assert TrainConfig(data="x").group_spec == "world"
    assert TrainConfig(data="x", mode="hybrid").num_servers == 1
    assert TrainConfig(data="x", mode="async").group_spec == "each"
    assert TrainConfig(data="x").max_epochs == 1
    assert TrainConfig(data="x", steps=5).max_epochs is None


def test_ideal_throughput_follows_the_schedule():
    sd = parse_slowdown("0-1:1,2-3:4")
    assert ideal_samples_per_sec(sd, 4, 1.0, 10.0) == pytest.approx(2 * 1000 + 2 * 250)
    changing = parse_slowdown("0-1:1,2-3:4@0;0-1:4,2-3:1@5")
    assert ideal_samples_per_sec(changing, 4, 1.0, 10.0) == pytest.approx(2500)
    # half the run with every rank at 1x, half with ranks 0-1 at 2x
    half = parse_slowdown("0:1@0;0-1:2@5")
    assert ideal_samples_per_sec(half, 2, 1.0, 10.0) == pytest.approx((2000 + 1000) / 2)


def test_pacer_sleeps_out_the_emulated_step():
    pacer = Pacer(parse_slowdown("1:3"), 1, 2.0, time.perf_counter())
    assert pacer.target(10, 0.001) == pytest.approx(0.06)
    t0 = time.perf_counter()
    slept = pacer.pace(5, 0.01)  # 2 ms x 5 x 3 = 30 ms, 10 ms of it computed
    assert slept == pytest.approx(0.02)
    assert time.perf_counter() - t0 >= 0.019
    plain = Pacer(parse_slowdown("0:2"), 0, 0.0, time.perf_counter())
    assert plain.target(100, 0.01) == pytest.approx(0.02)  # no base: stretch compute


@pytest.mark.parametrize("name", ["mlp", "cnn", "resnet"])
@pytest.mark.parametrize("shape", [(64,), (3, 16, 16)])
def test_zoo_models_map_samples_to_logits(name, shape):
    model = build_model(name, shape, 7)
    assert model(torch.randn(5, *shape)).shape == (5, 7)


def test_user_factory_and_bad_names(tmp_path, monkeypatch):
    (tmp_path / "mymodels.py").write_text(
        "import torch\n"
        "def tiny(sample_shape, num_classes):\n"
        "    return torch.nn.Sequential(torch.nn.Flatten(), "
        "torch.nn.Linear(sample_shape[0], num_classes))\n"
        "def notamodel():\n    return 3\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert build_model("mymodels:tiny", (4,), 2)(torch.randn(1, 4)).shape == (1, 2)
    with pytest.raises(TypeError, match=r"not a torch\.nn\.Module"):
        build_model("mymodels:notamodel", (4,), 2)
    with pytest.raises(ValueError, match="cannot be loaded"):
        build_model("mymodels:missing", (4,), 2)
    with pytest.raises(ValueError, match="unknown model"):
        build_model("vgg", (4,), 2)
    with pytest.raises(ValueError, match="not a square image"):
        image_shape((10,))


def test_metrics_parts_merge_in_time_order(tmp_path):
    path = tmp_path / "m.jsonl"
    a, b = MetricsWriter(path, 0), MetricsWriter(path, 1)
    a.write("step", t=0.2)
    b.write("step", t=0.1)
    a.write("eval", t=0.3, accuracy=0.9)
    a.close()
    b.close()
    assert merge_parts(path, 2) == 3
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["rank"], r["event"]) for r in recs] == [
        (1, "step"),
        (0, "step"),
        (0, "eval"),
    ]
    assert not list(tmp_path.glob("m.jsonl.rank-*"))
    row = summary_row({"mode": "sync", "samples_per_sec": 10.0, "steps": 3})
    table = format_table([row])
    assert "| sync |" in table.replace("  ", " ") and "10.0" in table


def test_checkpoint_commit_is_atomic_and_stale_parts_go(tmp_path):
    ck0, ck1 = Checkpointer(tmp_path, 0, "run"), Checkpointer(tmp_path, 1, "run")
    assert latest_checkpoint(tmp_path) is None
    for n in (1, 2, 3):
        ck0.write(n, {"x": torch.tensor([n])})
        ck1.write(n, {"x": torch.tensor([10 * n])})
        ck0.commit(n, {"mode": "sync"})
    ck1.write(4, {"x": torch.tensor([40])})  # the job dies before the commit
    latest = latest_checkpoint(tmp_path)
    assert latest.name == "ckpt-000003"
    assert load_part(latest, 1)["x"].item() == 30
    assert load_part(latest, 7) is None
    assert sorted(p.name for p in tmp_path.glob("ckpt-*")) == [
        "ckpt-000002",
        "ckpt-000003",
    ]
    ck0.remove_stale()
    assert not list(tmp_path.glob(".staging-*"))
    (latest / "rank-00000.pt").write_bytes(b"garbage")
    with pytest.raises(ValueError, match="cannot be loaded"):
        load_part(latest, 0)


# ------------------------------------------------------------- end to end
@pytest.mark.parametrize(
    "nranks,mode",
    [
        (3, ["--mode", "sync"]),
        (5, ["--mode", "hybrid", "--groups", "0-1,2-3"]),
        (4, ["--mode", "async", "--servers", "1"]),
    ],
)
def test_each_mode_learns_the_digits(digits, tmp_path, nranks, mode):
    out = tmp_path / "summary.json"
    metrics = tmp_path / "metrics.jsonl"
    result = run_train(
        nranks,
        [
            "--data",
            digits,
            *mode,
            "--epochs",
            "6",
            "--lr",
            "0.05",
            "--no-progress",
            "--slowdown",
            "0:1,1:2",
            "--sample-ms",
            "0.2",
            "--target-accuracy",
            "0.85",
            "--eval-every",
            "10",
            "--summary",
            str(out),
            "--metrics",
            str(metrics),
        ],
    )
    assert result.returncode == 0, output(result)[-3000:]
    s = summary(out)
    assert s["final_accuracy"] >= 0.85, s  # the stated accuracy; runs reach 0.89-0.97
    assert s["time_to_target_s"] is not None and s["time_to_target_s"] <= s["wall_s"]
    assert s["epochs"] == 6 and s["samples"] > 0
    # every validation on the curve: training time rising, the last the final
    # model's, the target first crossed where time_to_target_s says
    curve = s["accuracy_curve"]
    times = [t for t, _ in curve]
    assert len(curve) >= 2 and times == sorted(times), curve
    assert curve[-1][1] == s["final_accuracy"]
    first = next(t for t, a in curve if a >= 0.85)
    assert first == s["time_to_target_s"]
    # and the update it was reached at, within the run's updates
    assert 0 < s["updates_to_target"] <= s["steps"], s
    # each validation's update: rising, the first crossing's is that update,
    # the last the final model's; one per --eval-every 10 bucket before it
    updates = s["accuracy_updates"]
    assert len(updates) == len(curve) and updates == sorted(updates), updates
    crossing = next(i for i, (_, a) in enumerate(curve) if a >= 0.85)
    assert updates[crossing] == s["updates_to_target"], (updates, s)
    assert updates[-1] == s["steps"], (updates, s)
    buckets = [u // 10 for u in updates[:-1]]
    assert buckets == sorted(set(buckets)) and 0 not in buckets, updates
    assert s["samples_per_sec"] > 0 and 0 < s["efficiency"] <= 1.05, s
    # every rank's CPU seconds (servers' too) on this one machine's cores;
    # the emulated compute sleeps, so the cores leave room here
    assert s["cpu_s"] > 0 and s["cores"] == (os.cpu_count() or 1), s
    assert s["cores_bound_samples_per_sec"] > s["samples_per_sec"], s
    # the record says how stale updates were treated (the CLI's defaults)
    assert s["lookahead"] == (s["mode"] != "sync"), s
    assert s["damping"] == (None if s["mode"] == "sync" else "inverse"), s
    recs = [json.loads(line) for line in metrics.read_text().splitlines()]
    steps = [r for r in recs if r["event"] == "step"]
    workers = s["workers"]
    assert {r["rank"] for r in steps} == set(range(workers))
    # every training sample is seen once per epoch, summed over the workers
    assert sum(r["batch"] for r in steps) == s["samples"] == 6 * 1438
    if s["mode"] == "sync":
        # static shares end every epoch at its last batch, with no empty
        # update after it: 1438 samples of 3 x 32 take 15 updates per epoch
        totals = {}
        for r in steps:
            totals[r["step"]] = totals.get(r["step"], 0) + r["batch"]
        assert sorted(totals) == list(range(1, 6 * 15 + 1))
        assert min(totals.values()) > 0, totals
    assert any(r["event"] == "eval" and r.get("final") for r in recs)


@pytest.mark.parametrize("steps,every", [(30, 10), (45, 30)])
def test_kill_during_a_checkpoint_then_resume_matches_an_uninterrupted_run(
    digits, tmp_path, steps, every
):
    # (45, 30): 3 workers x 16 take 30 updates per epoch, so checkpoint 1 is
    # the last update of epoch 0, and the resumed run starts at its end
    args = [
        "--data",
        digits,
        "--steps",
        str(steps),
        "--batch-size",
        "16",
        "--no-progress",
        "--lr",
        "0.05",
        "--checkpoint-every",
        str(every),
    ]
    whole = run_train(3, [*args, "--checkpoint", str(tmp_path / "a")])
    assert whole.returncode == 0, output(whole)[-2000:]
    crashed = run_train(
        3,
        [*args, "--checkpoint", str(tmp_path / "b")],
        env={"HYBRIDAGG_FAULT": "checkpoint:2:1"},
    )
    assert crashed.returncode != 0
    # the checkpoint before the crash is whole and the one being written is not published
    assert latest_checkpoint(tmp_path / "b").name == "ckpt-000001"
    assert load_part(latest_checkpoint(tmp_path / "b"), 0)["updates"] == every
    resumed = run_train(3, [*args, "--checkpoint", str(tmp_path / "b"), "--resume"])
    assert resumed.returncode == 0, output(resumed)[-2000:]
    a = load_part(latest_checkpoint(tmp_path / "a"), 0)
    b = load_part(latest_checkpoint(tmp_path / "b"), 0)
    assert a["updates"] == b["updates"] == steps
    # the same steps and epochs counted: no empty update after the resume
    assert (a["step"], a["epochs_done"]) == (b["step"], b["epochs_done"])
    for key in a["model"]:
        assert torch.equal(a["model"][key], b["model"][key]), key


def test_hybrid_resumes_from_the_servers_checkpoint(digits, tmp_path):
    ck = str(tmp_path / "ck")
    args = [
        "--data",
        digits,
        "--mode",
        "hybrid",
        "--groups",
        "0-1,2-3",
        "--steps",
        "60",
        "--no-progress",
        "--checkpoint",
        ck,
        "--checkpoint-every",
        "20",
        "--summary",
        str(tmp_path / "s.json"),
    ]
    crashed = run_train(5, args, env={"HYBRIDAGG_FAULT": "checkpoint:2:3"})
    assert crashed.returncode != 0
    first = latest_checkpoint(ck)
    assert first.name == "ckpt-000001"
    manifest = json.loads((first / "manifest.json").read_text())
    assert manifest["version"] >= 20 and manifest["groups"] == [[0, 1], [2, 3]]
    assert load_part(first, 4)["server"]["version"] == manifest["version"]
    resumed = run_train(5, [*args, "--resume"])
    assert resumed.returncode == 0, output(resumed)[-2000:]
    s = summary(tmp_path / "s.json")
    assert s["resumed_from"].endswith("ckpt-000001")
    assert s["steps"] >= 60 and s["final_accuracy"] > 0.5  # chance is 0.1


@pytest.mark.parametrize(
    "args,match",
    [
        (["--model", "vgg"], "unknown --model"),
        (["--mode", "sync", "--servers", "1"], "uses no parameter servers"),
        (["--groups", "0-0,0-1"], "in group 0 and group 1"),
        (["--slowdown", "0-5:2"], "slowdown names ranks"),
        (["--data", "/nonexistent/d.h5"], "No such file|does not exist|not found"),
    ],
)
def test_bad_input_stops_every_rank_with_one_message(digits, args, match):
    full = ["--data", digits, "--no-progress", "--steps", "3", *args]
    if "--data" in args:
        full = ["--no-progress", "--steps", "3", *args]
    result = run_train(2, full, timeout=90)
    text = output(result)
    assert result.returncode != 0
    assert "Traceback" not in text, text[-3000:]
    import re

    assert re.search(match, text), text[-3000:]
    assert text.count("hybridagg train: error:") == 1, text[-3000:]


def test_a_bad_server_setting_stops_every_rank_with_one_message(digits):
    args = ["--data", digits, "--no-progress", "--steps", "3"]
    args += ["--mode", "async", "--servers", "1"]
    result = run_train(2, args, env={"HYBRIDAGG_SERVER_MAX_SLEEP_US": "0"}, timeout=90)
    text = output(result)
    assert result.returncode != 0
    assert "Traceback" not in text, text[-3000:]
    assert "HYBRIDAGG_SERVER_MAX_SLEEP_US must be positive" in text, text[-3000:]
    assert text.count("hybridagg train: error:") == 1, text[-3000:]


def test_broken_data_file_and_checkpoint_of_another_model(digits, tmp_path):
    broken = tmp_path / "broken.h5"
    broken.write_bytes(Path(digits).read_bytes()[:5000])
    result = run_train(2, ["--data", str(broken), "--no-progress", "--steps", "2"])
    assert result.returncode != 0 and "Traceback" not in output(result)
    assert "broken.h5" in output(result)
    ck = str(tmp_path / "ck")
    ok = run_train(
        2, ["--data", digits, "--no-progress", "--steps", "2", "--checkpoint", ck]
    )
    assert ok.returncode == 0, output(ok)[-2000:]
    other = run_train(
        2,
        [
            "--data",
            digits,
            "--no-progress",
            "--steps",
            "4",
            "--checkpoint",
            ck,
            "--resume",
            "--model",
            "cnn",
        ],
    )
    assert other.returncode == 2
    assert "--model: was mlp, now cnn" in output(other), output(other)[-2000:]


def test_sigusr1_checkpoints_and_stops_cleanly(digits, tmp_path):
    """What Slurm's --signal does before a time limit."""
    from hybridagg.runtime import runner

    ck = tmp_path / "ck"
    argv = runner.mpiexec_argv(
        3,
        [
            sys.executable,
            "-m",
            "hybridagg.cli",
            "train",
            "--data",
            digits,
            "--steps",
            "100000",
            "--sample-ms",
            "1",
            "--no-progress",
            "--checkpoint",
            str(ck),
            "--summary",
            str(tmp_path / "s.json"),
        ],
    )
    env = runner.mpiexec_env()
    proc = subprocess.Popen(
        argv,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        ranks = _rank_pids(f"hybridagg.cli train --data {digits}", proc, 3, deadline)
        time.sleep(4)  # let training start
        for pid in ranks:
            os.kill(pid, signal.SIGUSR1)
        text, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, text[-3000:]
    latest = latest_checkpoint(ck)
    s = summary(tmp_path / "s.json")
    assert latest is not None and 0 < s["steps"] < 100000
    assert load_part(latest, 0)["updates"] == s["steps"]


def test_a_hybrid_stop_while_a_checkpoint_is_pending_resumes_and_finishes(
    digits, tmp_path
):
    """A signal that comes while a checkpoint is pending: the next job trains on.

    The fast group saved its part of a checkpoint and waits for the slow one
    (20x slower, in the middle of a step) when every rank gets SIGUSR1. The
    stop used to ride on that checkpoint: the fast group, released after it
    with nothing left to save, pushed once more before it learnt of the stop,
    so the servers' last checkpoint at the end held that update, no worker's
    part and every group as finished; the resumed run then trained nothing
    and reported the budget unmet as a finished run (a chain of Slurm jobs
    lost the rest of its training).
    """
    from hybridagg.runtime import runner

    ck, steps = tmp_path / "ck", 200
    args = ["--data", digits, "--mode", "hybrid", "--groups", "0-1,2"]
    args += ["--servers", "1", "--steps", str(steps), "--sample-ms", "2"]
    args += ["--slowdown", "0-1:1,2:20", "--no-progress", "--checkpoint", str(ck)]
    args += ["--checkpoint-every", "20", "--summary", str(tmp_path / "s.json")]
    argv = runner.mpiexec_argv(
        4, [sys.executable, "-m", "hybridagg.cli", "train", *args]
    )
    env = runner.mpiexec_env()
    env["HYBRIDAGG_TIMEOUT"] = "60"
    proc = subprocess.Popen(
        argv,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        ranks = _rank_pids(
            f"hybridagg.cli train .*--checkpoint {ck}", proc, 4, deadline
        )
        pending = None  # a checkpoint group 0 saved its part of, and group 1 not yet
        while pending is None and time.monotonic() < deadline and proc.poll() is None:
            for stage in sorted(ck.glob(".staging-*")):
                if (stage / "rank-00000.pt").exists() and not (
                    stage / "rank-00002.pt"
                ).exists():
                    pending = stage.name
                    break
            else:
                time.sleep(0.01)
        assert pending is not None, "never saw a checkpoint group 1 had not saved"
        for pid in ranks:
            os.kill(pid, signal.SIGUSR1)
        text, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, text[-3000:]
    first = summary(tmp_path / "s.json")
    assert 0 < first["steps"] < steps
    latest = latest_checkpoint(ck)
    manifest = json.loads((latest / "manifest.json").read_text())
    # the stop's checkpoint: every group stopped mid-run, none finished
    assert manifest["done_groups"] == [], (pending, manifest)
    assert all(load_part(latest, rank) is not None for rank in range(4))
    assert manifest["version"] == first["steps"]  # nothing pushed after it
    resumed = run_train(4, [*args, "--resume"])
    assert resumed.returncode == 0, output(resumed)[-2000:]
    s = summary(tmp_path / "s.json")
    assert s["resumed_from"] == str(latest)
    assert s["steps"] >= steps, (pending, first["steps"], s["steps"])


def _rank_pids(pattern: str, proc: subprocess.Popen, n: int, deadline: float) -> list:
    """The ``n`` ranks of ``proc``'s job (command lines matching ``pattern``),
    once each catches SIGUSR1."""
    ranks = []
    while time.monotonic() < deadline and len(ranks) < n:
        time.sleep(0.5)
        ranks = [
            int(p)
            for p in subprocess.run(
                ["pgrep", "-f", pattern], capture_output=True, text=True
            ).stdout.split()
            if int(p) != proc.pid
        ]
        ranks = [p for p in ranks if _parent(p) != os.getpid()]
    # a rank is found as soon as it is exec'd, but catches the signal only
    # once the CLI has installed its handler (after Python and the package
    # start, which took over 4 s on a loaded machine)
    while time.monotonic() < deadline and not all(map(_catches_usr1, ranks)):
        time.sleep(0.2)
    return ranks


def _catches_usr1(pid: int) -> bool:
    """Whether ``pid`` has a handler installed for SIGUSR1 (``SigCgt``)."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            caught = next(ln for ln in fh if ln.startswith("SigCgt:")).split()[1]
    except (OSError, StopIteration):
        return False
    return bool(int(caught, 16) >> (signal.SIGUSR1 - 1) & 1)


def _parent(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return int(fh.read().rsplit(")", 1)[1].split()[1])
    except OSError:
        return -1
