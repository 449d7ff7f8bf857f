"""Where to cut one model replica into pipeline stages (pure logic).

A pipelined group runs ``S`` consecutive stages of a model of ``L`` layers
on ``S`` ranks in order; stage ``k`` holds layers ``bounds[k]`` to
``bounds[k + 1] - 1`` and every stage holds at least one layer. The
partitioner is communication-aware (Ling et al., IEEE TPDS 2024): it weighs
each rank's speed and the bytes that cross each cut against the link
between the two ranks.

Cost model, per micro-batch of ``m`` samples:

* stage ``k`` computes for ``m x sum(layer_seconds[i:j]) / speeds[k]``
  (forward and backward of its layers ``i..j-1``);
* a cut after layer ``l`` sends ``activation_bytes[l]`` bytes per sample
  forward, and a gradient of the same size comes back; one message over a
  boundary takes ``latency + m x bytes / bandwidth``;
* a message occupies its *receiver* only, for that whole time. hybridagg's
  stage posts a non-blocking send and goes on computing, but posts the
  receive only when its next action needs the input, and on shared memory
  MPI copies the message on the receiving rank's CPU: neither end can
  overlap a transfer it waits for. So stage ``k`` pays the forward
  activation of its incoming boundary and the gradient of its outgoing one::

      T_k = m x compute_k + recv(boundary k-1) + recv(boundary k)

  (no incoming boundary on the first stage, no outgoing one on the last).
  :mod:`.timing` simulates a whole schedule with the same rule.

In the steady state of a pipeline every stage handles one micro-batch per
cycle, so the cycle is the slowest stage's ``max_k T_k`` (the bottleneck);
:func:`best_partition` minimises it exactly. The cut points are chosen from
layers, so :func:`continuous_bottleneck` and :func:`analytic_cut` give the
bound that infinitely divisible layers and free links would reach.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "FORWARD_SHARE",
    "Link",
    "Partition",
    "analytic_cut",
    "best_partition",
    "brute_force_partition",
    "continuous_bottleneck",
    "even_partition",
    "stage_times",
    "timing_inputs",
]

FORWARD_SHARE = 1.0 / 3.0
"""The forward pass's share of a layer's forward+backward seconds.

