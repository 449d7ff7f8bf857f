"""Pipeline stages: the communication-aware partition and a schedule's batch time (pure)."""

import itertools
import math
import random

import pytest

from hybridagg.pipeline.partition import (
    FORWARD_SHARE,
    Link,
    Partition,
    analytic_cut,
    best_partition,
    brute_force_partition,
    continuous_bottleneck,
    even_partition,
    stage_times,
    timing_inputs,
)
from hybridagg.pipeline.timing import batch_time, micro_sizes

FREE = Link()


def random_case(rng):
    """A small partition problem: layers, speeds, sizes, links, micro-batch."""
    layers = rng.randint(2, 9)
    stages = rng.randint(1, min(layers, 4))
    seconds = [
        rng.choice([0.0, rng.uniform(0, 2), float(rng.randint(1, 3))])
        for _ in range(layers)
    ]
    speeds = [rng.choice([1.0, 0.5, rng.uniform(0.1, 1.0)]) for _ in range(stages)]
    nbytes = [rng.choice([0.0, rng.uniform(0, 400), 100.0]) for _ in range(layers - 1)]
    links = [
        Link(
            rng.choice([0.0, rng.uniform(0, 0.5)]),
            rng.choice([math.inf, rng.uniform(50, 500)]),
        )
        for _ in range(stages - 1)
    ]
    link = links[0] if links and rng.random() < 0.3 else links
    return seconds, speeds, nbytes, link, rng.randint(1, 4)


# ------------------------------------------------------------------ partition
def test_stage_times_follow_the_cost_model_by_hand():
    # 3 layers of 3 s, the second rank at half speed, 2 samples per
    # micro-batch; a message over the link is 1 s + bytes / 100 B/s
    args = ([3.0, 3.0, 3.0], [1.0, 0.5], [100.0, 10.0], Link(1.0, 100.0), 2)
    p = stage_times((0, 1, 3), *args)
    # stage 0: 2 x 3 s, plus the gradient of cut 1 received: 1 + 2 x 100 / 100
    # stage 1: 2 x 6 s / 0.5, plus the activation of cut 1 received: 3 s
    assert p.stage_seconds == (9.0, 27.0) and p.bottleneck_s == 27.0
    assert p.layers(0) == range(0, 1) and p.layers(1) == range(1, 3)
    q = stage_times((0, 2, 3), *args)
    # both stages: 12 s of compute plus 1 + 2 x 10 / 100 s of message
    assert q.stage_seconds == (13.2, 13.2)
    assert best_partition(*args) == q


def test_links_per_boundary_and_latency_per_message():
    seconds, nbytes = [1.0] * 3, [50.0, 50.0]
    links = [Link(0.5, 100.0), Link(0.0, 50.0)]
    p = stage_times((0, 1, 2, 3), seconds, [1.0, 1.0, 1.0], nbytes, links, 4)
    # boundary 0: 0.5 + 4 x 50 / 100 = 2.5 s; boundary 1: 4 x 50 / 50 = 4 s
    assert p.stage_seconds == (4 + 2.5, 4 + 2.5 + 4.0, 4 + 4.0)
    assert Link(0.5, 100.0).seconds(50) == 1.0 and FREE.seconds(1e12) == 0.0


def test_the_partitioner_cuts_where_the_activation_is_small():
    # 4 equal layers on equal ranks: the middle cut balances the compute, but
    # its activation costs 2 s each way while the outer cuts send nothing
    seconds, nbytes, link = [1.0] * 4, [0.0, 1000.0, 0.0], Link(0.0, 500.0)
    assert even_partition(seconds, 2) == (0, 2, 4)
    assert stage_times((0, 2, 4), seconds, [1, 1], nbytes, link).bottleneck_s == 4.0
    best = best_partition(seconds, [1, 1], nbytes, link)
    # (0, 1, 4) and (0, 3, 4) both reach 3 s: the smaller bounds win
    assert best.bounds == (0, 1, 4) and best.bottleneck_s == 3.0


def test_best_partition_matches_brute_force():
    rng = random.Random(22)
    for _ in range(400):
        case = random_case(rng)
        best, brute = best_partition(*case), brute_force_partition(*case)
        assert best.bottleneck_s == brute.bottleneck_s, case
        assert best.bounds == brute.bounds, case  # the tie rule, bit for bit
        assert stage_times(best.bounds, *case) == best


