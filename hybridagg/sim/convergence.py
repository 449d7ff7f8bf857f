"""The convergence table and the predicted time to a target accuracy (pure logic).

Samples per second alone rank configurations wrongly when their updates
differ in what they buy: an update of few samples, or one computed on stale
weights, moves the model less, so more of them are needed (Pollux's
statistical efficiency, OSDI'21; "steps to result", Shallue et al., 2019).
A :class:`ConvergenceTable` holds measured points: samples per update
``B``, staleness ``tau`` (the updates the model took between an update's
read of the weights and its own), and the median updates ``U`` a run needs
to reach the target accuracy (``bench/convergence.py`` measures them).

:meth:`ConvergenceTable.updates_to_target` interpolates ``U`` at any
``(B, tau)``: per measured ``B``, linearly in ``tau`` between its points;
between two measured ``B``, linearly in ``log B``; clamped at the table's
edges in ``tau`` and above its largest ``B`` (outside them the table says
nothing, and the nearest measurement is the least wrong guess), except
below its smallest ``B``, where the *samples* to the target are held
(``U(B) = U(B_min) B_min / B``): below a task's critical batch an update of
half the samples needs about twice the updates (McCandlish et al., 2018),
and holding ``U`` instead would make a slow worker's small updates look
nearly free, the very error this table exists to correct.

:func:`time_to_target` combines it with the analytic model's cycles: a
group that updates every ``c_g`` seconds with ``B_g`` samples at staleness
``tau_g`` does ``1 / (c_g U(B_g, tau_g))`` of the work to the target per
second, and the groups' shares add (each update moves the shared model):
time ``= 1 / sum_g 1 / (c_g U(B_g, tau_g))``. A group's staleness is the
other groups' updates during its cycle, ``tau_g = c_g sum_{h != g} 1 / c_h``
(:func:`group_staleness`; ``k`` equal workers: ``k - 1``). Sync makes one
update of every worker's samples per step, at staleness 0.

A run's updates to the target are those at its first validation at or
above the target, so they depend on how often it validates
(``--eval-every``): a noisy accuracy curve crosses the target sooner when
it is looked at more often. A table holds the updates at one cadence,
its ``eval_every``.

The file is JSON: an object whose ``points`` is a list of objects with
``batch`` (> 0), ``staleness`` (>= 0) and ``updates`` (> 0), with the
cadence of those points in ``eval_every`` (1 when absent:
``bench/convergence.py``'s runs validate after every update), and
optionally ``tables``, a list of objects each with its own ``eval_every``
and ``points`` (the same runs read at other cadences); other keys
(``bench/convergence.py``'s runs, ranges, metadata) are ignored.
"""

from __future__ import annotations

import bisect
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "ConvergenceTable",
    "group_staleness",
    "load_convergence",
    "time_to_target",
]


