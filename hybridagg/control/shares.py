"""Shares of a global batch for groups whose batch time is affine (pure logic).

Ling et al. ("Joint Dynamic Data and Model Parallelism for Distributed
Training of DNNs Over Heterogeneous Infrastructure", IEEE TPDS 2024) model
a group's time for a batch of ``b`` samples as affine in ``b``::

    T_g(b) = a_g * b + c_g

``a_g`` is the group's seconds per sample and ``c_g`` its fixed seconds per
batch, paid whatever the share: a pipeline's fill and drain bubble, the
exchange with the other groups. The shares that make every group take the
same time ``T*`` under ``sum_g b_g = B`` solve a linear system with the
closed form::

    T* = (B + sum_g c_g / a_g) / sum_g (1 / a_g)
    b_g = (T* - c_g) / a_g

:func:`affine_shares` is that solve within per-group bounds (water-filling)
and rounded to integers that sum to ``B``; :func:`fit_affine` estimates
``(a_g, c_g)`` from measured batches; :class:`ShareSolver` keeps the
measurement windows and decides when to re-split.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from hybridagg.batching import _largest_remainder

__all__ = ["ShareSolver", "affine_shares", "affine_time", "fit_affine"]


def _check_int(name: str, value: object) -> int:
    # bool is an int subclass, but True samples is a caller's mistake
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r}")
    return value


def _check_model(
    slopes: Sequence[float], intercepts: Sequence[float]
) -> tuple[list[float], list[float]]:
    a = [float(s) for s in slopes]
    c = [float(i) for i in intercepts]
    if not a:
        raise ValueError(f"slopes must name at least one group, got {list(slopes)}")
    if len(c) != len(a):
        raise ValueError(
            f"intercepts must have one entry per group ({len(a)}), "
            f"got {len(c)}: {list(intercepts)}"
        )
    if any(not (s > 0 and math.isfinite(s)) for s in a):
        raise ValueError(f"slopes must be positive and finite, got {list(slopes)}")
    # a negative fixed cost is not physical (fit_affine clamps it to zero)
    if any(not (i >= 0 and math.isfinite(i)) for i in c):
        raise ValueError(
            f"intercepts must be non-negative and finite, got {list(intercepts)}"
        )
    return a, c


def _bounds(
    name: str, value: Sequence[int] | int | None, n: int, default: int
) -> list[int]:
    if value is None:
        return [default] * n
    if isinstance(value, int) and not isinstance(value, bool):
        return [value] * n
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise TypeError(f"{name} must be an int or a sequence of ints, got {value!r}")
    if len(value) != n:
        raise ValueError(
            f"{name} must have one entry per group ({n}), got {len(value)}: {value!r}"
        )
    return [
        default if v is None else _check_int(f"{name}[{i}]", v)
        for i, v in enumerate(value)
    ]


def _water_level(
    a: list[float], c: list[float], lows: list[int], highs: list[int], total: int
) -> float:
    """The common time ``T`` at which the clipped shares sum to ``total``.

    ``S(T) = sum_g clip((T - c_g) / a_g, low_g, high_g)`` is continuous,
    piecewise linear and non-decreasing, with kinks where a group reaches
    a bound (``T = a_g * low_g + c_g`` or ``a_g * high_g + c_g``); the level
    is found on the segment between two kinks where ``S`` crosses
    ``total``, exactly rather than by clipping and re-solving in rounds,
    because fixing a group at its floor and another at its ceiling in the
    same round can leave the first below a level that the second's excess
    lifts above its floor.
    """

    def filled(level: float) -> float:
        return sum(
            min(max((level - ci) / ai, lo), hi)
            for ai, ci, lo, hi in zip(a, c, lows, highs, strict=True)
        )

    kinks = sorted(
        {ai * lo + ci for ai, ci, lo in zip(a, c, lows, strict=True)}
        | {ai * hi + ci for ai, ci, hi in zip(a, c, highs, strict=True)}
    )
    below, s_below = kinks[0], filled(kinks[0])
    if s_below >= total:
        return below
    for kink in kinks[1:]:
        s_kink = filled(kink)
        if s_kink >= total:
            # S is linear between two neighbouring kinks
            return below + (total - s_below) * (kink - below) / (s_kink - s_below)
        below, s_below = kink, s_kink
    return kinks[-1]


def _round_within(
    shares: list[float], total: int, lows: list[int], highs: list[int]
) -> list[int]:
    out = [
        min(max(b, lo), hi)
        for b, lo, hi in zip(
            _largest_remainder(shares, total), lows, highs, strict=True
        )
    ]
    # Float shares can sit a hair outside their bounds, so the clamp may
    # move the sum; give the difference back by the largest remainder, in
    # a fixed order, so every rank rounds alike.
    rest = total - sum(out)
    order = sorted(range(len(out)), key=lambda i: shares[i] - out[i], reverse=True)
    while rest > 0:
        i = next(i for i in order if out[i] < highs[i])
        out[i] += 1
        rest -= 1
    while rest < 0:
        i = next(i for i in reversed(order) if out[i] > lows[i])
        out[i] -= 1
        rest += 1
    return out


def affine_shares(
    slopes: Sequence[float],
    intercepts: Sequence[float],
    total: int,
    *,
    low: Sequence[int] | int = 1,
    high: Sequence[int | None] | int | None = None,
) -> list[int]:
    """Split ``total`` samples so that every group's affine batch time is equal.

    Each group's time is ``slopes[g] * b + intercepts[g]``. Without bounds
    the shares are ``b_g = (T* - c_g) / a_g`` with ``T* = (total + sum c/a)
    / sum 1/a``. A group whose share falls below ``low`` or above ``high``
    is fixed at that bound and the rest is re-solved among the others
    (water-filling, as :func:`hybridagg.batching.proportional_batches`
    does). The real shares are then rounded by largest remainder so the
    sum is exactly ``total``; each share is within one sample of its real
    value, so each free group's time is within one slope of the level.

    With every intercept zero the time is proportional to the share and
    the result is ``proportional_batches([1 / a for a in slopes], total)``
    with the same bounds, except where a floor and a ceiling both bind:
    this solve finds the level where the clipped shares sum to ``total``,
    while clipping every offender in one round, as that function does, can
    leave a group at its floor below the level. With ``low=0`` a group whose fixed cost alone
    exceeds the level gets nothing, since any share would make it the
    slowest.

    Args:
        slopes: Seconds per sample of each group (positive).
        intercepts: Fixed seconds per batch of each group (non-negative).
        total: Samples to split.
        low: Smallest share, for all groups or per group (default 1).
        high: Largest share (device memory), for all groups or per group;
            ``None`` means ``total``.

    Returns:
        One integer share per group, summing to ``total``.

    Raises:
        TypeError: ``total`` or a bound is not an int.
        ValueError: A slope is not positive, an intercept is negative, the
            lengths differ, or the bounds cannot hold ``total``.
    """
    a, c = _check_model(slopes, intercepts)
    total = _check_int("total", total)
    n = len(a)
    lows = _bounds("low", low, n, 1)
    highs = _bounds("high", high, n, total)
    if any(lo < 0 for lo in lows):
        raise ValueError(f"low must be >= 0, got {lows}")
    if any(hi < lo for lo, hi in zip(lows, highs, strict=True)):
        raise ValueError(f"high must be >= low in every group, got {lows}..{highs}")
    if sum(lows) > total or sum(highs) < total:
        raise ValueError(
            f"share bounds {lows}..{highs} cannot hold a total of {total} samples"
        )
    level = _water_level(a, c, lows, highs, total)
    # Fix the groups the level puts outside their bounds, then compute the
    # free groups' shares from the closed form over the free set alone, in
    # the same arithmetic as proportional_batches (left * w / sum w) so a
    # zero-intercept split equals it to the last bit.
    fixed: dict[int, float] = {}
    for g in range(n):
        share = (level - c[g]) / a[g]
        if share < lows[g]:
            fixed[g] = float(lows[g])
        elif share > highs[g]:
            fixed[g] = float(highs[g])
    free = [g for g in range(n) if g not in fixed]
    left = total - sum(fixed.values())
    weights = {g: 1.0 / a[g] for g in free}
    weight = sum(weights.values())
    lift = sum(c[g] * weights[g] for g in free)
    shares = [
        fixed[g]
        if g in fixed
        else (left + lift) * weights[g] / weight - c[g] * weights[g]
        for g in range(n)
    ]
    return _round_within(shares, total, lows, highs)


def affine_time(
    slopes: Sequence[float], intercepts: Sequence[float], shares: Sequence[int]
) -> float:
    """The batch time of a split: the slowest group's ``a_g * b_g + c_g``.

    A group with no samples takes no part in the batch and costs nothing,
    fixed part included.

    Args:
        slopes: Seconds per sample of each group.
        intercepts: Fixed seconds per batch of each group.
        shares: Samples of each group (non-negative).

    Returns:
        Seconds of the batch; ``0.0`` when every share is zero.

    Raises:
        ValueError: Bad slopes or intercepts (as :func:`affine_shares`),
            lengths that differ, or a negative share.
    """
    a, c = _check_model(slopes, intercepts)
    b = [float(s) for s in shares]
    if len(b) != len(a):
        raise ValueError(
            f"shares must have one entry per group ({len(a)}), got {len(b)}: "
            f"{list(shares)}"
        )
    if any(not s >= 0 for s in b):
        raise ValueError(f"shares must be non-negative, got {list(shares)}")
    return max(
        (ai * bi + ci for ai, ci, bi in zip(a, c, b, strict=True) if bi > 0),
        default=0.0,
    )


def fit_affine(
    samples: Sequence[float], seconds: Sequence[float]
) -> tuple[float, float]:
    """Least-squares ``(slope, intercept)`` of one group's measured batches.

    Fits ``seconds = slope * samples + intercept`` over a window of
    measurements of one group. Three cases do not give a usable line and
    fall back:

    * a single distinct batch size: the intercept is not identifiable (any
      line through the one point fits), so the result is the proportional
      model ``(mean seconds / mean samples, 0.0)``, the one OmniLearn's
      controller assumes;
    * a negative intercept: a negative fixed cost is not physical, it is
      measurement noise over a narrow spread of sizes, so the intercept is
      clamped to zero and the slope refitted through the origin
      (``sum(x * y) / sum(x * x)``);
    * a non-positive slope (seconds that fall as the batch grows, again
      noise): the proportional model, as for a single size.

    Args:
        samples: Samples of each measured batch (positive).
        seconds: Seconds of each measured batch (positive), same length.

    Returns:
        ``(slope, intercept)``, slope positive, intercept non-negative.

    Raises:
        ValueError: Empty or unequal inputs, or a value that is not
            positive and finite.
    """
    x = [float(s) for s in samples]
    y = [float(t) for t in seconds]
    if not x or len(x) != len(y):
        raise ValueError(
            f"samples and seconds must be non-empty and of equal length, got "
            f"{len(x)} and {len(y)}"
        )
    if any(not (v > 0 and math.isfinite(v)) for v in x):
        raise ValueError(f"samples must be positive and finite, got {list(samples)}")
    if any(not (v > 0 and math.isfinite(v)) for v in y):
        raise ValueError(f"seconds must be positive and finite, got {list(seconds)}")
    n = len(x)
    mx, my = sum(x) / n, sum(y) / n
    proportional = (my / mx, 0.0)
    sxx = sum((v - mx) ** 2 for v in x)
    if len(set(x)) == 1 or sxx <= 0:
        return proportional
    # centred sums: the raw-moment form loses digits when sizes are large
    slope = sum((u - mx) * (v - my) for u, v in zip(x, y, strict=True)) / sxx
    intercept = my - slope * mx
    if intercept < 0:
        slope = sum(u * v for u, v in zip(x, y, strict=True)) / sum(u * u for u in x)
        intercept = 0.0
    if not slope > 0:
        return proportional
    return slope, intercept


@dataclass
class ShareSolver:
    """Windows of measured batches per group, and when to re-split.

    OmniLearn's proportional controller (:class:`hybridagg.batching.
    BatchController`) gives each group a share proportional to its
    measured rate ``b_g / T_g``. That is exact when a group's time is
    proportional to its share (``T_g = a_g * b_g``): the rate is ``1 / a_g``
    whatever the share, so one decision equalises the times. It is wrong
    for a pipeline with a bubble, or any fixed cost per batch
    (``T_g = a_g * b_g + c_g``): the measured rate then depends on the share
    it was measured at, a group with a large ``c_g`` looks slower per
    sample than its marginal cost ``a_g``, and the proportional step lands
    short of equal times; repeated steps approach them only geometrically,
    and the dead-band can stop the approach with the groups still unequal.
    This solver keeps the controller's windowed measurements and dead-band
    but replaces its decision step with the affine solve
    (:func:`affine_shares` on :func:`fit_affine` of each window).

    A window that holds one batch size only fits the proportional model,
    so the first decision after an even start is the proportional one.
    The measurements it causes are at new sizes; the windows slide, so the
    next full windows hold two sizes and the fit recovers the intercepts.
    At a split where the times are equal, the proportional fit of a
    one-size window reproduces that split, so a settled solver does not
    drift back towards proportional shares.

    Decisions depend only on the measurements, in the order added, and
    the arguments, so ranks that add the same measurements decide alike.

    Args:
        groups: Number of groups.
        window: Most recent measurements kept per group; a decision needs
            this many in every group.
        deadband: Minimum relative change of some group's share to act on
            (in ``[0, 1)``, default 0.2 as :class:`BatchController`).
        low: Smallest share, for all groups or per group.
        high: Largest share, for all groups or per group; ``None``: no cap.
        shares: The current split, or ``None`` before the first decision
            (which then acts whatever the change).
    """

    groups: int
    window: int = 10
    deadband: float = 0.2
    low: Sequence[int] | int = 1
    high: Sequence[int | None] | int | None = None
    shares: list[int] | None = None
    _windows: list[deque[tuple[float, float]]] = field(
        default_factory=list, init=False, repr=False
    )

    def __post_init__(self) -> None:
        _check_int("groups", self.groups)
        if self.groups < 1:
            raise ValueError(f"groups must be >= 1, got {self.groups}")
        _check_int("window", self.window)
        if self.window < 1:
            raise ValueError(f"window must be >= 1 measurement, got {self.window}")
        if not 0 <= self.deadband < 1:
            raise ValueError(f"deadband must be in [0, 1), got {self.deadband}")
        if self.shares is not None:
            self.shares = [_check_int("shares", s) for s in self.shares]
            if len(self.shares) != self.groups or min(self.shares) < 0:
                raise ValueError(
                    f"shares must be {self.groups} non-negative ints, got {self.shares}"
                )
        self._windows = [deque(maxlen=self.window) for _ in range(self.groups)]

    def add(self, group: int, samples: float, seconds: float) -> None:
        """Record one measured batch of one group (the oldest beyond the window drops).

        Raises:
            ValueError: ``group`` out of range, or ``samples`` or ``seconds``
                not positive and finite.
        """
        if isinstance(group, bool) or not isinstance(group, int):
            raise TypeError(f"group must be an int, got {group!r}")
        if not 0 <= group < self.groups:
            raise ValueError(f"group must be in [0, {self.groups}), got {group}")
        samples, seconds = float(samples), float(seconds)
        if not (samples > 0 and math.isfinite(samples)):
            raise ValueError(f"samples must be positive and finite, got {samples}")
        if not (seconds > 0 and math.isfinite(seconds)):
            raise ValueError(f"seconds must be positive and finite, got {seconds}")
        self._windows[group].append((samples, seconds))

    def ready(self) -> bool:
        """Whether every group has a full window."""
        return all(len(w) == self.window for w in self._windows)

    def fits(self) -> list[tuple[float, float]]:
        """Each group's ``(slope, intercept)`` from its current window.

        Raises:
            ValueError: A group has no measurement yet.
        """
        out = []
        for g, w in enumerate(self._windows):
            if not w:
                raise ValueError(f"group {g} has no measurement yet")
            out.append(fit_affine([s for s, _ in w], [t for _, t in w]))
        return out

    def decide(self, total: int) -> list[int] | None:
        """Re-solve the split of ``total`` samples, if the windows say to.

        Returns:
            The new shares when every group has a full window and either
            there is no current split, the current split does not sum to
            ``total``, or some group's share changes by more than the
            dead-band relative to its current share (a group moving from
            zero to a share counts as beyond any dead-band); else ``None``.
            New shares become :attr:`shares`.
        """
        total = _check_int("total", total)
        if not self.ready():
            return None
        fits = self.fits()
        new = affine_shares(
            [s for s, _ in fits],
            [i for _, i in fits],
            total,
            low=self.low,
            high=self.high,
        )
        old = self.shares
        if old is not None and sum(old) == total:
            change = max(
                (abs(b - a) / a if a > 0 else (math.inf if b > 0 else 0.0))
                for a, b in zip(old, new, strict=True)
            )
            if change <= self.deadband:
                return None
        self.shares = new
        return list(new)
