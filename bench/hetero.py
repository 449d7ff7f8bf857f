"""The headline experiment: time to accuracy on a heterogeneous 4-worker job.

One command runs every cell (it starts the MPI jobs itself)::

    python bench/hetero.py --json hetero.json --md hetero.md --png hetero.png

Like OmniLearn's set-ups, two of four workers are 1x, 2x, 4x and 8x slower
than the other two (``--slowdown 0-1:1,2-3:F``, emulated by sleeping with
``--sample-ms``), plus a level whose heterogeneity changes mid-run (the slow
pair turns fast and the fast pair slow after ``--change-at`` seconds). Every
level is trained by every mode on the same data, model, seeds and emulation:

* ``sync``: hybridagg, one all-reduce over the 4 workers per step;
* ``hybrid``: groups {0,1} and {2,3} plus 1 parameter server (5 ranks);
* ``async``: every worker its own group plus 1 server (5 ranks);
* ``ddp``: PyTorch DistributedDataParallel with gloo (``bench/ddp_train.py``),
  the outside baseline: hybridagg's ``sync`` should match it;
* ``horovod``: the same script with ``horovod.torch.DistributedOptimizer``
  (``make horovod``); added to the default modes when Horovod is importable;
  with ``--cluster`` it runs without Open MPI's ``han`` collectives
  (``OMPI_MCA_coll=^han`` unless ``OMPI_MCA_coll`` is set): across hosts
  ``han``'s all-reduce polls without sleeping while Horovod's main thread
  spins on its handle, and on this machine's shared cores that starved the
  links' TCP work (10 against 85 samples/s, bench/RESULTS.md);
* ``*+adaptive``: the same with adaptive batch sizes (``--adaptive-batch``);
* ``fast-pair``: a reference, not a way to run the 4-worker job: ``sync``
  over workers 0-1 alone (2 ranks, never slowed), the slow pair left out.
  It shows what the job gets from the fast workers alone; a mode that beats
  it does so with the slow pair's samples, at most ``2 x 1000 / (MS x F)``
  samples/s, a share ``1 / (F + 1)`` of the ideal. Its efficiency is against
  its own ideal (the pair's). It is the same job at every level (run again
  at each, which shows its spread between runs) and is not run at the
  ``change`` level, whose fast pair changes.

``--workers 8`` runs the same shapes on 8 workers: the slow half is ranks
4-7, hybrid's groups are {0-3} and {4-7} (2 groups of 4), async has 8
groups, and ``fast-pair`` is the fast half.

``--model NAME`` trains another zoo model (e.g. ``resnet50-twin``: ResNet-50's
gradients at a fraction of its compute) in every mode, DDP and Horovod
included. ``--cluster FILE`` runs every job on an emulated cluster brought
up with ``hybridagg cluster up FILE`` (``hybridagg-run --cluster``): ranks
fill its hosts in order, so with ``examples/cluster.toml`` the hybrid
groups {0,1} and {2,3} are its hosts a and b and the server is on ps.

Each (mode, level) is one MPI job that trains ``--seeds`` runs in a row (the
start-up of an MPI job with torch costs seconds). Reported per cell: median
and range over seeds of the time to ``--target-accuracy`` (training time,
validation excluded), samples/s (the true sum over workers), the cores'
bound (``hybridagg train``'s ``cores_bound_samples_per_sec``: samples over
every rank's CPU seconds per core of the machine; emulated compute sleeps,
so this is what the real work alone allows; "-" for DDP and Horovod), the
link bound (with ``--cluster``, modes with servers: the servers' host's
link rate over the model's bytes, times the samples an update carries; an
update moves the model in and out of that link once each way), the
servers' bound (with ``--ps-capacity FILE``, a ``bench/ps.py --json`` file
whose capacity jobs pushed a model of this size: the servers' updates/s
with as many leaders as the mode has groups, times the samples an update
carries), efficiency against the ideal throughput (``sum 1000 / (MS x
factor)``), the fraction of the mode's own bound (the least of the ideal
and the bounds above) and final accuracy; ``--json`` has one record per (mode, level, seed) with the
summary keys of ``hybridagg train``. When a mode and its adaptive variant both run
(e.g. ``async`` and ``async+adaptive``), a second table compares their
accuracy at equal training time (OmniLearn's comparison): per seed, each
run's last validation by the shorter run's end (``accuracy_curve``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shlex
import statistics
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve()
MODES = {
    "sync": (4, ["--mode", "sync"]),
    "hybrid": (5, ["--mode", "hybrid", "--groups", "0-1,2-3", "--servers", "1"]),
    "async": (5, ["--mode", "async", "--servers", "1"]),
    "ddp": (4, []),
    "horovod": (4, []),
    "sync+adaptive": (4, ["--mode", "sync", "--adaptive-batch"]),
    "hybrid+adaptive": (
        5,
        [
            "--mode",
            "hybrid",
            "--groups",
            "0-1,2-3",
            "--servers",
            "1",
            "--adaptive-batch",
        ],
    ),
    "async+adaptive": (5, ["--mode", "async", "--servers", "1", "--adaptive-batch"]),
    "fast-pair": (2, ["--mode", "sync"]),
}


def halves(workers: int) -> tuple[str, str]:
    """The fast and the slow half of ``workers`` as rank ranges (``0-1``, ``2-3``)."""
    if workers < 2 or workers % 2:
        raise SystemExit(f"--workers must be even and >= 2, got {workers}")
    h = workers // 2
    fast = "0" if h == 1 else f"0-{h - 1}"
    slow = f"{h}" if h == 1 else f"{h}-{workers - 1}"
    return fast, slow


def layout(mode: str, workers: int = 4) -> tuple[int, list[str]]:
    """(ranks, mode options) of a mode on ``workers`` workers.

    Four workers is :data:`MODES`; otherwise the same shapes: hybrid's groups
    are the fast and the slow half, ``fast-pair`` is the fast half.
    """
    nranks, extra = MODES[mode]
    if workers == 4:
        return nranks, list(extra)
    extra = list(extra)
    if "--groups" in extra:
        extra[extra.index("--groups") + 1] = ",".join(halves(workers))
    if mode == "fast-pair":
        return workers // 2, extra
    return workers + (nranks - 4), extra


def level_spec(level: str, change_at: float, workers: int = 4) -> str:
    """The ``--slowdown`` of a level: ``4`` (the slow half four times slower) or ``change``."""
    fast, slow = halves(workers)
    if level == "change":
        return f"{fast}:1,{slow}:4@0;{fast}:4,{slow}:1@{change_at:g}"
    factor = float(level)
    return f"{fast}:1,{slow}:{factor:g}"


# ------------------------------------------------------------ inside the MPI job
def inner(args: argparse.Namespace) -> int:
    from mpi4py import MPI

    from hybridagg.cli import build_parser
    from hybridagg.train import train
    from hybridagg.train.flags import config_from_args

    out = []
    for seed in [int(s) for s in args.seeds.split(",")]:
        argv = ["train", *args.train_args, "--seed", str(seed)]
        cfg = config_from_args(build_parser().parse_args(argv))
        summary = train(cfg)
        if summary is not None:
            out.append(summary)
    if MPI.COMM_WORLD.Get_rank() == 0:
        Path(args.out).write_text(json.dumps(out))
    return 0


# ------------------------------------------------------------ the driver
def run_cell(mode: str, level: str, args, tmp: Path) -> list[dict]:
    from hybridagg.runtime import runner

    workers = getattr(args, "workers", 4)
    nranks, extra = layout(mode, workers)
    slowdown = level_spec(level, args.change_at, workers)
    if mode == "fast-pair":
        if level == "change":
            return []
        slowdown = f"{halves(workers)[0]}:1"
    common = [
        "--data",
        args.data,
        "--epochs",
        str(args.epochs),
        "--lr",
        str(args.lr),
        "--batch-size",
        str(args.batch_size),
        "--slowdown",
        slowdown,
        "--sample-ms",
        str(args.sample_ms),
        "--target-accuracy",
        str(args.target_accuracy),
        "--eval-every",
        str(args.eval_every),
        "--model",
        args.model,
    ]
    out = tmp / f"{mode}-{level}.json".replace("+", "_")
    seeds = ",".join(str(s) for s in range(args.seeds))
    if mode in ("ddp", "horovod"):
        cmd = [
            sys.executable,
            str(HERE.parent / "ddp_train.py"),
            "--backend",
            mode,
            *common,
            "--seeds",
            seeds,
            "--summary",
            str(out),
        ]
    else:
        cmd = [
            sys.executable,
            str(HERE),
            "--inner",
            "--seeds",
            seeds,
            "--out",
            str(out),
            "--",
            *common,
            *extra,
            "--wire",
            args.wire,
            *shlex.split(args.train_extra),
            "--no-progress",
        ]
    if args.cluster:
        launch = [
            str(Path(sys.executable).parent / "hybridagg-run"),
            "--cluster",
            args.cluster,
            "-n",
            str(nranks),
            "--",
            *cmd,
        ]
    else:
        launch = runner.mpiexec_argv(nranks, cmd)
    env = runner.mpiexec_env()
    if mode == "horovod" and args.cluster:
        env.setdefault("OMPI_MCA_coll", "^han")
    result = runner.run_job(launch, timeout=args.timeout, env=env)
    if result.returncode != 0 or not out.exists():
        print(result.stdout[-3000:], result.stderr[-3000:], file=sys.stderr)
        raise SystemExit(f"hetero: {mode} at level {level} failed")
    records = json.loads(out.read_text())
    link = None
    if args.cluster and "--servers" in extra:
        from hybridagg.cluster import load

        spec = load(args.cluster)
        # (a compact wire sends 2 bytes an element each way instead of 4)
        per_element = 4 if args.wire == "fp32" else 2
        link = (
            spec.host_of_rank(nranks - 1).link.rate_bytes,
            model_bytes(args.model, args.data) * per_element // 4,
        )
    capacity = (
        json.loads(Path(args.ps_capacity).read_text()) if args.ps_capacity else []
    )
    groups, servers = mode_groups(mode, workers)
    size = model_bytes(args.model, args.data) if capacity and groups else 0
    for seed, rec in enumerate(records):
        rec.update({"mode": mode, "level": level, "seed": seed})
        if link is not None and link[0] is not None:
            rec["link_bound_samples_per_sec"] = link_bound(
                link[0], link[1], rec["samples"], rec["steps"]
            )
        if size:
            rec["servers_bound_samples_per_sec"] = servers_bound(
                capacity,
                size,
                groups,
                servers,
                rec["samples"],
                rec["steps"],
                args.wire,
            )
        bound = own_bound(rec)
        rate = rec.get("samples_per_sec")
        rec["of_own_bound"] = rate / bound if bound and rate else None
    return records


def mode_groups(mode: str, workers: int = 4) -> tuple[int, int]:
    """(groups, servers) of a mode with servers; (0, 0) for one without."""
    nranks, extra = layout(mode, workers)
    if "--servers" not in extra:
        return 0, 0
    servers = int(extra[extra.index("--servers") + 1])
    if "--groups" in extra:
        return len(extra[extra.index("--groups") + 1].split(",")), servers
    return nranks - servers, servers


def servers_bound(
    capacity: list[dict],
    param_bytes: int,
    groups: int,
    servers: int,
    samples: float,
    updates: int,
    wire: str = "fp32",
) -> float | None:
    """Samples/s the servers allow: their measured updates/s times samples per update.

    ``capacity`` holds ``bench/ps.py`` capacity records; the one used has
    ``groups`` leaders, ``servers`` servers, the fused kernel (the servers'
    default), the run's ``wire`` and a model within 25% of ``param_bytes`` (a
    capacity measured on another size or wire says nothing about this one):
    ``None`` when there is none, or no update.
    """
    if updates <= 0 or groups <= 0:
        return None
    fits = [
        r
        for r in capacity
        if r.get("leaders") == groups
        and r.get("servers") == servers
        and r.get("kernel", "loop") == "fused"
        and r.get("wire", "fp32") == wire
        and abs(r.get("capacity_bytes", 2**20) - param_bytes) <= 0.25 * param_bytes
    ]
    if not fits:
        return None
    best = min(fits, key=lambda r: abs(r["capacity_bytes"] - param_bytes))
    return best["updates_per_sec"] * samples / updates


def own_bound(rec: dict) -> float | None:
    """The least of a run's ideal and its bounds (``None``: nothing known)."""
    eff, rate = rec.get("efficiency"), rec.get("samples_per_sec")
    ideal = rate / eff if eff and rate else None
    got = [
        v
        for v in (
            ideal,
            rec.get("cores_bound_samples_per_sec"),
            rec.get("link_bound_samples_per_sec"),
            rec.get("servers_bound_samples_per_sec"),
        )
        if v
    ]
    return min(got) if got else None


