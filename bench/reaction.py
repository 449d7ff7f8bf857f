"""How fast adaptive batching follows a change of speed, from ``--metrics`` files.

For each ``hybridagg train --metrics`` file of a run whose ``--slowdown``
changes at ``--change-at`` seconds (the headline's changing level:
``0-1:1,2-3:4@0;0-1:4,2-3:1@3``), rank 0's records give

* ``decision_s``: seconds from the change to the first batch decision
  after it, and ``decision_steps``: the steps that ended in between (run
  at the old split);
* ``balanced_s``: seconds from the change to the start of the first step
  begun after it whose ranks' busy times (``compute_s + pace_s``, ranks
  with a batch) are within ``--tolerance`` of each other (``None``: never):
  until then the job ran at the newly slow workers' pace.

::

    python bench/reaction.py --change-at 3 runs/seed0.jsonl runs/seed1.jsonl
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from pathlib import Path

__all__ = ["main", "reaction"]


def reaction(path: str | Path, change_at: float, tolerance: float = 0.25) -> dict:
    """The reaction of one run to its change of speed (see the module).

    Args:
        path: A JSONL file written by ``hybridagg train --metrics``.
        change_at: Seconds into training when the speeds change.
        tolerance: Largest ``max / min - 1`` of the ranks' busy times in a
            balanced step.

    Returns:
        ``file``, ``decision_s``, ``decision_steps`` and ``balanced_s``
        (``None`` where the run has no such event).
    """
    steps: dict[int, dict[int, dict]] = {}
    decisions = []
    for line in Path(path).read_text().splitlines():
        record = json.loads(line)
        if record.get("event") == "step":
            steps.setdefault(record["step"], {})[record["rank"]] = record
        elif record.get("event") == "batch" and record["rank"] == 0:
            decisions.append(record["t"])
    ends = sorted((by_rank[0]["t"], n) for n, by_rank in steps.items() if 0 in by_rank)
    after = [t for t in decisions if t > change_at]
    decision = after[0] if after else None
    balanced = None
    # a step starts where rank 0's previous one ended
    for (previous, _), (_, n) in itertools.pairwise(ends):
        if previous < change_at:
            continue
        busy = [r["compute_s"] + r["pace_s"] for r in steps[n].values() if r["batch"]]
        if busy and max(busy) <= (1 + tolerance) * min(busy):
            balanced = previous
            break
    return {
        "file": str(path),
        "decision_s": None if decision is None else decision - change_at,
        "decision_steps": None
        if decision is None
        else sum(1 for t, _ in ends if change_at < t <= decision),
        "balanced_s": None if balanced is None else balanced - change_at,
    }


def _fmt(value) -> str:
    if value is None:
        return "-"
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="+", help="hybridagg train --metrics files")
    p.add_argument("--change-at", type=float, required=True)
    p.add_argument("--tolerance", type=float, default=0.25)
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args(argv)
    rows = [reaction(f, args.change_at, args.tolerance) for f in args.files]
    keys = ("decision_s", "decision_steps", "balanced_s")
    print("| file | " + " | ".join(keys) + " |")
    print("|---|" + "---:|" * len(keys))
    for row in rows:
        print(f"| {row['file']} | " + " | ".join(_fmt(row[k]) for k in keys) + " |")
    for k in keys:
        values = [row[k] for row in rows if row[k] is not None]
        if values:
            print(f"# median {k}: {_fmt(statistics.median(values))}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
