"""Checkpoints never lose or mix up a run (issue 19).

A checkpoint folder may hold another run's checkpoints; pruning must never
delete them, a fresh run must not quietly start there, ``--resume`` must
continue the right run and say what changed, and a newest checkpoint that
does not load must not end a Slurm chain while the one before it is whole.
"""

import json
import re
from pathlib import Path

import pytest
import torch
from train_helpers import output, run_train, summary

from hybridagg.train.checkpoint import (
    Checkpointer,
    latest_checkpoint,
    load_part,
    read_manifest,
    resume_candidates,
    scan,
)
from hybridagg.train.config import TrainConfig
from hybridagg.train.config.changes import config_changes, refusal


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    from hybridagg.data import convert_digits

    path = tmp_path_factory.mktemp("data") / "digits.h5"
    convert_digits(path, val_fraction=0.2, seed=0, progress=False)
    return str(path)


# ------------------------------------------------------ configuration changes
def _cfg(**kw) -> dict:
    return TrainConfig(**{"data": "d.h5", **kw}).as_dict()


def test_changes_name_each_flag_that_alters_training():
    before = _cfg(lr=0.05, steps=30, warmup_updates=0)
    after = _cfg(
        lr=0.1,
        steps=60,
        warmup_updates=5,
        optimizer="adam",
        model="cnn",
        momentum=0.5,
        weight_decay=1e-4,
    )
    changes = config_changes(before, after)
    assert [str(c) for c in changes] == [
        "--model: was mlp, now cnn",
        "--optimizer: was sgd, now adam",
        "--lr: was 0.05, now 0.1",
        "--momentum: was 0.9, now 0.5",
        "--weight-decay: was 0.0, now 0.0001",
        "--warmup-updates: was 0, now 5",
        "--steps: was 30, now 60",
    ]
    assert {c.kind for c in changes} == {"changed"}
    assert config_changes(_cfg(data="a.h5"), _cfg(data="b.h5"))[0].field == "data"
    assert (
        str(config_changes(_cfg(epochs=3), _cfg())[0]) == "--epochs: was 3, now unset"
    )


def test_changes_ignore_what_does_not_alter_training():
    before = _cfg(checkpoint="a", checkpoint_every=5, resume=True)
    after = _cfg(
        checkpoint="b",
        metrics="m.jsonl",
        summary="s.json",
        progress=False,
        eval_every=7,
        target_accuracy=0.9,
        device="cuda",
        allreduce_backend="torch",
        slowdown="0:2",
        sample_ms=1.0,
        batch_probe=0,
        overwrite_checkpoints=True,
        accumulate=4,
    )
    assert config_changes(before, after) == []
    assert config_changes(before, before) == []


def test_topology_is_resharded_and_mode_is_fixed():
    before = _cfg(mode="hybrid", groups="0-1,2-3", servers=1)
    after = _cfg(mode="hybrid", groups="0-3", servers=2)
    changes = config_changes(before, after)
    assert [(c.field, c.kind) for c in changes] == [
        ("groups", "resharded"),
        ("servers", "resharded"),
    ]
    # a change of topology alone is never refused by this check
    assert refusal(changes, accept=False, where="ck") is None
    mode = config_changes(_cfg(), _cfg(mode="async"))
    assert [(c.field, c.kind) for c in mode] == [("mode", "fixed")]
    why = refusal(mode, accept=True, where="checkpoint ck")
    assert why is not None and "--mode: was sync, now async" in why


def test_refusal_lists_every_change_and_the_way_out():
    changes = config_changes(_cfg(lr=0.05, steps=30), _cfg(lr=0.1, steps=60))
    why = refusal(changes, accept=False, where="checkpoint ck-7")
    assert why is not None
    assert "checkpoint ck-7" in why and "--accept-config-changes" in why
    assert "--lr: was 0.05, now 0.1; --steps: was 30, now 60" in why
    assert refusal(changes, accept=True, where="ck") is None


def test_a_field_the_checkpoint_does_not_record_counts_as_its_default():
    before = _cfg()
    del before["weight_decay"]  # written before the option existed
    defaults = {"weight_decay": 0.0}
    assert config_changes(before, _cfg(), defaults) == []
    (change,) = config_changes(before, _cfg(weight_decay=0.1), defaults)
    assert str(change) == "--weight-decay: was 0.0, now 0.1"
    (change,) = config_changes(before, _cfg())
    assert str(change) == "--weight-decay: was not recorded, now 0.0"


# --------------------------------------------------- the folder, without MPI
def _commit(ck: Checkpointer, number: int, value: float) -> Path:
    ck.write(number, {"x": torch.tensor([value])})
    return ck.commit(number, {"mode": "sync"})


