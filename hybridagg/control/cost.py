"""Batch time against a long-term cost budget: Lyapunov drift-plus-penalty.

Time is cut into slots (a slot is however long the job runs one
configuration before the controller is asked again; slots need not be
equal). At each slot the controller picks one :class:`Candidate`
configuration, which has a batch time ``t_x`` and a price ``c_x`` per hour
(the sum over its active ranks). A *virtual queue* ``Q`` holds the money
spent above the budget ``beta`` per hour; after a slot of ``tau`` seconds
with candidate ``x``::

    Q <- max(Q + (c_x - beta) * tau / 3600, 0)

and the next slot takes the candidate minimising ``V * t_x + Q * c_x``
(the first in order on a tie). With ``Q`` zero the fastest candidate
wins; the more has been overspent, the more a dollar per hour weighs
against a second of batch time. ``V > 0`` sets the trade: large ``V``
follows batch time closely and lets the queue (the overspend) grow
larger before it bites.

Guarantees, for a fixed list of candidates, slots of at most ``tau_max``
seconds, ``K`` slots of ``E`` seconds in all, queue ``Q_0`` at the start
and ``Q_K`` at the end. They hold for any slot lengths, even ones that
depend on the choices.

**Cost.** ``max(y, 0) >= y``, so ``Q_K - Q_0`` is at least the total
overspend: the time-averaged cost per hour is at most
``beta + 3600 * (Q_K - Q_0) / E``. This holds for any choices; it means
something because the queue stays bounded. A slot raises ``Q`` by at most
``(c_max - beta) * tau_max / 3600``. A candidate ``x`` above the budget
beats a candidate ``m`` at or under it only while
``Q * (c_x - c_m) <= V * (t_m - t_x)``, so once ``Q`` exceeds
``theta = min_m max_x V * (t_m - t_x)+ / (c_x - c_m)`` (``m`` over the
candidates within the budget, ``x`` over those above it) the choice is
within the budget and ``Q`` does not grow. Hence
``Q_k <= max(Q_0, theta + (c_max - beta)+ * tau_max / 3600)`` for every
``k``, a bound of order ``V``, and the time-averaged cost exceeds the
budget by ``O(V / E)``: it tends to the budget or below. With no
candidate within the budget the controller still runs (it then takes the
cheapest candidate once ``Q`` is large enough, with ties to the faster)
and ``Q`` grows without bound, which these bounds then say nothing
about.

**Batch time.** With ``L = Q**2 / 2`` and ``d = (c_x - beta) * tau / 3600``,
``L' - L <= d**2 / 2 + Q * d``. Adding ``V * tau * t_x / 3600`` to both
sides, the right-hand side is ``d**2 / 2`` plus ``tau / 3600`` times
``V * t_x + Q * (c_x - beta)``, which the choice minimises over the
candidates and hence over any mix of them. A mix spending fractions
``lambda_x`` of the time on each candidate with ``sum lambda_x c_x <= beta``
makes that bracket at most ``V * sum lambda_x t_x``. Summing over the slots
and dropping ``L_K >= 0``::

    sum_k tau_k t_k / E <= A* + D**2 * tau_max / (7200 V) + 1800 Q_0**2 / (V E)

where ``D = max_x |c_x - beta|`` and ``A*`` is the least time-weighted
batch time ``sum lambda_x t_x`` of any mix meeting the budget
(:func:`best_mix` with ``weighting="time"``). So the time-weighted mean
batch time is within ``O(1 / V)`` of the best mix, while the overspend is
``O(V / E)``: the usual trade.

**Per batch.** Training cares about batches per second. Over a stretch
with time fractions ``lambda_x`` the mean time *per batch* is
``1 / (sum_x lambda_x / t_x)``, never more than the time-weighted mean, and
its best value under the budget is :func:`best_mix`'s default
(``weighting="batches"``). Each optimum is a single candidate or two
straddling the budget with the budget spent exactly; when both pick the
same pair they run it at the same fractions. They pick the same pair
whenever the candidates' batches per second lie on a concave increasing
curve of their cost (diminishing returns), since the reciprocal of a
concave positive function is convex, so the batch times then lie on a
convex curve. Then the controller's time per batch also approaches the
best mix's as ``V`` grows. Otherwise the controller pursues the
time-weighted optimum, which can be a different pair, slower per batch,
and the bound above says nothing about time per batch. (A penalty of
``-V / t_x``, batches per second, would make the same argument bound
the batches per second against :func:`best_mix`'s default instead.)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

__all__ = [
    "Candidate",
    "CostBounds",
    "CostController",
    "best_mix",
    "best_static",
    "cost_bounds",
]

_HOUR = 3600.0


def _check_real(name: str, value: object, *, positive: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {value!r}")
    v = float(value)
    if not math.isfinite(v) or v < 0 or (positive and v == 0):
        want = "positive" if positive else "non-negative"
        raise ValueError(f"{name} must be {want} and finite, got {value!r}")
    return v


@dataclass(frozen=True)
class Candidate:
    """One configuration the controller may run for a slot.

    Args:
        name: A label for logs.
        batch_time_s: Seconds per batch (positive).
        cost_per_hour: Price per hour, the sum over its active ranks
            (non-negative).
        config: Whatever the caller needs to apply it (partition bounds,
            shares, active ranks); the controller never looks inside.
    """

    name: str
    batch_time_s: float
    cost_per_hour: float
    config: object = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise TypeError(f"name must be a str, got {self.name!r}")
        _check_real("batch_time_s", self.batch_time_s, positive=True)
        _check_real("cost_per_hour", self.cost_per_hour)


def _check_candidates(candidates: Sequence[Candidate]) -> list[Candidate]:
    out = list(candidates)
    if not out:
        raise ValueError(f"candidates must not be empty, got {candidates!r}")
    for i, x in enumerate(out):
        if not isinstance(x, Candidate):
            raise TypeError(f"candidates[{i}] must be a Candidate, got {x!r}")
    return out


class CostController:
    """Chooses a candidate per slot, keeping spend near a budget (see the module).

    Args:
        budget_per_hour: Long-term average spend per hour to keep
            (non-negative).
        V: Weight of batch time against the queue (positive); larger
            follows batch time more closely and tolerates a larger
            overspend before correcting it.
        queue: Starting virtual queue (money already overspent; default 0).

    Raises:
        TypeError: An argument is not a number.
        ValueError: ``budget_per_hour`` or ``queue`` negative, ``V`` not
            positive, or a value not finite.
    """

    def __init__(self, budget_per_hour: float, V: float, queue: float = 0.0) -> None:
        self._budget = _check_real("budget_per_hour", budget_per_hour)
        self._v = _check_real("V", V, positive=True)
        self._queue = _check_real("queue", queue)
        self._spent = 0.0
        self._elapsed = 0.0
        self._batches = 0.0
        self._weighted_time = 0.0

    def __repr__(self) -> str:
        return (
            f"CostController(budget_per_hour={self._budget!r}, V={self._v!r}, "
            f"queue={self._queue!r})"
        )

    def choose(self, candidates: Sequence[Candidate]) -> Candidate:
        """The candidate minimising ``V * batch_time_s + queue * cost_per_hour``.

        Ties go to the first in order, so ranks given the same list and the
        same history choose alike.

        Raises:
            ValueError: ``candidates`` is empty.
            TypeError: An entry is not a :class:`Candidate`.
        """
        pool = _check_candidates(candidates)
        return min(
            pool, key=lambda x: self._v * x.batch_time_s + self._queue * x.cost_per_hour
        )

    def observe(self, candidate: Candidate, seconds: float) -> None:
        """Account for a slot of ``seconds`` run with ``candidate``.

        Raises:
            TypeError: ``candidate`` is not a :class:`Candidate`, or
                ``seconds`` not a number.
            ValueError: ``seconds`` negative or not finite.
        """
        if not isinstance(candidate, Candidate):
            raise TypeError(f"candidate must be a Candidate, got {candidate!r}")
        tau = _check_real("seconds", seconds)
        hours = tau / _HOUR
        self._queue = max(
            self._queue + (candidate.cost_per_hour - self._budget) * hours, 0.0
        )
        self._spent += candidate.cost_per_hour * hours
        self._elapsed += tau
        self._batches += tau / candidate.batch_time_s
        self._weighted_time += tau * candidate.batch_time_s

    @property
    def budget_per_hour(self) -> float:
        """The budget per hour."""
        return self._budget

    @property
    def V(self) -> float:
        """The penalty weight."""
        return self._v

    @property
    def queue(self) -> float:
        """The virtual queue: money spent above the budget, not yet made up."""
        return self._queue

    @property
    def spent(self) -> float:
        """Money spent over the observed slots."""
        return self._spent

    @property
    def elapsed_s(self) -> float:
        """Seconds of the observed slots."""
        return self._elapsed

    @property
    def average_cost_per_hour(self) -> float:
        """Spend per hour over the observed slots (``0.0`` before any)."""
        return self._spent * _HOUR / self._elapsed if self._elapsed > 0 else 0.0

    @property
    def batches(self) -> float:
        """Batches run over the observed slots (a slot's seconds over its batch time)."""
        return self._batches

    @property
    def average_batch_time_s(self) -> float:
        """Seconds per batch over the observed slots (``0.0`` before any)."""
        return self._elapsed / self._batches if self._batches > 0 else 0.0

    @property
    def time_weighted_batch_time_s(self) -> float:
        """Batch time averaged over time, the quantity the DPP bound is about."""
        return self._weighted_time / self._elapsed if self._elapsed > 0 else 0.0


def best_static(
    candidates: Sequence[Candidate], budget_per_hour: float
) -> Candidate | None:
    """The fastest single candidate within the budget (first on a tie), or ``None``.

    Raises:
        ValueError: ``candidates`` empty or ``budget_per_hour`` negative.
        TypeError: An entry is not a :class:`Candidate`.
    """
    pool = _check_candidates(candidates)
    budget = _check_real("budget_per_hour", budget_per_hour)
    within = [x for x in pool if x.cost_per_hour <= budget]
    return min(within, key=lambda x: x.batch_time_s) if within else None


def best_mix(
    candidates: Sequence[Candidate],
    budget_per_hour: float,
    *,
    weighting: Literal["batches", "time"] = "batches",
) -> float:
    """The best mean batch time of alternating candidates in time, within budget.

    A mix runs candidate ``x`` for a fraction ``lambda_x`` of the time
    (fractions of wall time, not of batches), and meets the budget when
    its time-averaged cost ``sum lambda_x c_x`` is at most the budget.
    Two means of its batch time:

    * ``"batches"`` (default): seconds per batch, the mix's time over its
      batches, ``1 / (sum_x lambda_x / t_x)``; minimising it maximises
      batches per second;
    * ``"time"``: the time-weighted mean ``sum lambda_x t_x``, the quantity
      :class:`CostController`'s bound compares with (see the module).

    Either objective is linear in the fractions (batches per second is
    ``sum lambda_x / t_x``), so the optimum is a vertex of the feasible
    set: one candidate within the budget, or two straddling it with the
    budget spent exactly, ``lambda`` on the cheaper ``i`` and ``1 - lambda``
    on the dearer ``j``, ``lambda = (c_j - beta) / (c_j - c_i)``. All such
    vertices are compared.

    Returns:
        The optimum in seconds; ``math.inf`` when every candidate costs
        more than the budget (no mix meets it).

    Raises:
        ValueError: ``candidates`` empty, ``budget_per_hour`` negative, or
            an unknown ``weighting``.
        TypeError: An entry is not a :class:`Candidate`.
    """
    pool = _check_candidates(candidates)
    budget = _check_real("budget_per_hour", budget_per_hour)
    if weighting not in ("batches", "time"):
        raise ValueError(f"weighting must be 'batches' or 'time', got {weighting!r}")

    def mean(mix: list[tuple[float, Candidate]]) -> float:
        if weighting == "time":
            return sum(f * x.batch_time_s for f, x in mix)
        return 1.0 / sum(f / x.batch_time_s for f, x in mix)

    best = math.inf
    for i in pool:
        if i.cost_per_hour > budget:
            continue
        best = min(best, i.batch_time_s)
        for j in pool:
            if j.cost_per_hour <= budget:
                continue
            lam = (j.cost_per_hour - budget) / (j.cost_per_hour - i.cost_per_hour)
            best = min(best, mean([(lam, i), (1.0 - lam, j)]))
    return best


@dataclass(frozen=True)
class CostBounds:
    """The module's guarantees for one setting (see :func:`cost_bounds`).

    Attributes:
        queue: Largest virtual queue any slot can reach (``math.inf`` when
            no candidate is within the budget).
        cost_excess_per_hour: Most the time-averaged cost per hour can
            exceed the budget over ``elapsed_s`` seconds.
        batch_time_gap_s: Most the time-weighted mean batch time can
            exceed ``best_mix(..., weighting="time")``.
    """

    queue: float
    cost_excess_per_hour: float
    batch_time_gap_s: float


def cost_bounds(
    candidates: Sequence[Candidate],
    budget_per_hour: float,
    V: float,
    max_slot_s: float,
    elapsed_s: float,
    queue: float = 0.0,
) -> CostBounds:
    """Evaluate the module's bounds for a fixed list of candidates.

    Args:
        candidates: The candidates offered at every slot.
        budget_per_hour: The controller's budget.
        V: The controller's penalty weight.
        max_slot_s: Longest slot, in seconds.
        elapsed_s: Total seconds of the slots (positive).
        queue: The controller's starting queue.

    Returns:
        The bounds; infinite where the module's argument does not apply
        (no candidate within the budget).

    Raises:
        ValueError: As :class:`CostController` and :func:`best_mix`, or
            ``elapsed_s`` not positive.
    """
    pool = _check_candidates(candidates)
    budget = _check_real("budget_per_hour", budget_per_hour)
    v = _check_real("V", V, positive=True)
    tau = _check_real("max_slot_s", max_slot_s)
    elapsed = _check_real("elapsed_s", elapsed_s, positive=True)
    q0 = _check_real("queue", queue)
    within = [m for m in pool if m.cost_per_hour <= budget]
    above = [x for x in pool if x.cost_per_hour > budget]
    if not within:
        return CostBounds(math.inf, math.inf, math.inf)
    if above:
        theta = min(
            max(
                v
                * max(m.batch_time_s - x.batch_time_s, 0.0)
                / (x.cost_per_hour - m.cost_per_hour)
                for x in above
            )
            for m in within
        )
        step = (max(x.cost_per_hour for x in above) - budget) * tau / _HOUR
        q_max = max(q0, theta + step)
    else:
        q_max = q0  # every slot lowers the queue
    spread = max(abs(x.cost_per_hour - budget) for x in pool)
    return CostBounds(
        queue=q_max,
        cost_excess_per_hour=_HOUR * max(q_max - q0, 0.0) / elapsed,
        batch_time_gap_s=spread**2 * tau / (2 * _HOUR * v)
        + _HOUR * q0**2 / (2 * v * elapsed),
    )
