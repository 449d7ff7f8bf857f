"""The simulator against real runs: a validation table from one sitting (issue 21).

One command calibrates, trains and simulates (it starts the MPI jobs itself)::

    python bench/simcheck.py --json simcheck.json --md simcheck.md
    python bench/simcheck.py --cluster bench/clusters/four-workers-10g.toml \\
        --json simcheck-10g.json          # the emulated cluster (it must be up)
    python bench/simcheck.py --from-json simcheck.json simcheck-10g.json
    python bench/simcheck.py --from-json simcheck.json --repredict --json again.json
    python bench/simcheck.py --from-json simcheck.json --repredict --recalibrate --json again.json

Cells (``--cells``): the digits headline (``mlp``, 6 epochs, ``--sample-ms
1``) at ``1x``, ``4x``, ``8x`` and ``change`` (bench/hetero.py's levels: two
of four workers that many times slower, or swapping after ``--change-at``
seconds), and ``twin-4x``, the ResNet-50 twin (3 epochs, ``--sample-ms 2``, as
the communication issue's goal table ran it)
at 4x. Modes (``--modes``): sync, hybrid and async as bench/hetero.py runs
them (its ``*+adaptive`` variants too); ``--seeds`` seeds each.

In order, all in the same sitting:

1. **Calibration, on microbenchmarks only**: per model, ``hybridagg
   profile`` under ``mpiexec -n 4`` (compute, memory, the all-reduce over 4
   ranks, a server's update), ``bench/allreduce.py`` over 4 ranks (sizes up
   to the model's gradient) and ``bench/ps.py`` (push+pull latency to one
   server, and the server's capacity with 2 and 4 leaders at the model's
   size); with ``--cluster``, ``bench/allreduce.py`` over 4 ranks across
   the emulated cluster too (its links between nodes: their latency and
   the core's bandwidth, :func:`hybridagg.sim.calibrate.fit_network`);
   :func:`calibrate` fits the profile's all-reduce, server and network
   parameters from their ``--json`` outputs. The training cells are never
   used to fit anything.
2. **Real runs**: every (cell, mode) with bench/hetero.py's machinery
   (:func:`hetero.run_cell`), on shared memory or, with ``--cluster``, on
   the emulated cluster (``hybridagg-run --cluster``).
3. **Predictions**: ``hybridagg simulate`` with the cell's options (mode,
   groups, servers, batch, slowdown, sample-ms, epochs, model, data) and the
   calibrated profile; on shared memory ``--ranks N`` (this machine as
   profiled), with ``--cluster`` its simulator twin (``--sim-cluster``,
   default from :data:`SIM_CLUSTERS`, checked against the emulated one).
4. **The table**: per cell and mode the real samples/s (median [range] over
   seeds), the prediction, the error, whether it is within 15%, and
   whether the simulator orders the mode against the others as the runs do
   wherever two modes' real ranges over seeds do not overlap.

``--json`` writes everything (calibration, records, predictions, rows);
``--from-json`` rebuilds the table from one or more such files without
running anything (run the cells in pieces, then join them).
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(ROOT))

import hetero  # noqa: E402

#: name -> (model, level, epochs, sample-ms): the issue's validation cells
CELLS = {
    "1x": ("mlp", "1", 6, 1.0),
    "4x": ("mlp", "4", 6, 1.0),
    "8x": ("mlp", "8", 6, 1.0),
    "change": ("mlp", "change", 6, 1.0),
    "twin-4x": ("resnet50-twin", "4", 3, 2.0),
}

#: an emulated cluster (bench/clusters) -> the cluster file that describes it
SIM_CLUSTERS = {
    "four-workers-10g.toml": ROOT / "examples" / "clusters" / "four-workers-10g.yaml",
}

TOLERANCE = 0.15
"""the issue's bound on a prediction's error"""

WORKERS = 4


# ------------------------------------------------------------ the arithmetic
def median_range(values: list[float]) -> tuple[float, float, float] | None:
    """(median, min, max) of ``values``; ``None`` when empty."""
    got = [v for v in values if v is not None]
    if not got:
        return None
    return statistics.median(got), min(got), max(got)


def error(predicted: float, real: float) -> float:
    """The prediction's relative error against the real median (+: too high)."""
    return predicted / real - 1


