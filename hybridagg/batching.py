"""Adaptive batch sizes: OmniLearn's proportional controller (pure logic).

OmniLearn (Tyagi and Sharma, IEEE TPDS 2025) balances a heterogeneous job by
giving each worker a batch proportional to its measured throughput, so every
worker's step takes about as long. From each worker's compute time per step
``t_i`` and batch ``b_i``::

    b_i' = b_i x t_mean / t_i

applied only when some worker's relative change passes a dead-band (default
0.2, so noise does not make batches flap), clipped to per-worker bounds (a
maximum stands for device memory) with the clipped remainder shared among
the others, and rescaled so the total stays what the user asked for (in sync
mode the global batch, and with it the learning rate, is unchanged).

hybridagg measures seconds per *sample* (a step's compute time over its
batch, summed over a window of steps and smoothed across windows), which
makes the rule ``b_i' proportional to 1 / s_i`` and lets it follow speeds
that change during the run.

Smoothing follows noise well and a real change of speed badly: when a
worker's speed changes by a large factor (another job lands on its node,
its clock drops), the smoothed estimate keeps half the old speed after one
window and a quarter after two, and the window itself, counted in steps,
lasts as long as the newly slow worker's steps. So each step is also
compared with the estimate (:func:`shift_direction`): a worker whose seconds
per sample leave ``[1 / (1 + shift), 1 + shift]`` times its estimate for
``shift_steps`` steps in a row has *shifted*; the window closes at once, and
that worker's estimate is replaced by what those steps measured, not
blended with the history that no longer describes it. The same controller runs

* in ``sync`` mode on every worker, on the times all workers share through
  the gradient all-reduce (every worker reaches the same decision);
* in ``hybrid`` mode inside each group (the group's total batch kept), and
  optionally on server 0 across groups, sizing each group's batch so groups
  reach the server at similar rates;
* in ``async`` mode on server 0, across the workers (OmniLearn's
  asynchronous variant), which tells each worker its batch in its replies.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["BatchController", "Decision", "proportional_batches", "shift_direction"]


def _largest_remainder(shares: Sequence[float], total: int) -> list[int]:
    floors = [int(s) for s in shares]
    rest = total - sum(floors)
    order = sorted(
        range(len(shares)), key=lambda i: shares[i] - floors[i], reverse=True
    )
    for i in order[: max(0, rest)]:
        floors[i] += 1
    return floors


def proportional_batches(
    rates: Sequence[float],
    total: int,
    *,
    low: Sequence[int] | int = 1,
    high: Sequence[int | None] | int | None = None,
) -> list[int]:
    """Split ``total`` samples in proportion to ``rates``, within bounds.

    Workers whose share falls outside ``[low, high]`` are clipped and the
    remainder is shared among the others in proportion to their rates
    (water-filling), then rounded by largest remainder so the sum is exact.

    Raises:
        ValueError: A rate is not positive, or the bounds cannot hold ``total``.
    """
    n = len(rates)
    if n == 0 or any(not r > 0 for r in rates):
        raise ValueError(f"rates must be positive, got {list(rates)}")
    lows = [low] * n if isinstance(low, int) else list(low)
    highs = [high] * n if high is None or isinstance(high, int) else list(high)
    highs = [total if h is None else h for h in highs]
    if sum(lows) > total or sum(highs) < total:
        raise ValueError(
            f"batch bounds {lows}..{highs} cannot hold a total of {total} samples"
        )
    fixed: dict[int, float] = {}
    while True:
        free = [i for i in range(n) if i not in fixed]
        left = total - sum(fixed.values())
        weight = sum(rates[i] for i in free)
        shares = {i: left * rates[i] / weight for i in free}
        clipped = {
            i: min(max(s, lows[i]), highs[i])
            for i, s in shares.items()
            if s < lows[i] or s > highs[i]
        }
        if not clipped:
            break
        fixed.update(clipped)
    all_shares = [fixed.get(i, shares.get(i, 0.0)) for i in range(n)]
    out = _largest_remainder(all_shares, total)
    return [min(max(b, lows[i]), highs[i]) for i, b in enumerate(out)]


def shift_direction(measured: float, believed: float, shift: float) -> int:
    """Whether one measurement of seconds per sample departs from the estimate.

    Args:
        measured: Seconds per sample of one step (or push).
        believed: The worker's current estimate.
        shift: Relative departure that counts (``0.5``: 1.5 times slower, or
            1.5 times faster); ``0`` turns detection off.

    Returns:
        ``1`` (slower by more than ``shift``), ``-1`` (faster by more than
        ``shift``) or ``0`` (within the band, or detection off).
    """
    if shift <= 0 or not measured > 0 or not believed > 0:
        return 0
    if measured > believed * (1 + shift):
        return 1
    if measured * (1 + shift) < believed:
        return -1
    return 0


@dataclass
class Decision:
    """One change of batch sizes."""

    old: list[int]
    new: list[int]
    seconds_per_sample: list[float]


@dataclass
class BatchController:
    """Turns measured step times into batch sizes (identical input, identical output).

    Args:
        batches: Current batch of each worker (or group).
        total: Samples per round to keep (default: the sum of ``batches``).
        deadband: Minimum relative change of some worker's batch to act on.
        smoothing: Weight of the newest window in the running estimate of
            each worker's seconds per sample (1: no memory).
        window: Steps per measurement window (a decision after each).
        first_window: Steps of the first window, before any estimate
            exists (default: ``window``). The initial split is blind, so an
            early first decision recovers most of the imbalance; later
            windows refine it with ``smoothing``.
        min_batch: Smallest batch of a worker.
        max_batch: Largest batch of a worker (device memory), or ``None``.
        shift: Relative departure of one step's seconds per sample from a
            worker's estimate that counts as a change of its speed (see the
            module); ``0`` turns detection off.
        shift_steps: Steps in a row, each departing the same way, that
            make a shift. Steps with less than half a worker's batch (the
            end of an epoch, where fixed costs weigh more per sample)
            neither count nor break a run.
    """

    batches: list[int]
    total: int | None = None
    deadband: float = 0.2
    smoothing: float = 0.5
    window: int = 10
    first_window: int | None = None
    min_batch: int = 1
    max_batch: int | None = None
    shift: float = 0.5
    shift_steps: int = 1
    estimate: list[float | None] = field(default_factory=list)
    _time: list[float] = field(default_factory=list)
    _samples: list[float] = field(default_factory=list)
    _steps: int = 0
    # per worker: the run of steps departing from the estimate the same way
    # (direction, steps, seconds, samples)
    _run: list[tuple[int, int, float, float]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.batches = [int(b) for b in self.batches]
        if not self.batches or min(self.batches) < 1:
            raise ValueError(f"batches must be positive, got {self.batches}")
        if self.total is None:
            self.total = sum(self.batches)
        if not 0 <= self.deadband < 1:
            raise ValueError(f"deadband must be in [0, 1), got {self.deadband}")
        if not 0 < self.smoothing <= 1:
            raise ValueError(f"smoothing must be in (0, 1], got {self.smoothing}")
        if self.window < 1:
            raise ValueError(f"window must be >= 1 step, got {self.window}")
        if self.first_window is None:
            self.first_window = self.window
        if self.first_window < 1:
            raise ValueError(f"first_window must be >= 1 step, got {self.first_window}")
        if not self.shift >= 0:
            raise ValueError(f"shift must be >= 0, got {self.shift}")
        if self.shift_steps < 1:
            raise ValueError(f"shift_steps must be >= 1 step, got {self.shift_steps}")
        if self.max_batch is not None and self.max_batch < self.min_batch:
            raise ValueError("max_batch must be >= min_batch")
        n = len(self.batches)
        if self.min_batch * n > self.total or (
            self.max_batch is not None and self.max_batch * n < self.total
        ):
            raise ValueError(
                f"{n} workers with batches in [{self.min_batch}, {self.max_batch}] "
                f"cannot hold a total of {self.total}"
            )
        self.estimate = [None] * n
        self._run = [(0, 0, 0.0, 0.0)] * n
        self._reset_window()

    def _reset_window(self) -> None:
        n = len(self.batches)
        self._time, self._samples, self._steps = [0.0] * n, [0.0] * n, 0

    def add(self, worker: int, seconds: float, samples: float) -> None:
        """Add one step of one worker to the current window."""
        seconds, samples = float(seconds), float(samples)
        self._time[worker] += seconds
        self._samples[worker] += samples
        believed = self.estimate[worker]
        if believed is None or samples <= 0 or 2 * samples < self.batches[worker]:
            return  # nothing to compare with, or an epoch's short last step
        way = shift_direction(seconds / samples, believed, self.shift)
        run_way, steps, t, s = self._run[worker]
        if way == 0:
            self._run[worker] = (0, 0, 0.0, 0.0)
        elif way == run_way:
            self._run[worker] = (way, steps + 1, t + seconds, s + samples)
        else:
            self._run[worker] = (way, 1, seconds, samples)

    def shifted(self) -> list[int]:
        """Workers whose speed has shifted (see the module), not yet acted on."""
        return [i for i, run in enumerate(self._run) if run[1] >= self.shift_steps]

    def observe(
        self, seconds: Sequence[float], samples: Sequence[float]
    ) -> Decision | None:
        """Add one step's compute seconds and samples of every worker.

        Returns:
            A :class:`Decision` at the end of a window whose measurements
            move some batch by more than the dead-band, else ``None``.
        """
        for i, (t, s) in enumerate(zip(seconds, samples, strict=True)):
            self.add(i, t, s)
        self._steps += 1
        if self._steps < self.steps_to_decide() and not self.shifted():
            return None
        return self.decide()

    def steps_to_decide(self) -> int:
        """Steps in the current window: ``first_window`` until every worker has an estimate."""
        if any(e is None for e in self.estimate):
            return int(self.first_window)  # type: ignore[arg-type]
        return self.window

    def set_total(self, total: int) -> list[int]:
        """Keep ``total`` samples from now on (split by the current estimate)."""
        self.total = int(total)
        if any(e is None for e in self.estimate):
            rates = [float(b) for b in self.batches]
        else:
            rates = [1.0 / e for e in self.estimate]  # type: ignore[operator]
        self.batches = proportional_batches(
            rates, self.total, low=self.min_batch, high=self.max_batch
        )
        return list(self.batches)

    def decide(self) -> Decision | None:
        """Close the current window and decide (also called at an epoch's end).

        A worker that has shifted gets the speed of its shifted steps alone;
        the others' estimates are smoothed with the window.
        """
        shifted = set(self.shifted())
        for i, (t, s) in enumerate(zip(self._time, self._samples, strict=True)):
            if i in shifted:
                _, _, run_t, run_s = self._run[i]
                self.estimate[i] = run_t / run_s
                self._run[i] = (0, 0, 0.0, 0.0)
            elif s > 0 and t > 0:
                sps = t / s
                old = self.estimate[i]
                self.estimate[i] = (
                    sps
                    if old is None
                    else self.smoothing * sps + (1 - self.smoothing) * old
                )
        self._reset_window()
        if any(e is None for e in self.estimate):
            return None  # a worker without samples yet: nothing to compare
        rates = [1.0 / e for e in self.estimate]  # type: ignore[operator]
        new = proportional_batches(
            rates, self.total, low=self.min_batch, high=self.max_batch
        )
        change = max(abs(b - a) / a for a, b in zip(self.batches, new, strict=True))
        if change <= self.deadband:
            return None
        decision = Decision(list(self.batches), new, list(self.estimate))  # type: ignore[arg-type]
        self.batches = new
        return decision