The flop-count rule of :mod:`hybridagg.train.pacing`: a backward pass costs
twice its forward (gradients with respect to the inputs and to the
weights), so the forward is a third and the backward two thirds.
"""

BRUTE_FORCE_MAX_LAYERS = 20
"""The most layers :func:`brute_force_partition` enumerates."""


def _is_number(value: object) -> bool:
    # bool is an int to Python but never a duration, a speed or a size
    return isinstance(value, int | float) and not isinstance(value, bool)


def _check_number(label: str, value: object, *, positive: bool = False) -> float:
    if not _is_number(value):
        raise TypeError(f"{label} must be a number, got {value!r}")
    v = float(value)
    bad = not v > 0 if positive else not v >= 0
    if bad or math.isinf(v):
        rule = "positive" if positive else ">= 0"
        raise ValueError(f"{label} must be finite and {rule}, got {value!r}")
    return v


def _check_numbers(
    label: str, values: object, length: int | None = None, *, positive: bool = False
) -> tuple[float, ...]:
    if isinstance(values, str | bytes) or not isinstance(values, Sequence):
        raise TypeError(f"{label} must be a sequence of numbers, got {values!r}")
    if length is not None and len(values) != length:
        raise ValueError(f"{label} must hold {length} values, got {len(values)}")
    return tuple(
        _check_number(f"{label}[{i}]", v, positive=positive)
        for i, v in enumerate(values)
    )


def _check_count(label: str, value: object, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{label} must be an int, got {value!r}")
    if value < low:
        raise ValueError(f"{label} must be >= {low}, got {value}")
    return value


@dataclass(frozen=True)
class Link:
    """The link between two neighbouring stages' ranks.

    Raises:
        TypeError: A field is not a number.
        ValueError: A negative or infinite latency, or a bandwidth that is
            not positive.
    """

    latency_s: float = 0.0
    """seconds of one message before its first byte arrives"""
    bandwidth_Bps: float = math.inf
    """bytes per second (``inf``: a free link)"""

    def __post_init__(self) -> None:
        _check_number("latency_s", self.latency_s)
        if not _is_number(self.bandwidth_Bps):
            raise TypeError(
                f"bandwidth_Bps must be a number, got {self.bandwidth_Bps!r}"
            )
        if not self.bandwidth_Bps > 0:
            raise ValueError(
                f"bandwidth_Bps must be positive, got {self.bandwidth_Bps!r}"
            )

    def seconds(self, nbytes: float) -> float:
        """Seconds of one message of ``nbytes`` bytes in one direction."""
        return self.latency_s + nbytes / self.bandwidth_Bps


@dataclass(frozen=True)
class Partition:
    """Stage boundaries and what each stage costs per micro-batch."""

    bounds: tuple[int, ...]
    """``S + 1`` cut points from ``0`` to ``L``; stage ``k`` holds
    ``bounds[k]..bounds[k + 1] - 1``"""
    stage_seconds: tuple[float, ...]
    """``T_k`` of each stage per micro-batch (see the module)"""
    bottleneck_s: float
    """the largest ``T_k``: the pipeline's steady-state cycle"""

    @property
    def stages(self) -> int:
        """The number of stages ``S``."""
        return len(self.bounds) - 1

    def layers(self, k: int) -> range:
        """The layers stage ``k`` holds.

        Raises:
            ValueError: ``k`` is not a stage.
        """
        if not 0 <= k < self.stages:
            raise ValueError(f"k must be in 0..{self.stages - 1}, got {k!r}")
        return range(self.bounds[k], self.bounds[k + 1])


@dataclass(frozen=True)
class _Problem:
    """Validated inputs of a partition, shared by every search."""

    layer_seconds: tuple[float, ...]
    speeds: tuple[float, ...]
    activation_bytes: tuple[float, ...]
    links: tuple[Link, ...]
    micro_batch: int
    layer_bytes: tuple[float, ...] = ()
    """bytes each layer needs on its rank (empty: memory is not checked)"""
    memory: tuple[float, ...] = ()
    """bytes each stage's rank has (``inf``: no limit)"""

    def fits(self, k: int, i: int, j: int) -> bool:
        """Whether stage ``k``'s rank holds layers ``i..j-1``."""
        if not self.layer_bytes:
            return True
        return _add(self.layer_bytes[i:j]) <= self.memory[k]

    @property
    def layers(self) -> int:
        return len(self.layer_seconds)

    @property
    def stages(self) -> int:
        return len(self.speeds)

    def recv_seconds(self, boundary: int, cut: int) -> float:
        """One message of a micro-batch over ``boundary`` for a cut before layer ``cut``."""
        nbytes = self.micro_batch * self.activation_bytes[cut - 1]
        return self.links[boundary].seconds(nbytes)

    def stage_seconds(self, k: int, i: int, j: int, compute: float) -> float:
        """``T_k`` of stage ``k`` holding layers ``i..j-1`` whose seconds sum to ``compute``.

        Every search calls this one function with the same sum, so a bound
        found by one is bit for bit the bound another computes.
        """
        if not self.fits(k, i, j):
            return math.inf  # the stage's layers do not fit its rank
        t = self.micro_batch * (compute / self.speeds[k])
        if k > 0:
            t += self.recv_seconds(k - 1, i)
        if k < self.stages - 1:
            t += self.recv_seconds(k, j)
        return t


def _links(link: object, stages: int) -> tuple[Link, ...]:
    if isinstance(link, Link):
        return (link,) * (stages - 1)
    if isinstance(link, str | bytes) or not isinstance(link, Sequence):
        raise TypeError(f"link must be a Link or a sequence of Links, got {link!r}")
    if len(link) != stages - 1:
        raise ValueError(
            f"link must hold one Link per boundary ({stages - 1}), got {len(link)}"
        )
    for i, one in enumerate(link):
        if not isinstance(one, Link):
            raise TypeError(f"link[{i}] must be a Link, got {one!r}")
    return tuple(link)


