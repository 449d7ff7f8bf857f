"""Which groups get a momentum lookahead, and how far (pure logic).

The servers may answer a push with the weights expected when the group's
next gradient lands (:mod:`hybridagg.ps.compensation` explains the idea).
How far to look is each group's running mean of its measured staleness,
and at which rate the rate of the group's own updates without damping;
this module keeps both, per group. The weights themselves are moved by
:meth:`hybridagg.ps.store.ShardStore.predict`.
"""

from __future__ import annotations

from .compensation import Compensation

__all__ = ["TAU_WEIGHT", "Lookahead"]

# weight of the newest staleness in a group's running mean
TAU_WEIGHT = 0.3


class Lookahead:
    """Each group's running staleness and the rates of its predictions.

    Args:
        compensation: The learning-rate rule (``lookahead`` turns this on;
            ``lookahead_horizon`` bounds it).
        num_groups: Number of groups ``G``.

    Attributes:
        enabled: Whether any reply is a prediction.
        horizon: Largest running staleness that still gets one (default ``G``).
        tau: Each group's running mean of its staleness; it starts at
            ``G - 1``, the staleness of groups that all run at one speed.
        rates: The rates of each group's last update, undamped (``None``
            before its first push).
    """

    def __init__(self, compensation: Compensation, num_groups: int) -> None:
        self.compensation = compensation
        self.enabled = compensation.lookahead
        horizon = compensation.lookahead_horizon
        self.horizon = float(num_groups) if horizon is None else horizon
        self.tau = [float(num_groups - 1)] * num_groups
        self.rates: list[list[float] | None] = [None] * num_groups

    def observe(
        self,
        group: int,
        staleness: int,
        lrs: list[float],
        samples: float,
        version: int,
    ) -> None:
        """Take in a push: its staleness and its group's rates.

        Args:
            group: The pushing group.
            staleness: The push's staleness.
            lrs: The user's rates forwarded with it.
            samples: Samples in the push.
            version: The server's version before applying it.
        """
        if not self.enabled:
            return
        self.tau[group] += TAU_WEIGHT * (staleness - self.tau[group])
        undamped = self.compensation.scale(samples, version, 0)
        self.rates[group] = [lr * undamped for lr in lrs]

    def predicts(self, group: int) -> bool:
        """Whether the answer to ``group``'s push is a prediction."""
        tau = self.tau[group]
        return (
            self.enabled and self.rates[group] is not None and 0 < tau <= self.horizon
        )
