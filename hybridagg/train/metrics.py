"""Metrics of a training run: per-rank JSON lines, the summary, the final table.

Every rank appends its records to a file of its own next to ``--metrics``
(``FILE.rank-00003``) while it trains, so no rank waits for another to log
and a killed job keeps what it wrote. At the end rank 0 merges the parts,
ordered by time, into ``FILE`` and removes them. A record is one JSON object
per line with an ``event``: ``step`` (one per step per worker), ``eval``
(validation on rank 0), ``checkpoint`` and ``batch`` (adaptive batching).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

__all__ = ["MetricsWriter", "format_table", "merge_parts", "summary_row"]


def _part(path: Path, rank: int) -> Path:
    return path.with_name(f"{path.name}.rank-{rank:05d}")


class MetricsWriter:
    """Appends this rank's records (a no-op without a path)."""

    def __init__(self, path: str | os.PathLike | None, rank: int) -> None:
        self.path = Path(path) if path else None
        self.rank = rank
        self._fh = None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fh = open(_part(self.path, rank), "a", buffering=1)  # noqa: SIM115

    def write(self, event: str, **fields: Any) -> None:
        if self._fh is not None:
            self._fh.write(
                json.dumps({"event": event, "rank": self.rank, **fields}) + "\n"
            )

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None


def _read_part(part: Path) -> list[dict]:
    """A part's records; a torn last line (its rank was killed mid-write) is left out."""
    lines = [line for line in part.read_text().splitlines() if line.strip()]
    records = []
    for i, line in enumerate(lines):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if i != len(lines) - 1:
                raise
    return records


def merge_parts(path: str | os.PathLike, ranks: int) -> int:
    """Merge every rank's part into ``path`` by time; returns the number of records.

    A rank that died leaves its part as far as it got (a torn last line is
    left out).
    """
    path = Path(path)
    records = []
    for rank in range(ranks):
        part = _part(path, rank)
        if not part.exists():
            continue
        records += _read_part(part)
    records.sort(key=lambda r: (r.get("t", 0.0), r.get("rank", 0)))
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as fh:
        for r in records:
            fh.write(json.dumps(r) + "\n")
    os.replace(tmp, path)
    for rank in range(ranks):
        _part(path, rank).unlink(missing_ok=True)
    return len(records)


def summary_row(summary: dict) -> dict[str, str]:
    """The summary's headline figures, formatted (``-`` where a figure is ``None``
    or absent: ``efficiency`` without ``--sample-ms``, accuracy with ``--loss mse``)."""

    def num(key: str, fmt: str) -> str:
        value = summary.get(key)
        return "-" if value is None else format(value, fmt)

    return {
        "mode": str(summary["mode"]),
        "samples/s": num("samples_per_sec", ".1f"),
        "ideal/s": num("ideal_samples_per_sec", ".1f"),
        "efficiency": num("efficiency", ".2f"),
        "time to target (s)": num("time_to_target_s", ".1f"),
        "final acc": num("final_accuracy", ".4f"),
        "final loss": num("final_loss", ".4g"),
        "updates": num("steps", "d"),
        "stall": num("stall_fraction", ".3f"),
        "staleness": num("mean_staleness", ".2f"),
        "wall (s)": num("wall_s", ".1f"),
    }


def format_table(rows: list[dict[str, str]]) -> str:
    """A Markdown table of rows with the same keys."""
    if not rows:
        return ""
    keys = list(rows[0])
    widths = {k: max(len(k), *(len(r[k]) for r in rows)) for k in keys}
    head = "| " + " | ".join(k.ljust(widths[k]) for k in keys) + " |"
    rule = "|" + "|".join("-" * (widths[k] + 2) for k in keys) + "|"
    body = ["| " + " | ".join(r[k].rjust(widths[k]) for k in keys) + " |" for r in rows]
    return "\n".join([head, rule, *body])
