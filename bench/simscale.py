"""Predictions at scale: the two-generation cluster at 64, 256 and 1,024 ranks (issue 21).

::

    python bench/simscale.py --json simscale.json --md simscale.md --png simscale.png

For ``examples/clusters/two-generation-1024.yaml`` (nodes of 8 fast and
nodes of 8 slow GPUs, 100 Gb/s inside a node, 25 Gb/s between nodes) cut
to ``--ranks`` workers (64, 256, 1,024: half on fast nodes, half on slow
ones, ``hybridagg simulate --ranks``), every mode is simulated with SimGrid:

* ``sync``: one all-reduce over every worker per step;
* ``hybrid-node``: groups by node (8 GPUs each), parameter servers;
* ``hybrid-speed``: two groups by speed (``--groups speed:2``), servers;
* ``async``: every worker alone with the servers;
* ``sync+adaptive``: sync with batches in proportion to speed.

Servers (``--servers``): ``max`` (default) puts one on every slow node of
the cut (the cluster's placement allows one per slow node), or a number.
Every worker trains ``--steps-per-worker`` steps' worth of samples
(``--epochs 1 --samples W x batch x steps``), so every mode covers the same
work. The profile is ``--profile FILE`` or bench/planner.py's synthetic
ResNet-50-sized one (100 MB of gradient, 3 ms per sample on a speed-1
device, a server's update 4 ms + 0.2 ns/B). Reported per (ranks, mode):
predicted samples/s, the ideal sum of rates (every worker's compute-only
rate), their ratio, the rate over the second half of the updates (without
the first rounds, where with many leaders every one pushes at once; its
tail of the epoch kept), and the simulation's wall time (the issue's bound: at
most 60 s at 1,024 ranks). ``--png`` plots samples/s against ranks, the
ideal beside them.
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

from planner import SYNTHETIC  # noqa: E402  (the default profile)

CLUSTER = ROOT / "examples" / "clusters" / "two-generation-1024.yaml"

#: name -> (simulate options, uses servers)
MODES = {
    "sync": (["--mode", "sync"], False),
    "hybrid-node": (["--mode", "hybrid", "--groups", "node"], True),
    "hybrid-speed": (["--mode", "hybrid", "--groups", "speed:2"], True),
    "async": (["--mode", "async"], True),
    "sync+adaptive": (["--mode", "sync", "--adaptive-batch"], False),
}


def servers_for(cluster, workers: int, servers: str) -> int:
    """The servers of a cut of ``workers``: one per allowed node (``max``), or
    the number given (checked against the placement)."""
    cut = cluster.scaled(workers)
    slots = sum(
        t.count * cut.servers.per_node
        for t in cut.node_types
        if t.name in cut.servers.node_types
    )
    if servers == "max":
        return slots
    try:
        n = int(servers)
    except ValueError:
        raise SystemExit(f"--servers: 'max' or a number, got {servers!r}") from None
    if not 1 <= n <= slots:
        raise SystemExit(f"--servers {n}: {workers} workers' cut has {slots} slots")
    return n


def simulate_argv(
    mode: str, workers: int, servers: int, profile: str, args
) -> list[str]:
    """``hybridagg simulate``'s options for one (ranks, mode)."""
    extra, with_servers = MODES[mode]
    argv = ["simulate", "--profile", profile, "--cluster", str(args.cluster), *extra]
    ranks = workers + (servers if with_servers else 0)
    if with_servers:
        argv += ["--servers", str(servers)]
    argv += ["--ranks", str(ranks), "--batch-size", str(args.batch_size)]
    samples = workers * args.batch_size * args.steps_per_worker
    argv += ["--epochs", "1", "--samples", str(samples)]
    argv += ["--sim-timeout", str(args.timeout), *shlex.split(args.extra)]
    return argv


def predict(argv: list[str], timeout: float) -> dict:
    """Run ``hybridagg simulate`` (a child process): its ``--json`` and the
    wall time of the whole command (start-up included).

    A simulation that fails on its own (past ``--sim-timeout``, or the
    engine's error) gives a record with ``error`` and no figures, so the
    other (ranks, mode) pairs still run; bad options stop everything.
    """
    with tempfile.TemporaryDirectory(prefix="simscale-") as tmp:
        out = Path(tmp) / "p.json"
        cmd = [sys.executable, "-m", "hybridagg.cli", *argv, "--json", str(out)]
        start = time.perf_counter()
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        wall = time.perf_counter() - start
        if done.returncode == 2:
            raise SystemExit(
                f"simscale: hybridagg {shlex.join(argv)}: {done.stderr[-2000:]}"
            )
        if done.returncode != 0 or not out.exists():
            rec = {
                "error": done.stderr.strip()[-500:] or f"exit {done.returncode}",
                "samples_per_sec": None,
                "ideal_samples_per_sec": None,
                "wall_s": wall,
            }
        else:
            rec = json.loads(out.read_text())
    rec["command_wall_s"] = wall
    return rec


def row(rec: dict) -> dict:
    """A record's figures for the table (``of_ideal``: samples/s over the
    ideal; ``None`` where the simulation failed)."""
    rate, ideal = rec["samples_per_sec"], rec["ideal_samples_per_sec"]
    return {
        "ranks": rec["workers_asked"],
        "mode": rec["mode_name"],
        "servers": rec.get("servers", rec.get("servers_asked")),
        "samples_per_sec": rate,
        "ideal_samples_per_sec": ideal,
        "of_ideal": rate / ideal if (rate is not None and ideal) else None,
        "steady_samples_per_sec": rec.get("steady_samples_per_sec"),
        "wall_s": rec["wall_s"],
        "error": rec.get("error"),
    }