def _problem(
    layer_seconds: Sequence[float],
    speeds: Sequence[float],
    activation_bytes: Sequence[float],
    link: Link | Sequence[Link],
    micro_batch: int,
    layer_bytes: Sequence[float] | None = None,
    memory: Sequence[float | None] | None = None,
) -> _Problem:
    seconds = _check_numbers("layer_seconds", layer_seconds)
    if not seconds:
        raise ValueError("layer_seconds must hold at least one layer, got none")
    rates = _check_numbers("speeds", speeds, positive=True)
    if not rates:
        raise ValueError("speeds must hold at least one stage, got none")
    if len(rates) > len(seconds):
        raise ValueError(
            f"speeds: {len(rates)} stages cannot each hold a layer of "
            f"{len(seconds)} layers"
        )
    nbytes = _check_numbers("activation_bytes", activation_bytes, len(seconds) - 1)
    links = _links(link, len(rates))
    m = _check_count("micro_batch", micro_batch, 1)
    if (layer_bytes is None) != (memory is None):
        raise ValueError("layer_bytes and memory go together: pass both or neither")
    if layer_bytes is None:
        return _Problem(seconds, rates, nbytes, links, m)
    need = _check_numbers("layer_bytes", layer_bytes, len(seconds))
    if isinstance(memory, str | bytes) or not isinstance(memory, Sequence):
        raise TypeError(f"memory must be a sequence of numbers or None, got {memory!r}")
    if len(memory) != len(rates):
        raise ValueError(f"memory must hold {len(rates)} values, got {len(memory)}")
    have = tuple(
        math.inf if v is None else _check_number(f"memory[{k}]", v, positive=True)
        for k, v in enumerate(memory)
    )
    return _Problem(seconds, rates, nbytes, links, m, need, have)


def _check_bounds(bounds: object, layers: int, stages: int) -> tuple[int, ...]:
    if isinstance(bounds, str | bytes) or not isinstance(bounds, Sequence):
        raise TypeError(f"bounds must be a sequence of ints, got {bounds!r}")
    for b in bounds:
        if isinstance(b, bool) or not isinstance(b, int):
            raise TypeError(f"bounds must hold ints, got {bounds!r}")
    out = tuple(bounds)
    if len(out) != stages + 1:
        raise ValueError(
            f"bounds must hold {stages + 1} cut points for {stages} stages, got {out!r}"
        )
    increasing = all(a < b for a, b in itertools.pairwise(out))
    if out[0] != 0 or out[-1] != layers or not increasing:
        raise ValueError(
            f"bounds must rise strictly from 0 to {layers} (every stage holds "
            f"a layer), got {out!r}"
        )
    return out


def _add(values: Sequence[float]) -> float:
    # left to right, as _segment_sums adds (sum() compensates since Python
    # 3.12, which could round a tie differently from the search)
    total = 0.0
    for v in values:
        total += v
    return total


def _evaluate(problem: _Problem, bounds: tuple[int, ...]) -> Partition:
    times = tuple(
        problem.stage_seconds(k, i, j, _add(problem.layer_seconds[i:j]))
        for k, (i, j) in enumerate(itertools.pairwise(bounds))
    )
    return Partition(bounds, times, max(times))


