"""The convergence table and the predicted time to a target accuracy (pure logic).

Samples per second alone rank configurations wrongly when their updates
differ in what they buy: an update of few samples, or one computed on stale
weights, moves the model less, so more of them are needed (Pollux's
statistical efficiency, OSDI'21; "steps to result", Shallue et al., 2019).
A :class:`ConvergenceTable` holds measured points: samples per update
``B``, staleness ``tau`` (the updates the model took between an update's
read of the weights and its own), and the median updates ``U`` a run needs
to reach the target accuracy (``bench/convergence.py`` measures them, with
``k`` equal workers: ``tau = k - 1``).

**Drift, not staleness, is what a stale update pays for.** The servers damp
an update of staleness ``tau`` by ``d(tau)`` (``1 / (1 + tau)`` by
default, :func:`hybridagg.ps.compensation.damping`), so what separates the
weights an update was computed on from those it lands on is the *drift*:
the damped updates in between, ``D = sum d(tau_h)``, in undamped updates.
With ``k`` equal workers every update sees ``k - 1`` others damped by
``1 / k``: ``D = tau d(tau) = (k - 1) / k``, below one however many
workers, which is what the damping is for. A slow worker among fast ones
is different: its ``tau`` fast updates are nearly undamped, so its drift
is about ``tau``, far beyond anything equal workers measure (the headline
cluster's 4x-slower workers: ``D`` about 3). Keyed by staleness, the table
gave those updates the worth of an equal worker's at the same ``tau``;
measured, they bought nothing (bench/RESULTS.md, "Drift: what a slow
worker's update is worth").

:meth:`ConvergenceTable.updates_to_target` interpolates ``U`` at any
``(B, D)`` (and the update's own staleness, below): per measured ``B``,
linearly in drift between its points (each point's drift ``tau d(tau)``,
the table's ``damping`` rule); beyond its
largest measured drift the *progress per update* ``1 / U`` falls: along
the line through its last two points where they fall, and in any case
linearly to zero at twice that drift, floored at zero (``U`` infinite: the
update moves the model nowhere useful). The table says nothing out there;
equal workers never reach drift 1, and measured mixed runs at drift 3 got
nothing from those updates, so the fall has to end before that, and twice
the table's reach is the assumption. Below its smallest drift, and beyond
a batch measured at drift 0 alone, clamped. Between two measured ``B``, linearly in
``log B``; above the largest ``B``, clamped (outside it the table says
nothing, and the nearest measurement is the least wrong guess), except
below the smallest ``B``, where the *samples* to the target are held
(``U(B) = U(B_min) B_min / B``): below a task's critical batch an update of
half the samples needs about twice the updates (McCandlish et al., 2018),
and holding ``U`` instead would make a slow worker's small updates look
nearly free, the very error this table exists to correct.

**An update's own staleness counts too.** Among equal workers staleness
and drift fix each other, so a table measured on them holds both effects at
once; among workers of mixed speeds they part. A fast worker beside slow
ones has a small drift (the slow updates in between are few) but a large
staleness, and the servers damp its *own* update by ``d(tau)``: the
uneven cluster's fast workers in async (staleness 3.25, drift 0.46) made
about 93 updates to the target where the table read at their drift alone
says 55.5 (bench/RESULTS.md, "An update's own staleness"). With
a ``staleness_weight`` ``w`` the table reads an update at both keys and
blends them geometrically, ``U = U(B, D)^(1 - w) x U(B, D_eq(tau))^w``,
where ``D_eq(tau) = tau d(tau)`` is the drift equal workers have at that
staleness: ``w = 0`` is drift alone, ``w = 1`` staleness alone (where a
slow worker's updates beside fast ones were worth an equal worker's,
which they were not), and either reading buying nothing buys nothing.
:func:`fit_staleness_weight` fits ``w`` on runs of mixed speeds
(``bench/convergence.py --mixed``), never on the jobs it predicts.

:func:`time_to_target` combines it with the analytic model's cycles: a
group that updates every ``c_g`` seconds with ``B_g`` samples at drift
``D_g`` does ``1 / (c_g U(B_g, D_g))`` of the work to the target per
second, and the groups' shares add (each update moves the shared model):
time ``= 1 / sum_g 1 / (c_g U(B_g, D_g))``. A group's staleness is the
other groups' updates during its cycle, ``tau_g = c_g sum_{h != g} 1 /
c_h`` (:func:`group_staleness`), its drift the same updates damped,
``D_g = c_g sum_{h != g} d(tau_h) / c_h`` (:func:`group_drift`); each
group is read at both. Sync makes one update of every worker's samples per
step, at drift 0.

A run's updates to the target are those at its first validation at or
above the target, so they depend on how often it validates
(``--eval-every``): a noisy accuracy curve crosses the target sooner when
it is looked at more often. A table holds the updates at one cadence,
its ``eval_every``.

The file is JSON: an object whose ``points`` is a list of objects with
``batch`` (> 0), ``staleness`` (>= 0) and ``updates`` (> 0), with the
cadence of those points in ``eval_every`` (1 when absent:
``bench/convergence.py``'s runs validate after every update), the damping
rule of the measuring runs in ``damping`` (``inverse`` when absent, the
runtime's default), the fitted weight in ``staleness_weight`` (0 when
absent), and optionally ``tables``, a list of objects each with its own
``eval_every``, ``points`` and ``staleness_weight`` (the same runs read at
other cadences; the file's weight where a table has none); other keys
(``bench/convergence.py``'s runs, ranges, mixed cells, metadata) are
ignored.
"""