def _number(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{what} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{what} must be finite, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class ConvergenceTable:
    """Measured updates to the target per (samples per update, staleness).

    Attributes:
        points: ``(batch, staleness, updates)`` triples: ``batch`` > 0,
            ``staleness`` >= 0, ``updates`` > 0, no (batch, staleness)
            twice.
        target_accuracy: The accuracy the updates reach (``None``: not
            recorded).
        eval_every: The validation cadence the updates were counted at
            (``--eval-every``).
    """

    points: tuple[tuple[float, float, float], ...]
    target_accuracy: float | None = None
    eval_every: int = 1

    def __post_init__(self) -> None:
        if not self.points:
            raise ValueError("the convergence table has no points")
        seen: set[tuple[float, float]] = set()
        for i, p in enumerate(self.points):
            if len(p) != 3:
                raise ValueError(f"point {i}: expected (batch, staleness, updates)")
            b, tau, u = (_number(v, f"point {i}: {k}") for k, v in zip(
                ("batch", "staleness", "updates"), p, strict=True))  # fmt: skip
            if not b > 0:
                raise ValueError(f"point {i}: batch must be > 0, got {b:g}")
            if tau < 0:
                raise ValueError(f"point {i}: staleness must be >= 0, got {tau:g}")
            if not u > 0:
                raise ValueError(f"point {i}: updates must be > 0, got {u:g}")
            if (b, tau) in seen:
                raise ValueError(
                    f"point {i}: batch {b:g} at staleness {tau:g} appears twice"
                )
            seen.add((b, tau))
        if (
            isinstance(self.eval_every, bool)
            or not isinstance(self.eval_every, int)
            or self.eval_every < 1
        ):
            raise ValueError(
                f"eval_every must be an integer >= 1, got {self.eval_every!r}"
            )
        if self.target_accuracy is not None and not 0 < self.target_accuracy <= 1:
            raise ValueError(
                f"target_accuracy must be in (0, 1], got {self.target_accuracy!r}"
            )

    @property
    def batches(self) -> list[float]:
        """The measured samples per update, ascending."""
        return sorted({b for b, _, _ in self.points})

    def _along_staleness(self, batch: float, tau: float) -> float:
        """``U`` at a measured ``batch``: linear in ``tau``, clamped."""
        row = sorted((t, u) for b, t, u in self.points if b == batch)
        taus = [t for t, _ in row]
        if tau <= taus[0]:
            return row[0][1]
        if tau >= taus[-1]:
            return row[-1][1]
        i = bisect.bisect_right(taus, tau)
        (t0, u0), (t1, u1) = row[i - 1], row[i]
        return u0 + (u1 - u0) * (tau - t0) / (t1 - t0)

    def updates_to_target(self, batch: float, staleness: float) -> float:
        """Interpolated updates to the target at ``batch`` samples per update
        and ``staleness`` (see the module).

        Raises:
            ValueError: ``batch`` not > 0, or ``staleness`` < 0 (or not finite).
        """
        b = _number(batch, "batch")
        tau = _number(staleness, "staleness")
        if not b > 0:
            raise ValueError(f"batch must be > 0, got {b:g}")
        if tau < 0:
            raise ValueError(f"staleness must be >= 0, got {tau:g}")
        batches = self.batches
        if b <= batches[0]:  # the samples held (see the module)
            return self._along_staleness(batches[0], tau) * batches[0] / b
        if b >= batches[-1]:
            return self._along_staleness(batches[-1], tau)
        i = bisect.bisect_right(batches, b)
        lo, hi = batches[i - 1], batches[i]
        u_lo, u_hi = self._along_staleness(lo, tau), self._along_staleness(hi, tau)
        w = (math.log(b) - math.log(lo)) / (math.log(hi) - math.log(lo))
        return u_lo + (u_hi - u_lo) * w

    @classmethod
    def from_dict(
        cls,
        data: Any,
        *,
        where: str = "convergence table",
        eval_every: int | None = None,
    ) -> ConvergenceTable:
        """The table of a JSON object (see the module).

        Args:
            data: The file's object.
            where: What to name in errors.
            eval_every: The cadence to read the table at (``None``: the
                object's own ``points``).

        Raises:
            ValueError: Not an object with a list of ``points``, a bad
                point, or no table at ``eval_every``; the message names
                ``where`` and the point or the cadences there are.
        """
        if not isinstance(data, dict):
            raise ValueError(f"{where}: expected a JSON object with 'points'")
        own = data.get("eval_every", 1)
        if eval_every is not None and eval_every != own:
            tables = data.get("tables")
            if tables is not None and not isinstance(tables, list):
                raise ValueError(f"{where}: 'tables' must be a list")
            found = [
                t for t in tables or []
                if isinstance(t, dict) and t.get("eval_every") == eval_every
            ]  # fmt: skip
            if not found:
                have = sorted(
                    {own}
                    | {t.get("eval_every") for t in tables or [] if isinstance(t, dict)}
                    - {None},
                    key=str,
                )
                raise ValueError(
                    f"{where}: no table at --eval-every {eval_every} (it has "
                    f"{', '.join(map(str, have))}; bench/convergence.py "
                    f"--eval-every derives others from the same runs)"
                )
            data = {**found[0], "target_accuracy": data.get("target_accuracy")}
            own = eval_every
        points = data.get("points")
        if not isinstance(points, list) or not points:
            raise ValueError(f"{where}: 'points' must be a non-empty list")
        triples = []
        for i, p in enumerate(points):
            if not isinstance(p, dict):
                raise ValueError(f"{where}: point {i} must be an object")
            missing = [k for k in ("batch", "staleness", "updates") if k not in p]
            if missing:
                raise ValueError(f"{where}: point {i} lacks {', '.join(missing)}")
            triples.append((p["batch"], p["staleness"], p["updates"]))
        target = data.get("target_accuracy")
        try:
            if target is not None:
                target = _number(target, "target_accuracy")
            return cls(tuple(triples), target, own)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None

    def as_dict(self) -> dict[str, Any]:
        """The table as the file's JSON object."""
        return {
            "target_accuracy": self.target_accuracy,
            "eval_every": self.eval_every,
            "points": [
                {"batch": b, "staleness": t, "updates": u} for b, t, u in self.points
            ],
        }


def load_convergence(
    path: str | Path, eval_every: int | None = None
) -> ConvergenceTable:
    """Read and check a convergence file (``bench/convergence.py --json``).

    Args:
        path: The file.
        eval_every: Its table at this validation cadence (``None``: its
            ``points``).

    Raises:
        ValueError: A missing or unreadable file, a bad table, or none at
            ``eval_every``; the message names the file.
    """
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"convergence file {path} does not exist") from None
    except (OSError, ValueError) as exc:
        raise ValueError(
            f"convergence file {path} cannot be read as JSON: {exc}"
        ) from None
    return ConvergenceTable.from_dict(
        data, where=f"convergence file {path}", eval_every=eval_every
    )


