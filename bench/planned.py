"""Planned jobs for real: ``hybridagg plan``'s choice against hand-written ones (issue 21).

One command plans, trains and compares (it starts the MPI jobs itself)::

    python bench/planned.py --seeds 10 --json planned.json --md planned.md

On this machine's emulation (workers slowed by ``--slowdown``, compute slept
with ``--sample-ms``), per emulated cluster (``--clusters``):

* ``headline-4x``: bench/hetero.py's 4x level, 4 workers of which 2-3 are
  4 times slower (``--slowdown 0-1:1,2-3:4 --sample-ms 1``);
* ``uneven-8``: 8 workers of three speeds (``--slowdown
  0-1:1,2-4:2,5-7:4 --sample-ms 2``, bench/planner.py's emulated space);

it runs ``hybridagg plan -n W --slowdown S --sample-ms MS --objective
throughput`` (the model profiled on the spot, or ``--profile FILE``; with
``--objective time --convergence FILE``, the plan with the shortest
predicted time to the target instead, from a ``bench/convergence.py``
table such as bench/results/sim/convergence-digits-paced-mixed.json, read
at the jobs' ``--eval-every``), then
trains the planned job (``hybridagg train --plan FILE`` on the plan's ranks)
and the hand-written configurations (as bench/hetero.py writes them: sync;
hybrid with the workers grouped by speed and one server; async with one
server; sync with adaptive batches) over ``--seeds`` seeds each, on the
same data, model and emulation. Reported per configuration: the median
[range] time to ``--target-accuracy`` over the seeds that reached it and
how many did, samples/s, and for the plan its median time over the best
hand-written configuration's (the issue's goals: at most 1.05 on the
headline, below 1.0 on the uneven cluster).
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(ROOT))

import hetero  # noqa: E402

#: name -> (workers, slowdown, sample-ms, hybrid's groups by speed)
CLUSTERS = {
    "headline-4x": (4, "0-1:1,2-3:4", 1.0, "0-1,2-3"),
    "uneven-8": (8, "0-1:1,2-4:2,5-7:4", 2.0, "0-1,2-4,5-7"),
}

HAND_WRITTEN = ("sync", "hybrid", "async", "sync+adaptive")
PLANNED = "planned"
#: async with one server on the workers the plan uses (after ``planned``): a
#: plan that leaves slow workers idle, against the simplest job on the same
#: workers (not one of the hand-written configurations the goal names)
SAME_WORKERS = "async-plan-workers"


def hand_written(name: str, cluster: str) -> tuple[int, list[str]]:
    """(ranks, train options) of a hand-written configuration on a cluster."""
    workers, _slowdown, _ms, groups = CLUSTERS[cluster]
    return {
        "sync": (workers, ["--mode", "sync"]),
        "hybrid": (
            workers + 1,
            ["--mode", "hybrid", "--groups", groups, "--servers", "1"],
        ),
        "async": (workers + 1, ["--mode", "async", "--servers", "1"]),
        "sync+adaptive": (workers, ["--mode", "sync", "--adaptive-batch"]),
    }[name]


def common_args(cluster: str, args) -> list[str]:
    """``hybridagg train``'s options every configuration of a cluster shares."""
    _workers, slowdown, sample_ms, _groups = CLUSTERS[cluster]
    return [
        "--data", args.data, "--model", args.model, "--epochs", str(args.epochs),
        "--lr", str(args.lr), "--batch-size", str(args.batch_size),
        "--slowdown", slowdown, "--sample-ms", f"{sample_ms:g}",
        "--target-accuracy", str(args.target_accuracy),
        "--eval-every", str(args.eval_every),
    ]  # fmt: skip


def without_flag(argv: list[str], flag: str) -> list[str]:
    """``argv`` without ``flag`` and its value."""
    i = argv.index(flag)
    return argv[:i] + argv[i + 2 :]


def plan_argv(cluster: str, args, out: Path, summary: Path) -> list[str]:
    """``hybridagg plan``'s options for a cluster's emulation."""
    workers, slowdown, sample_ms, _groups = CLUSTERS[cluster]
    argv = ["plan", "-n", str(workers), "--slowdown", slowdown]
    argv += ["--sample-ms", f"{sample_ms:g}", "--objective", args.objective]
    if args.convergence:
        # the table at the cadence these jobs validate at (their time to the
        # target is their first validation at or above it)
        argv += ["--convergence", args.convergence]
        argv += ["--eval-every", str(args.eval_every)]
    argv += ["--batch-size", str(args.batch_size)]
    if args.profile:
        argv += ["--profile", args.profile]
    else:
        argv += ["--model", args.model, "--data", args.data]
    return argv + ["--out", str(out), "--json", str(summary)]