def test_ties_go_to_the_lexicographically_smallest_bounds():
    # all-zero layers: every partition costs 0
    assert best_partition([0.0] * 5, [1.0] * 3, [0.0] * 4, FREE).bounds == (0, 1, 2, 5)
    assert even_partition([1.0] * 4, 3) == (0, 1, 2, 4)
    # one stage holds everything
    assert best_partition([1.0, 2.0], [0.5], [7.0], FREE).bounds == (0, 2)


def test_even_partition_matches_brute_force_on_equal_ranks():
    rng = random.Random(7)
    for _ in range(200):
        seconds, speeds, _, _, _ = random_case(rng)
        stages = len(speeds)
        brute = brute_force_partition(
            seconds, [1.0] * stages, [0.0] * (len(seconds) - 1), FREE
        )
        assert even_partition(seconds, stages) == brute.bounds
        # the plain sums: max over stages of the compute
        sums = [sum(seconds[i:j]) for i, j in itertools.pairwise(brute.bounds)]
        assert brute.bottleneck_s == pytest.approx(max(sums))


def test_best_partition_scales_to_hundreds_of_layers():
    rng = random.Random(3)
    seconds = [rng.uniform(0.1, 1.0) for _ in range(300)]
    nbytes = [rng.uniform(0, 1e6) for _ in range(299)]
    p = best_partition(seconds, [1.0, 0.5, 0.8, 0.3], nbytes, Link(1e-4, 1e9), 8)
    assert p.bounds[0] == 0 and p.bounds[-1] == 300 and p.stages == 4
    # no single cut moved by one layer does better
    for k in range(1, 4):
        for d in (-1, 1):
            moved = list(p.bounds)
            moved[k] += d
            if moved[k - 1] < moved[k] < moved[k + 1]:
                q = stage_times(
                    moved, seconds, [1.0, 0.5, 0.8, 0.3], nbytes, Link(1e-4, 1e9), 8
                )
                assert q.bottleneck_s >= p.bottleneck_s