def markdown(records: list[dict]) -> str:
    """The predictions as a table, ranks by ranks."""
    lines = [
        "| ranks | mode | servers | samples/s | ideal | of ideal "
        "| second half (of ideal) | simulation (s) |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for rec in records:
        r = row(rec)
        if r["error"] is not None:
            lines.append(
                f"| {r['ranks']:,} | {r['mode']} | {r['servers']} | failed after "
                f"{r['wall_s']:.0f} s: {r['error'].splitlines()[-1]} | | | | |"
            )
            continue
        frac = "-" if r["of_ideal"] is None else f"{r['of_ideal']:.3f}"
        steady, ideal = r["steady_samples_per_sec"], r["ideal_samples_per_sec"]
        half = (
            "-"
            if steady is None or not ideal
            else f"{steady:,.0f} ({steady / ideal:.3f})"
        )
        lines.append(
            f"| {r['ranks']:,} | {r['mode']} | {r['servers']} | "
            f"{r['samples_per_sec']:,.0f} | {ideal:,.0f} | "
            f"{frac} | {half} | {r['wall_s']:.1f} |"
        )
    return "\n".join(lines)


def plot(records: list[dict], path: str, title: str) -> None:
    """Samples/s against ranks per mode, the ideal beside them (log-log)."""
    from hybridagg.runtime.extras import require

    matplotlib = require("matplotlib", "bench/simscale.py --png")
    matplotlib.use("Agg")
    plt = require("matplotlib.pyplot", "bench/simscale.py --png")

    rows = [row(r) for r in records if r.get("error") is None]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for mode in dict.fromkeys(r["mode"] for r in rows):
        mine = sorted((r for r in rows if r["mode"] == mode), key=lambda r: r["ranks"])
        ax.plot(
            [r["ranks"] for r in mine],
            [r["samples_per_sec"] for r in mine],
            marker="o",
            ls="--" if "adaptive" in mode else "-",
            label=mode,
        )
    ideal: dict[int, float] = {}
    for r in rows:  # every mode has the same workers, so the same ideal
        ideal.setdefault(r["ranks"], r["ideal_samples_per_sec"])
    xs = sorted(ideal)
    ax.plot(xs, [ideal[x] for x in xs], color="black", ls=":", marker="x",
            label="ideal (sum of rates)")  # fmt: skip
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(xs, [f"{x:,}" for x in xs])
    ax.set_xlabel("workers (half fast, half slow)")
    ax.set_ylabel("predicted samples/s (SimGrid)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", default="64,256,1024", help="workers of each cut")
    p.add_argument("--modes", default=",".join(MODES), help=f"from {list(MODES)}")
    p.add_argument("--servers", default="max", help="'max' (one per slow node) or N")
    p.add_argument("--cluster", default=str(CLUSTER), help="the cluster file")
    p.add_argument("--profile", help="a profile file (default: bench/planner.py's)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--steps-per-worker", type=int, default=10)
    p.add_argument("--extra", default="", help="more simulate flags, e.g. '--overlap'")
    p.add_argument("--timeout", type=float, default=600, help="per simulation (s)")
    p.add_argument("--json")
    p.add_argument("--md")
    p.add_argument("--png")
    args = p.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    bad = set(modes) - set(MODES)
    if bad:
        raise SystemExit(f"unknown --modes {sorted(bad)}; choose from {list(MODES)}")
    try:
        counts = [int(r) for r in args.ranks.split(",") if r]
    except ValueError:
        raise SystemExit(f"--ranks: numbers, got {args.ranks!r}") from None
    if args.png:  # a missing matplotlib is said now, not after the runs
        from hybridagg.runtime.extras import require

        require("matplotlib", "bench/simscale.py --png")
    from hybridagg.sim import load_cluster
    from hybridagg.sim.profile import save_profile

    cluster = load_cluster(args.cluster)
    records = []
    with tempfile.TemporaryDirectory(prefix="simscale-") as tmp:
        profile = args.profile
        if profile is None:
            profile = str(save_profile(SYNTHETIC, Path(tmp) / "synthetic.json"))
        for workers in counts:
            servers = servers_for(cluster, workers, args.servers)
            for mode in modes:
                cmd = simulate_argv(mode, workers, servers, profile, args)
                rec = predict(cmd, args.timeout + 60)
                rec.update({"workers_asked": workers, "mode_name": mode, "argv": cmd})
                rec.setdefault("servers_asked", servers if MODES[mode][1] else 0)
                records.append(rec)
                r = row(rec)
                if r["error"] is not None:
                    print(f"# {workers:>5} {mode:<14} failed: {r['error']}", flush=True)
                    continue
                print(
                    f"# {workers:>5} {mode:<14} {r['samples_per_sec']:>12,.0f} "
                    f"samples/s, ideal {r['ideal_samples_per_sec']:,.0f}, "
                    f"simulated in {r['wall_s']:.1f} s",
                    flush=True,
                )
    table = markdown(records)
    print(table)
    if args.json:
        Path(args.json).write_text(json.dumps(records, indent=1))
    if args.md:
        Path(args.md).write_text(table + "\n")
    if args.png:
        name = Path(args.profile).name if args.profile else "synthetic 100 MB model"
        plot(records, args.png, f"{cluster.name}, {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
