"""``--cost-budget`` in a pipelined sync job: which groups train, slot by slot.

Every rank holds one :class:`GroupCostControl` and feeds it the same
numbers (the groups' batch times and each round's seconds, gathered at
the step's agreement), so every rank parks and brings back the same groups
at the same step without another message. The policy is
:mod:`hybridagg.control.slots`; this module only ties it to the run's
options, the share solver and the log.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from ...control import (
    CostController,
    CostSlots,
    GroupChoice,
    ShareSolver,
    SlotRecord,
    group_candidates,
)
from ..config import TrainConfig

__all__ = ["GroupCostControl"]

log = logging.getLogger("hybridagg.train")


class GroupCostControl:
    """Slots of ``--cost-slot`` rounds under ``--cost-budget``.

    Args:
        cfg: The run's options (``cost_budget`` set).
        solver: The groups' share solver (its windows are the groups'
            measured batch times).
        group_prices: Each group's price per hour (its ranks' sum).
        shares: The starting split.
    """

    def __init__(
        self,
        cfg: TrainConfig,
        solver: ShareSolver,
        group_prices: Sequence[float],
        shares: Sequence[int],
    ) -> None:
        self.cfg, self.solver = cfg, solver
        self.prices = [float(p) for p in group_prices]
        self.total = int(sum(shares))
        self.slots = CostSlots(
            CostController(cfg.cost_budget, cfg.cost_v),
            self.prices,
            cfg.cost_slot,
            shares,
        )

    def round(self, seconds: float) -> SlotRecord | None:
        """Count a round of ``seconds``; at a slot's end, charge it and choose.

        Returns:
            The finished slot's record (its choice is what ran; the next
            one is :attr:`choice`), or ``None`` mid-slot.
        """
        if not self.slots.step(seconds):
            return None
        candidates = None
        if self.solver.ready():
            candidates = group_candidates(
                self.solver.fits(),
                self.prices,
                self.total,
                low=self.cfg.min_batch,
                high=self.cfg.max_batch,
            )
        self.slots.end_slot(candidates)
        return self.slots.records[-1] if self.slots.records else None

    @property
    def choice(self) -> GroupChoice:
        """What the current slot runs."""
        return self.slots.current

    def finish(self) -> dict:
        """Charge the last, partial slot; the run's cost account (for the summary)."""
        self.slots.charge()
        ctl = self.slots.controller
        records = self.slots.records
        parked_s = [0.0] * len(self.prices)
        for r in records:
            for g in r.choice.parked:
                parked_s[g] += r.seconds
        return {
            "budget_per_hour": ctl.budget_per_hour,
            "V": ctl.V,
            "slot_rounds": self.slots.slot_steps,
            "group_prices_per_hour": list(self.prices),
            "spent": ctl.spent,
            "seconds": ctl.elapsed_s,
            "average_cost_per_hour": ctl.average_cost_per_hour,
            "queue": ctl.queue,
            "slots": len(records),
            "parked_seconds": parked_s,
            "choices": [
                {
                    "active": list(r.choice.active),
                    "shares": list(r.choice.shares),
                    "rounds": r.steps,
                    "seconds": r.seconds,
                    "cost_per_hour": r.cost_per_hour,
                    "predicted_s": r.predicted_s,
                    "queue": r.queue,
                }
                for r in records
            ],
        }