def test_continuous_bound_and_analytic_cut():
    assert analytic_cut((1, 0.25)) == 0.6
    assert analytic_cut([0.5, 0.5, 0.5]) == 0.0
    assert analytic_cut([1.0, 1.0, 0.5, 0.5]) == pytest.approx(1 - 4 * 0.5 / 3)
    assert continuous_bottleneck(12.0, [1, 0.25]) == 9.6
    assert continuous_bottleneck(10.0, [2.0, 3.0]) == 2.0
    # the cut against the even split's bottleneck, from the two bounds
    total, speeds = 7.0, [0.9, 0.2, 0.6]
    even = (total / 3) / min(speeds)
    assert analytic_cut(speeds) == pytest.approx(
        1 - continuous_bottleneck(total, speeds) / even
    )
    # no real cut beats the continuous bound
    rng = random.Random(5)
    for _ in range(50):
        seconds, speeds, _, _, _ = random_case(rng)
        p = best_partition(seconds, speeds, [0.0] * (len(seconds) - 1), FREE)
        assert p.bottleneck_s >= continuous_bottleneck(sum(seconds), speeds) * (
            1 - 1e-12
        )


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: best_partition([1, 1], [1, 1, 1], [0], FREE), "speeds: 3 stages"),
        (lambda: best_partition([], [1], [], FREE), "layer_seconds must hold"),
        (lambda: best_partition([1, -1], [1], [0], FREE), r"layer_seconds\[1\]"),
        (lambda: best_partition([1, math.nan], [1], [0], FREE), r"layer_seconds\[1\]"),
        (
            lambda: best_partition([1, 1], [1, 0], [0], FREE),
            r"speeds\[1\] must be finite and positive",
        ),
        (lambda: best_partition([1, 1], [], [0], FREE), "speeds must hold"),
        (
            lambda: best_partition([1, 1], [1], [0, 0], FREE),
            "activation_bytes must hold 1",
        ),
        (lambda: best_partition([1, 1], [1, 1], [-2], FREE), r"activation_bytes\[0\]"),
        (
            lambda: best_partition([1, 1, 1], [1, 1, 1], [0, 0], [FREE]),
            "link must hold one Link per boundary",
        ),
        (
            lambda: best_partition([1, 1], [1], [0], FREE, 0),
            "micro_batch must be >= 1, got 0",
        ),
        (
            lambda: stage_times((0, 2, 2), [1, 1], [1, 1], [0], FREE),
            r"bounds must rise strictly from 0 to 2.*\(0, 2, 2\)",
        ),
        (
            lambda: stage_times((1, 2), [1, 1], [1], [0], FREE),
            "bounds must rise strictly",
        ),
        (
            lambda: stage_times((0, 2), [1, 1], [1, 1], [0], FREE),
            "bounds must hold 3 cut points",
        ),
        (
            lambda: brute_force_partition([1] * 21, [1], [0] * 20, FREE),
            "at most 20 layers, got 21",
        ),
        (
            lambda: even_partition([1, 1], 3),
            "stages must be at most the 2 layers, got 3",
        ),
        (lambda: even_partition([1, 1], 0), "stages must be >= 1, got 0"),
        (lambda: Link(-1.0), "latency_s must be finite and >= 0, got -1.0"),
        (lambda: Link(0.0, 0.0), "bandwidth_Bps must be positive, got 0.0"),
        (lambda: Link(0.0, math.nan), "bandwidth_Bps must be positive"),
        (lambda: continuous_bottleneck(-1.0, [1]), "total_seconds"),
        (lambda: analytic_cut([]), "speeds must hold"),
        (lambda: Partition((0, 1), (1.0,), 1.0).layers(1), "k must be in 0..0, got 1"),
    ],
)
def test_partition_refuses_bad_input_with_a_value_error(call, match):
    with pytest.raises(ValueError, match=match):
        call()


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (
            lambda: best_partition([1, 1], [1], [0], FREE, 2.0),
            "micro_batch must be an int, got 2.0",
        ),
        (
            lambda: best_partition([1, 1], [1], [0], FREE, True),
            "micro_batch must be an int",
        ),
        (
            lambda: best_partition("ab", [1], [0], FREE),
            "layer_seconds must be a sequence",
        ),
        (
            lambda: best_partition([1, "1"], [1], [0], FREE),
            r"layer_seconds\[1\] must be a number",
        ),
        (
            lambda: best_partition([1, 1], [1, 1], [0], (1.0,)),
            r"link\[0\] must be a Link",
        ),
        (
            lambda: best_partition([1, 1], [1, 1], [0], 5),
            "link must be a Link or a sequence",
        ),
        (
            lambda: stage_times((0, 1.0, 2), [1, 1], [1, 1], [0], FREE),
            "bounds must hold ints",
        ),
        (lambda: even_partition([1, 1], 1.5), "stages must be an int, got 1.5"),
        (lambda: Link("1"), "latency_s must be a number"),
    ],
)
def test_partition_refuses_bad_types_with_a_type_error(call, match):
    with pytest.raises(TypeError, match=match):
        call()


def test_timing_inputs_split_forward_and_backward_by_the_flop_rule():
    fwd, bwd, comm = timing_inputs(
        (0, 1, 3), [3.0, 3.0, 3.0], [1.0, 0.5], [100.0, 10.0], Link(1.0, 100.0)
    )
    assert FORWARD_SHARE == 1 / 3
    assert fwd == pytest.approx([1.0, 4.0]) and bwd == pytest.approx([2.0, 8.0])
    assert comm == [(1.0, 1.0)]


