"""``hybridagg train --pipeline-groups`` against data-parallel groups, end to end.

Where ``bench/pipeline.py`` runs the pipeline pieces in a loop of its own,
this runs whole ``hybridagg train`` jobs (the launcher, the loader, the
servers, validation) and reads their summaries and ``--metrics``::

    python bench/pipelined_train.py --json pipelined-train.json

Setting ``pair``: one group of two ranks, rank 1 emulated four times slower
than rank 0 (``--slowdown 1:4``), and one parameter server, in hybrid mode.
Setting ``mixed``: that group beside a rank alone at full speed. The model
is ``--layers`` equal linear layers (``deep_mlp`` below), so that a cut can
fall near the analytic one. Configurations (``config``):

* ``dp``: the group data parallel (each rank a batch, all-reduced);
* ``dp-adaptive``: the same with ``--adaptive-batch`` (the batch moves to
  the fast rank; OmniLearn's rule);
* ``even``: the group pipelined, cut into stages of equal compute;
* ``auto``: the group pipelined, cut by the dynamic program over measured
  per-layer costs and the ranks' speeds.

Per configuration: samples per second (the summary's) and group 0's batch
time (the median period between its steps, from the metrics); the JSON
also holds the final accuracy (a throughput bench: 60 steps of a deep
plain MLP do not train it far). Per setting: the cut of ``auto`` against
``even``, against the analytic steady-state cut of this model's even split
(two stages at speeds 1 and 1/4, layers infinitely divisible), the best cut
of whole units and the textbook 60% (an even split in halves).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from torch import nn

__all__ = ["deep_mlp", "main"]

HERE = Path(__file__).resolve().parent
LAYERS = int(os.environ.get("PIPELINED_BENCH_LAYERS", "12"))


def deep_mlp(sample_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """``LAYERS`` linear layers of equal size (the bench's model)."""
    n = 1
    for d in sample_shape:
        n *= d
    width = 64
    layers: list[nn.Module] = [nn.Flatten(), nn.Linear(n, width), nn.ReLU()]
    for _ in range(LAYERS - 2):
        layers += [nn.Linear(width, width), nn.ReLU()]
    layers.append(nn.Linear(width, num_classes))
    return nn.Sequential(*layers)


def bounds_of(layers: int) -> dict:
    """The cuts of ``auto`` against ``even`` this model allows, by the same cost model.

    Units' costs are what ``hybridagg train`` measures (floating-point
    operations of each unit on one digits sample); the two stages' speeds
    are 1 and 1/4. Returns the analytic steady-state cut (layers infinitely
    divisible, free links: ``continuous_bottleneck``), the best cut of whole
    units (``best_partition``), both against this model's ``even`` split,
    and the textbook 60% (even split in halves).
    """
    from hybridagg.pipeline import (
        Link,
        best_partition,
        continuous_bottleneck,
        even_partition,
        layer_costs,
        model_layers,
        stage_times,
    )
    from hybridagg.train.pacing import module_costs
    from hybridagg.train.pipelined import pipeline_units

    global LAYERS
    LAYERS = layers
    model = deep_mlp((8, 8), 10)
    flops = layer_costs(model, module_costs(model, torch.zeros(1, 8, 8)))
    units = pipeline_units(model_layers(model))
    cost = [sum(flops[i] for i in unit) for unit in units]
    speeds, free = [1.0, 0.25], [0.0] * (len(cost) - 1)
    even = stage_times(even_partition(cost, 2), cost, speeds, free, Link()).bottleneck_s
    best = best_partition(cost, speeds, free, Link()).bottleneck_s
    analytic = continuous_bottleneck(sum(cost), speeds)
    return {
        "analytic_cut": 1 - analytic / even,
        "best_unit_cut": 1 - best / even,
        "textbook_cut": 0.6,
    }


CONFIGS = {
    "dp": [],
    "dp-adaptive": ["--adaptive-batch"],
    "even": ["--pipeline-groups", "0", "--pipeline-partition", "even"],
    "auto": ["--pipeline-groups", "0", "--pipeline-partition", "auto"],
}
SETTINGS = {
    "pair": {"ranks": 2, "groups": "0-1"},  # workers (the server is one more)
    "mixed": {"ranks": 3, "groups": "0-1,2"},
}


def _period(metrics: Path, warmup: int) -> float:
    """Group 0's median seconds between steps, after ``warmup`` steps."""
    times: dict[int, list[float]] = {}
    for line in metrics.read_text().splitlines():
        r = json.loads(line)
        if r.get("event") == "step" and r["group"] == 0 and r.get("batch"):
            times.setdefault(r["rank"], []).append(r["t"])
    first = min(times)  # the group's leader (stage 0)
    t = sorted(times[first])[warmup:]
    return statistics.median(b - a for a, b in itertools.pairwise(t))


def run(setting: str, config: str, args, work: Path) -> dict:
    from hybridagg.runtime import runner

    spec = SETTINGS[setting]
    out, metrics = work / f"{setting}-{config}.json", work / f"{setting}-{config}.jsonl"
    train = [
        sys.executable, "-m", "hybridagg.cli", "train", "--data", str(args.data),
        "--mode", "hybrid", "--groups", spec["groups"], "--servers", "1",
        "--model", "pipelined_train:deep_mlp", "--slowdown", "1:4",
        "--sample-ms", str(args.sample_ms), "--batch-size", str(args.batch),
        "--micro-batches", str(args.micro_batches), "--steps", str(args.steps),
        "--eval-every", str(10 * args.steps), "--lr", "0.05", "--no-progress",
        "--summary", str(out), "--metrics", str(metrics), *CONFIGS[config],
    ]  # fmt: skip
    env = runner.mpiexec_env()
    env["PYTHONPATH"] = f"{HERE}{os.pathsep}{env.get('PYTHONPATH', '')}"
    env["PIPELINED_BENCH_LAYERS"] = str(args.layers)
    argv = runner.mpiexec_argv(spec["ranks"] + 1, train)
    result = runner.run_job(argv, timeout=args.timeout, env=env)
    if result.returncode != 0:
        raise RuntimeError(result.stdout[-2000:] + result.stderr[-2000:])
    s = json.loads(out.read_text())
    record = {
        "setting": setting,
        "config": config,
        "batch_time_s": _period(metrics, args.warmup),
        "samples_per_sec": s["samples_per_sec"],
        "final_accuracy": s["final_accuracy"],
        "bounds": (s.get("pipeline") or {}).get("bounds"),
    }
    if args.profile is not None:
        record.update(
            predict(train, spec["ranks"] + 1, args, work / f"{setting}-{config}")
        )
    return record


def predict(train: list[str], ranks: int, args, stem: Path) -> dict:
    """``hybridagg simulate`` of the same job (the same flags, ``--profile``):
    the predicted samples/s, group 0's seconds per update and its cut."""
    from hybridagg.runtime import runner

    flags = train[train.index("train") + 1 :]
    for drop in ("--summary", "--metrics"):
        i = flags.index(drop)
        del flags[i : i + 2]
    flags.remove("--no-progress")
    out = stem.with_suffix(".sim.json")
    cmd = [
        sys.executable, "-m", "hybridagg.cli", "simulate", *flags,
        "--profile", str(args.profile), "--ranks", str(ranks), "--json", str(out),
    ]  # fmt: skip
    env = runner.mpiexec_env()
    env["PYTHONPATH"] = f"{HERE}{os.pathsep}{env.get('PYTHONPATH', '')}"
    env["PIPELINED_BENCH_LAYERS"] = str(args.layers)
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(done.stdout[-2000:] + done.stderr[-2000:])
    p = json.loads(out.read_text())
    return {
        "predicted_samples_per_sec": p["samples_per_sec"],
        "predicted_batch_time_s": p["group_update_s"][0],
        "predicted_bounds": p.get("pipeline_bounds"),
    }


def markdown(records: list[dict], layers: int) -> str:
    lines = []
    for setting in dict.fromkeys(r["setting"] for r in records):
        rows = {r["config"]: r for r in records if r["setting"] == setting}
        predicted = all("predicted_samples_per_sec" in r for r in rows.values())
        lines += [
            f"**{setting}**",
            "",
            "| config | group 0 batch time (ms) | samples/s | cut |"
            + (" simulated samples/s | simulated / measured | simulated cut |"
               if predicted else ""),
            "|---|---:|---:|---|" + ("---:|---:|---|" if predicted else ""),
        ]  # fmt: skip
        for r in rows.values():
            cut = r["bounds"][0] if r["bounds"] else "-"
            row = (
                f"| {r['config']} | {1000 * r['batch_time_s']:.1f} | "
                f"{r['samples_per_sec']:.0f} | {cut} |"
            )
            if predicted:
                sim = r["predicted_samples_per_sec"]
                row += (
                    f" {sim:.0f} | {sim / r['samples_per_sec']:.2f} | "
                    f"{(r.get('predicted_bounds') or ['-'])[0]} |"
                )
            lines.append(row)
        if "auto" in rows and "even" in rows:
            cut = 1 - rows["auto"]["batch_time_s"] / rows["even"]["batch_time_s"]
            b = bounds_of(layers)
            lines += [
                "",
                f"auto cuts group 0's batch time {100 * cut:.1f}% against even: "
                f"{cut / b['analytic_cut']:.2f} of the analytic cut for this "
                f"model's even split ({100 * b['analytic_cut']:.1f}%), "
                f"{cut / b['best_unit_cut']:.2f} of the best cut of whole units "
                f"({100 * b['best_unit_cut']:.1f}%), {cut / 0.6:.2f} of the "
                "textbook 60%.",
            ]
            if "dp-adaptive" in rows:
                gain = (
                    rows["auto"]["samples_per_sec"]
                    / rows["dp-adaptive"]["samples_per_sec"]
                )
                lines.append(f"auto / dp-adaptive samples/s: {gain:.2f}.")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--data", type=Path, default=None, help="digits HDF5 (made if absent)"
    )
    p.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=SETTINGS)
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    p.add_argument("--layers", type=int, default=LAYERS)
    p.add_argument("--sample-ms", type=float, default=4.0)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--micro-batches", type=int, default=8)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--md", type=Path, default=None)
    p.add_argument(
        "--profile",
        type=Path,
        default=None,
        help="a profile of the bench's model (hybridagg profile --model "
        "pipelined_train:deep_mlp): each job is also simulated, and the table "
        "shows the prediction beside the measurement",
    )
    p.add_argument(
        "--from-json", type=Path, default=None, help="print a saved run again"
    )
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    if args.from_json:
        print(markdown(json.loads(args.from_json.read_text()), args.layers))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if args.data is None:
            from hybridagg.data import convert_digits

            args.data = work / "digits.h5"
            convert_digits(args.data, val_fraction=0.2, seed=0, progress=False)
        records = []
        for setting in args.settings:
            for config in args.configs:
                records.append(run(setting, config, args, work))
                r = records[-1]
                print(
                    f"{setting:6s} {config:12s} batch {1000 * r['batch_time_s']:7.1f} ms "
                    f"{r['samples_per_sec']:7.0f} samples/s",
                    flush=True,
                )
    table = markdown(records, args.layers)
    print(table)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(records, indent=1) + "\n")
    if args.md:
        args.md.write_text(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
