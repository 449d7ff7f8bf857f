"""Online control of a heterogeneous job (pure logic).

:mod:`.shares` splits a global batch across groups whose batch time is
affine in their share (Ling et al.'s linear solve); :mod:`.cost` trades
batch time against a long-term cost budget with Lyapunov drift-plus-penalty;
:mod:`.slots` turns measured groups and their prices into the controller's
candidates and charges each slot of a run.

This package is layer 0: it imports nothing from hybridagg but
:mod:`hybridagg.batching` (whose rounding it shares), and neither MPI nor
torch, so every rank can run it on the same measurements and reach the
same decision.
"""

from __future__ import annotations

from .cost import (
    Candidate,
    CostBounds,
    CostController,
    best_mix,
    best_static,
    cost_bounds,
)
from .shares import ShareSolver, affine_shares, affine_time, fit_affine
from .slots import CostSlots, GroupChoice, SlotRecord, group_candidates

__all__ = [
    "Candidate",
    "CostBounds",
    "CostController",
    "CostSlots",
    "GroupChoice",
    "ShareSolver",
    "SlotRecord",
    "affine_shares",
    "affine_time",
    "best_mix",
    "best_static",
    "cost_bounds",
    "fit_affine",
    "group_candidates",
]