def within(err: float, tolerance: float = TOLERANCE) -> bool:
    """Whether an error is within the tolerance (either way)."""
    return abs(err) <= tolerance


def separated(a: tuple[float, float, float], b: tuple[float, float, float]) -> bool:
    """Whether two modes differ by more than their spread over seeds: their
    real ranges (min to max) do not overlap."""
    return a[2] < b[1] or b[2] < a[1]


def orderings(rows: list[dict]) -> list[dict]:
    """Per pair of modes of a cell whose real ranges do not overlap, whether
    the predictions order them the same way.

    ``rows`` are :func:`table_rows`'s; returns ``{"cell", "where", "faster",
    "slower", "agrees"}`` records, ``faster`` being the one faster for real.
    """
    out = []
    keys = list(dict.fromkeys((r["cell"], r["where"]) for r in rows))
    for cell, where in keys:
        mine = [
            r
            for r in rows
            if (r["cell"], r["where"]) == (cell, where)
            and r["real"] is not None
            and r["predicted"] is not None
        ]
        for i, a in enumerate(mine):
            for b in mine[i + 1 :]:
                if not separated(a["real"], b["real"]):
                    continue
                fast, slow = (a, b) if a["real"][0] > b["real"][0] else (b, a)
                out.append(
                    {
                        "cell": cell,
                        "where": where,
                        "faster": fast["mode"],
                        "slower": slow["mode"],
                        "agrees": fast["predicted"] > slow["predicted"],
                    }
                )
    return out


def table_rows(records: list[dict], predictions: list[dict]) -> list[dict]:
    """One row per (where, cell, mode): real samples/s over seeds, the
    prediction, its error, within the tolerance, and the mode's orderings."""
    keys = list(
        dict.fromkeys((r["where"], r["cell"], r["mode"]) for r in records + predictions)
    )
    rows = []
    for where, cell, mode in keys:
        real = median_range(
            [
                r.get("samples_per_sec")
                for r in records
                if (r["where"], r["cell"], r["mode"]) == (where, cell, mode)
            ]
        )
        seeds = sum(
            1
            for r in records
            if (r["where"], r["cell"], r["mode"]) == (where, cell, mode)
        )
        pred = next(
            (
                p
                for p in predictions
                if (p["where"], p["cell"], p["mode"]) == (where, cell, mode)
            ),
            None,
        )
        predicted = pred["samples_per_sec"] if pred else None
        err = error(predicted, real[0]) if (real and predicted is not None) else None
        rows.append(
            {
                "where": where,
                "cell": cell,
                "mode": mode,
                "seeds": seeds,
                "real": real,
                "predicted": predicted,
                "ideal": pred.get("ideal_samples_per_sec") if pred else None,
                "error": err,
                "within": within(err) if err is not None else None,
            }
        )
    pairs = orderings(rows)
    for row in rows:
        mine = [
            p
            for p in pairs
            if (p["cell"], p["where"]) == (row["cell"], row["where"])
            and row["mode"] in (p["faster"], p["slower"])
        ]
        row["ordering"] = (
            None
            if not mine
            else [
                {
                    "other": p["slower"] if p["faster"] == row["mode"] else p["faster"],
                    "agrees": p["agrees"],
                }
                for p in mine
            ]
        )
    return rows