def link_bound(
    rate_bytes: float, param_bytes: int, samples: float, updates: int
) -> float | None:
    """Samples/s the servers' link allows: every update pushes the model's
    gradient in and pulls its weights out over that one link (each way at
    ``rate_bytes`` B/s), carrying ``samples / updates`` samples."""
    if updates <= 0 or param_bytes <= 0:
        return None
    return rate_bytes / param_bytes * samples / updates


def model_bytes(model: str, data: str) -> int:
    """Bytes of the model's float32 parameters for the data's samples."""
    from hybridagg.data.loader import load_split_info
    from hybridagg.train.models import build_model

    info = load_split_info([data], "train")[0]
    net = build_model(model, info.sample_shape, info.num_classes)
    return sum(p.numel() * p.element_size() for p in net.parameters())


def _median_range(
    values: list[float | None],
) -> tuple[float | None, float | None, float | None]:
    got = [v for v in values if v is not None]
    if not got:
        return None, None, None
    return statistics.median(got), min(got), max(got)


def cells(records: list[dict]) -> list[dict]:
    """Median and range per (level, mode), and the cut against sync."""
    out = []
    levels = list(dict.fromkeys(r["level"] for r in records))
    modes = list(dict.fromkeys(r["mode"] for r in records))
    for level in levels:
        sync_t = None
        for mode in modes:
            rs = [r for r in records if r["level"] == level and r["mode"] == mode]
            if not rs:
                continue
            t = _median_range([r["time_to_target_s"] for r in rs])
            if mode == "sync":
                sync_t = t[0]
            reached = sum(r["time_to_target_s"] is not None for r in rs)
            out.append(
                {
                    "level": level,
                    "mode": mode,
                    "runs": len(rs),
                    "reached": reached,
                    "ttt": t,
                    "samples_per_sec": _median_range(
                        [r["samples_per_sec"] for r in rs]
                    ),
                    "efficiency": _median_range([r.get("efficiency") for r in rs]),
                    "cores_bound": _median_range(
                        [r.get("cores_bound_samples_per_sec") for r in rs]
                    ),
                    "link_bound": _median_range(
                        [r.get("link_bound_samples_per_sec") for r in rs]
                    ),
                    "servers_bound": _median_range(
                        [r.get("servers_bound_samples_per_sec") for r in rs]
                    ),
                    "of_own_bound": _median_range([r.get("of_own_bound") for r in rs]),
                    "final_accuracy": _median_range([r["final_accuracy"] for r in rs]),
                    "staleness": _median_range([r.get("mean_staleness") for r in rs]),
                }
            )
        for cell in out:
            if cell["level"] == level:
                med = cell["ttt"][0]
                cell["cut_vs_sync"] = (
                    1 - med / sync_t if (med is not None and sync_t) else None
                )
    return out


