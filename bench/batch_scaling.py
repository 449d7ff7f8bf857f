"""Updates to the target against the samples an update carries (one process).

Hybrid's point is one update per group instead of one per worker: where the
servers' link binds, its updates carry a group's samples and it moves about
``group size`` times async's samples per second. Whether that reaches the
target sooner depends on the task: below its critical batch size (McCandlish
et al., 2018; Shallue et al., 2019, "steps to result") an update of ``k``
times the samples cuts the updates needed up to ``k``-fold; above it, not at
all. This measures it without the cluster's noise: one rank (``--mode sync``,
no staleness), ``--eval-every 1``, the same model and data, each batch ``B``
trained at ``lr x B / B0`` (the linear scaling rule that hybridagg applies to
a group's update), several seeds::

    python bench/batch_scaling.py --data runs/digits.h5 --model resnet50-twin \\
        --batches 32,64,128 --seeds 5 --json scaling.json

Per batch: the median (and range) of the updates to ``--target-accuracy``
(``updates_to_target`` of the summary), the samples they hold, the gain
against the first batch (``U(B0) / U(B)``: 1 means larger updates bought
nothing, ``B / B0`` perfect scaling) and the final accuracy. A mode whose
updates carry ``k`` times the samples at ``R`` times the samples per second
reaches the target ``R / k x gain`` times sooner, staleness aside: that is
the bound this task puts on a time-to-target ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve()


def run_batch(batch: int, args: argparse.Namespace, tmp: Path) -> list[dict]:
    """Train every seed at ``batch`` in one single-rank MPI job; their summaries."""
    from hybridagg.runtime import runner

    base = int(args.batches.split(",")[0])
    out = tmp / f"b{batch}.json"
    cmd = [
        sys.executable,
        str(HERE.parent / "hetero.py"),
        "--inner",
        "--seeds",
        ",".join(str(s) for s in range(args.seeds)),
        "--out",
        str(out),
        "--",
        "--mode",
        "sync",
        "--data",
        args.data,
        "--model",
        args.model,
        "--batch-size",
        str(batch),
        "--lr",
        repr(args.lr * batch / base),
        "--steps",
        str(args.steps),
        "--eval-every",
        "1",
        "--target-accuracy",
        str(args.target_accuracy),
        "--no-progress",
    ]
    result = runner.run_job(
        runner.mpiexec_argv(1, cmd), timeout=args.timeout, env=runner.mpiexec_env()
    )
    if result.returncode != 0 or not out.exists():
        print(result.stdout[-3000:], result.stderr[-3000:], file=sys.stderr)
        raise SystemExit(f"batch_scaling: batch {batch} failed")
    return json.loads(out.read_text())


def rows(records: list[dict], base: int) -> list[dict]:
    """One row per batch: updates and samples to the target, the gain, accuracy.

    A seed that never reached the target counts as its run's updates plus one
    (it needed more than it was given), so a median over such seeds is a
    lower bound and is marked.
    """
    by_batch: dict[int, list[dict]] = {}
    for r in records:
        by_batch.setdefault(r["batch_size"], []).append(r)

    def updates(r: dict) -> int:
        u = r.get("updates_to_target")
        return int(u) if u is not None else int(r["steps"]) + 1

    out = []
    for batch in sorted(by_batch):
        runs = by_batch[batch]
        u = [updates(r) for r in runs]
        out.append(
            {
                "batch": batch,
                "seeds": len(runs),
                "missed": sum(r.get("updates_to_target") is None for r in runs),
                "updates": statistics.median(u),
                "updates_range": (min(u), max(u)),
                "samples": statistics.median(x * batch for x in u),
                "final_accuracy": statistics.median(r["final_accuracy"] for r in runs),
            }
        )
    first = next((r for r in out if r["batch"] == base), out[0] if out else None)
    for r in out:
        r["gain"] = first["updates"] / r["updates"] if first else None
        r["perfect_gain"] = r["batch"] / first["batch"] if first else None
    return out


def markdown(table: list[dict], target: float) -> str:
    """The rows as a markdown table."""
    lines = [
        f"| batch | seeds | updates to {target:g} (median, range) | samples to {target:g} "
        "| gain U(B0)/U(B) | perfect | final accuracy |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in table:
        lo, hi = r["updates_range"]
        mark = f" ({r['missed']} missed: lower bound)" if r["missed"] else ""
        lines.append(
            f"| {r['batch']} | {r['seeds']} | {r['updates']:g} ({lo}-{hi}){mark} "
            f"| {r['samples']:g} | {r['gain']:.2f} | {r['perfect_gain']:g} "
            f"| {r['final_accuracy']:.3f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default="runs/digits.h5")
    p.add_argument("--model", default="mlp", help="a zoo name")
    p.add_argument(
        "--batches", default="32,64,128", help="samples per update; the first is B0"
    )
    p.add_argument("--lr", type=float, default=0.05, help="the rate at the first batch")
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--steps", type=int, default=120, help="updates each run may take")
    p.add_argument("--target-accuracy", type=float, default=0.9)
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--json")
    args = p.parse_args(argv)
    try:
        batches = [int(b) for b in args.batches.split(",") if b]
    except ValueError:
        raise SystemExit(f"--batches must be integers, got {args.batches!r}") from None
    if not batches or min(batches) < 1:
        raise SystemExit(f"--batches must be positive integers, got {args.batches!r}")
    from hybridagg.data import digits_file

    digits_file(args.data)
    records: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for batch in batches:
            got = run_batch(batch, args, Path(tmp))
            records += got
            print(
                f"# batch {batch:>4} updates to target "
                f"{[r.get('updates_to_target') for r in got]}",
                flush=True,
            )
    table = rows(records, batches[0])
    print(markdown(table, args.target_accuracy))
    if args.json:
        Path(args.json).write_text(
            json.dumps({"records": records, "rows": table}, indent=1)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