def markdown(rows: list[dict]) -> str:
    """The validation table, then one line of totals."""

    def fmt(triple):
        if triple is None:
            return "-"
        med, lo, hi = triple
        return f"{med:.0f} [{lo:.0f}-{hi:.0f}]"

    lines = [
        "| where | cell | mode | seeds | real samples/s, median [range] | predicted "
        "| error | within 15% | ordering of modes |",
        "|---|---|---|---:|---:|---:|---:|---|---|",
    ]
    for r in rows:
        pred = "-" if r["predicted"] is None else f"{r['predicted']:.0f}"
        err = "-" if r["error"] is None else f"{100 * r['error']:+.1f}%"
        ok = "-" if r["within"] is None else ("yes" if r["within"] else "**no**")
        if r["ordering"] is None:
            order = "- (no mode apart)"
        else:
            order = ", ".join(
                f"{'agrees' if o['agrees'] else '**differs**'} vs {o['other']}"
                for o in r["ordering"]
            )
        lines.append(
            f"| {r['where']} | {r['cell']} | {r['mode']} | {r['seeds']} | "
            f"{fmt(r['real'])} | {pred} | {err} | {ok} | {order} |"
        )
    scored = [r for r in rows if r["within"] is not None]
    pairs = {
        (r["where"], r["cell"], *sorted((r["mode"], o["other"]))): o["agrees"]
        for r in rows
        for o in r["ordering"] or []
    }
    lines.append("")
    lines.append(
        f"{sum(r['within'] for r in scored)} of {len(scored)} predictions within "
        f"{100 * TOLERANCE:.0f}%; {sum(pairs.values())} of {len(pairs)} pairs of modes "
        "that differ by more than their spread over seeds ordered alike."
    )
    return "\n".join(lines)


# ------------------------------------------------------------ clusters
def check_cluster_match(emulated: str | Path, sim: str | Path, workers: int) -> None:
    """Refuse a simulator cluster file that does not describe the emulated one.

    The emulated cluster's hosts take ranks in order: the hosts holding the
    ``workers`` workers must be the simulator's worker nodes (as many, with
    as many devices each), and every host's link must have the simulator's
    node-to-switch bandwidth.

    Raises:
        SystemExit: naming what differs.
    """
    from hybridagg.cluster import load
    from hybridagg.sim import load_cluster

    real, model = load(emulated), load_cluster(sim)
    hosts, left = [], workers
    for h in real.hosts:
        if left <= 0:
            break
        hosts.append(min(h.ranks, left))
        left -= h.ranks
    nodes = [t.devices for t in model.node_types for _ in range(t.count) if t.devices]
    if hosts != nodes:
        raise SystemExit(
            f"{sim} does not describe {emulated}: workers per host {hosts} "
            f"(emulated) against devices per node {nodes}"
        )
    for h in real.hosts:
        rate = h.link.rate_bytes
        if rate is not None and abs(rate - model.inter_node.bandwidth) > 1e-6 * rate:
            raise SystemExit(
                f"{sim} does not describe {emulated}: host {h.name}'s link is "
                f"{rate:g} B/s, the simulator's {model.inter_node.bandwidth:g} B/s"
            )


# ------------------------------------------------------------ calibration
def calibrate(
    profile: Path,
    allreduce_json: Path,
    ps_json: Path,
    out: Path,
    network: tuple[Path, Path] | None = None,
) -> dict:
    """Fit the profile's all-reduce and server parameters on the
    microbenchmarks' ``--json`` outputs (:func:`hybridagg.sim.calibrate`)
    and write the calibrated profile to ``out``. ``network``: (the
    all-reduce's output across an emulated cluster, the simulator's file of
    that cluster), whose links between nodes are fitted on it."""
    from hybridagg.sim import calibrate as fit
    from hybridagg.sim import load_cluster, load_profile, save_profile

    across = {}
    if network is not None:
        across = {
            "network_json": str(network[0]),
            "network_cluster": load_cluster(network[1]),
        }
    calibrated = fit(
        load_profile(profile),
        allreduce_json=str(allreduce_json),
        ps_json=str(ps_json),
        **across,
    )
    save_profile(calibrated, out)
    how = "hybridagg.sim.calibrate on bench/allreduce.py and bench/ps.py"
    rec = {
        "profile": str(out),
        "raw_profile": str(profile),
        "how": how
        + (" (and bench/allreduce.py across the cluster)" if network else ""),
        "content": json.loads(out.read_text()),
    }
    if network is not None:
        rec.update({"network_json": str(network[0]), "sim_cluster": str(network[1])})
    return rec


