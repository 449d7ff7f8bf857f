"""Updates to the target against samples per update and staleness (a convergence table).

``hybridagg plan --objective time`` ranks configurations by their predicted
time to the target accuracy, which needs how many updates a run needs at a
given number of samples per update ``B`` and staleness ``tau`` (Pollux's
statistical efficiency; "steps to result", Shallue et al., 2019). This
measures it with real ``hybridagg train`` runs on this machine, no emulation:

* ``tau = 0``: one rank, ``--mode sync`` (bench/batch_scaling.py's runs);
* ``tau > 0``: ``--mode async`` with ``k`` equal-speed workers and one
  server; the run's measured ``mean_staleness`` is its ``tau``.

Every run: ``--eval-every 1``, ``--batch-size B`` at ``--lr lr0 x B / B0``
(the linear scaling rule hybridagg applies to an update's samples; async
updates are further damped by the server's staleness rule, as in any run),
the run's ``updates_to_target`` (server versions in async). Per (B, workers)
one MPI job trains every seed in a row::

    python bench/convergence.py --data runs/digits.h5 --model mlp \\
        --batches 32 --workers 1,2,4,8 --seeds 6 --steps 300 --sample-ms 1 \\
        --run-eval-every 5 --eval-every 5 --json P32.json

The JSON holds the runs (``records``) and, under ``points``, the table that
``hybridagg plan --convergence FILE`` reads (hybridagg/sim/convergence.py):
per cell ``batch``, ``staleness`` (the median of the seeds' measured mean
staleness; with the runs' ``damping`` rule it gives the point's drift) and
``updates`` (the median updates to the target; a seed that
missed it counts as the updates it made plus one, so such a median is a
lower bound and the cell says how many ``missed``).

Every run validates after every update, so the updates a run would have
needed at a coarser ``--eval-every E`` (rank 0 validating only when the
version enters a new bucket of ``E``, as ``hybridagg train`` does) are
read off the same run: the first validation at or above the target among
those the coarser cadence keeps. A noisy accuracy curve crosses the
target sooner when it is looked at more often, so the cadence changes the
updates a job is measured to take (by a quarter on the digits at
``E = 5``). ``--eval-every 1,5`` writes one table per cadence: ``points``
at the first, ``tables`` holding every one, each with its ``eval_every``
(``hybridagg plan --convergence FILE --eval-every E`` picks one). The
records keep the derived ``reached`` updates per cadence, not the curves.

Async updates' worth depends on how the workers' steps line up, so the
table should come from steps as long as the predicted jobs': ``--sample-ms``
paces every worker as ``hybridagg train --sample-ms`` does. Unpaced, this
38 KB model's sub-millisecond steps on oversubscribed cores were another
regime: 4 equal workers needed 81.5 updates at B = 32 unpaced and 112
paced at 1 ms a sample (bench/RESULTS.md, "Drift"). ``--run-eval-every R``
makes the runs validate every ``R`` updates themselves (tables only at
multiples of ``R``): validating after every step is work on worker 0 that
the predicted jobs do not do.

Equal workers cannot tell an update's own staleness (its damping) from its
drift: one fixes the other. ``--mixed 'W SLOWDOWN [GROUPS]'`` adds cells of
mixed speeds at ``--base-batch``: ``W`` workers slowed by ``SLOWDOWN``
(paced, so a group's cycle is its slowest member's factor), async, or
hybrid with ``GROUPS``; the file then holds, per cadence, the
``staleness_weight`` that best predicts them (hybridagg/sim/convergence.py)
and each cell's updates beside its predictions from drift alone and at that
weight. With ``--from-json``, ``--mixed`` measures those cells as the
files' runs were made (model, data, lr, pacing; give the same
``--run-eval-every``) and adds them::

    python bench/convergence.py --from-json P.json --mixed '4 2-3:4' \
        --mixed '8 2-4:2,5-7:4 0-1,2-4,5-7' --seeds 6 --steps 600 \
        --run-eval-every 5 --eval-every 5 --json PM.json

Cells that missed can be measured again with a longer ``--steps`` (every
run trains to the end: the cost is steps, not the target) and merged:
``--from-json A.json B.json --json C.json`` rebuilds the table from their
records, a run of a later file replacing the same (B, workers, seed) run of
an earlier one; more seeds (``--first-seed 3``) add to a cell.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))


def train_args(batch: int, workers: int, args: argparse.Namespace) -> list[str]:
    """``hybridagg train``'s options for one cell (sync on one rank if ``workers == 1``)."""
    mode = ["--mode", "sync"] if workers == 1 else ["--mode", "async", "--servers", "1"]
    return mode + _common(batch, args)


