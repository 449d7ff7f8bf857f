"""Resuming at another size: server shards, data positions and worker parts.

The pure mappings run in the pytest process; the end-to-end tests run
``hybridagg train``, stop it mid-epoch at a checkpoint, resume it with other
numbers of workers and servers, and check from the samples every worker's
loop received (``HYBRIDAGG_SAMPLE_LOG``) that the epoch in progress is read
exactly once across the two runs. The resumed runs train longer than the
first (``--steps``, ``--epochs``), a change that needs
``--accept-config-changes``; ``--servers`` and ``--groups`` never do. A
resharded resume falls back to the run's previous checkpoint when a part
of the newest does not load, as a resume at the same size does.
"""

from __future__ import annotations

import collections
import itertools
import json
import random
import re
from pathlib import Path

import pytest
import torch
from train_helpers import output, run_train, summary

from hybridagg.data.position import (
    DynamicTrack,
    counter_pieces,
    reshard_dynamic,
    snapshot,
)
from hybridagg.data.samplelog import read_sample_log
from hybridagg.data.shares import (
    LocalCounter,
    drop_prefix,
    reshard_static,
    split_static,
)
from hybridagg.ps.compensation import Compensation
from hybridagg.ps.reshard import (
    ShardSource,
    group_state,
    reshard_map,
    shard_overlaps,
)
from hybridagg.ps.shards import shard_ranges
from hybridagg.ps.spec import server_specs
from hybridagg.ps.store import ShardStore
from hybridagg.train.checkpoint import latest_checkpoint, read_manifest, scan
from hybridagg.train.elastic import (
    Layout,
    derived_seed,
    reshard_plan,
    worker_part,
)

TRAIN_SAMPLES = 1438  # the digits fixture's training split


# ------------------------------------------------------------ shard bounds
def test_old_shard_bounds_map_onto_new_ones():
    # 10 elements: 2 old shards [0, 5) [5, 10) -> 3 new [0, 4) [4, 7) [7, 10)
    assert reshard_map(10, 2, 3) == [
        [(0, 0, 4)],
        [(0, 4, 5), (1, 5, 7)],
        [(1, 7, 10)],
    ]
    assert reshard_map(10, 1, 2) == [[(0, 0, 5)], [(0, 5, 10)]]
    assert reshard_map(10, 3, 1) == [[(0, 0, 4), (1, 4, 7), (2, 7, 10)]]


@pytest.mark.parametrize("total", [7, 10, 37])
def test_every_new_shard_is_covered_once_by_old_ones(total):
    for old in range(1, 5):
        for new in range(1, 5):
            for (lo, hi), pieces in zip(
                shard_ranges(total, new), reshard_map(total, old, new), strict=True
            ):
                assert pieces[0][1] == lo and pieces[-1][2] == hi
                for (_, _, b), (_, a, _) in itertools.pairwise(pieces):
                    assert a == b  # contiguous, no overlap
                olds = shard_ranges(total, old)
                for s, a, b in pieces:
                    assert olds[s][0] <= a < b <= olds[s][1]


def test_old_shards_of_another_model_are_refused():
    with pytest.raises(ValueError, match=r"do not cover the elements \[0, 10\)"):
        shard_overlaps([(0, 5), (5, 9)], 0, 10)
    with pytest.raises(ValueError, match="exactly once"):
        shard_overlaps([(0, 6), (4, 10)], 0, 10)


# ------------------------------------------------------------ server state
_NUMELS = (5, 7, 3, 4)  # four parameters in two of the user's groups


def _model(optimizer: str):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n)) for n in _NUMELS]
    groups = [
        {"params": [params[0], params[2]]},
        {"params": [params[1], params[3]], "lr": 0.05},
    ]
    if optimizer == "sgd":
        opt = torch.optim.SGD(groups, lr=0.1, momentum=0.9, weight_decay=1e-3)
    else:
        opt = torch.optim.Adam(groups, lr=0.01)
    return params, opt