#: (mode, the same with adaptive batches): OmniLearn's comparison at equal time
ADAPTIVE_PAIRS = (
    ("async", "async+adaptive"),
    ("hybrid", "hybrid+adaptive"),
    ("sync", "sync+adaptive"),
)


def accuracy_at(curve: list, t: float) -> float | None:
    """The accuracy of the last validation at or before training second ``t``."""
    got = [a for s, a in curve if s <= t]
    return got[-1] if got else None


def equal_time(records: list[dict]) -> list[dict]:
    """Each adaptive pair's accuracy at equal training time, per level.

    Per seed, ``T`` is the shorter of the two runs' last validations, and
    each run's accuracy is its last one at or before ``T`` (OmniLearn
    compares final accuracy at equal training time). Medians over seeds.
    """
    out = []
    levels = list(dict.fromkeys(r["level"] for r in records))
    for base, adaptive in ADAPTIVE_PAIRS:
        for level in levels:
            pairs = []
            for r in records:
                if r["level"] != level or r["mode"] != base:
                    continue
                other = next(
                    (
                        o
                        for o in records
                        if o["level"] == level
                        and o["mode"] == adaptive
                        and o["seed"] == r["seed"]
                    ),
                    None,
                )
                a, b = r.get("accuracy_curve"), (other or {}).get("accuracy_curve")
                if not a or not b:
                    continue
                t = min(a[-1][0], b[-1][0])
                x, y = accuracy_at(a, t), accuracy_at(b, t)
                if x is not None and y is not None:
                    pairs.append((t, x, y))
            if pairs:
                out.append(
                    {
                        "level": level,
                        "modes": (base, adaptive),
                        "runs": len(pairs),
                        "t": statistics.median(p[0] for p in pairs),
                        "base": statistics.median(p[1] for p in pairs),
                        "adaptive": statistics.median(p[2] for p in pairs),
                        "gain_points": statistics.median(
                            100 * (p[2] - p[1]) for p in pairs
                        ),
                    }
                )
    return out