def _common(batch: int, args: argparse.Namespace) -> list[str]:
    """``hybridagg train``'s options every cell of ``batch`` shares."""
    return [
        "--data", args.data, "--model", args.model,
        "--batch-size", str(batch), "--lr", repr(args.lr * batch / args.base_batch),
        "--steps", str(args.steps), "--eval-every", str(args.run_eval_every),
        "--target-accuracy", str(args.target_accuracy), "--no-progress",
        *(["--sample-ms", repr(args.sample_ms)] if args.sample_ms else []),
    ]  # fmt: skip


def parse_mixed(spec: str) -> dict:
    """A ``--mixed`` cell, ``"W SLOWDOWN [GROUPS]"``: ``W`` workers slowed by
    ``SLOWDOWN`` (``hybridagg train --slowdown``, fixed), in hybrid with
    ``GROUPS`` (``--groups``) or, without, async (one worker a group).

    Each group's cycle is its slowest member's factor: paced (and unpaced)
    compute scales with the factor, and a group waits for its slowest.

    Raises:
        SystemExit: A malformed spec (named).
    """
    from hybridagg.slowdown import parse_slowdown
    from hybridagg.topology import parse_group_spec

    parts = spec.split()
    try:
        if len(parts) not in (2, 3):
            raise ValueError("expected 'W SLOWDOWN [GROUPS]'")
        workers = int(parts[0])
        if workers < 2:
            raise ValueError("a mixed cell needs 2 workers or more")
        slowdown = parse_slowdown(parts[1])
        if slowdown.changes:
            raise ValueError("the slowdown must not change during the run")
        slowdown.validate_workers(workers)
        groups = (
            parse_group_spec(parts[2]) if len(parts) == 3
            else [[r] for r in range(workers)]
        )  # fmt: skip
        if sorted(r for g in groups for r in g) != list(range(workers)):
            raise ValueError(f"the groups must hold workers 0-{workers - 1} once each")
    except ValueError as exc:
        raise SystemExit(f"--mixed {spec!r}: {exc}") from None
    return {
        "spec": spec,
        "mode": "hybrid" if len(parts) == 3 else "async",
        "workers": workers,
        "slowdown": parts[1],
        "groups": groups,
        "group_cycles": [max(slowdown.factor(r) for r in g) for g in groups],
    }


def mixed_args(batch: int, cell: dict, args: argparse.Namespace) -> list[str]:
    """``hybridagg train``'s options for a ``--mixed`` cell."""
    mode = ["--mode", cell["mode"], "--servers", "1", "--slowdown", cell["slowdown"]]
    if cell["mode"] == "hybrid":
        mode += ["--groups", cell["spec"].split()[2]]
    return mode + _common(batch, args)


def run_cell(
    batch: int,
    workers: int,
    args: argparse.Namespace,
    tmp: Path,
    mixed: dict | None = None,
) -> list[dict]:
    """Train every seed of one (B, workers) cell, or a ``--mixed`` one, in
    one MPI job; their summaries."""
    from hybridagg.runtime import runner

    name = f"b{batch}-w{workers}"
    if mixed:
        name += "-" + "".join(ch if ch.isalnum() else "_" for ch in mixed["spec"])
    out = tmp / f"{name}.json"
    cell_args = (
        mixed_args(batch, mixed, args) if mixed else train_args(batch, workers, args)
    )
    cmd = [
        sys.executable, str(HERE.parent / "hetero.py"), "--inner",
        "--seeds", ",".join(str(args.first_seed + s) for s in range(args.seeds)),
        "--out", str(out), "--", *cell_args,
    ]  # fmt: skip
    ranks = 1 if workers == 1 else workers + 1
    result = runner.run_job(
        runner.mpiexec_argv(ranks, cmd), timeout=args.timeout, env=runner.mpiexec_env()
    )
    if result.returncode != 0 or not out.exists():
        print(result.stdout[-3000:], result.stderr[-3000:], file=sys.stderr)
        raise SystemExit(f"convergence: batch {batch} workers {workers} failed")
    runs = json.loads(out.read_text())
    for r in runs:
        r["cell_batch"], r["cell_workers"] = batch, workers
        r["cell_steps"] = args.steps
        r["cell_eval_every"] = args.run_eval_every
        if mixed:
            r["cell_mixed"] = mixed["spec"]
    return runs