def _job(
    nranks: int, cmd: list[str], timeout: float, what: str, cluster: str | None = None
) -> None:
    """Run ``cmd`` on ``nranks`` ranks here, or across the emulated
    ``cluster`` (up)."""
    from hybridagg.runtime import runner

    result = runner.run_job(
        runner.launch_argv(nranks, cmd, cluster=cluster),
        timeout=timeout,
        env=runner.mpiexec_env(),
    )
    if result.returncode != 0:
        print(result.stdout[-3000:], result.stderr[-3000:], file=sys.stderr)
        raise SystemExit(f"simcheck: {what} failed")


def _size_arg(nbytes: int) -> str:
    """The power of 4 (from 4 KiB) at or above ``nbytes``, as bytes."""
    size = 4096
    while size < nbytes:
        size *= 4
    return str(size)


NETWORK_MAX = 256 << 20
"""The largest all-reduce measured across an emulated cluster: its links'
rate shows at large sizes, whatever the model's."""


def measure_network(args, work: Path) -> Path:
    """``bench/allreduce.py`` over ``WORKERS`` ranks across the emulated
    cluster ``args.cluster`` (4 KiB to :data:`NETWORK_MAX`), once a sitting
    for every model (reused from ``work`` with ``--reuse``)."""
    across = work / "allreduce-across.json"
    if args.reuse and across.exists():
        print(f"# reusing {across}", flush=True)
        return across
    start = time.perf_counter()
    _job(
        WORKERS,
        [sys.executable, str(HERE.parent / "allreduce.py"), "--impls",
         "hybridagg-flat", "--max", str(NETWORK_MAX), "--reps",
         str(args.reps * 4), "--json", str(across)],
        args.timeout, "bench/allreduce.py across the cluster", cluster=args.cluster,
    )  # fmt: skip
    print(f"# {across.name}: {time.perf_counter() - start:.0f} s", flush=True)
    return across


def measure(
    model: str,
    args,
    work: Path,
    sim_cluster: str | None = None,
    across: Path | None = None,
) -> dict:
    """Profile ``model`` and run the microbenchmarks (reused from ``work``
    with ``--reuse``), then :func:`calibrate`; with ``across``
    (:func:`measure_network`'s output), the links between the nodes of
    ``sim_cluster`` are fitted on it too."""
    nbytes = hetero.model_bytes(model, args.data)
    prof = work / f"profile-{model}.json"
    ar = work / f"allreduce-{model}.json"
    ps = work / f"ps-{model}.json"
    hyb = str(Path(sys.executable).parent / "hybridagg")
    steps = [
        (
            prof,
            lambda: _job(
                WORKERS,
                [hyb, "profile", "--model", model, "--data", args.data,
                 "--batch-size", str(args.batch_size), "--reps", str(args.reps),
                 "--out", str(prof)],
                args.timeout, f"hybridagg profile --model {model}",
            ),
        ),
        (
            ar,
            lambda: _job(
                WORKERS,
                [sys.executable, str(HERE.parent / "allreduce.py"), "--impls",
                 args.allreduce_impls, "--max", _size_arg(nbytes), "--reps",
                 str(args.reps * 4), "--json", str(ar)],
                args.timeout, "bench/allreduce.py",
            ),
        ),
        (
            ps,
            lambda: _run_ps(nbytes, args, ps),
        ),
    ]  # fmt: skip
    for path, run in steps:
        if args.reuse and path.exists():
            print(f"# reusing {path}", flush=True)
            continue
        start = time.perf_counter()
        run()
        print(f"# {path.name}: {time.perf_counter() - start:.0f} s", flush=True)
    network = (across, Path(sim_cluster)) if across and sim_cluster else None
    rec = calibrate(prof, ar, ps, work / f"calibrated-{model}.json", network)
    rec.update({"model": model, "allreduce_json": str(ar), "ps_json": str(ps)})
    return rec