def equal_time_markdown(rows: list[dict]) -> str:
    """OmniLearn's comparison as a table ("" without pairs)."""
    if not rows:
        return ""
    lines = [
        "| level | modes | seeds | equal time (s) | accuracy | with adaptive "
        "batches | gain (points) |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        level = "changing" if r["level"] == "change" else f"{r['level']}x"
        lines.append(
            f"| {level} | {r['modes'][0]} vs {r['modes'][1]} | {r['runs']} | "
            f"{r['t']:.1f} | {r['base']:.3f} | {r['adaptive']:.3f} | "
            f"{r['gain_points']:+.1f} |"
        )
    return "\n".join(lines)


def markdown(rows: list[dict], target: float) -> str:
    def fmt(triple, spec):
        med, lo, hi = triple
        if med is None:
            return "-"
        return f"{format(med, spec)} [{format(lo, spec)}-{format(hi, spec)}]"

    head = (
        f"| level | mode | time to {target:g} (s), median [range] | cut vs sync | "
        "samples/s | cores' bound | link bound | servers' bound | efficiency | "
        "of own bound | final accuracy | staleness |\n"
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    )
    lines = [head]
    for c in rows:
        cut = "-" if c.get("cut_vs_sync") is None else f"{100 * c['cut_vs_sync']:.0f}%"
        reached = (
            ""
            if c["reached"] == c["runs"]
            else f" ({c['reached']}/{c['runs']} reached)"
        )
        level = "changing" if c["level"] == "change" else f"{c['level']}x"
        lines.append(
            f"| {level} | {c['mode']} | {fmt(c['ttt'], '.2f')}{reached} | {cut} | "
            f"{fmt(c['samples_per_sec'], '.0f')} | "
            f"{fmt(c.get('cores_bound', (None, None, None)), '.0f')} | "
            f"{fmt(c.get('link_bound', (None, None, None)), '.0f')} | "
            f"{fmt(c.get('servers_bound', (None, None, None)), '.0f')} | "
            f"{fmt(c['efficiency'], '.2f')} | "
            f"{fmt(c.get('of_own_bound', (None, None, None)), '.2f')} | "
            f"{fmt(c['final_accuracy'], '.3f')} | {fmt(c['staleness'], '.2f')} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict], path: str, target: float) -> None:
    from hybridagg.runtime.extras import require

    matplotlib = require("matplotlib", "bench/hetero.py --png")
    matplotlib.use("Agg")
    plt = require("matplotlib.pyplot", "bench/hetero.py --png")

    levels = list(dict.fromkeys(c["level"] for c in rows))
    modes = list(dict.fromkeys(c["mode"] for c in rows))
    labels = ["changing" if lv == "change" else f"{lv}x" for lv in levels]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for mode in modes:
        xs, ys, lo, hi, eff = [], [], [], [], []
        for i, level in enumerate(levels):
            cell = next(
                (c for c in rows if c["level"] == level and c["mode"] == mode), None
            )
            if cell is None or cell["ttt"][0] is None:
                continue
            med, a, b = cell["ttt"]
            xs.append(i)
            ys.append(med)
            lo.append(med - a)
            hi.append(b - med)
            eff.append(cell["efficiency"][0] or 0.0)
        style = "--" if "adaptive" in mode else "-"
        axes[0].errorbar(
            xs, ys, yerr=[lo, hi], marker="o", ls=style, capsize=3, label=mode
        )
        axes[1].plot(xs, eff, marker="o", ls=style, label=mode)
    for ax in axes:
        ax.set_xticks(range(len(levels)), labels)
        ax.set_xlabel("slowdown of workers 2-3")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel(f"time to {target:g} accuracy (s, median, range)")
    axes[1].set_ylabel("throughput / ideal")
    axes[1].set_ylim(0, 1.05)
    axes[0].legend(fontsize=8)
    fig.suptitle("hybridagg on 4 workers, 2 of them slower (digits, MLP)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("train_args", nargs="*", help=argparse.SUPPRESS)
    p.add_argument("--data", default="runs/digits.h5")
    p.add_argument("--levels", default="1,2,4,8,change")
    p.add_argument(
        "--modes", help="default: sync,hybrid,async,ddp (+horovod when importable)"
    )
    p.add_argument("--seeds", default="5", help="seeds per cell (inner: the list)")
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--model", default="mlp", help="a zoo name, in every mode")
    p.add_argument(
        "--workers",
        type=int,
        default=4,
        help="workers (even): the slow half is slowed; hybrid's groups are the halves",
    )
    p.add_argument(
        "--cluster", help="run every job on this emulated cluster (it must be up)"
    )
    p.add_argument(
        "--ps-capacity",
        help="a bench/ps.py --json file with capacity jobs at this model's size "
        "(the servers' bound)",
    )
    p.add_argument(
        "--wire",
        default="fp32",
        choices=("fp32", "bf16", "fp16"),
        help="the type gradients and weights travel in, in every hybridagg mode "
        "(train's --wire; DDP and Horovod stay fp32)",
    )
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--sample-ms", type=float, default=1.0)
    p.add_argument("--target-accuracy", type=float, default=0.9)
    p.add_argument("--eval-every", type=int, default=5)
    p.add_argument(
        "--change-at",
        type=float,
        default=3.0,
        help="seconds into training when the 'change' level swaps the slow pair",
    )
    p.add_argument(
        "--train-extra",
        default="",
        help="more 'hybridagg train' options for every hybridagg mode, "
        "e.g. '--damping sqrt'",
    )
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--json")
    p.add_argument("--md")
    p.add_argument("--png")
    args = p.parse_args(argv)
    if args.inner:
        return inner(args)
    args.seeds = int(args.seeds)
    halves(args.workers)  # refuses an odd count before any job starts
    if args.png:  # a missing matplotlib is said now, not after the runs
        from hybridagg.runtime.extras import require

        require("matplotlib", "bench/hetero.py --png")
    has_horovod = importlib.util.find_spec("horovod") is not None
    if args.modes is None:
        args.modes = "sync,hybrid,async,ddp" + (",horovod" if has_horovod else "")
    modes = [m for m in args.modes.split(",") if m]
    unknown = set(modes) - set(MODES)
    if unknown:
        raise SystemExit(
            f"unknown --modes {sorted(unknown)}; choose from {list(MODES)}"
        )
    if "horovod" in modes and not has_horovod:
        raise SystemExit("--modes horovod: Horovod is not importable (make horovod)")
    from hybridagg.data import digits_file

    digits_file(args.data)
    records: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for level in args.levels.split(","):
            for mode in modes:
                got = run_cell(mode, level, args, Path(tmp))
                records += got
                ttt = [r["time_to_target_s"] for r in got]
                print(f"# level {level:>6} {mode:<16} time to target {ttt}", flush=True)
    rows = cells(records)
    table = markdown(rows, args.target_accuracy)
    same_time = equal_time_markdown(equal_time(records))
    if same_time:
        table += "\n\nAt equal training time (OmniLearn's comparison):\n\n" + same_time
    print(table)
    if args.json:
        Path(args.json).write_text(json.dumps(records, indent=1))
    if args.md:
        Path(args.md).write_text(table + "\n")
    if args.png:
        plot(rows, args.png, args.target_accuracy)
    return 0


if __name__ == "__main__":
    sys.exit(main())