def test_pruning_keeps_this_runs_newest_by_commit_order_and_never_another_runs(
    tmp_path,
):
    a = Checkpointer(tmp_path, 0, "run-a")
    for n in (8, 9, 10):
        _commit(a, n, n)
    b = Checkpointer(tmp_path, 0, "run-b")
    for n in (1, 2, 3):
        _commit(b, n, 100 + n)
    names = {e.path.name: e.run for e in scan(tmp_path)}
    assert names == {
        "ckpt-000009": "run-a",
        "ckpt-000010": "run-a",
        "ckpt-000002": "run-b",
        "ckpt-000003": "run-b",
    }
    assert latest_checkpoint(tmp_path).name == "ckpt-000003"
    assert (tmp_path / (tmp_path / "latest").read_text().strip()).is_dir()
    # --resume continues the run that committed last, newest first
    assert [e.path.name for e in resume_candidates(tmp_path)] == [
        "ckpt-000003",
        "ckpt-000002",
    ]
    # commit order, not the name: a run resumed from an older checkpoint
    c = Checkpointer(tmp_path / "c", 0, "run-c")
    for n in (7, 2, 3):
        _commit(c, n, n)
    kept = sorted(e.path.name for e in scan(tmp_path / "c"))
    assert kept == ["ckpt-000002", "ckpt-000003"]
    seqs = [read_manifest(e.path)["sequence"] for e in scan(tmp_path / "c")]
    assert seqs == sorted(seqs) and len(set(seqs)) == 2


def test_overwrite_removes_the_other_run_at_the_first_commit(tmp_path):
    a = Checkpointer(tmp_path, 0, "run-a")
    for n in (1, 2):
        _commit(a, n, n)
    b = Checkpointer(tmp_path, 0, "run-b", replace_others=True)
    b.write(1, {"x": torch.tensor([7.0])})
    # nothing of the other run is gone before this run has a checkpoint
    assert {e.run for e in scan(tmp_path)} == {"run-a"}
    b.commit(1, {"mode": "sync"})
    (entry,) = scan(tmp_path)
    assert entry.run == "run-b" and load_part(entry.path, 0)["x"].item() == 7.0
    assert latest_checkpoint(tmp_path) == entry.path


def test_an_unreadable_newest_checkpoint_is_tried_first_then_its_predecessors(
    tmp_path,
):
    ck = Checkpointer(tmp_path, 0, "run-a")
    for n in (1, 2, 3):
        _commit(ck, n, n)
    (tmp_path / "ckpt-000003" / "manifest.json").write_text("{trunc")
    names = [(e.path.name, e.manifest is None) for e in resume_candidates(tmp_path)]
    assert names == [("ckpt-000003", True), ("ckpt-000002", False)]
    assert latest_checkpoint(tmp_path).name == "ckpt-000002"
    (tmp_path / "latest").unlink()
    assert latest_checkpoint(tmp_path).name == "ckpt-000002"
    assert [e.path.name for e in resume_candidates(tmp_path)] == ["ckpt-000002"]


# ------------------------------------------------------------- end to end
def _train_args(digits: str, ck: Path, *extra: str) -> list[str]:
    return [
        "--data",
        digits,
        "--no-progress",
        "--batch-size",
        "16",
        "--checkpoint",
        str(ck),
        *extra,
    ]


def _run_id(path: Path) -> str:
    return read_manifest(path)["run_id"]


def test_a_folder_of_another_run_is_refused_overwritten_or_resumed(digits, tmp_path):
    ck = tmp_path / "ck"
    first = run_train(
        2, _train_args(digits, ck, "--steps", "6", "--checkpoint-every", "2")
    )
    assert first.returncode == 0, output(first)[-2000:]
    other = latest_checkpoint(ck)
    other_run = _run_id(other)
    assert read_manifest(other)["config"]["lr"] == 0.05

    # a fresh run refuses, naming the folder, the run, its newest and the ways out
    fresh = _train_args(digits, ck, "--steps", "4", "--lr", "0.1")
    refused = run_train(2, fresh, timeout=90)
    text = output(refused)
    assert refused.returncode == 2, text[-2000:]
    assert text.count("hybridagg train: error:") == 1, text[-2000:]
    assert "Traceback" not in text
    for needle in (
        str(ck),
        other_run,
        other.name,
        "--resume",
        "--overwrite-checkpoints",
    ):
        assert needle in text, (needle, text[-2000:])
    assert {e.run for e in scan(ck)} == {other_run}

    # --resume with another lr: refused, naming the flag and both values
    resumed = run_train(2, [*fresh, "--resume", "--steps", "6"], timeout=90)
    text = output(resumed)
    assert resumed.returncode == 2, text[-2000:]
    assert text.count("hybridagg train: error:") == 1, text[-2000:]
    assert "--lr: was 0.05, now 0.1" in text and "--accept-config-changes" in text
    assert "--steps:" not in text  # --steps 6 again: the same length

    # ... and accepted when told, continuing the same run
    s_path = tmp_path / "s.json"
    args = [*fresh, "--resume", "--steps", "8", "--accept-config-changes"]
    accepted = run_train(2, [*args, "--summary", str(s_path)])
    assert accepted.returncode == 0, output(accepted)[-2000:]
    assert "--lr: was 0.05, now 0.1; --steps: was 6, now 8" in output(accepted)
    s = summary(s_path)
    assert s["run_id"] == other_run and s["resumed_from"] == str(other)
    newest = latest_checkpoint(ck)
    assert _run_id(newest) == other_run and load_part(newest, 0)["updates"] == 8
    assert read_manifest(newest)["config"]["lr"] == 0.1

    # --overwrite-checkpoints starts afresh; the other run's checkpoints go
    overwrite = [*fresh, "--overwrite-checkpoints", "--checkpoint-every", "2"]
    new = run_train(2, [*overwrite, "--summary", str(s_path)])
    assert new.returncode == 0, output(new)[-2000:]
    new_run = summary(s_path)["run_id"]
    assert new_run != other_run and summary(s_path)["resumed_from"] is None
    assert {e.run for e in scan(ck)} == {new_run}
    assert sorted(e.path.name for e in scan(ck)) == ["ckpt-000001", "ckpt-000002"]
    assert latest_checkpoint(ck).name == "ckpt-000002"
    assert load_part(latest_checkpoint(ck), 0)["updates"] == 4

    # and --resume now continues that run, not the one before
    again = run_train(2, [*fresh, "--resume", "--summary", str(s_path)])
    assert again.returncode == 0, output(again)[-2000:]
    assert summary(s_path)["run_id"] == new_run