def _run_ps(nbytes: int, args, out: Path) -> None:
    import ps as psbench

    argv = ["--servers", "1", "--max", _size_arg(nbytes), "--reps", str(args.reps)]
    argv += [
        "--leaders",
        args.ps_leaders,
        "--nap-ms",
        "0",
        "--seconds",
        str(args.ps_seconds),
    ]
    argv += ["--capacity-bytes", str(nbytes), "--json", str(out)]
    if psbench.main(argv) != 0:
        raise SystemExit("simcheck: bench/ps.py failed")


# ------------------------------------------------------------ runs
def hetero_args(args, cell: str, ps_json: str | None = None) -> argparse.Namespace:
    """bench/hetero.py's options for a cell (what :func:`hetero.run_cell` reads)."""
    model, _level, epochs, sample_ms = CELLS[cell]
    return argparse.Namespace(
        data=args.data,
        epochs=args.epochs or epochs,
        lr=args.lr,
        batch_size=args.batch_size,
        sample_ms=args.sample_ms or sample_ms,
        target_accuracy=args.target_accuracy,
        eval_every=args.eval_every,
        change_at=args.change_at,
        train_extra=args.train_extra,
        timeout=args.timeout,
        seeds=args.seeds,
        model=model,
        cluster=args.cluster,
        ps_capacity=ps_json,  # the servers' bound beside each run
        wire="fp32",
        workers=WORKERS,
    )


def simulate_argv(
    cell: str, mode: str, h: argparse.Namespace, profile: str, sim_cluster: str | None
) -> list[str]:
    """``hybridagg simulate``'s options for a (cell, mode): the run's own."""
    _model, level, _epochs, _ms = CELLS[cell]
    nranks, extra = hetero.layout(mode, WORKERS)
    argv = ["simulate", "--profile", profile, *extra]
    argv += ["--slowdown", hetero.level_spec(level, h.change_at, WORKERS)]
    argv += ["--sample-ms", str(h.sample_ms), "--batch-size", str(h.batch_size)]
    argv += ["--epochs", str(h.epochs), "--data", h.data, "--model", h.model]
    argv += ["--lr", str(h.lr), "--wire", h.wire, *shlex.split(h.train_extra)]
    argv += ["--eval-every", str(h.eval_every)]  # rank 0's validations cost wall time
    if sim_cluster:
        argv += ["--cluster", str(sim_cluster)]
    else:
        argv += ["--ranks", str(nranks)]
    return argv