def _stores(optimizer: str, servers: int, part_elems: int) -> list[ShardStore]:
    params, opt = _model(optimizer)
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    specs = server_specs(
        params,
        opt,
        flat,
        torch.arange(3, dtype=torch.float64),
        shard_ranges(flat.numel(), servers),
        compensation=Compensation(),
        staleness_bound=None,
        max_updates=None,
        part_elems=part_elems,
    )
    return [ShardStore(spec) for spec in specs], specs


def _push(stores: list[ShardStore], grad: torch.Tensor, lrs: list[float]) -> None:
    """What every server does with one push: its slice of the gradient, every part."""
    for store in stores:
        lo, hi = store.shard_range
        store.grad.copy_(grad[lo:hi])
        for part in range(len(store.parts)):
            store.apply(part, lrs, scale=1.0)
        store.version += 1


def _flat(stores: list[ShardStore]) -> torch.Tensor:
    return torch.cat([s.flat for s in stores])


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("old,new", [(1, 2), (2, 3), (3, 1), (2, 2)])
def test_resharded_servers_continue_exactly_like_the_old_ones(optimizer, old, new):
    total = sum(_NUMELS)
    gen = torch.Generator().manual_seed(1)
    grads = [torch.randn(total, generator=gen) for _ in range(6)]
    lrs = [0.1, 0.05]
    reference, _ = _stores(optimizer, old, part_elems=4)
    for g in grads[:3]:
        _push(reference, g, lrs)
    saved = [
        {
            "checkpoint": 2,
            "version": s.version,
            "updates_per_leader": [2, 1],
            "done": [],
            "shard": s.state(),
        }
        for s in reference
    ]
    loaded = collections.Counter()

    def load(s: int) -> dict:
        loaded[s] += 1
        return saved[s]

    # another part size too: parts are a server's own business
    resumed, specs = _stores(optimizer, new, part_elems=3)
    for store, spec in zip(resumed, specs, strict=True):
        state = ShardSource(old, load, groups_changed=False).restore(spec, store, 2)
        assert state["version"] == 3 and state["checkpoint"] == 2
        assert state["updates_per_leader"] == [2, 1]
        store.load(state["shard"])
        store.version = state["version"]
    # each new server read only the old parts it overlaps
    assert sum(loaded.values()) == sum(len(m) for m in reshard_map(total, old, new))
    assert torch.equal(_flat(resumed), _flat(reference))
    assert torch.equal(resumed[0].buffers, reference[0].buffers)
    for g in grads[3:]:
        _push(reference, g, lrs)
        _push(resumed, g, lrs)
    # element-wise optimizers: the momentum (Adam: moments and step) moved
    # with the weights, so the next updates are the same, bit for bit
    assert torch.equal(_flat(resumed), _flat(reference))


def test_a_per_piece_state_that_differs_between_old_servers_is_refused():
    reference, _ = _stores("adam", 2, part_elems=4)
    _push(reference, torch.ones(sum(_NUMELS)), [0.1, 0.05])
    _push(reference[1:], torch.ones(sum(_NUMELS)), [0.1, 0.05])  # server 1 only
    saved = [
        {
            "checkpoint": 1,
            "version": 1,
            "updates_per_leader": [1],
            "done": [],
            "shard": s.state(),
        }
        for s in reference
    ]
    resumed, specs = _stores("adam", 1, part_elems=4)
    with pytest.raises(ValueError, match="'step' differs between the old pieces"):
        ShardSource(2, saved.__getitem__, False).restore(specs[0], resumed[0], 1)


def test_per_group_server_state_is_kept_with_the_same_groups_and_reset_otherwise():
    saved = {"updates_per_leader": [5, 3], "done": [1]}
    assert group_state(saved, 2, groups_changed=False) == {
        "updates_per_leader": [5, 3],
        "done": [1],
    }
    assert group_state(saved, 3, groups_changed=True) == {
        "updates_per_leader": None,
        "done": [],
    }
    with pytest.raises(ValueError, match="updates of 2 groups, this run has 3"):
        group_state(saved, 3, groups_changed=False)