def group_staleness(cycles: Sequence[float]) -> list[float]:
    """Each group's predicted staleness: the other groups' updates during its
    cycle, ``c_g x sum_{h != g} 1 / c_h``.

    Raises:
        ValueError: No cycles, or a cycle not > 0.
    """
    if not cycles or any(not c > 0 for c in cycles):
        raise ValueError(f"group cycles must be > 0, got {list(cycles)}")
    rate = sum(1.0 / c for c in cycles)
    return [c * (rate - 1.0 / c) for c in cycles]


def time_to_target(
    table: ConvergenceTable,
    mode: str,
    group_samples: Sequence[float],
    group_cycle_s: Sequence[float],
) -> float:
    """Predicted seconds to the target accuracy (see the module).

    Args:
        table: The convergence table.
        mode: ``sync`` (one update of every group's samples per step, at
            staleness 0; the step is the slowest group's cycle), or
            ``hybrid`` / ``async`` (each group updates on its own).
        group_samples: Samples of each group's update.
        group_cycle_s: Seconds per update of each group.

    Raises:
        ValueError: Groups and cycles of different lengths, or a cycle not > 0.
    """
    if len(group_samples) != len(group_cycle_s) or not group_samples:
        raise ValueError("time_to_target needs one cycle per group")
    if any(not c > 0 for c in group_cycle_s):
        raise ValueError(f"group cycles must be > 0, got {list(group_cycle_s)}")
    if mode == "sync":
        step = max(group_cycle_s)
        return step * table.updates_to_target(sum(group_samples), 0.0)
    taus = group_staleness(group_cycle_s)
    progress = sum(
        1.0 / (c * table.updates_to_target(b, tau))
        for b, c, tau in zip(group_samples, group_cycle_s, taus, strict=True)
    )
    return 1.0 / progress