def reached_at(
    curve_updates: list[int], accuracies: list[float], target: float, every: int
) -> int | None:
    """The update at which a run validating every ``every`` updates would
    first have seen the target, from a run that validated after each update.

    ``hybridagg train`` validates when rank 0's version enters a new bucket
    of ``every`` (``version // every`` above the last validation's), and at
    the end; ``curve_updates`` are the versions rank 0 validated at, the
    last of them the final one.

    Raises:
        ValueError: Curves of different lengths, or ``every`` < 1.
    """
    if len(curve_updates) != len(accuracies):
        raise ValueError("one update per accuracy expected")
    if every < 1:
        raise ValueError(f"eval_every must be >= 1, got {every}")
    last = 0
    for i, (v, a) in enumerate(zip(curve_updates, accuracies, strict=True)):
        final = i == len(curve_updates) - 1
        if v // every <= last and not final:
            continue
        last = v // every
        if a >= target:
            return int(v)
    return None


def add_reached(records: list[dict], cadences: list[int], target: float) -> None:
    """Record in each run the updates to the target per cadence (``reached``),
    from its curve; a record that has ``reached`` and no curve keeps it."""
    for r in records:
        updates = r.get("accuracy_updates")
        curve = r.get("accuracy_curve")
        if updates is None or curve is None:
            continue  # an older record: the cadences its file derived
        own = int(r.get("cell_eval_every") or 1)
        coarser = [e for e in cadences if e % own]
        if coarser:
            raise SystemExit(
                f"convergence: runs that validated every {own} updates cannot "
                f"give --eval-every {coarser[0]} (only multiples of {own})"
            )
        accuracies = [a for _, a in curve]
        r["reached"] = {
            str(e): reached_at(updates, accuracies, target, e) for e in cadences
        }


def updates_at(r: dict, every: int) -> int | None:
    """A run's updates to the target at cadence ``every``.

    Raises:
        SystemExit: The record holds no curve and no derived value for it.
    """
    reached = r.get("reached")
    if reached is not None and str(every) in reached:
        return reached[str(every)]
    if every == 1 and "reached" not in r:
        return r.get("updates_to_target")  # measured at --eval-every 1
    raise SystemExit(
        f"convergence: a record of B {r.get('cell_batch')} workers "
        f"{r.get('cell_workers')} seed {r.get('seed')} has no updates at "
        f"--eval-every {every} (its file derived {sorted(reached or {'1': 0})})"
    )


def _one(values: set, default: object, differ: str) -> object:
    """The one value the runs agree on (``default`` when none has one).

    Raises:
        SystemExit: They differ (``differ`` and the values).
    """
    if len(values) > 1:
        raise SystemExit(f"{differ} {sorted(values)}")
    return values.pop() if values else default


def merge(files: list[list[dict]]) -> list[dict]:
    """Records of several runs of this script: a (B, workers, mixed cell,
    seed) run of a later file replaces the same run of an earlier one; other
    seeds add."""
    runs: dict[tuple, dict] = {}
    for records in files:
        for r in records:
            key = (r["cell_batch"], r["cell_workers"], r.get("cell_mixed"), r["seed"])
            runs[key] = r
    return list(runs.values())


