"""``hybridagg train --cost-budget``: the online cost controller in whole jobs.

A sync job of two groups on digits: ranks 0+1 a pipeline at 4 $/h each,
rank 2 alone, emulated ``--slow`` times slower, at 3 $/h; every group is
paced at ``--sample-ms`` per sample. Configurations (``config``):

* ``all``: both groups every step (11 $/h; the run without a budget);
* ``pipeline``: the pipeline alone, on ranks 0+1 (8 $/h);
* ``ctl-V``: ``--cost-budget`` with the controller's weight ``V``, both
  groups started, the controller parking and bringing back groups.

Per configuration: samples per second and the *measured* cost per hour
(active prices times measured seconds, the summary's ``cost`` account; for
the static configurations, their price). The bound for a controller run is
the best mix of the static configurations within the budget: spending a
fraction ``l = (11 - B) / (11 - 8)`` of the time on ``pipeline`` and the rest
on ``all`` meets the budget ``B`` exactly, with ``l x r_pipeline + (1 - l)
x r_all`` samples per second (both rates measured in the same run). A
controller run meets the budget when its measured cost is at most ``B``;
the drift-plus-penalty bound allows ``B + 3600 x Q / seconds``::

    python bench/cost_train.py --json cost-train.json --md cost-train.md
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

__all__ = ["main"]

PRICES = {"pipeline": 8.0, "all": 11.0}  # $/h: ranks 0+1 at 4, rank 2 at 3


def run(config: str, args, work: Path) -> dict:
    from hybridagg.runtime import runner

    out = work / f"{config}.json"
    groups, ranks, extra = "0-1,2", 3, []
    if config == "pipeline":
        groups, ranks = "0-1", 2
    elif config.startswith("ctl-"):
        extra = ["--cost-budget", str(args.budget), "--prices", "0-1:4,2:3"]
        extra += ["--cost-v", config[4:], "--cost-slot", str(args.slot)]
    train = [
        sys.executable, "-m", "hybridagg.cli", "train", "--data", str(args.data),
        "--mode", "sync", "--groups", groups, "--pipeline-groups", "0",
        "--adaptive-batch", "--slowdown", f"2:{args.slow}" if ranks == 3 else "0:1",
        "--sample-ms", str(args.sample_ms), "--epochs", str(args.epochs),
        "--eval-every", "100000", "--no-progress", "--summary", str(out), *extra,
    ]  # fmt: skip
    argv = runner.mpiexec_argv(ranks, train)
    result = runner.run_job(argv, timeout=args.timeout, env=runner.mpiexec_env())
    if result.returncode != 0:
        raise RuntimeError(result.stdout[-2000:] + result.stderr[-2000:])
    s = json.loads(out.read_text())
    rec = {
        "config": config,
        "samples_per_sec": s["samples_per_sec"],
        "cost_per_hour": PRICES.get(config),
        "final_accuracy": s["final_accuracy"],
        "wall_s": s["wall_s"],
    }
    if "cost" in s:
        c = s["cost"]
        rec.update(
            cost_per_hour=c["average_cost_per_hour"],
            budget_per_hour=c["budget_per_hour"],
            V=c["V"],
            queue=c["queue"],
            seconds=c["seconds"],
            slots=c["slots"],
            parked_seconds=c["parked_seconds"],
            bound_per_hour=c["budget_per_hour"] + 3600 * c["queue"] / c["seconds"],
        )
    return rec


def best_mix_rate(rows: dict, budget: float) -> float | None:
    """Samples/s of the best time-sharing of ``pipeline`` and ``all`` within ``budget``."""
    if "pipeline" not in rows or "all" not in rows:
        return None
    lo, hi = PRICES["pipeline"], PRICES["all"]
    if budget >= hi:
        return rows["all"]["samples_per_sec"]
    if budget < lo:
        return None
    share = (hi - budget) / (hi - lo)  # time on the pipeline alone
    return (
        share * rows["pipeline"]["samples_per_sec"]
        + (1 - share) * rows["all"]["samples_per_sec"]
    )


def markdown(records: list[dict]) -> str:
    rows = {r["config"]: r for r in records}
    budget = next(
        (r["budget_per_hour"] for r in records if "budget_per_hour" in r), None
    )
    mix = best_mix_rate(rows, budget) if budget is not None else None
    lines = [
        "| config | samples/s | cost ($/h, measured) | budget met | bound ($/h) | "
        "parked s (group 0, group 1) of s | / best mix |",
        "|---|---:|---:|---|---:|---:|---:|",
    ]
    for r in records:
        ctl = "budget_per_hour" in r
        met = (
            ("yes" if r["cost_per_hour"] <= r["budget_per_hour"] else "NO")
            if ctl
            else "-"
        )
        bound = f"{r['bound_per_hour']:.2f}" if ctl else "-"
        parked = (
            f"{r['parked_seconds'][0]:.1f}, {r['parked_seconds'][1]:.1f} of {r['seconds']:.1f}"
            if ctl
            else "-"
        )
        ratio = f"{r['samples_per_sec'] / mix:.2f}" if ctl and mix else "-"
        lines.append(
            f"| {r['config']} | {r['samples_per_sec']:.0f} | {r['cost_per_hour']:.2f} | "
            f"{met} | {bound} | {parked} | {ratio} |"
        )
    if mix is not None:
        lines += ["", f"Best mix within {budget:g} $/h: {mix:.0f} samples/s."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--data", type=Path, default=None, help="digits HDF5 (made if absent)"
    )
    p.add_argument("--V", nargs="+", default=["0.001", "0.01", "0.1", "1"])
    p.add_argument("--budget", type=float, default=10.0)
    p.add_argument("--slot", type=int, default=10, help="rounds per slot")
    p.add_argument("--slow", type=float, default=2.0)
    p.add_argument("--sample-ms", type=float, default=2.0)
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--md", type=Path, default=None)
    p.add_argument(
        "--from-json", type=Path, default=None, help="print a saved run again"
    )
    args = p.parse_args(argv)
    if args.from_json:
        print(markdown(json.loads(args.from_json.read_text())), end="")
        return 0
    configs = ["all", "pipeline", *(f"ctl-{v}" for v in args.V)]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if args.data is None:
            from hybridagg.data import convert_digits

            args.data = work / "digits.h5"
            convert_digits(args.data, val_fraction=0.2, seed=0, progress=False)
        records = []
        for config in configs:
            records.append(run(config, args, work))
            r = records[-1]
            print(
                f"{config:10s} {r['samples_per_sec']:7.0f} samples/s "
                f"{r['cost_per_hour']:6.2f} $/h",
                flush=True,
            )
    table = markdown(records)
    print(table, end="")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(records, indent=1) + "\n")
    if args.md:
        args.md.parent.mkdir(parents=True, exist_ok=True)
        args.md.write_text(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