def stage_times(
    bounds: Sequence[int],
    layer_seconds: Sequence[float],
    speeds: Sequence[float],
    activation_bytes: Sequence[float],
    link: Link | Sequence[Link],
    micro_batch: int = 1,
) -> Partition:
    """What the stages cut at ``bounds`` cost per micro-batch.

    Args:
        bounds: ``S + 1`` cut points, ``0`` first, ``L`` last, rising strictly.
        layer_seconds: ``L`` forward+backward seconds of each layer for one
            sample on a device of speed 1.
        speeds: ``S`` relative speeds of the ranks holding the stages, in order.
        activation_bytes: ``L - 1`` bytes per sample that a cut after each
            layer sends forward (and, as a gradient, back).
        link: One :class:`Link` for every boundary, or ``S - 1`` of them.
        micro_batch: Samples per micro-batch.

    Raises:
        TypeError: An argument of the wrong type.
        ValueError: A length that does not match, a negative or infinite
            value, a speed that is not positive, more stages than layers, or
            bounds that leave a stage without a layer.
    """
    problem = _problem(layer_seconds, speeds, activation_bytes, link, micro_batch)
    return _evaluate(problem, _check_bounds(bounds, problem.layers, problem.stages))


def _segment_sums(seconds: tuple[float, ...]) -> list[list[float]]:
    # sums[i][j - i] == _add(seconds[i:j]), added in the same order, so the
    # search and stage_times agree to the last bit
    sums = []
    for i in range(len(seconds)):
        row = [0.0]
        for s in seconds[i:]:
            row.append(row[-1] + s)
        sums.append(row)
    return sums


def _refuse_memory(problem: _Problem) -> None:
    """Raise: no partition fits (only memory makes a stage cost infinite)."""
    raise ValueError(
        f"no cut of {problem.layers} layers into {problem.stages} stages fits "
        f"the ranks' memory ({', '.join(f'{m:.4g}' for m in problem.memory)} bytes)"
    )


def _search(problem: _Problem) -> Partition:
    n, stages = problem.layers, problem.stages
    sums = _segment_sums(problem.layer_seconds)

    def cost(k: int, i: int, j: int) -> float:
        return problem.stage_seconds(k, i, j, sums[i][j - i])

    # rest[k][i]: the smallest bottleneck of stages k..S-1 over layers i..L-1
    rest = [[math.inf] * (n + 1) for _ in range(stages + 1)]
    rest[stages][n] = -math.inf  # nothing left to place costs nothing
    for k in range(stages - 1, -1, -1):
        for i in range(k, n - (stages - k) + 1):
            rest[k][i] = min(
                max(cost(k, i, j), rest[k + 1][j])
                for j in range(i + 1, n - (stages - k - 1) + 1)
            )
    best = rest[0][0]
    if math.isinf(best):
        _refuse_memory(problem)
    # the smallest cut that still reaches the best bottleneck, stage by
    # stage, gives the lexicographically smallest optimal bounds
    bounds = [0]
    for k in range(stages):
        i = bounds[-1]
        bounds.append(
            next(
                j
                for j in range(i + 1, n - (stages - k - 1) + 1)
                if max(cost(k, i, j), rest[k + 1][j]) <= best
            )
        )
    return _evaluate(problem, tuple(bounds))


def best_partition(
    layer_seconds: Sequence[float],
    speeds: Sequence[float],
    activation_bytes: Sequence[float],
    link: Link | Sequence[Link],
    micro_batch: int = 1,
    *,
    layer_bytes: Sequence[float] | None = None,
    memory: Sequence[float | None] | None = None,
) -> Partition:
    """The bounds with the smallest bottleneck, by an exact dynamic program.

    ``O(S L^2)`` stage costs. Among equal bottlenecks the lexicographically
    smallest bounds win, so every rank that runs this on the same input
    chooses the same partition.

    Args:
        layer_seconds: As :func:`stage_times`.
        speeds: As :func:`stage_times`.
        activation_bytes: As :func:`stage_times`.
        link: As :func:`stage_times`.
        micro_batch: As :func:`stage_times`.
        layer_bytes: Bytes each layer needs on the rank that holds it
            (weights, gradients, optimizer state, activations in flight);
            with ``memory``, a stage whose layers exceed its rank's memory
            is not a candidate.
        memory: Bytes of each stage's rank (``None``: no limit).

    Raises:
        TypeError: As :func:`stage_times`.
        ValueError: As :func:`stage_times`, or no partition fits the memory.
    """
    problem = _problem(
        layer_seconds, speeds, activation_bytes, link, micro_batch, layer_bytes, memory
    )
    return _search(problem)