from __future__ import annotations

import bisect
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..ps.compensation import DAMPING_RULES, damping

__all__ = [
    "ConvergenceTable",
    "MixedCell",
    "fit_staleness_weight",
    "group_drift",
    "group_staleness",
    "load_convergence",
    "time_to_target",
    "updates_of",
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
        damping: The servers' damping rule in the measuring runs (a point's
            drift is ``staleness x damping(staleness)``).
        staleness_weight: ``w`` in [0, 1]: how much an update's own
            staleness counts beside its drift (``U = U(D)^(1-w) U(tau)^w``,
            see the module); 0 reads drift alone. Fitted on runs of mixed
            speeds (:func:`fit_staleness_weight`).
    """

    points: tuple[tuple[float, float, float], ...]
    target_accuracy: float | None = None
    eval_every: int = 1
    damping: str = "inverse"
    staleness_weight: float = 0.0

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
        w = self.staleness_weight
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not 0 <= w <= 1:
            raise ValueError(f"staleness_weight must be in [0, 1], got {w!r}")
        if self.damping not in DAMPING_RULES:
            raise ValueError(
                f"damping must be one of {', '.join(DAMPING_RULES)}, got "
                f"{self.damping!r}"
            )

    @property
    def batches(self) -> list[float]:
        """The measured samples per update, ascending."""
        return sorted({b for b, _, _ in self.points})

    def drift(self, staleness: float) -> float:
        """The drift of an update of ``staleness`` among equal workers, as the
        table's runs had it: ``staleness x damping(staleness)``."""
        return staleness * damping(staleness, self.damping)

    def _along_drift(self, batch: float, drift: float) -> float:
        """``U`` at a measured ``batch``: linear in drift between its
        points, clamped below them, and beyond them the progress ``1 / U``
        falling to zero (see the module)."""
        row = sorted((self.drift(t), u) for b, t, u in self.points if b == batch)
        ds = [d for d, _ in row]
        if drift <= ds[0]:
            return row[0][1]
        if drift > ds[-1]:
            d1, u1 = row[-1]
            if d1 == 0:  # staleness never measured: nothing to go on
                return u1
            # the table's own fall, where its last two points fall ...
            progress = 1 / u1
            if len(row) > 1:
                d0, u0 = row[-2]
                slope = (1 / u1 - 1 / u0) / (d1 - d0)
                if slope < 0:
                    progress = 1 / u1 + slope * (drift - d1)
            # ... and at the latest zero at twice its largest drift
            progress = min(progress, (1 / u1) * (2 - drift / d1))
            # (rounding leaves ~1e-19 where a line meets zero)
            return 1 / progress if progress > 1e-12 / u1 else math.inf
        if drift == ds[-1]:
            return row[-1][1]
        i = bisect.bisect_right(ds, drift)
        (d0, u0), (d1, u1) = row[i - 1], row[i]
        return u0 + (u1 - u0) * (drift - d0) / (d1 - d0)

    def updates_to_target(
        self,
        batch: float,
        staleness: float | None = None,
        *,
        drift: float | None = None,
    ) -> float:
        """Interpolated updates to the target at ``batch`` samples per update
        (see the module).

        Args:
            batch: Samples per update.
            staleness: The updates' own staleness (0 when neither it nor
                ``drift`` is given). Alone, it is read as equal workers'
                staleness, at the table's ``drift(staleness)``.
            drift: The updates' drift, in undamped updates. With a
                ``staleness_weight`` above 0 the staleness is needed too.

        Returns:
            The updates; ``math.inf`` where the drift is so far beyond the
            table's that the updates are predicted to buy nothing.

        Raises:
            ValueError: ``batch`` not > 0, ``staleness`` or ``drift`` < 0
                (or not finite), or ``drift`` without ``staleness`` on a
                table whose ``staleness_weight`` is above 0.
        """
        b = _number(batch, "batch")
        if not b > 0:
            raise ValueError(f"batch must be > 0, got {b:g}")
        tau = None
        if staleness is not None:
            tau = _number(staleness, "staleness")
            if tau < 0:
                raise ValueError(f"staleness must be >= 0, got {tau:g}")
        if drift is None:
            return self._at(b, self.drift(tau or 0.0))
        d = _number(drift, "drift")
        if d < 0:
            raise ValueError(f"drift must be >= 0, got {d:g}")
        w = self.staleness_weight
        if w == 0:
            return self._at(b, d)
        if tau is None:
            raise ValueError(
                f"this table weighs an update's own staleness ({w:g}): "
                "give the staleness beside the drift"
            )
        if w == 1:
            return self._at(b, self.drift(tau))
        u_drift, u_stale = self._at(b, d), self._at(b, self.drift(tau))
        if math.isinf(u_drift) or math.isinf(u_stale):
            return math.inf
        return math.exp((1 - w) * math.log(u_drift) + w * math.log(u_stale))

    def _at(self, b: float, d: float) -> float:
        """``U`` at ``b`` samples per update and drift ``d`` (see the module)."""
        batches = self.batches
        if b <= batches[0]:  # the samples held (see the module)
            return self._along_drift(batches[0], d) * batches[0] / b
        if b >= batches[-1]:
            return self._along_drift(batches[-1], d)
        if b in batches:
            return self._along_drift(b, d)
        i = bisect.bisect_right(batches, b)
        lo, hi = batches[i - 1], batches[i]
        u_lo, u_hi = self._along_drift(lo, d), self._along_drift(hi, d)
        if math.isinf(u_lo) or math.isinf(u_hi):
            return math.inf
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
            data = {
                **found[0],
                "target_accuracy": data.get("target_accuracy"),
                "damping": data.get("damping", "inverse"),
                # a cadence's own fit, else the file's
                "staleness_weight": found[0].get(
                    "staleness_weight", data.get("staleness_weight", 0.0)
                ),
            }
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
            return cls(
                tuple(triples),
                target,
                own,
                data.get("damping", "inverse"),
                data.get("staleness_weight", 0.0),
            )
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None

    def as_dict(self) -> dict[str, Any]:
        """The table as the file's JSON object."""
        return {
            "target_accuracy": self.target_accuracy,
            "eval_every": self.eval_every,
            "damping": self.damping,
            "staleness_weight": self.staleness_weight,
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


def group_drift(cycles: Sequence[float], rule: str = "inverse") -> list[float]:
    """Each group's predicted drift: the other groups' updates during its
    cycle, each damped by ``rule`` at its own group's staleness,
    ``c_g x sum_{h != g} damping(tau_h) / c_h`` (see the module).

    Raises:
        ValueError: No cycles, a cycle not > 0, or an unknown rule.
    """
    taus = group_staleness(cycles)
    damped = sum(damping(t, rule) / c for t, c in zip(taus, cycles, strict=True))
    return [
        c * (damped - damping(t, rule) / c) for t, c in zip(taus, cycles, strict=True)
    ]


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
            drift 0; the step is the slowest group's cycle), or
            ``hybrid`` / ``async`` (each group updates on its own, at its
            drift under the table's damping rule).
        group_samples: Samples of each group's update.
        group_cycle_s: Seconds per update of each group.

    Returns:
        The seconds; ``math.inf`` where no group's updates buy anything.

    Raises:
        ValueError: Groups and cycles of different lengths, or a cycle not > 0.
    """
    if len(group_samples) != len(group_cycle_s) or not group_samples:
        raise ValueError("time_to_target needs one cycle per group")
    if any(not c > 0 for c in group_cycle_s):
        raise ValueError(f"group cycles must be > 0, got {list(group_cycle_s)}")
    if mode == "sync":
        step = max(group_cycle_s)
        return step * table.updates_to_target(sum(group_samples), 0.0, drift=0.0)
    taus = group_staleness(group_cycle_s)
    drifts = group_drift(group_cycle_s, table.damping)
    progress = sum(
        1.0 / (c * table.updates_to_target(b, tau, drift=d))
        for b, c, tau, d in zip(group_samples, group_cycle_s, taus, drifts, strict=True)
    )
    return 1.0 / progress if progress > 0 else math.inf


def updates_of(
    table: ConvergenceTable,
    mode: str,
    group_samples: Sequence[float],
    group_cycle_s: Sequence[float],
) -> float:
    """Predicted updates a job makes to the target: its time to the target
    (:func:`time_to_target`) times its updates per second (every group's
    in ``hybrid``/``async``, the slowest group's steps in ``sync``);
    ``math.inf`` where it never gets there.

    Raises:
        ValueError: As :func:`time_to_target`.
    """
    t = time_to_target(table, mode, group_samples, group_cycle_s)
    if mode == "sync":
        return t / max(group_cycle_s)
    return t * sum(1.0 / c for c in group_cycle_s)


@dataclass(frozen=True)
class MixedCell:
    """Runs whose groups differ in speed, and the updates they needed.

    Attributes:
        mode: ``hybrid`` or ``async``.
        group_samples: Samples of each group's update.
        group_cycles: Each group's time per update (any unit: only their
            ratios matter).
        updates: The runs' median updates to the target (all groups').
    """

    mode: str
    group_samples: tuple[float, ...]
    group_cycles: tuple[float, ...]
    updates: float

    def __post_init__(self) -> None:
        if self.mode not in ("hybrid", "async"):
            raise ValueError(
                f"a mixed cell's mode must be hybrid or async, got {self.mode!r}"
            )
        if not self.group_samples or len(self.group_samples) != len(self.group_cycles):
            raise ValueError("a mixed cell needs one cycle per group")
        if any(not c > 0 for c in (*self.group_samples, *self.group_cycles)):
            raise ValueError("a mixed cell's samples and cycles must be > 0")
        if not self.updates > 0:
            raise ValueError(
                f"a mixed cell's updates must be > 0, got {self.updates!r}"
            )


def fit_staleness_weight(
    table: ConvergenceTable, cells: Sequence[MixedCell], *, steps: int = 100
) -> tuple[float, list[float]]:
    """The ``staleness_weight`` in [0, 1] that best predicts mixed runs.

    Equal workers cannot tell an update's own staleness from its drift (one
    fixes the other), so the table measured on them holds both at once;
    runs of mixed speeds separate them. The weight minimises the squared
    log error of :func:`updates_of` over ``cells``, searched on a grid of
    ``steps + 1`` values (the error is not smooth in it: the table is
    piecewise linear); a weight at which some cell is predicted never to
    get there is not a candidate.

    Returns:
        The weight and each cell's predicted updates at it.

    Raises:
        ValueError: No cells, or no weight that gets every cell there.
    """
    if not cells:
        raise ValueError("fitting the staleness weight needs mixed cells")
    best: tuple[float, float, list[float]] | None = None
    for i in range(steps + 1):
        w = i / steps
        t = ConvergenceTable(
            table.points, table.target_accuracy, table.eval_every, table.damping, w
        )
        got = [updates_of(t, c.mode, c.group_samples, c.group_cycles) for c in cells]
        if any(math.isinf(u) for u in got):
            continue
        err = sum(
            (math.log(u) - math.log(c.updates)) ** 2
            for u, c in zip(got, cells, strict=True)
        )
        if best is None or err < best[0] - 1e-12:
            best = (err, w, got)
    if best is None:
        raise ValueError("no staleness weight gets every mixed cell to the target")
    return best[1], best[2]
