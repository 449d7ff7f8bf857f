"""How long one batch takes through a pipeline schedule (pure logic).

An exact event simulation: each of ``S`` stages runs its actions from
:func:`.schedule.schedule` in order, one at a time, and an action waits for
its input. The model is the one :mod:`.partition` optimises:

* forward of micro-batch ``i`` (``m_i`` samples) on stage ``k`` computes
  for ``m_i x forward_s[k]``, its backward for ``m_i x backward_s[k]``;
* the first stage has the whole batch at ``t = 0``; the last stage starts
  a backward right after its own forward of that micro-batch;
* every other action first receives its input from a neighbour: the
  activation from stage ``k - 1`` for a forward, the gradient from stage
  ``k + 1`` for a backward. A message over boundary ``b`` takes
  ``latency + m_i x seconds_per_sample`` (``comm_s[b]``) and occupies the
  *receiver only*: it starts when the sender has produced it and the
  receiver has reached the action that needs it, and the receiver computes
  only after it. The sender posts a non-blocking send and goes on at once;
  the receiver posts its receive when it needs the input, and on shared
  memory MPI copies the message on the receiving rank's CPU.

So a stage spends, per micro-batch, its compute plus the forward message
of its incoming boundary and the gradient message of its outgoing one: the
``T_k`` whose largest value :func:`.partition.best_partition` minimises.
No schedule beats ``M x max_k T_k`` for ``M`` micro-batches, and 1F1B
reaches it in the steady state: its bottleneck stage holds enough
micro-batches in flight to stay busy. GPipe runs all forwards, then all
backwards, so its cycle is the slowest forward share plus the slowest
backward share, more than ``max_k T_k`` when the messages load the stages
differently in the two directions.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from .partition import _check_count
from .schedule import SCHEDULES, Action
from .schedule import schedule as stage_actions

__all__ = ["batch_time", "micro_sizes"]


def _check_seconds(label: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{label} must be a number, got {value!r}")
    if not 0 <= value < math.inf:
        raise ValueError(f"{label} must be finite and >= 0, got {value!r}")
    return float(value)


def _sequence(label: str, values: object, length: int | None = None) -> Sequence:
    if isinstance(values, str | bytes) or not isinstance(values, Sequence):
        raise TypeError(f"{label} must be a sequence, got {values!r}")
    if length is not None and len(values) != length:
        raise ValueError(f"{label} must hold {length} values, got {len(values)}")
    return values


def micro_sizes(samples: int, micro_batches: int) -> list[int]:
    """How ``samples`` samples split into at most ``micro_batches`` micro-batches.

    The rule of ``hybridagg.train.worker.step.pass_sizes`` (and of
    ``torch.tensor_split``): sizes differ by at most one, larger first, and
    no micro-batch is empty (fewer than ``micro_batches`` samples give one
    micro-batch per sample).

    Args:
        samples: The batch (0: no micro-batch).
        micro_batches: The most micro-batches.

    Raises:
        TypeError: A count is not an int.
        ValueError: A negative batch, or fewer than one micro-batch.
    """
    n = _check_count("samples", samples, 0)
    k = min(n, _check_count("micro_batches", micro_batches, 1))
    if k == 0:
        return []
    base, extra = divmod(n, k)
    return [base + 1] * extra + [base] * (k - extra)


def _check_inputs(
    forward_s: Sequence[float],
    backward_s: Sequence[float],
    comm_s: Sequence[tuple[float, float]],
    sizes: Sequence[int],
    schedule: str,
) -> tuple[list[float], list[float], list[tuple[float, float]], list[int]]:
    stages = len(_sequence("forward_s", forward_s))
    if stages == 0:
        raise ValueError("forward_s must hold at least one stage, got none")
    _sequence("backward_s", backward_s, stages)
    _sequence("comm_s", comm_s, stages - 1)
    if schedule not in SCHEDULES:
        raise ValueError(
            f"schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}"
        )
    fwd = [_check_seconds(f"forward_s[{k}]", v) for k, v in enumerate(forward_s)]
    bwd = [_check_seconds(f"backward_s[{k}]", v) for k, v in enumerate(backward_s)]
    links = []
    for b, pair in enumerate(comm_s):
        if len(_sequence(f"comm_s[{b}]", pair)) != 2:
            raise ValueError(
                f"comm_s[{b}] must be (latency_s, seconds_per_sample), got {pair!r}"
            )
        links.append(
            (
                _check_seconds(f"comm_s[{b}] latency", pair[0]),
                _check_seconds(f"comm_s[{b}] seconds per sample", pair[1]),
            )
        )
    sizes = [
        _check_count(f"micro_sizes[{i}]", m, 1)
        for i, m in enumerate(_sequence("micro_sizes", sizes))
    ]
    return fwd, bwd, links, sizes


class _Pipeline:
    """The state of the simulation: when each stage is free, when each action ended."""

    def __init__(
        self,
        forward_s: list[float],
        backward_s: list[float],
        comm_s: list[tuple[float, float]],
        sizes: list[int],
    ) -> None:
        self.forward_s, self.backward_s, self.comm_s = forward_s, backward_s, comm_s
        self.sizes = sizes
        self.stages = len(forward_s)
        self.free = [0.0] * self.stages
        # ended[(kind, stage, micro)]: when that action's compute finished
        self.ended: dict[tuple[str, int, int], float] = {}

    def _source(self, k: int, action: Action) -> tuple[int, int] | None:
        """The (stage, boundary) the input of ``action`` on ``k`` comes from."""
        if action.kind == "F":
            return (k - 1, k - 1) if k > 0 else None
        return (k + 1, k) if k < self.stages - 1 else None

    def try_run(self, k: int, action: Action) -> bool:
        """Run ``action`` on stage ``k`` if its input exists; whether it ran."""
        m = self.sizes[action.micro]
        start = self.free[k]
        source = self._source(k, action)
        if source is not None:
            sent = self.ended.get((action.kind, source[0], action.micro))
            if sent is None:
                return False
            latency, per_sample = self.comm_s[source[1]]
            start = max(start, sent) + latency + m * per_sample
        per_sample = self.forward_s[k] if action.kind == "F" else self.backward_s[k]
        self.free[k] = start + m * per_sample
        self.ended[(action.kind, k, action.micro)] = self.free[k]
        return True


def batch_time(
    forward_s: Sequence[float],
    backward_s: Sequence[float],
    comm_s: Sequence[tuple[float, float]],
    micro_sizes: Sequence[int],
    schedule: str = "1f1b",
) -> float:
    """Seconds from the start of a batch to the end of its last backward.

    Args:
        forward_s: ``S`` seconds per sample of each stage's forward, already
            divided by its rank's speed.
        backward_s: ``S`` seconds per sample of each stage's backward.
        comm_s: ``S - 1`` pairs ``(latency_s, seconds_per_sample)``, one per
            boundary between stage ``k`` and ``k + 1``.
        micro_sizes: Samples of each micro-batch (uneven sizes allowed; see
            :func:`micro_sizes`); none: an empty batch takes no time.
        schedule: ``"1f1b"`` or ``"gpipe"``.

    Returns:
        When the last backward of the first stage ends, all stages free and
        the batch at the first stage at ``t = 0``.

    Raises:
        TypeError: An argument of the wrong type.
        ValueError: A length that does not match, a negative or infinite
            time, an empty micro-batch, or an unknown schedule.
    """
    fwd, bwd, links, sizes = _check_inputs(
        forward_s, backward_s, comm_s, micro_sizes, schedule
    )
    pipe = _Pipeline(fwd, bwd, links, sizes)
    todo = [
        stage_actions(schedule, k, pipe.stages, len(sizes)) for k in range(pipe.stages)
    ]
    done = [0] * pipe.stages
    # each sweep runs every stage as far as its inputs allow; a valid
    # schedule always lets some stage move, so a sweep without progress is a bug
    while any(d < len(t) for d, t in zip(done, todo, strict=True)):
        moved = False
        for k in range(pipe.stages):
            while done[k] < len(todo[k]) and pipe.try_run(k, todo[k][done[k]]):
                done[k] += 1
                moved = True
        if not moved:
            raise RuntimeError(f"pipeline schedule {schedule!r} deadlocked")
    return max(pipe.free)