def make_plan(cluster: str, args, tmp: Path) -> tuple[Path, dict]:
    """Run ``hybridagg plan``; the plan file and its JSON."""
    out, summary = tmp / f"plan-{cluster}.json", tmp / f"plan-{cluster}-pred.json"
    argv = plan_argv(cluster, args, out, summary)
    cmd = [sys.executable, "-m", "hybridagg.cli", *argv]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    if done.returncode != 0 or not out.exists():
        raise SystemExit(
            f"planned: hybridagg {shlex.join(argv)} failed: {done.stderr[-2000:]}"
        )
    print(done.stdout, flush=True)
    return out, json.loads(summary.read_text())


def train(nranks: int, train_args: list[str], args, out: Path) -> list[dict]:
    """Train ``--seeds`` runs in one MPI job (bench/hetero.py's inner loop)."""
    from hybridagg.runtime import runner

    first = args.first_seed
    seeds = ",".join(str(s) for s in range(first, first + args.seeds))
    cmd = [sys.executable, str(hetero.HERE), "--inner", "--seeds", seeds]
    cmd += ["--out", str(out), "--", *train_args, "--no-progress"]
    result = runner.run_job(
        runner.mpiexec_argv(nranks, cmd), timeout=args.timeout, env=runner.mpiexec_env()
    )
    if result.returncode != 0 or not out.exists():
        print(result.stdout[-3000:], result.stderr[-3000:], file=sys.stderr)
        raise SystemExit(f"planned: the job {shlex.join(train_args)} failed")
    records = json.loads(out.read_text())
    for seed, rec in enumerate(records, start=first):
        rec["seed"] = seed
    return records


def rows(records: list[dict]) -> list[dict]:
    """Per (cluster, configuration): median [range] time to target over the
    seeds that reached it, how many did, samples/s; and per cluster the
    plan's median time over the best hand-written median (``ratio``)."""
    out = []
    for cluster in dict.fromkeys(r["cluster"] for r in records):
        mine = [r for r in records if r["cluster"] == cluster]
        these = []
        for config in dict.fromkeys(r["config"] for r in mine):
            rs = [r for r in mine if r["config"] == config]
            these.append(
                {
                    "cluster": cluster,
                    "config": config,
                    "runs": len(rs),
                    "reached": sum(r["time_to_target_s"] is not None for r in rs),
                    "ttt": hetero._median_range([r["time_to_target_s"] for r in rs]),
                    "samples_per_sec": hetero._median_range(
                        [r.get("samples_per_sec") for r in rs]
                    ),
                    "train_args": rs[0].get("train_args"),
                }
            )
        hand = [
            c for c in these if c["config"] in HAND_WRITTEN and c["ttt"][0] is not None
        ]
        best = min(hand, key=lambda c: c["ttt"][0]) if hand else None
        same = next(
            (c for c in these if c["config"] == SAME_WORKERS and c["ttt"][0]), None
        )
        for c in these:
            c["ratio_same_workers"] = (
                c["ttt"][0] / same["ttt"][0]
                if (same and c["config"] == PLANNED and c["ttt"][0] is not None)
                else None
            )
            c["best_hand_written"] = best["config"] if best else None
            c["ratio"] = (
                c["ttt"][0] / best["ttt"][0]
                if (best and c["config"] == PLANNED and c["ttt"][0] is not None)
                else None
            )
        out += these
    return out