def points(records: list[dict], steps: int, every: int = 1) -> list[dict]:
    """One table point per (B, workers): median staleness and updates to the
    target at validation cadence ``every``.

    A seed that never reached the target counts as the updates it made plus
    one (its summary's ``steps``; else its cell's, else ``steps``): it
    needed more than it was given, so the median is then a lower bound, and
    ``missed`` says how many seeds it holds.
    """
    cells: dict[tuple[int, int], list[dict]] = {}
    for r in records:
        if r.get("cell_mixed") is None:  # mixed cells are not points
            cells.setdefault((r["cell_batch"], r["cell_workers"]), []).append(r)
    out = []
    for (batch, workers), runs in sorted(cells.items()):
        got, u = _updates(runs, steps, every)
        tau = [float(r.get("mean_staleness") or 0.0) for r in runs]
        out.append(
            {
                "batch": batch,
                "workers": workers,
                "staleness": round(statistics.median(tau), 3),
                "updates": statistics.median(u),
                "updates_range": [min(u), max(u)],
                "staleness_range": [round(min(tau), 3), round(max(tau), 3)],
                "seeds": len(runs),
                "missed": sum(g is None for g in got),
            }
        )
    return out


def _updates(runs: list[dict], steps: int, every: int) -> tuple[list, list[int]]:
    """The runs' updates to the target at ``every`` (``None`` if missed),
    and the same with a miss counted as the updates it made plus one."""
    got = [updates_at(r, every) for r in runs]
    u = [
        int(g) if g is not None
        else int(r.get("steps") or r.get("cell_steps") or steps) + 1
        for g, r in zip(got, runs, strict=True)
    ]  # fmt: skip
    return got, u


def mixed_cells(
    records: list[dict], steps: int, every: int, table: list[dict], damping: str
) -> tuple[list[dict], float | None]:
    """The ``--mixed`` cells at cadence ``every``, and the staleness weight
    fitted on them against ``table`` (hybridagg/sim/convergence.py,
    ``fit_staleness_weight``; ``None`` without mixed cells). Each cell also
    gets its updates as predicted from drift alone (``predicted_drift``)
    and at the fitted weight (``predicted``)."""
    from hybridagg.sim.convergence import (
        ConvergenceTable,
        MixedCell,
        fit_staleness_weight,
        updates_of,
    )

    cells: dict[tuple[int, str], list[dict]] = {}
    for r in records:
        if r.get("cell_mixed") is not None:
            cells.setdefault((r["cell_batch"], r["cell_mixed"]), []).append(r)
    if not cells:
        return [], None
    out = []
    for (batch, spec), runs in sorted(cells.items()):
        cell = parse_mixed(spec)
        got, u = _updates(runs, steps, every)
        tau = [float(r.get("mean_staleness") or 0.0) for r in runs]
        cell.update(
            batch=batch,
            group_samples=[batch * len(g) for g in cell["groups"]],
            updates=statistics.median(u),
            updates_range=[min(u), max(u)],
            staleness=round(statistics.median(tau), 3),
            seeds=len(runs),
            missed=sum(g is None for g in got),
        )
        out.append(cell)
    base = ConvergenceTable(
        tuple((p["batch"], p["staleness"], p["updates"]) for p in table),
        eval_every=every,
        damping=damping,
    )
    fit = [
        MixedCell(c["mode"], tuple(c["group_samples"]), tuple(c["group_cycles"]),
                  c["updates"])
        for c in out
    ]  # fmt: skip
    try:
        weight, predicted = fit_staleness_weight(base, fit)
    except ValueError as exc:
        raise SystemExit(f"convergence: --eval-every {every}: {exc}") from None
    for c, f, u in zip(out, fit, predicted, strict=True):
        c["predicted"] = round(u, 1)
        drift_only = updates_of(base, f.mode, f.group_samples, f.group_cycles)
        c["predicted_drift"] = (
            round(drift_only, 1) if math.isfinite(drift_only) else None
        )
    return out, weight