# ------------------------------------------------------------------ timing
def test_micro_sizes_split_like_tensor_split():
    assert micro_sizes(10, 4) == [3, 3, 2, 2]
    assert micro_sizes(8, 4) == [2, 2, 2, 2]
    assert micro_sizes(3, 5) == [1, 1, 1]
    assert micro_sizes(0, 2) == []
    for n in range(30):
        for k in range(1, 8):
            sizes = micro_sizes(n, k)
            assert sum(sizes) == n and sizes == sorted(sizes, reverse=True)
            assert not sizes or (min(sizes) >= 1 and max(sizes) - min(sizes) <= 1)
    with pytest.raises(ValueError, match="micro_batches must be >= 1, got 0"):
        micro_sizes(4, 0)
    with pytest.raises(TypeError, match="samples must be an int"):
        micro_sizes(4.0, 2)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_one_stage_runs_its_micro_batches_back_to_back(schedule):
    assert batch_time([0.5], [1.5], [], [3, 3, 2, 2], schedule) == 20.0
    assert batch_time([0.5], [1.5], [], [], schedule) == 0.0


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_equal_stages_free_links_take_m_plus_s_minus_one_slots(schedule):
    # GPipe: forward of micro-batch i on stage k ends at (i + k + 1) m f; the
    # last stage's backwards start after its last forward, (M + S - 1) m f,
    # and backward i on stage k ends (i + S - k) m b later, so stage 0's last
    # ends at (M + S - 1) m (f + b). 1F1B fills and drains the same diagonal
    # (the known equal bubble), which the simulation confirms for b < f too.
    for stages, micros, f, b in itertools.product(
        range(1, 6), range(1, 7), (1.0, 2.0), (2.0, 0.5)
    ):
        t = batch_time(
            [f] * stages,
            [b] * stages,
            [(0.0, 0.0)] * (stages - 1),
            [2] * micros,
            schedule,
        )
        assert t == pytest.approx((micros + stages - 1) * 2 * (f + b))


def test_uneven_micro_batches():
    # GPipe on equal stages: the longest chain through the grid of (stage,
    # micro-batch) visits every micro-batch once and stays on the largest,
    # the first, for the S - 1 extra stages: (f + b)(sum m + (S - 1) m_0)
    for stages in range(1, 5):
        for n, k in itertools.product(range(1, 12), range(1, 6)):
            sizes = micro_sizes(n, k)
            t = batch_time(
                [1.0] * stages, [2.0] * stages, [(0, 0)] * (stages - 1), sizes, "gpipe"
            )
            assert t == pytest.approx(3.0 * (n + (stages - 1) * sizes[0]))
            one = batch_time(
                [1.0] * stages, [2.0] * stages, [(0, 0)] * (stages - 1), sizes
            )
            assert one <= t + 1e-9  # 1F1B never loses here; see below
    # sizes 2, 1 on two stages, f = 1, b = 2 per sample. 1F1B: stage 0 F0
    # [0, 2], F1 [2, 3]; stage 1 F0 [2, 4], B0 [4, 8]; stage 0 B0 [8, 12];
    # stage 1 F1 [8, 9], B1 [9, 11]; stage 0 B1 [12, 14]. GPipe: stage 1 F0
    # [2, 4], F1 [4, 5], B0 [5, 9], B1 [9, 11]; stage 0 B0 [9, 13], B1 [13, 15]
    assert batch_time([1, 1], [2, 2], [(0, 0)], [2, 1]) == 14.0
    assert batch_time([1, 1], [2, 2], [(0, 0)], [2, 1], "gpipe") == 15.0


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_messages_occupy_the_receiver(schedule):
    # one micro-batch crosses every boundary twice, in series
    f, b, comm = [1.0, 0.5, 2.0], [2.0, 1.0, 4.0], [(0.5, 0.25), (0.1, 1.0)]
    t = batch_time(f, b, comm, [4], schedule)
    assert t == pytest.approx(4 * 10.5 + 2 * (0.5 + 4 * 0.25) + 2 * (0.1 + 4 * 1.0))


def test_messages_between_two_stages_by_hand():
    # f = 1, b = 2 per sample, a message of one sample 0.5 + 0.25 s.
    # 1F1B: stage 0 F0 [0, 1], F1 [1, 2]; stage 1 receives F0 [1, 1.75],
    # F0 to 2.75, B0 to 4.75; stage 0 receives [4.75, 5.5], B0 to 7.5; stage 1
    # receives F1 [4.75, 5.5] (it was busy), F1 to 6.5, B1 to 8.5; stage 0
    # receives [8.5, 9.25], B1 to 11.25.
    args = ([1.0, 1.0], [2.0, 2.0], [(0.5, 0.25)], [1, 1])
    assert batch_time(*args) == 11.25
    # GPipe: stage 1 receives F0 [1, 1.75], F0 to 2.75, receives F1 [2.75,
    # 3.5], F1 to 4.5, B0 to 6.5, B1 to 8.5; stage 0 receives [6.5, 7.25], B0
    # to 9.25, receives [9.25, 10], B1 to 12
    assert batch_time(*args, "gpipe") == 12.0


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_no_schedule_beats_the_bottleneck(schedule):
    rng = random.Random(11)
    for _ in range(60):
        seconds, speeds, nbytes, link, m = random_case(rng)
        p = best_partition(seconds, speeds, nbytes, link, m)
        fwd, bwd, comm = timing_inputs(p.bounds, seconds, speeds, nbytes, link)
        micros = rng.randint(1, 12)
        assert batch_time(
            fwd, bwd, comm, [m] * micros, schedule
        ) >= micros * p.bottleneck_s * (1 - 1e-12)