def markdown(table: list[dict], target: float) -> str:
    """The comparison as a table."""

    def fmt(triple, spec):
        med, lo, hi = triple
        if med is None:
            return "-"
        return f"{format(med, spec)} [{format(lo, spec)}-{format(hi, spec)}]"

    lines = [
        f"| cluster | configuration | time to {target:g} (s), median [range] | "
        "reached | samples/s | plan / best hand-written |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for c in table:
        ratio = (
            f"**{c['ratio']:.3f}** (vs {c['best_hand_written']})"
            if c["ratio"] is not None
            else "-"
        )
        if c.get("ratio_same_workers") is not None:
            ratio += f"; {c['ratio_same_workers']:.3f} vs {SAME_WORKERS}"
        name = c["config"]
        if name == PLANNED and c["train_args"]:
            name = f"planned: `{' '.join(c['train_args'])}`"
        lines.append(
            f"| {c['cluster']} | {name} | {fmt(c['ttt'], '.2f')} | "
            f"{c['reached']}/{c['runs']} | {fmt(c['samples_per_sec'], '.0f')} | "
            f"{ratio} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clusters", default=",".join(CLUSTERS), help=f"{list(CLUSTERS)}")
    p.add_argument(
        "--configs",
        default=",".join((PLANNED, *HAND_WRITTEN)),
        help=f"from {[PLANNED, *HAND_WRITTEN, SAME_WORKERS]} ({SAME_WORKERS} "
        f"after {PLANNED})",
    )
    p.add_argument("--seeds", type=int, default=10, help="seeds per configuration")
    p.add_argument(
        "--first-seed",
        type=int,
        default=0,
        help="seeds from this one on (a new sitting)",
    )
    p.add_argument("--data", default="runs/digits.h5")
    p.add_argument("--model", default="mlp")
    p.add_argument("--profile", help="a profile for hybridagg plan (default: --model)")
    p.add_argument(
        "--objective",
        default="throughput",
        choices=("throughput", "time"),
        help="hybridagg plan's objective (time needs --convergence)",
    )
    p.add_argument(
        "--convergence",
        help="with --objective time: a convergence table (bench/convergence.py --json)",
    )
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--target-accuracy", type=float, default=0.9)
    p.add_argument("--eval-every", type=int, default=5)
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--json")
    p.add_argument("--md")
    p.add_argument("--from-json", nargs="+", help="rebuild the table from --json files")
    args = p.parse_args(argv)
    if (args.objective == "time") != (args.convergence is not None):
        raise SystemExit("--objective time and --convergence FILE go together")
    if args.from_json:
        records: list[dict] = []
        plans: list[dict] = []
        for path in args.from_json:
            got = json.loads(Path(path).read_text())
            records += got["records"]
            plans += got.get("plans", [])
    else:
        clusters = [c for c in args.clusters.split(",") if c]
        configs = [c for c in args.configs.split(",") if c]
        bad = set(clusters) - set(CLUSTERS)
        if bad:
            raise SystemExit(f"unknown --clusters {sorted(bad)}; from {list(CLUSTERS)}")
        known = [PLANNED, *HAND_WRITTEN, SAME_WORKERS]
        bad = set(configs) - set(known)
        if bad:
            raise SystemExit(f"unknown --configs {sorted(bad)}; from {known}")
        if SAME_WORKERS in configs and (
            PLANNED not in configs
            or configs.index(SAME_WORKERS) < configs.index(PLANNED)
        ):
            raise SystemExit(f"--configs: {SAME_WORKERS} needs {PLANNED} before it")
        from hybridagg.data import digits_file

        digits_file(args.data)
        records, plans = [], []
        with tempfile.TemporaryDirectory(prefix="planned-") as tmp:
            tmp_path = Path(tmp)
            for cluster in clusters:
                common = common_args(cluster, args)
                for config in configs:
                    start = time.perf_counter()
                    base = common
                    if config == PLANNED:
                        plan_file, plan = make_plan(cluster, args, tmp_path)
                        plans.append({**plan, "emulation": cluster})
                        nranks, extra = plan["ranks"], ["--plan", str(plan_file)]
                        shown = plan["train_args"]
                        # the plan names its workers' slowdown
                        base = without_flag(common, "--slowdown")
                    elif config == SAME_WORKERS:
                        nranks = plan["workers"] + 1
                        extra = ["--mode", "async", "--servers", "1"]
                        base = without_flag(common, "--slowdown")
                        if plan["slowdown"]:
                            extra += ["--slowdown", plan["slowdown"]]
                        shown = extra
                    else:
                        nranks, extra = hand_written(config, cluster)
                        shown = extra
                    out = tmp_path / f"{cluster}-{config}.json".replace("+", "_")
                    got = train(nranks, [*base, *extra], args, out)
                    for rec in got:
                        rec.update(
                            {"cluster": cluster, "config": config, "train_args": shown}
                        )
                    records += got
                    ttt = [r["time_to_target_s"] for r in got]
                    print(
                        f"# {cluster:<12} {config:<14} time to target {ttt} "
                        f"({time.perf_counter() - start:.0f} s)",
                        flush=True,
                    )
    table = rows(records)
    text = markdown(table, args.target_accuracy)
    print(text)
    if args.json:
        Path(args.json).write_text(
            json.dumps({"plans": plans, "records": records, "rows": table}, indent=1)
        )
    if args.md:
        Path(args.md).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
