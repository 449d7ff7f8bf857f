"""Server 0's batch-size advice to the groups (adaptive batching across groups).

Each push carries its group's compute seconds per sample; server 0 feeds
them to a :class:`~hybridagg.batching.BatchController` over the groups and
sends each group its batch in the ``advice`` field of its replies, so
groups reach the servers at similar rates. A window is ``window x G``
pushes of any group: about ``window`` per group.
"""

from __future__ import annotations

from collections.abc import Callable

from ..batching import BatchController, Decision

__all__ = ["BatchAdvisor"]


class BatchAdvisor:
    """The batch of each group, decided from the times the pushes report.

    Args:
        options: ``initial`` (each group's batch), ``deadband``,
            ``smoothing``, ``window`` and optionally ``first_window``
            (pushes per group per decision), ``shift`` and ``shift_steps``
            (pushes of a group; see :mod:`hybridagg.batching`), ``min_batch``,
            ``max_group_batch``.
        num_groups: Number of groups ``G``.
        on_batch: Called ``f(version, decision)`` for every change.

    Attributes:
        assigned: The batch each group is told.
        decisions: ``(version, old, new, seconds_per_sample)`` of every change.
    """

    def __init__(
        self,
        options: dict,
        num_groups: int,
        on_batch: Callable[[int, Decision], None] | None = None,
    ) -> None:
        shift = {k: options[k] for k in ("shift", "shift_steps") if k in options}
        self.controller = BatchController(
            batches=options["initial"],
            deadband=options["deadband"],
            smoothing=options["smoothing"],
            window=1,  # this class counts the pushes of a window itself
            min_batch=options["min_batch"],
            max_batch=options.get("max_group_batch"),
            **shift,
        )
        self.window = max(1, int(options["window"])) * num_groups
        first = options.get("first_window") or options["window"]
        self.first_window = max(1, int(first)) * num_groups
        self.assigned = list(self.controller.batches)
        self.decisions: list[tuple] = []
        self.on_batch = on_batch
        self._pushes = 0

    def advice(self, group: int) -> float:
        """The batch to tell ``group``, as the reply field carries it."""
        return float(self.assigned[group])

    def observe(
        self, group: int, seconds_per_sample: float, samples: float, version: int
    ) -> None:
        """Take in one push; at the end of a window, maybe change the batches.

        Args:
            group: The pushing group.
            seconds_per_sample: Its reported compute time per sample (0: none).
            samples: Samples in the push.
            version: The server's version, recorded with a decision.
        """
        if seconds_per_sample <= 0 or samples <= 0:
            return
        ctl = self.controller
        ctl.add(group, seconds_per_sample * samples, samples)
        self._pushes += 1
        unknown = any(e is None for e in ctl.estimate)
        # a group whose speed shifted closes the window at once (see batching)
        if self._pushes < (self.first_window if unknown else self.window) and not (
            ctl.shifted()
        ):
            return
        self._pushes = 0
        decision = ctl.decide()
        if decision is None:
            return
        self.assigned = list(decision.new)
        self.decisions.append(
            (version, decision.old, decision.new, decision.seconds_per_sample)
        )
        if self.on_batch is not None:
            self.on_batch(version, decision)