def brute_force_partition(
    layer_seconds: Sequence[float],
    speeds: Sequence[float],
    activation_bytes: Sequence[float],
    link: Link | Sequence[Link],
    micro_batch: int = 1,
    *,
    layer_bytes: Sequence[float] | None = None,
    memory: Sequence[float | None] | None = None,
) -> Partition:
    """:func:`best_partition` by trying every set of cut points (a check).

    Args:
        layer_seconds: As :func:`stage_times`, at most 20 layers.
        speeds: As :func:`stage_times`.
        activation_bytes: As :func:`stage_times`.
        link: As :func:`stage_times`.
        micro_batch: As :func:`stage_times`.
        layer_bytes: As :func:`best_partition`.
        memory: As :func:`best_partition`.

    Raises:
        TypeError: As :func:`stage_times`.
        ValueError: As :func:`stage_times`, or more than 20 layers (the
            combinations grow exponentially).
    """
    problem = _problem(
        layer_seconds, speeds, activation_bytes, link, micro_batch, layer_bytes, memory
    )
    if problem.layers > BRUTE_FORCE_MAX_LAYERS:
        raise ValueError(
            f"layer_seconds: brute force takes at most {BRUTE_FORCE_MAX_LAYERS} "
            f"layers, got {problem.layers}"
        )
    best: Partition | None = None
    # combinations come in lexicographic order: keeping only a strictly
    # better one keeps the smallest bounds among ties
    for cuts in itertools.combinations(range(1, problem.layers), problem.stages - 1):
        candidate = _evaluate(problem, (0, *cuts, problem.layers))
        if best is None or candidate.bottleneck_s < best.bottleneck_s:
            best = candidate
    assert best is not None  # S <= L leaves at least one combination
    if math.isinf(best.bottleneck_s):
        _refuse_memory(problem)
    return best


def even_partition(layer_seconds: Sequence[float], stages: int) -> tuple[int, ...]:
    """The bounds that share the compute most evenly among equal ranks.

    The classical balanced partition (the ``even`` baseline): the smallest
    largest sum of a stage's ``layer_seconds``, blind to speeds, activation
    sizes and links; ties as :func:`best_partition`.

    Args:
        layer_seconds: As :func:`stage_times`.
        stages: ``S``, at most the number of layers.

    Raises:
        TypeError: As :func:`stage_times`, or ``stages`` is not an int.
        ValueError: As :func:`stage_times`, or ``stages`` is below 1.
    """
    seconds = _check_numbers("layer_seconds", layer_seconds)
    s = _check_count("stages", stages, 1)
    if s > len(seconds):
        raise ValueError(f"stages must be at most the {len(seconds)} layers, got {s}")
    free = [0.0] * max(0, len(seconds) - 1)
    # speed 1 and free links leave T_k the plain sum of the stage's seconds
    return best_partition(seconds, [1.0] * s, free, Link()).bounds