def test_1f1b_settles_at_the_partitions_bottleneck():
    # the two modules agree: 1F1B's cost per extra micro-batch tends to max T_k
    rng = random.Random(13)
    for _ in range(40):
        seconds, speeds, nbytes, link, m = random_case(rng)
        p = best_partition(seconds, speeds, nbytes, link, m)
        fwd, bwd, comm = timing_inputs(p.bounds, seconds, speeds, nbytes, link)
        many = batch_time(fwd, bwd, comm, [m] * 400) - batch_time(
            fwd, bwd, comm, [m] * 200
        )
        assert many / 200 == pytest.approx(p.bottleneck_s, rel=1e-3)


def test_speed_aware_cut_against_even_on_two_stages():
    # 12 equal layers of 1 s, ranks at speeds 1 and 0.25, free links, one
    # sample per micro-batch. even: 6 + 6 layers, T = (6, 24); best: 10 + 2,
    # T = (10, 8) (9 + 3 gives 12). With two stages and free links 1F1B
    # keeps the bottleneck busy: even (stage 1 the bottleneck) ends at
    # f0 + M T_1 + b0 = 24 M + 6; best (stage 0) waits once for the first
    # gradient (F0, F1 end at 20/3, B0 from 10/3 + 8) and once for the last
    # (B(M-1) from 10 M - 2/3), so it ends at 10 M + 6 for M >= 2
    seconds, speeds, nbytes = [1.0] * 12, [1.0, 0.25], [0.0] * 11
    even = even_partition(seconds, 2)
    best = best_partition(seconds, speeds, nbytes, FREE)
    assert even == (0, 6, 12) and best.bounds == (0, 10, 12)
    assert best.stage_seconds == (10.0, 8.0)
    assert stage_times(even, seconds, speeds, nbytes, FREE).stage_seconds == (6.0, 24.0)
    for micros in (2, 3, 10, 1000):
        times = [
            batch_time(*timing_inputs(b, seconds, speeds, nbytes, FREE), [1] * micros)
            for b in (even, best.bounds)
        ]
        assert times == pytest.approx([24 * micros + 6, 10 * micros + 6])
    # the ratio tends to 10 / 24 = 5 / 12: layers of one twelfth keep it
    # above the continuous 0.4 (a cut of 58%, against the analytic 60%)
    ratio = times[1] / times[0]
    assert ratio == pytest.approx(5 / 12, abs=1e-3) and ratio > 1 - analytic_cut(speeds)


@pytest.mark.parametrize(
    ("args", "error", "match"),
    [
        (([], [], [], [1]), ValueError, "forward_s must hold at least one stage"),
        (([1], [1, 1], [], [1]), ValueError, "backward_s must hold 1 values, got 2"),
        (([1, 1], [1, 1], [], [1]), ValueError, "comm_s must hold 1 values, got 0"),
        (
            ([1, 1], [1, 1], [(0, 0, 0)], [1]),
            ValueError,
            r"comm_s\[0\] must be \(latency_s",
        ),
        (
            ([1, 1], [1, 1], [(-1, 0)], [1]),
            ValueError,
            r"comm_s\[0\] latency must be finite",
        ),
        (([1], [math.inf], [], [1]), ValueError, r"backward_s\[0\] must be finite"),
        (([-1], [1], [], [1]), ValueError, r"forward_s\[0\] must be finite and >= 0"),
        (([1], [1], [], [2, 0]), ValueError, r"micro_sizes\[1\] must be >= 1, got 0"),
        (([1], [1], [], [2.0]), TypeError, r"micro_sizes\[0\] must be an int"),
        (([1], [1], [], [1], "zb"), ValueError, "schedule must be one of 1f1b, gpipe"),
        (("1", [1], [], [1]), TypeError, "forward_s must be a sequence"),
    ],
)
def test_batch_time_refuses_bad_input(args, error, match):
    with pytest.raises(error, match=match):
        batch_time(*args)


