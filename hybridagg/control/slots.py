"""Which groups train, slot by slot, under a cost budget (pure logic).

Ling et al.'s online controller (TPDS 2024) decides, once per time slot,
which devices are active and how the global batch is split among them,
minimising ``V x batch time + Q x cost`` (:class:`~.cost.CostController`).
Here the unit that can be parked is a *group*: a pipelined group's stages
hold one replica between them, so parking one stage would stop the whole
group anyway, and a data-parallel job's groups are its replicas.

* :func:`group_candidates` turns the groups' measured affine batch times
  (:meth:`~.shares.ShareSolver.fits`) and their prices into the controller's
  candidates: every set of active groups (or, with many groups, the nested
  sets ordered by samples per second per dollar), each with the linear
  solve's shares and the batch time those shares predict.
* :class:`CostSlots` cuts the run into slots of a fixed number of steps,
  charges each slot its active groups' prices times the slot's *measured*
  seconds, and asks the controller for the next slot's candidate.

Both are deterministic in their inputs, so every rank that feeds them the
same measurements (gathered at the step's agreement) takes the same
decision without another message.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import combinations

from .cost import Candidate, CostController
from .shares import affine_shares, affine_time

__all__ = ["CostSlots", "GroupChoice", "SlotRecord", "group_candidates"]

# Beyond this many groups the 2**G - 1 sets are too many to weigh each slot;
# the nested sets by efficiency are G of them.
EXHAUSTIVE_GROUPS = 10


@dataclass(frozen=True)
class GroupChoice:
    """What a candidate runs: the active groups and every group's share.

    Attributes:
        active: Indices of the groups that train (ascending).
        shares: Samples per step of every group, zero for a parked one.
    """

    active: tuple[int, ...]
    shares: tuple[int, ...]

    @property
    def parked(self) -> tuple[int, ...]:
        """The groups that do not train."""
        return tuple(g for g in range(len(self.shares)) if g not in self.active)


def _per_group(name: str, value, n: int) -> list:
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        if len(value) != n:
            raise ValueError(
                f"{name} must have one entry per group ({n}), got {len(value)}: {value!r}"
            )
        return list(value)
    return [value] * n


def _label(active: Sequence[int], n: int) -> str:
    if len(active) == n:
        return "all groups"
    return "groups " + ",".join(str(g) for g in active)


def group_candidates(
    fits: Sequence[tuple[float, float]],
    prices_per_hour: Sequence[float],
    total: int,
    *,
    low: Sequence[int] | int = 1,
    high: Sequence[int | None] | int | None = None,
) -> list[Candidate]:
    """The controller's candidates: sets of active groups with their shares.

    For each set, the shares are :func:`~.shares.affine_shares` of ``total``
    among its groups (the others get zero) and the batch time is
    :func:`~.shares.affine_time` of those shares. Its cost is the sum of
    its groups' prices. With at most ``EXHAUSTIVE_GROUPS`` groups every
    non-empty set is a candidate; beyond, the sets are the prefixes of the
    groups sorted by samples per second per dollar (``1 / (a_g * price)``,
    free groups first): the fractional knapsack's order, so with zero
    intercepts and no binding bounds each prefix is the fastest set at its
    own price, and between those prices the sets are a heuristic. A set
    whose bounds cannot hold ``total`` is left out.

    Candidates come larger sets first, then in lexicographic order, so a
    tie in the controller keeps more groups at work.

    Args:
        fits: Each group's ``(seconds per sample, fixed seconds per batch)``.
        prices_per_hour: Each group's price per hour (the sum over its ranks).
        total: The global batch.
        low: Smallest share of an active group, for all or per group.
        high: Largest share of an active group (``None``: no cap).

    Returns:
        The candidates; each one's ``config`` is a :class:`GroupChoice`.

    Raises:
        ValueError: Lengths that differ, a negative or non-finite price, a
            bad fit (as :func:`~.shares.affine_shares`), or no set that can
            hold ``total``.
    """
    n = len(fits)
    if n == 0:
        raise ValueError("fits must name at least one group")
    prices = [float(p) for p in prices_per_hour]
    if len(prices) != n:
        raise ValueError(
            f"prices_per_hour must have one entry per group ({n}), got {len(prices)}"
        )
    if any(not (math.isfinite(p) and p >= 0) for p in prices):
        raise ValueError(f"prices must be non-negative and finite, got {prices}")
    slopes = [float(a) for a, _ in fits]
    intercepts = [float(c) for _, c in fits]
    lows = _per_group("low", low, n)
    highs = [total if h is None else h for h in _per_group("high", high, n)]
    if n <= EXHAUSTIVE_GROUPS:
        sets = [s for k in range(n, 0, -1) for s in combinations(range(n), k)]
    else:
        order = sorted(range(n), key=lambda g: (slopes[g] * prices[g], g))
        sets = [tuple(sorted(order[:k])) for k in range(n, 0, -1)]
    out: list[Candidate] = []
    for active in sets:
        lo = [lows[g] if g in active else 0 for g in range(n)]
        hi = [highs[g] if g in active else 0 for g in range(n)]
        if sum(lo) > total or sum(hi) < total:
            continue
        shares = affine_shares(slopes, intercepts, total, low=lo, high=hi)
        out.append(
            Candidate(
                _label(active, n),
                affine_time(slopes, intercepts, shares),
                sum(prices[g] for g in active),
                GroupChoice(tuple(active), tuple(shares)),
            )
        )
    if not out:
        raise ValueError(
            f"no set of groups can hold a batch of {total} samples within "
            f"the share bounds {lows}..{highs}"
        )
    return out


@dataclass(frozen=True)
class SlotRecord:
    """One finished slot, as charged.

    Attributes:
        choice: What ran.
        steps: Steps in the slot.
        seconds: The slot's measured seconds.
        cost_per_hour: Its active groups' prices.
        batch_time_s: Measured seconds per step.
        predicted_s: The candidate's predicted batch time (``None`` for a
            slot run before the groups were measured).
        queue: The controller's queue after the slot.
    """

    choice: GroupChoice
    steps: int
    seconds: float
    cost_per_hour: float
    batch_time_s: float
    predicted_s: float | None
    queue: float


class CostSlots:
    """Slots of ``slot_steps`` steps, each charged and followed by a choice.

    The run starts with every group active at ``shares``; a slot ends after
    ``slot_steps`` steps, and :meth:`end_slot` charges it (its active groups'
    prices times its measured seconds, :meth:`CostController.observe`) and
    asks the controller for the next slot.

    Args:
        controller: The drift-plus-penalty controller.
        prices_per_hour: Each group's price per hour.
        slot_steps: Steps per slot (at least 1).
        shares: The starting split (every group active).

    Raises:
        ValueError: ``slot_steps`` below 1, or ``shares`` and the prices of
            different lengths.
    """

    def __init__(
        self,
        controller: CostController,
        prices_per_hour: Sequence[float],
        slot_steps: int,
        shares: Sequence[int],
    ) -> None:
        if isinstance(slot_steps, bool) or not isinstance(slot_steps, int):
            raise TypeError(f"slot_steps must be an int, got {slot_steps!r}")
        if slot_steps < 1:
            raise ValueError(f"slot_steps must be >= 1, got {slot_steps}")
        self.controller = controller
        self.prices = [float(p) for p in prices_per_hour]
        if len(self.prices) != len(shares):
            raise ValueError(
                f"{len(self.prices)} prices for {len(shares)} groups: one each"
            )
        self.slot_steps = slot_steps
        n = len(self.prices)
        self.current = GroupChoice(tuple(range(n)), tuple(int(s) for s in shares))
        self.predicted: float | None = None
        self.records: list[SlotRecord] = []
        self._steps = 0
        self._seconds = 0.0

    def step(self, seconds: float) -> bool:
        """Count one step of ``seconds``; ``True`` when the slot is complete."""
        if not (math.isfinite(seconds) and seconds >= 0):
            raise ValueError(f"seconds must be non-negative and finite, got {seconds}")
        self._steps += 1
        self._seconds += seconds
        return self._steps >= self.slot_steps

    def cost_of(self, choice: GroupChoice) -> float:
        """The price per hour of ``choice``'s active groups."""
        return sum(self.prices[g] for g in choice.active)

    def charge(self) -> SlotRecord | None:
        """Charge the steps counted since the last charge (``None`` if none)."""
        if self._steps == 0 or self._seconds <= 0:
            self._steps, self._seconds = 0, 0.0
            return None
        price = self.cost_of(self.current)
        per_step = self._seconds / self._steps
        self.controller.observe(
            Candidate("ran", per_step, price, self.current), self._seconds
        )
        record = SlotRecord(
            self.current,
            self._steps,
            self._seconds,
            price,
            per_step,
            self.predicted,
            self.controller.queue,
        )
        self.records.append(record)
        self._steps, self._seconds = 0, 0.0
        return record

    def end_slot(self, candidates: Sequence[Candidate] | None) -> GroupChoice:
        """Charge the slot; choose the next one from ``candidates``.

        Args:
            candidates: From :func:`group_candidates`; ``None`` while the
                groups are not all measured yet (every group stays active).

        Returns:
            The choice for the next slot (also :attr:`current`).
        """
        self.charge()
        if candidates is not None:
            pick = self.controller.choose(candidates)
            if not isinstance(pick.config, GroupChoice):
                raise TypeError(
                    f"a candidate's config must be a GroupChoice, got {pick.config!r}"
                )
            self.current, self.predicted = pick.config, pick.batch_time_s
        return self.current

    @property
    def spent(self) -> float:
        """Money charged so far."""
        return self.controller.spent

    @property
    def elapsed_s(self) -> float:
        """Seconds charged so far."""
        return self.controller.elapsed_s