def continuous_bottleneck(
    total_seconds: float,
    speeds: Sequence[float],
    capacity: Sequence[float | None] | None = None,
) -> float:
    """The bottleneck of infinitely divisible layers over free links.

    Each stage gets work in proportion to its speed, so every stage takes
    ``total_seconds / sum(speeds)``: no cut of real layers does better.
    With ``capacity`` (the most work each stage's rank can hold, in the
    same seconds: its memory over the model's bytes per second of work),
    a rank that would hold more is filled to its capacity and the rest is
    shared the same way among the others (water-filling): the bottleneck
    is the smallest ``T`` with ``sum_k min(T x speed_k, capacity_k) >=
    total_seconds``.

    Args:
        total_seconds: Seconds of the whole model on a device of speed 1.
        speeds: The stages' relative speeds.
        capacity: Each stage's most work (``None``: no limit).

    Raises:
        TypeError: As :func:`stage_times`.
        ValueError: A negative total or a speed that is not positive, or
            capacities that cannot hold the model together.
    """
    total = _check_number("total_seconds", total_seconds)
    rates = _check_numbers("speeds", speeds, positive=True)
    if not rates:
        raise ValueError("speeds must hold at least one stage, got none")
    if capacity is None:
        return total / sum(rates)
    if isinstance(capacity, str | bytes) or not isinstance(capacity, Sequence):
        raise TypeError(f"capacity must be a sequence, got {capacity!r}")
    if len(capacity) != len(rates):
        raise ValueError(f"capacity must hold {len(rates)} values, got {len(capacity)}")
    caps = [
        math.inf if c is None else _check_number(f"capacity[{k}]", c)
        for k, c in enumerate(capacity)
    ]
    if sum(caps) < total:
        raise ValueError(
            f"capacity: the stages hold {sum(caps):.6g} s of work, the model "
            f"needs {total:.6g}"
        )
    # fill the ranks whose capacity binds first (the smallest T at which a
    # rank is full is cap/speed), then share the rest by speed
    left, free = total, list(range(len(rates)))
    for k in sorted(free, key=lambda k: caps[k] / rates[k]):
        t = left / sum(rates[i] for i in free)
        if caps[k] >= t * rates[k]:
            return t
        left -= caps[k]
        free.remove(k)
    return 0.0 if left <= 0 else math.inf


def analytic_cut(speeds: Sequence[float]) -> float:
    """How much of the even split's cycle the continuous bound removes.

    The even split gives every stage ``total / S``, so the slowest rank sets
    the cycle at ``(total / S) / min(speeds)``; the continuous bound is
    ``total / sum(speeds)``. Their ratio does not depend on the model::

        cut = 1 - continuous / even = 1 - S x min(speeds) / sum(speeds)

    Two stages at speeds 1 and 0.25 give a cut of 0.6: the steady-state
    cycle drops to 0.4 of the even split's.

    Args:
        speeds: The stages' relative speeds.

    Raises:
        TypeError: As :func:`stage_times`.
        ValueError: No speed, or a speed that is not positive.
    """
    rates = _check_numbers("speeds", speeds, positive=True)
    if not rates:
        raise ValueError("speeds must hold at least one stage, got none")
    return 1.0 - len(rates) * min(rates) / sum(rates)


def timing_inputs(
    bounds: Sequence[int],
    layer_seconds: Sequence[float],
    speeds: Sequence[float],
    activation_bytes: Sequence[float],
    link: Link | Sequence[Link],
) -> tuple[list[float], list[float], list[tuple[float, float]]]:
    """The per-sample arguments of :func:`.timing.batch_time` for a partition.

    Args:
        bounds: As :func:`stage_times`.
        layer_seconds: As :func:`stage_times`.
        speeds: As :func:`stage_times`.
        activation_bytes: As :func:`stage_times`.
        link: As :func:`stage_times`.

    Returns:
        ``(forward_s, backward_s, comm_s)``: each stage's forward and
        backward seconds per sample (:data:`FORWARD_SHARE` of its compute
        forward, the rest backward) and each boundary's ``(latency_s,
        seconds per sample)``.

    Raises:
        TypeError: As :func:`stage_times`.
        ValueError: As :func:`stage_times`.
    """
    problem = _problem(layer_seconds, speeds, activation_bytes, link, 1)
    cuts = _check_bounds(bounds, problem.layers, problem.stages)
    compute = [
        _add(problem.layer_seconds[i:j]) / problem.speeds[k]
        for k, (i, j) in enumerate(itertools.pairwise(cuts))
    ]
    forward = [FORWARD_SHARE * c for c in compute]
    backward = [c - f for c, f in zip(compute, forward, strict=True)]
    comm = [
        (one.latency_s, problem.activation_bytes[cut - 1] / one.bandwidth_Bps)
        for one, cut in zip(problem.links, cuts[1:-1], strict=True)
    ]
    return forward, backward, comm
