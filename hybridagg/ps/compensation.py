"""Large-mini-batch compensation: one learning-rate rule for every mode.

The user's ``lr`` is the rate for one worker's batch of the reference size
(the user's ``--batch-size``). An update built from ``samples`` samples gets

    lr_update = lr x warmup(u) x damping(staleness)

where, with ``k = samples / reference_batch`` (the linear scaling rule of
Goyal et al.), the warm-up ramps the scale from 1 to ``k`` over the first
``warmup_updates`` updates (``u`` counts updates: all-reduce steps in sync,
server versions in hybrid and async)::

    warmup(u) = 1 + (k - 1) x min(1, u / warmup_updates)      (k once warm)

and ``staleness`` is the server's version when the update is applied minus
the version the gradient was computed from. Damping rules:

``inverse`` (default)  1 / (1 + staleness)
``sqrt``               1 / sqrt(1 + staleness)
``none``               1

In ``sync`` mode an update holds every worker's samples and staleness is 0;
in ``hybrid`` a group's samples; in ``async`` one worker's.

Momentum lookahead (``lookahead=True``, for optimizers with a momentum
buffer such as SGD): a gradient sent now is applied about ``tau`` updates
later, and until then the weights keep moving along the momentum. So the
servers answer a push with the weights they expect at that point instead of
the current ones, ``w - lr_g x lookahead_factor(mu, tau_g) x buf`` (the
momentum-only path of the next ``tau_g`` updates), where ``tau_g`` is a
running mean of the group's measured staleness and ``lr_g`` the rate of the
group's own undamped updates. The group then computes its next gradient
close to where it will be applied, which is the idea of DANA (Hakimi et al.,
2019). Only groups whose running staleness is at most ``lookahead_horizon``
get a prediction; by default that is the number of groups ``G``, one update
more than the ``G - 1`` every group sees when all run at one speed. A group
much slower than the rest lands its gradient after many fresh ones from the
others, which the decaying momentum does not foresee: predicting that far
made training slower or gained nothing (bench/RESULTS.md, "The servers'
momentum lookahead"). ``lr_g`` is undamped while the updates in between are
damped, so this is an extrapolation whose gain was measured rather than an
exact forecast. With ``overlap`` every gradient is about ``G`` updates later,
so several groups need a larger horizon. The running staleness is not
checkpointed. Validation pulls and the final weights are the true
weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["DAMPING_RULES", "Compensation", "damping", "lookahead_factor", "lr_scale"]

DAMPING_RULES = ("inverse", "sqrt", "none")


def damping(staleness: int, rule: str = "inverse") -> float:
    """The factor an update of this staleness is damped by.

    Raises:
        ValueError: Negative staleness or an unknown rule.
    """
    if staleness < 0:
        raise ValueError(f"staleness must be >= 0, got {staleness}")
    if rule == "inverse":
        return 1.0 / (1.0 + staleness)
    if rule == "sqrt":
        return 1.0 / math.sqrt(1.0 + staleness)
    if rule == "none":
        return 1.0
    raise ValueError(f"damping rule must be one of {DAMPING_RULES}, got {rule!r}")


def lookahead_factor(momentum: float, staleness: float) -> float:
    """Learning rates' worth of momentum buffer the weights move in ``staleness`` updates.

    With no new gradients the buffer decays by ``momentum`` per update, so the
    weights move by ``lr x buf x (m + m**2 + ... + m**tau)``; ``staleness``
    may be fractional (a running mean).

    Raises:
        ValueError: ``momentum`` outside ``[0, 1)`` or negative ``staleness``.
    """
    if not 0.0 <= momentum < 1.0:
        raise ValueError(f"momentum must be in [0, 1) for a lookahead, got {momentum}")
    if staleness < 0:
        raise ValueError(f"staleness must be >= 0, got {staleness}")
    if momentum == 0.0:
        return 0.0
    return momentum * (1.0 - momentum**staleness) / (1.0 - momentum)


@dataclass(frozen=True)
class Compensation:
    """Settings of the learning-rate rule (see the module docstring).

    Attributes:
        reference_batch: Samples of one worker's batch at which ``lr`` is
            the user's rate; ``None`` turns linear scaling off (the rate is
            used as is, as plain PyTorch would).
        warmup_updates: Updates over which the scale ramps from 1 to ``k``.
        staleness: Damping rule: ``"inverse"``, ``"sqrt"`` or ``"none"``.
        lookahead: Answer pushes with the weights expected when the group's
            next gradient lands (see the module docstring).
        lookahead_horizon: Largest running staleness (in updates) a group
            may have and still get a lookahead (``None``: the number of
            groups).
    """

    reference_batch: float | None = None
    warmup_updates: int = 0
    staleness: str = "inverse"
    lookahead: bool = False
    lookahead_horizon: float | None = None

    def __post_init__(self) -> None:
        if self.reference_batch is not None and not self.reference_batch > 0:
            raise ValueError(
                f"reference_batch must be positive, got {self.reference_batch}"
            )
        if self.warmup_updates < 0:
            raise ValueError(f"warmup_updates must be >= 0, got {self.warmup_updates}")
        if self.lookahead_horizon is not None and not self.lookahead_horizon >= 0:
            raise ValueError(
                f"lookahead_horizon must be >= 0, got {self.lookahead_horizon}"
            )
        if self.staleness not in DAMPING_RULES:
            raise ValueError(
                f"staleness damping must be one of {DAMPING_RULES}, got {self.staleness!r}"
            )

    def scale(self, samples: float, update: int, staleness: int = 0) -> float:
        """The factor on the user's lr for one update (see :func:`lr_scale`)."""
        return lr_scale(
            samples,
            update,
            staleness,
            reference_batch=self.reference_batch,
            warmup_updates=self.warmup_updates,
            rule=self.staleness,
        )


def lr_scale(
    samples: float,
    update: int,
    staleness: int = 0,
    *,
    reference_batch: float | None,
    warmup_updates: int = 0,
    rule: str = "inverse",
) -> float:
    """The factor on the user's lr for one update of ``samples`` samples.

    Args:
        samples: Samples in the update.
        update: Index of the update (0 for the first).
        staleness: Server version at apply time minus the gradient's version.
        reference_batch: One worker's batch (``None``: no linear scaling).
        warmup_updates: Length of the warm-up in updates.
        rule: Staleness damping rule.
    """
    if samples < 0:
        raise ValueError(f"samples must be >= 0, got {samples}")
    k = 1.0 if reference_batch is None else samples / reference_batch
    if warmup_updates > 0:
        k = 1.0 + (k - 1.0) * min(1.0, update / warmup_updates)
    return k * damping(staleness, rule)
