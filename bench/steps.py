"""Where a training step's time goes, from ``hybridagg train --metrics`` files.

For every (group, role) of each file: steps, samples/s of one rank, and the
median milliseconds of the step's parts as the metrics record them
(``compute_s`` the real forward and backward, ``pace_s`` the emulation's
sleep, ``comm_s`` the whole ``optimizer.step()``: the group all-reduce, a
leader's exchange with the servers and the weights' broadcast in the group;
``reduce_s`` the all-reduce inside it; ``data_wait_s`` the loader) and the
median period between two steps. Steps with an empty batch (a rank that ran
out of data at the end of an epoch) are left out. Several files side by side
compare settings::

    python bench/steps.py runs/a.jsonl runs/b.jsonl --json steps.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from pathlib import Path

__all__ = ["PARTS", "main", "markdown", "summarize"]

PARTS = ("compute_s", "pace_s", "comm_s", "reduce_s", "data_wait_s")


def summarize(path: str | Path) -> list[dict]:
    """Summarize one metrics file.

    Args:
        path: A JSONL file written by ``hybridagg train --metrics``.

    Returns:
        One row per (group, role): ``file``, ``group``, ``role``, ``ranks``,
        ``steps`` (per rank), the median milliseconds of each of
        :data:`PARTS` and of the period between steps (``*_ms``;
        ``period_ms`` is ``None`` with a single step) and
        ``samples_per_sec_per_rank`` (median batch / median period).
    """
    by_rank: dict[int, list[dict]] = {}
    for line in Path(path).read_text().splitlines():
        record = json.loads(line)
        if record.get("event") == "step":
            by_rank.setdefault(record["rank"], []).append(record)
    rows: dict[tuple, dict] = {}
    for rank, steps in sorted(by_rank.items()):
        steps.sort(key=lambda r: r["t"])
        periods = [b["t"] - a["t"] for a, b in itertools.pairwise(steps) if b["batch"]]
        full = [r for r in steps if r["batch"]]
        if not full:
            continue
        key = (full[0]["group"], full[0]["role"])
        row = rows.setdefault(
            key,
            {
                "file": str(path),
                "group": key[0],
                "role": key[1],
                "ranks": [],
                "vals": {},
            },
        )
        row["ranks"].append(rank)
        for part in (*PARTS, "period_s"):
            got = periods if part == "period_s" else [r[part] or 0.0 for r in full]
            row["vals"].setdefault(part, []).extend(got)
        row["vals"].setdefault("batch", []).extend(r["batch"] for r in full)
    out = []
    for row in rows.values():
        vals = row.pop("vals")
        row["steps"] = len(vals["batch"]) // len(row["ranks"])
        for part in (*PARTS, "period_s"):
            got = vals[part]
            row[part.replace("_s", "_ms")] = (
                1e3 * statistics.median(got) if got else None
            )
        row["samples_per_sec_per_rank"] = (
            statistics.median(vals["batch"]) / statistics.median(vals["period_s"])
            if vals["period_s"]
            else None
        )
        out.append(row)
    return out


def markdown(rows: list[dict]) -> str:
    """The rows of :func:`summarize` as a Markdown table."""

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}"

    head = (
        "| file | group | role | ranks | steps | period ms | compute ms | pace ms | "
        "comm ms | reduce ms | data wait ms | samples/s per rank |\n"
        "|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"
    )
    lines = [head]
    for r in rows:
        sps = r["samples_per_sec_per_rank"]
        lines.append(
            f"| {Path(r['file']).name} | {r['group']} | {r['role']} | "
            f"{','.join(map(str, r['ranks']))} | {r['steps']} | {ms(r['period_ms'])} | "
            f"{r['compute_ms']:.2f} | {r['pace_ms']:.2f} | {r['comm_ms']:.2f} | "
            f"{r['reduce_ms']:.2f} | {r['data_wait_ms']:.2f} | "
            f"{'-' if sps is None else f'{sps:.0f}'} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Print the table of every file given; ``--json`` writes the rows too."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "metrics", nargs="+", help="JSONL files from hybridagg train --metrics"
    )
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args(argv)
    rows = [row for path in args.metrics for row in summarize(path)]
    if not rows:
        raise SystemExit("steps: no step records in " + ", ".join(args.metrics))
    print(markdown(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