def markdown_mixed(cells: list[dict], weight: float | None, target: float) -> str:
    """The mixed cells as a markdown table."""
    lines = [
        f"| B | mixed cell (workers, slowdown, groups) | updates to {target:g}, "
        "median [range] | missed | predicted, drift alone | predicted, "
        f"staleness weight {weight:g} |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    for c in cells:
        drift = "never" if c["predicted_drift"] is None else f"{c['predicted_drift']:g}"
        lines.append(
            f"| {c['batch']} | `{c['spec']}` | {c['updates']:g} "
            f"[{c['updates_range'][0]}-{c['updates_range'][1]}] | {c['missed']} "
            f"| {drift} | {c['predicted']:g} |"
        )
    return "\n".join(lines)


def markdown(table: list[dict], target: float) -> str:
    """The points as a markdown table."""
    lines = [
        f"| B | workers | staleness tau, median [range] | updates to {target:g}, "
        "median [range] | missed |",
        "|---:|---:|---:|---:|---:|",
    ]
    for p in table:
        lines.append(
            f"| {p['batch']} | {p['workers']} | {p['staleness']:.2f} "
            f"[{p['staleness_range'][0]:.2f}-{p['staleness_range'][1]:.2f}] "
            f"| {p['updates']:g} [{p['updates_range'][0]}-{p['updates_range'][1]}] "
            f"| {p['missed']} |"
        )
    return "\n".join(lines)


def _ints(text: str, flag: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v]
    except ValueError:
        raise SystemExit(f"{flag} must be integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise SystemExit(f"{flag} must be positive integers, got {text!r}")
    return values


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default="runs/digits.h5")
    p.add_argument("--model", default="mlp", help="a zoo name")
    p.add_argument("--batches", default="16,32,64,128", help="samples per update B")
    p.add_argument(
        "--workers", default="1,2,4,8", help="1: one-rank sync (tau 0); k: async"
    )
    p.add_argument("--lr", type=float, default=0.05, help="the rate at --base-batch")
    p.add_argument("--base-batch", type=int, default=32, help="B0 of the lr rule")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--first-seed", type=int, default=0, help="seeds from this one on")
    p.add_argument("--steps", type=int, default=400, help="updates each run may take")
    p.add_argument("--target-accuracy", type=float, default=0.9)
    p.add_argument(
        "--sample-ms",
        type=float,
        default=0.0,
        help="pace every worker to this many ms a sample (hybridagg train's "
        "--sample-ms): steps of the length the planned jobs have, not a "
        "small model's sub-millisecond ones",
    )
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument(
        "--eval-every",
        default="1",
        help="validation cadences to derive tables at (comma-separated, "
        "multiples of --run-eval-every; the first is the file's points)",
    )
    p.add_argument(
        "--run-eval-every",
        type=int,
        default=1,
        help="the runs' own validation cadence (default 1); --eval-every "
        "must be multiples of it (validating after every update is work on "
        "worker 0 that a job validating less often does not do)",
    )
    p.add_argument(
        "--mixed",
        action="append",
        default=[],
        metavar="'W SLOWDOWN [GROUPS]'",
        help="also a cell of mixed speeds at --base-batch: W workers slowed "
        "by SLOWDOWN (as hybridagg train's), in hybrid with GROUPS or else "
        "async (repeatable); the staleness weight is fitted on these cells",
    )
    p.add_argument("--json")
    p.add_argument(
        "--from-json",
        nargs="+",
        help="rebuild the table from these --json files (later cells replace earlier)",
    )
    args = p.parse_args(argv)
    batches = _ints(args.batches, "--batches")
    workers = _ints(args.workers, "--workers")
    cadences = _ints(args.eval_every, "--eval-every")
    mixed = [parse_mixed(m) for m in args.mixed]  # refused before any run
    if args.run_eval_every < 1:
        raise SystemExit("--run-eval-every must be >= 1")
    if (not args.from_json or mixed) and any(e % args.run_eval_every for e in cadences):
        # (refused before the runs, not after them in add_reached)
        raise SystemExit(
            f"--eval-every {args.eval_every} must be multiples of "
            f"--run-eval-every {args.run_eval_every}"
        )
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    if args.from_json:
        loaded = [json.loads(Path(f).read_text()) for f in args.from_json]
        records = merge([d["records"] for d in loaded])
        started = ", ".join(str(d.get("started")) for d in loaded)
        file_steps = max(int(d.get("steps") or args.steps) for d in loaded)
        args.sample_ms = _one(
            {float(r.get("sample_ms") or 0.0) for r in records},
            0.0,
            "the runs were paced differently: --sample-ms",
        )
        for key in ("model", "data", "target_accuracy", "lr", "base_batch"):
            if loaded[0].get(key) is not None:  # what the runs were, not the flags
                setattr(args, key, loaded[0][key])
        if mixed:  # measured now, as the files' runs were, at --steps
            started += ", " + time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
            records = merge([records, measure([], [], args, mixed)])
        args.steps = max(file_steps, args.steps if mixed else 0)
    else:
        records = measure(batches, workers, args, mixed)
    add_reached(records, cadences, args.target_accuracy)
    # the servers' damping rule of the async runs: a point's drift is
    # its staleness damped by it (hybridagg/sim/convergence.py)
    damping = _one(
        {r.get("damping") for r in records} - {None},
        "inverse",
        "the runs used different damping rules:",
    )
    tables = []
    for e in cadences:
        t = {"eval_every": e, "points": points(records, args.steps, e)}
        cells, weight = mixed_cells(records, args.steps, e, t["points"], damping)
        if cells:
            t.update(staleness_weight=weight, mixed=cells)
        tables.append(t)
    for t in tables:
        print(f"# --eval-every {t['eval_every']}")
        print(markdown(t["points"], args.target_accuracy))
        if t.get("mixed"):
            print(
                markdown_mixed(t["mixed"], t["staleness_weight"], args.target_accuracy)
            )
    table = tables[0]["points"]
    if args.json:
        meta = {
            # (quoted: a --mixed cell is one argument with spaces)
            "command": shlex.join(
                ["python", "bench/convergence.py", *(argv or sys.argv[1:])]
            ),
            "started": started,
            "finished": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
            "model": args.model,
            "data": args.data,
            "target_accuracy": args.target_accuracy,
            "lr": args.lr,
            "base_batch": args.base_batch,
            "steps": args.steps,
            "sample_ms": args.sample_ms,
        }
        if args.from_json:
            meta["sources"] = [
                {k: d.get(k) for k in ("command", "started", "finished", "steps")}
                for d in loaded
            ]
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        # the runs' accuracy curves (one point per update) would make the
        # file megabytes: the tables need the updates to the target alone
        # (``reached`` keeps them per cadence)
        curves = ("accuracy_curve", "accuracy_updates")
        kept = [{k: v for k, v in r.items() if k not in curves} for r in records]
        body = {
            **meta,
            "damping": damping,
            "eval_every": cadences[0],
            "points": table,
            **({"staleness_weight": tables[0]["staleness_weight"],
                "mixed": tables[0]["mixed"]} if tables[0].get("mixed") else {}),
            "tables": tables,
            "records": kept,
        }  # fmt: skip
        Path(args.json).write_text(json.dumps(body, indent=1))
    return 0


def measure(
    batches: list[int],
    workers: list[int],
    args: argparse.Namespace,
    mixed: list[dict] | None = None,
) -> list[dict]:
    """Train every (B, workers) cell, then every ``--mixed`` one at
    ``--base-batch``; the runs' summaries."""
    from hybridagg.data import digits_file

    digits_file(args.data)
    records: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for w in workers:
            for b in batches:
                got = run_cell(b, w, args, Path(tmp))
                records += got
                print(
                    f"# B {b:>4} workers {w}: updates to target "
                    f"{[r.get('updates_to_target') for r in got]} staleness "
                    f"{[round(r.get('mean_staleness') or 0.0, 2) for r in got]}",
                    flush=True,
                )
        for cell in mixed or []:
            got = run_cell(args.base_batch, cell["workers"], args, Path(tmp), cell)
            records += got
            print(
                f"# mixed {cell['spec']!r}: updates to target "
                f"{[r.get('updates_to_target') for r in got]}",
                flush=True,
            )
    return records


if __name__ == "__main__":
    sys.exit(main())