# ------------------------------------------------------------ data positions
@pytest.mark.parametrize("new", [1, 2, 3, 6])
def test_a_static_position_is_cut_anew_for_another_number_of_workers(new):
    total, old_sizes = 1000, [32, 32, 16, 8]
    shares, _ = split_static([(0, total)], old_sizes)
    consumed = [3 * b for b in old_sizes]  # three steps taken
    rest = [drop_prefix(s, k) for s, k in zip(shares, consumed, strict=True)]
    new_sizes = [24] * new
    cut, steps = reshard_static(rest, new_sizes)
    unread = sorted(p for share in rest for a, b in share for p in range(a, b))
    dealt = [p for share in cut for a, b in share for p in range(a, b)]
    assert sorted(dealt) == unread and len(set(dealt)) == len(dealt)
    # every worker takes the same number of steps, at most a batch each
    for share, b in zip(cut, new_sizes, strict=True):
        n = sum(y - x for x, y in share)
        assert n <= steps * b and n > (steps - 1) * b - b


class _Plan:
    """The part of an epoch plan the chunk counter's pieces need."""

    def __init__(self, size: int) -> None:
        self.size = size

    def window_size(self, g: int) -> int:
        return self.size


def _draw(gen, track) -> tuple | None:
    try:
        return next(gen)
    except StopIteration:
        return None


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("old,new", [(4, 6), (4, 2), (3, 1), (1, 3)])
def test_a_dynamic_position_is_dealt_to_new_workers_with_nothing_lost(seed, old, new):
    rng = random.Random(seed)
    windows, size = 12, 10
    plan, counter = _Plan(size), LocalCounter()
    tracks = [DynamicTrack(n_windows=windows) for _ in range(old)]
    gens = [counter_pieces(t, plan, counter) for t in tracks]
    yielded = [[] for _ in range(old)]
    # the old workers draw chunks in some order, each consuming part of what
    # it drew (the rest sits in its read-ahead)
    for _ in range(rng.randrange(old, 3 * windows // 2)):
        w = rng.randrange(old)
        piece = _draw(gens[w], tracks[w])
        if piece is not None:
            yielded[w].append(piece)
    consumed_rows: list[tuple[int, int, int]] = []
    states = [None] * old
    # a worker of a finished group saved nothing; it consumed what it drew
    # (its pass had ended before the others' snapshots, within the epoch)
    idle = [w for w in range(old) if tracks[w].stash is None]
    finished = rng.choice(idle) if old > 1 and idle and seed % 3 == 0 else None
    for w in rng.sample(range(old), old):
        if w == finished:  # its group had finished: it saved nothing
            states[w] = {
                "kind": "dynamic",
                "epoch": 0,
                "carry": [],
                "taken": [],
                "counter": None,
                "n_windows": windows,
            }
            for g, lo, hi in yielded[w]:
                consumed_rows += [(0, g, r) for r in range(lo, hi)]
            continue
        have = sum(hi - lo for _, lo, hi in yielded[w])
        consumed = rng.randint(0, have)
        left = consumed
        for g, lo, hi in yielded[w]:
            take = min(left, hi - lo)
            consumed_rows += [(tracks[w].epoch, g, r) for r in range(lo, lo + take)]
            left -= take
        states[w] = snapshot(tracks[w], consumed, counter.read())
        # after its snapshot it draws on (not in the checkpoint: read again)
        for _ in range(rng.randrange(3)):
            _draw(gens[w], tracks[w])
    carry, epoch, value = reshard_dynamic(states, new)
    assert epoch == 0 and len(carry) == new
    fresh = LocalCounter()
    fresh.set(value)
    new_tracks = [DynamicTrack(n_windows=windows, carry=c) for c in carry]
    rows = collections.Counter(consumed_rows)
    for e in (0, 1):  # the resumed epoch, then a whole next one
        for t in new_tracks:
            t.start_epoch(e)
        gens = [counter_pieces(t, plan, fresh) for t in new_tracks]
        active = list(range(new))
        while active:
            w = rng.choice(active)
            piece = _draw(gens[w], new_tracks[w])
            if piece is None:
                active.remove(w)
                continue
            g, lo, hi = piece
            rows.update((e, g, r) for r in range(lo, hi))
    everything = {
        (e, g, r) for e in (0, 1) for g in range(windows) for r in range(size)
    }
    assert set(rows) == everything, sorted(everything - set(rows))[:5]
    assert max(rows.values()) == 1, [k for k, v in rows.items() if v > 1][:5]


def test_dynamic_states_of_another_window_cut_are_refused():
    states = [
        {"epoch": 0, "carry": [], "taken": [], "counter": 3, "n_windows": 12},
        {"epoch": 0, "carry": [], "taken": [], "counter": 3, "n_windows": 8},
    ]
    with pytest.raises(ValueError, match="disagree on the windows per epoch"):
        reshard_dynamic(states, 2)
    with pytest.raises(ValueError, match="at least one worker"):
        reshard_dynamic(states[:1], 0)


# ------------------------------------------------------------ the plan
def _manifest(world_size, servers, groups, number=3):
    return {
        "world_size": world_size,
        "servers": servers,
        "groups": groups,
        "number": number,
        "mode": "hybrid",
        "model": "mlp",
    }


def test_the_plan_maps_workers_and_servers_by_index():
    new = Layout(8, 2, ((0, 1, 2), (3, 4, 5)))
    plan = reshard_plan(_manifest(5, 1, [[0, 1], [2, 3]]), new)
    assert plan.changed and plan.workers_changed and plan.servers_changed
    assert plan.groups_changed and plan.checkpoint == 3
    assert [plan.old_worker_rank(j) for j in range(6)] == [0, 1, 2, 3, None, None]
    assert plan.old_server_rank(0) == 4  # old rank 4 is a worker now
    with pytest.raises(ValueError, match="1 servers, not a server 1"):
        plan.old_server_rank(1)
    assert plan.record() == {
        "from": {
            "world_size": 5,
            "workers": 4,
            "servers": 1,
            "groups": [[0, 1], [2, 3]],
        },
        "to": {
            "world_size": 8,
            "workers": 6,
            "servers": 2,
            "groups": [[0, 1, 2], [3, 4, 5]],
        },
    }
    same = reshard_plan(
        _manifest(5, 1, [[0, 1], [2, 3]]), Layout(5, 1, ((0, 1), (2, 3)))
    )
    assert not same.changed and same.record() is None
    more_servers = reshard_plan(
        _manifest(5, 1, [[0, 1], [2, 3]]), Layout(6, 2, ((0, 1), (2, 3)))
    )
    assert more_servers.servers_changed and not more_servers.workers_changed
    assert not more_servers.groups_changed


@pytest.mark.parametrize(
    "manifest,match",
    [
        ({"world_size": 4}, "does not record its ranks, servers and groups"),
        (_manifest(5, 1, [[0, 1], [3]]), "are not its 4 workers"),
        (_manifest(4, 0, [[0, 1, 2, 3]]), "written with 0 servers; this run has 1"),
    ],
)
def test_a_plan_from_a_bad_or_unfitting_manifest_is_refused(manifest, match):
    with pytest.raises(ValueError, match=match):
        reshard_plan(manifest, Layout(3, 1, ((0, 1),)))


def test_new_workers_get_the_counters_and_a_derived_rng():
    plan = reshard_plan(_manifest(3, 1, [[0, 1]]), Layout(5, 1, ((0, 1, 2, 3),)))
    ref = {
        "rng": {"torch": torch.zeros(3)},
        "loader": {},
        "step": 7,
        "epochs_done": 1,
        "train_time_s": 2.5,
        "time_to_target_s": None,
        "window_blocks": 2,
        "loss_scale": {"scale": 1024.0, "good_steps": 3},
    }
    assert worker_part(plan, 1, ref, ref, seed=0) is ref
    made = worker_part(plan, 3, None, ref, seed=5)
    assert "rng" not in made and "loader" not in made
    assert made["step"] == 7 and made["epochs_done"] == 1 and made["window_blocks"] == 2
    assert made["loss_scale"] == ref["loss_scale"]  # (--amp fp16 goes on)
    assert made["rng_seed"] == derived_seed(5, 3, 3)
    seeds = {derived_seed(5, 3, w) for w in range(64)}
    assert len(seeds) == 64  # every worker its own
    assert derived_seed(5, 3, 2) == derived_seed(5, 3, 2) != derived_seed(5, 4, 2)
    assert 0 <= derived_seed(2**40, 10**6, 10**4) < 2**63


# ------------------------------------------------------------ end to end
@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    from hybridagg.data import convert_digits

    path = tmp_path_factory.mktemp("data") / "digits.h5"
    convert_digits(path, val_fraction=0.2, seed=0, progress=False)
    return str(path)


def _consumed(log_dir: Path, until: int | None = None) -> dict[int, list[int]]:
    """Sample ids each epoch's batches held, over every worker's log.

    Args:
        until: Count only what each worker logged before its part of this
            checkpoint (what the checkpoint's position says was consumed).
    """
    out: dict[int, list[int]] = collections.defaultdict(list)
    for path in sorted(log_dir.glob("rank-*.log")):
        entries = list(read_sample_log(path))
        marks = [e.mark for e in entries if e.mark]
        if until is not None and f"checkpoint {until}" not in marks:
            continue  # a worker of a group that had finished saved no part
        for entry in entries:
            if entry.mark == f"checkpoint {until}":
                break
            if entry.mark is None:
                out[entry.epoch] += entry.ids
    return out


def _stop_and_resume(
    digits, tmp_path, before, after, first_args, then_args, *, refused=()
):
    """Train mid-epoch at one size, resume at another; the logs of both runs.

    The resume is given ``--accept-config-changes``. With ``refused``
    (flags), it is first tried without, and must stop naming those flags
    and no topology flag.
    """
    ck = str(tmp_path / "ck")
    common = ["--data", digits, "--no-progress", "--checkpoint", ck, "--lr", "0.05"]
    logs = tmp_path / "first", tmp_path / "second"
    first = run_train(
        before, [*common, *first_args], env={"HYBRIDAGG_SAMPLE_LOG": str(logs[0])}
    )
    assert first.returncode == 0, output(first)[-3000:]
    saved = latest_checkpoint(ck)
    manifest = read_manifest(saved)
    if refused:
        no = run_train(after, [*common, "--resume", *then_args], timeout=90)
        text = output(no)
        assert no.returncode == 2, text[-3000:]
        why = text[text.index("the configuration differs") :].splitlines()[0]
        assert all(f"{flag}: was" in why for flag in refused), why
        assert "--servers" not in why and "--groups" not in why, why
        assert latest_checkpoint(ck) == saved  # the refusal changed nothing
    s, metrics = tmp_path / "summary.json", tmp_path / "metrics.jsonl"
    second = run_train(
        after,
        [
            *common,
            "--resume",
            "--summary",
            str(s),
            "--metrics",
            str(metrics),
            "--accept-config-changes",
            *then_args,
        ],
        env={"HYBRIDAGG_SAMPLE_LOG": str(logs[1])},
    )
    text = output(second)
    assert second.returncode == 0, text[-3000:]
    assert f"resuming {saved.name} with a changed configuration" in text, text[-3000:]
    assert f"resuming {saved.name} resharded" in text, text[-3000:]
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    (reshard,) = [r for r in records if r["event"] == "reshard"]
    assert {k: reshard[k] for k in ("from", "to")} == summary(s)["resharded"]
    # the resumed run is the same run: its id, and its checkpoints carry it
    assert summary(s)["run_id"] == manifest["run_id"]
    assert read_manifest(latest_checkpoint(ck))["run_id"] == manifest["run_id"]
    return (
        manifest,
        summary(s),
        _consumed(logs[0], until=manifest["number"]),
        _consumed(logs[1]),
        text,
    )


def _read_once(before: dict, after: dict, epoch: int) -> None:
    seen = collections.Counter(before.get(epoch, []) + after.get(epoch, []))
    twice = sorted(i for i, n in seen.items() if n > 1)
    missed = sorted(set(range(TRAIN_SAMPLES)) - set(seen))
    assert not twice and not missed, (twice[:10], missed[:10])
    # the checkpoint was mid-epoch: both runs read part of it
    assert before.get(epoch) and after.get(epoch)


def test_hybrid_resumes_4_workers_and_1_server_as_6_workers_and_2_servers(
    digits, tmp_path
):
    manifest, s, before, after, text = _stop_and_resume(
        digits,
        tmp_path,
        5,
        8,
        [
            "--mode",
            "hybrid",
            "--groups",
            "0-1,2-3",
            "--steps",
            "12",
            "--checkpoint-every",
            "6",
        ],
        [
            "--mode",
            "hybrid",
            "--groups",
            "0-2,3-5",
            "--servers",
            "2",
            "--steps",
            "1000",
            "--epochs",
            "1",
        ],
    )
    assert manifest["world_size"] == 5 and manifest["version"] >= 12
    # the notice lists the accepted changes, the topology's among them
    for change in (
        "--steps: was 12, now 1000",
        "--epochs: was unset, now 1",
        "--groups: was 0-1,2-3, now 0-2,3-5",
        "--servers: was unset, now 2",
    ):
        assert change in text, (change, text[-3000:])
    _read_once(before, after, 0)
    assert s["resharded"] == {
        "from": {
            "world_size": 5,
            "workers": 4,
            "servers": 1,
            "groups": [[0, 1], [2, 3]],
        },
        "to": {
            "world_size": 8,
            "workers": 6,
            "servers": 2,
            "groups": [[0, 1, 2], [3, 4, 5]],
        },
    }
    # the servers continued from the checkpoint's version, and the model
    # from its weights: one more part-epoch reaches well above chance (0.1)
    assert s["steps"] > manifest["version"] and s["epochs"] == 1
    assert s["final_accuracy"] > 0.5, s


def test_sync_resumes_4_workers_as_2(digits, tmp_path):
    # 4 x 32 samples an update: 12 updates an epoch; checkpoint 1 after 5
    manifest, s, before, after, _ = _stop_and_resume(
        digits,
        tmp_path,
        4,
        2,
        ["--mode", "sync", "--steps", "5", "--checkpoint-every", "5"],
        ["--mode", "sync", "--epochs", "1"],
    )
    assert manifest["updates"] == 5 and manifest["world_size"] == 4
    _read_once(before, after, 0)
    assert s["resharded"]["from"]["workers"] == 4
    assert s["resharded"]["to"]["workers"] == 2
    # rank 0's model and optimizer went on at 2 workers: 5 updates were
    # counted before, and the rest of the epoch (1438 - 5 x 128 samples at
    # 2 x 32 an update) after
    assert s["steps"] == 5 + -(-(TRAIN_SAMPLES - 5 * 128) // 64)
    assert s["epochs"] == 1 and s["final_accuracy"] > 0.5, s


@pytest.mark.parametrize("counter", ["auto", "server"])
def test_async_resumes_3_workers_and_1_server_as_2_workers_and_2_servers(
    digits, tmp_path, counter
):
    # the same 4 ranks: rank 2, a worker before, is a server now. With the
    # chunk counter on server 0 the resumed workers set it while the server
    # still waits for their loaders, and draw from it to the epoch's end.
    chunks = ["--chunk-counter", counter]
    manifest, s, before, after, _ = _stop_and_resume(
        digits,
        tmp_path,
        4,
        4,
        ["--mode", "async", "--servers", "1", "--steps", "15",
         "--checkpoint-every", "15", *chunks],
        ["--mode", "async", "--servers", "2", "--steps", "1000", "--epochs", "1",
         *chunks],
        refused=("--steps", "--epochs"),
    )  # fmt: skip
    assert s["chunk_counter"] == ("server" if counter == "server" else "window")
    assert manifest["servers"] == 1 and manifest["version"] >= 15
    _read_once(before, after, 0)
    assert s["resharded"]["to"] == {
        "world_size": 4,
        "workers": 2,
        "servers": 2,
        "groups": [[0], [1]],
    }
    assert s["steps"] > manifest["version"] and s["final_accuracy"] > 0.5, s


@pytest.mark.parametrize(
    "corrupt,reader",
    [
        ("rank-00002.pt", "rank 3"),  # the old server's: both new servers read it
        ("rank-00001.pt", "rank 0"),  # old worker 1's: every new worker reads it
    ],
)
def test_a_resharded_resume_falls_back_when_a_part_of_the_newest_does_not_load(
    digits, tmp_path, corrupt, reader
):
    # 2 workers + 1 server write two checkpoints; resumed as 3 workers in
    # other groups + 2 servers, the world passes the newest over
    ck = tmp_path / "ck"
    common = [
        *("--data", digits, "--no-progress", "--checkpoint", str(ck)),
        *("--lr", "0.05", "--mode", "hybrid", "--steps", "20"),
        *("--checkpoint-every", "10"),
    ]
    first = run_train(3, [*common, "--groups", "0,1"])
    assert first.returncode == 0, output(first)[-3000:]
    previous, newest = [e.path for e in scan(ck)]
    old = read_manifest(previous)
    data = (newest / corrupt).read_bytes()
    (newest / corrupt).write_bytes(data[: len(data) // 2])

    s = tmp_path / "s.json"
    # only topology flags change: no --accept-config-changes needed
    args = [*common, "--groups", "0-1,2", "--servers", "2", "--resume"]
    second = run_train(5, [*args, "--summary", str(s)])
    text = output(second)
    assert second.returncode == 0, text[-3000:]
    warning = re.search(rf"checkpoint {newest.name} cannot be resumed \((.*)", text)
    assert warning, text[-3000:]
    assert warning.group(1).startswith(f"{reader}: ") and corrupt in warning.group(1)
    assert f"resuming from {previous.name}" in warning.group(1)
    assert text.count("cannot be resumed") == 1  # rank 0 only
    got = summary(s)
    assert got["resumed_from"] == str(previous) and got["run_id"] == old["run_id"]
    assert got["resharded"] == {
        "from": {"world_size": 3, "workers": 2, "servers": 1, "groups": [[0], [1]]},
        "to": {"world_size": 5, "workers": 3, "servers": 2, "groups": [[0, 1], [2]]},
    }
    # the servers went on from the previous checkpoint's version to the budget
    assert old["version"] < 20 <= got["steps"]
    redone = read_manifest(latest_checkpoint(ck))
    assert redone["run_id"] == old["run_id"] and redone["servers"] == 2
    assert redone["version"] >= 20 and redone["elements"] == old["elements"]


def test_a_sample_log_reads_back_batches_and_marks(tmp_path):
    from hybridagg.data.samplelog import SampleLog

    log = SampleLog(tmp_path / "sub" / "rank-00000.log")
    log.record(0, torch.tensor([3, 1, 2]).numpy())
    log.record(0, torch.tensor([], dtype=torch.int64).numpy())  # an empty batch
    log.mark("checkpoint 1")
    log.record(1, torch.tensor([7]).numpy())
    log.close()
    log.close()
    entries = list(read_sample_log(tmp_path / "sub" / "rank-00000.log"))
    assert [(e.epoch, e.ids, e.mark) for e in entries] == [
        (0, (3, 1, 2), None),
        (None, (), "checkpoint 1"),
        (1, (7,), None),
    ]
