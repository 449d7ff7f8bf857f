"""``make demo``: sync against hybrid on a heterogeneous "cluster" of 4 workers.

Trains an MLP on scikit-learn's bundled digits (converted to hybridagg's HDF5
format) twice on this machine, under the same emulated heterogeneity: workers
2 and 3 are four times slower than workers 0 and 1.

* ``sync``: 4 workers, one all-reduce per step (what DDP and Horovod do): every
  step waits for the slow workers.
* ``hybrid``: the same 4 workers in 2 groups ({0,1} fast, {2,3} slow) plus 1
  parameter-server rank: each group all-reduces inside and meets the server
  asynchronously, so the fast group is never held back.

Then prints the two runs side by side. Run: ``python examples/demo.py``
(``make demo`` does it after installing).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hybridagg.runtime import runner
from hybridagg.train.metrics import format_table, summary_row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default="runs/digits.h5")
    p.add_argument("--out", default="runs/demo")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--slowdown", default="0-1:1,2-3:4")
    p.add_argument("--sample-ms", type=float, default=1.0)
    p.add_argument("--target-accuracy", type=float, default=0.9)
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from hybridagg.data import digits_file

    digits_file(args.data)
    common = [
        "--data",
        args.data,
        "--epochs",
        str(args.epochs),
        "--lr",
        "0.05",
        "--slowdown",
        args.slowdown,
        "--sample-ms",
        str(args.sample_ms),
        "--target-accuracy",
        str(args.target_accuracy),
        "--eval-every",
        "10",
    ]
    runs = [
        ("sync", 4, ["--mode", "sync"]),
        ("hybrid", 5, ["--mode", "hybrid", "--groups", "0-1,2-3", "--servers", "1"]),
    ]
    rows = []
    for name, nranks, extra in runs:
        summary = out / f"{name}.json"
        cmd = [
            sys.executable,
            "-m",
            "hybridagg.cli",
            "train",
            *common,
            *extra,
            "--summary",
            str(summary),
            "--metrics",
            str(out / f"{name}.jsonl"),
        ]
        print(
            f"\n$ mpiexec -n {nranks} hybridagg train {' '.join(common + extra)}",
            flush=True,
        )
        result = runner.run_job(
            runner.mpiexec_argv(nranks, cmd),
            timeout=900,
            env=runner.mpiexec_env(),
            stream=True,
        )
        if result.returncode != 0:
            print(
                f"demo: the {name} run failed (exit {result.returncode})",
                file=sys.stderr,
            )
            return 1
        import json

        rows.append(summary_row(json.loads(summary.read_text())))
    print(
        f"\nDigits, MLP, 4 workers, slowdown {args.slowdown} (sample {args.sample_ms} ms), "
        f"{args.epochs} epochs; target accuracy {args.target_accuracy}:\n"
    )
    print(format_table(rows))
    sync_t = rows[0]["time to target (s)"]
    hyb_t = rows[1]["time to target (s)"]
    if "-" not in (sync_t, hyb_t):
        print(
            f"\nhybrid reached the target {float(sync_t) / float(hyb_t):.1f}x sooner than sync."
        )
    print(f"Summaries and per-step metrics: {out}/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