def test_memory_limits_agree_with_brute_force_and_refuse_when_nothing_fits():
    import random

    from hybridagg.pipeline import Link, best_partition, brute_force_partition

    rng = random.Random(7)
    checked = 0
    for _ in range(300):
        layers = rng.randint(2, 9)
        stages = rng.randint(1, min(layers, 4))
        seconds = [rng.uniform(0, 2) for _ in range(layers)]
        speeds = [rng.uniform(0.2, 2) for _ in range(stages)]
        acts = [rng.uniform(0, 5) for _ in range(layers - 1)]
        need = [rng.uniform(1, 4) for _ in range(layers)]
        memory = [rng.choice([None, rng.uniform(2, 12)]) for _ in range(stages)]
        args = (seconds, speeds, acts, Link(0.01, 10.0))
        kw = {"layer_bytes": need, "memory": memory}
        try:
            want = brute_force_partition(*args, **kw)
        except ValueError as exc:
            assert "fits the ranks' memory" in str(exc)
            with pytest.raises(ValueError, match="fits the ranks' memory"):
                best_partition(*args, **kw)
            continue
        got = best_partition(*args, **kw)
        assert got.bounds == want.bounds and got.bottleneck_s == want.bottleneck_s
        for k in range(stages):
            held = sum(need[i] for i in got.layers(k))
            assert memory[k] is None or held <= memory[k]
        checked += 1
    assert checked > 100
    # a memory limit moves the cut: the fast rank cannot hold 4 of 5 layers
    free = best_partition([1.0] * 5, [1.0, 0.25], [0.0] * 4, Link())
    tight = best_partition(
        [1.0] * 5,
        [1.0, 0.25],
        [0.0] * 4,
        Link(),
        layer_bytes=[1.0] * 5,
        memory=[3, None],
    )
    assert free.bounds == (0, 4, 5) and tight.bounds == (0, 3, 5)
    with pytest.raises(ValueError, match="go together"):
        best_partition([1.0] * 5, [1.0], [0.0] * 4, Link(), layer_bytes=[1.0] * 5)


def test_continuous_bottleneck_fills_ranks_to_their_capacity():
    import random

    from hybridagg.pipeline import continuous_bottleneck

    assert continuous_bottleneck(10.0, [1.0, 0.25]) == pytest.approx(8.0)
    # the fast rank holds at most 6 s of work: the slow one takes 4 s at 0.25
    assert continuous_bottleneck(10.0, [1.0, 0.25], [6.0, None]) == pytest.approx(16.0)
    # a capacity that does not bind changes nothing
    assert continuous_bottleneck(10.0, [1.0, 0.25], [9.0, 9.0]) == pytest.approx(8.0)
    with pytest.raises(ValueError, match="hold 5 s of work"):
        continuous_bottleneck(10.0, [1.0, 1.0], [2.0, 3.0])
    rng = random.Random(3)
    for _ in range(200):  # against bisection on sum_k min(T s_k, c_k) = total
        n = rng.randint(1, 5)
        speeds = [rng.uniform(0.1, 2) for _ in range(n)]
        caps = [rng.choice([None, rng.uniform(0.5, 6)]) for _ in range(n)]
        total = rng.uniform(1, 10)
        held = sum(math.inf if c is None else c for c in caps)
        if held < total:
            continue
        lo, hi = 0.0, 1e6
        for _ in range(200):
            mid = (lo + hi) / 2
            got = sum(
                min(mid * s, math.inf if c is None else c)
                for s, c in zip(speeds, caps, strict=True)
            )
            lo, hi = (mid, hi) if got < total else (lo, mid)
        assert continuous_bottleneck(total, speeds, caps) == pytest.approx(hi, rel=1e-9)