def predict(argv: list[str], timeout: float) -> dict:
    """Run ``hybridagg simulate`` (a child process) and read its ``--json``."""
    import subprocess

    with tempfile.TemporaryDirectory(prefix="simcheck-") as tmp:
        out = Path(tmp) / "p.json"
        cmd = [sys.executable, "-m", "hybridagg.cli", *argv, "--json", str(out)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0 or not out.exists():
            raise SystemExit(
                f"simcheck: hybridagg {shlex.join(argv)} failed: {done.stderr[-2000:]}"
            )
        return json.loads(out.read_text())


def recalibrate(calibration: list[dict]) -> list[dict]:
    """Each sitting's microbenchmarks fitted again by this calibration code
    (its raw profile, ``bench/allreduce.py`` and ``bench/ps.py`` outputs as
    they were measured); the calibrated profiles the predictions name are
    rewritten in place. Nothing is fitted to the runs."""
    out = []
    for rec in calibration:
        path = Path(rec["profile"])
        raw = rec.get("raw_profile") or str(
            path.with_name(f"profile-{rec['model']}.json")
        )
        inputs = [Path(raw), Path(rec["allreduce_json"]), Path(rec["ps_json"])]
        network = None
        if rec.get("network_json"):
            network = (Path(rec["network_json"]), Path(rec["sim_cluster"]))
        missing = [str(p) for p in [*inputs, *(network or ())] if not p.exists()]
        if missing:
            raise SystemExit(
                f"--recalibrate: {', '.join(missing)} no longer exist (run the "
                "sitting with --work DIR to keep its microbenchmarks)"
            )
        new = calibrate(*inputs, path, network)
        out.append({**rec, **new})
        print(f"# recalibrated {path}", flush=True)
    return out


def repredict(predictions: list[dict], timeout: float) -> list[dict]:
    """The same (cell, mode) predictions by this simulator: each one's own
    ``hybridagg simulate`` options again (its calibrated profile, fitted on
    the microbenchmarks of its sitting); nothing is fitted to the runs."""
    out = []
    for old in predictions:
        pred = predict(old["argv"], timeout)
        keep = {k: old[k] for k in ("cell", "where", "mode", "argv")}
        out.append({**pred, **keep, "previous": old["samples_per_sec"]})
        print(
            f"# {old['cell']:>8} {old['mode']:<14} predicted "
            f"{pred['samples_per_sec']:.1f} (was {old['samples_per_sec']:.1f})",
            flush=True,
        )
    return out


def run(args) -> dict:
    """Calibrate, train and simulate every asked (cell, mode)."""
    from hybridagg.data import digits_file

    digits_file(args.data)
    where = "shared memory" if not args.cluster else Path(args.cluster).stem
    sim_cluster = None
    if args.cluster:
        sim_cluster = args.sim_cluster or SIM_CLUSTERS.get(Path(args.cluster).name)
        if sim_cluster is None:
            raise SystemExit(
                f"no simulator cluster file known for {args.cluster}: give --sim-cluster"
            )
        check_cluster_match(args.cluster, sim_cluster, WORKERS)
    out: dict = {"calibration": [], "records": [], "predictions": []}
    with tempfile.TemporaryDirectory(prefix="simcheck-") as tmp:
        work = Path(args.work) if args.work else Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        models = list(dict.fromkeys(CELLS[c][0] for c in args.cells))
        profiles = {}
        across = measure_network(args, work) if args.cluster else None
        for model in models:
            rec = measure(model, args, work, sim_cluster, across)
            out["calibration"].append(rec)
            profiles[model] = rec["profile"]
            print(f"# {model}: {rec['how']}", flush=True)
        for cell in args.cells:
            model = CELLS[cell][0]
            cal = next(c for c in out["calibration"] if c["model"] == model)
            h = hetero_args(args, cell, cal["ps_json"])
            level = CELLS[cell][1]
            for mode in args.modes:
                start = time.perf_counter()
                got = hetero.run_cell(mode, level, h, work)
                for r in got:
                    r.update({"cell": cell, "where": where})
                out["records"] += got
                argv = simulate_argv(cell, mode, h, profiles[h.model], sim_cluster)
                pred = predict(argv, args.timeout)
                pred.update({"cell": cell, "where": where, "mode": mode, "argv": argv})
                out["predictions"].append(pred)
                real = [round(r["samples_per_sec"], 1) for r in got]
                print(
                    f"# {cell:>8} {mode:<14} real {real} predicted "
                    f"{pred['samples_per_sec']:.1f} ({time.perf_counter() - start:.0f} s)",
                    flush=True,
                )
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cells", default=",".join(CELLS), help=f"from {list(CELLS)}")
    p.add_argument("--modes", default="sync,hybrid,async", help="bench/hetero.py's")
    p.add_argument("--seeds", type=int, default=5, help="seeds per (cell, mode)")
    p.add_argument("--cluster", help="an emulated cluster (bench/clusters, up)")
    p.add_argument(
        "--sim-cluster", help="the simulator's cluster file for --cluster "
        "(default: SIM_CLUSTERS)"
    )  # fmt: skip
    p.add_argument("--data", default="runs/digits.h5")
    p.add_argument("--epochs", type=int, help="every cell's epochs (default: CELLS)")
    p.add_argument("--sample-ms", type=float, help="every cell's (default: CELLS)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--target-accuracy", type=float, default=0.9)
    p.add_argument("--eval-every", type=int, default=5)
    p.add_argument("--change-at", type=float, default=3.0)
    p.add_argument("--train-extra", default="", help="more train (and simulate) flags")
    p.add_argument("--reps", type=int, default=5, help="profile and ps.py repetitions")
    p.add_argument("--ps-seconds", type=float, default=4.0, help="ps.py capacity jobs")
    p.add_argument(
        "--ps-leaders", default="2,4",
        help="ps.py capacity jobs' leaders (hybrid's 2 groups, async's 4)",
    )  # fmt: skip
    p.add_argument(
        "--allreduce-impls", default="hybridagg-flat,mpi4py",
        help="bench/allreduce.py's --impls",
    )  # fmt: skip
    p.add_argument("--work", help="keep the profiles and microbenchmarks' outputs here")
    p.add_argument(
        "--reuse", action="store_true",
        help="with --work: reuse the profiles and microbenchmarks found there",
    )  # fmt: skip
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--json", help="write calibration, records, predictions, rows")
    p.add_argument("--md", help="write the table here")
    p.add_argument(
        "--from-json", nargs="+", help="rebuild the table from these --json files"
    )
    p.add_argument(
        "--repredict",
        action="store_true",
        help="with --from-json: simulate their cells again (this simulator, their "
        "calibrated profiles and options); the real runs are theirs",
    )
    p.add_argument(
        "--recalibrate", action="store_true",
        help="with --repredict: first fit each sitting's microbenchmarks again "
        "with this calibration code (rewrites their calibrated profiles; needs "
        "the sitting's --work files; a profile keeps the fields it was measured "
        "with)",
    )  # fmt: skip
    args = p.parse_args(argv)
    if args.repredict and not args.from_json:
        raise SystemExit("--repredict needs --from-json FILE")
    if args.recalibrate and not args.repredict:
        raise SystemExit("--recalibrate needs --repredict")
    if args.from_json:
        data: dict = {"calibration": [], "records": [], "predictions": []}
        for path in args.from_json:
            got = json.loads(Path(path).read_text())
            for key in data:
                data[key] += got.get(key, [])
        if args.recalibrate:
            data["calibration"] = recalibrate(data["calibration"])
        if args.repredict:
            data["predictions"] = repredict(data["predictions"], args.timeout)
    else:
        args.cells = [c for c in args.cells.split(",") if c]
        args.modes = [m for m in args.modes.split(",") if m]
        bad = set(args.cells) - set(CELLS)
        if bad:
            raise SystemExit(
                f"unknown --cells {sorted(bad)}; choose from {list(CELLS)}"
            )
        bad = {m for m in args.modes if m not in hetero.MODES} | (
            set(args.modes) & {"ddp", "horovod", "fast-pair"}
        )
        if bad:
            raise SystemExit(
                f"--modes {sorted(bad)}: hybridagg's modes only (sync, hybrid, "
                "async and their +adaptive)"
            )
        if args.reuse and not args.work:
            raise SystemExit("--reuse needs --work DIR")
        data = run(args)
    data["rows"] = table_rows(data["records"], data["predictions"])
    table = markdown(data["rows"])
    print(table)
    if args.json:
        Path(args.json).write_text(json.dumps(data, indent=1))
    if args.md:
        Path(args.md).write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