def _truncate(part: Path) -> None:
    data = part.read_bytes()
    part.write_bytes(data[: len(data) // 2])


def test_sync_resumes_from_the_previous_checkpoint_when_the_newest_is_corrupt(
    digits, tmp_path
):
    ck = tmp_path / "ck"
    args = _train_args(digits, ck, "--steps", "6", "--checkpoint-every", "2")
    whole = run_train(2, args)
    assert whole.returncode == 0, output(whole)[-2000:]
    newest = latest_checkpoint(ck)
    assert newest.name == "ckpt-000003"
    reference = load_part(newest, 0)["model"]
    _truncate(newest / "rank-00001.pt")

    s_path = tmp_path / "s.json"
    resumed = run_train(2, [*args, "--resume", "--summary", str(s_path)])
    text = output(resumed)
    assert resumed.returncode == 0, text[-2000:]
    warning = re.search(
        r"warning: checkpoint ckpt-000003 cannot be resumed \((.*)", text
    )
    assert warning, text[-2000:]
    assert "rank 1" in warning.group(1) and "rank-00001.pt" in warning.group(1)
    assert "resuming from ckpt-000002" in warning.group(1)
    assert text.count("cannot be resumed") == 1  # rank 0 only
    assert summary(s_path)["resumed_from"] == str(ck / "ckpt-000002")
    # the updates after checkpoint 2 are trained again, to the same weights
    redone = load_part(latest_checkpoint(ck), 0)
    assert redone["updates"] == 6
    for key in reference:
        assert torch.equal(reference[key], redone["model"][key]), key

    # when no checkpoint of the run loads, the run stops with one message
    for entry in scan(ck):
        _truncate(entry.path / "rank-00000.pt")
    broken = run_train(2, [*args, "--resume"], timeout=90)
    text = output(broken)
    assert broken.returncode == 2, text[-2000:]
    assert text.count("hybridagg train: error:") == 1, text[-2000:]
    assert "no checkpoint in" in text and "ckpt-000002" in text, text[-2000:]


def test_hybrid_resumes_from_the_previous_checkpoint_when_a_server_part_is_corrupt(
    digits, tmp_path
):
    ck = tmp_path / "ck"
    s_path = tmp_path / "s.json"
    args = _train_args(
        digits,
        ck,
        "--mode",
        "hybrid",
        "--groups",
        "0,1",
        "--steps",
        "30",
        "--checkpoint-every",
        "10",
        "--summary",
        str(s_path),
    )
    whole = run_train(3, args)
    assert whole.returncode == 0, output(whole)[-2000:]
    newest = latest_checkpoint(ck)
    before = [e.path.name for e in scan(ck)]
    assert len(before) == 2 and newest.name == before[-1], before
    previous = ck / before[0]
    _truncate(newest / "rank-00002.pt")  # the server's part

    resumed = run_train(3, [*args, "--resume"])
    text = output(resumed)
    assert resumed.returncode == 0, text[-2000:]
    assert f"warning: checkpoint {newest.name} cannot be resumed" in text, text[-2000:]
    assert "rank 2" in text and f"resuming from {previous.name}" in text
    s = summary(s_path)
    assert s["resumed_from"] == str(previous)
    assert s["steps"] >= 30 and s["final_accuracy"] > 0.5  # chance is 0.1
    manifest = json.loads((latest_checkpoint(ck) / "manifest.json").read_text())
    assert manifest["run_id"] == s["run_id"] and manifest["version"] >= 30
