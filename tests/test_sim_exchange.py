"""hybridagg.sim: a leader's exchange with a server on another host in parts,
push, update and reply overlapping, as the run's client and server do."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from test_sim import PACED, PROFILE, gpus, needs_simgrid, options

from hybridagg.runtime import envvars
from hybridagg.sim import (
    ClusterSpec,
    LinkSpec,
    NodeType,
    ServerPlacement,
    build_job,
    simulate,
)
from hybridagg.sim.analytic import estimate
from hybridagg.sim.job import PS_PART_BYTES

G = 1e8  # PROFILE's gradient, float32
COMPUTE = 32 * 0.003  # PROFILE's batch of 32
PARTS = math.ceil(G / PS_PART_BYTES)  # 24
FIRST = round(G / PARTS)  # the first part's whole bytes
UPDATE0 = 0.004 + G / PARTS * 2e-10  # the first part's update: the push's constant too


def two_nodes(core: float | None = None) -> ClusterSpec:
    """A worker's node and a server's node, 1 GB/s links, no latency."""
    return ClusterSpec(
        name="t",
        node_types=(
            NodeType(name="g", count=1, devices=1),
            NodeType(name="s", count=1, devices=0),
        ),
        intra_node=LinkSpec(1e10, 0.0),
        inter_node=LinkSpec(1e9, 0.0),
        servers=ServerPlacement(("s",), 1),
        core=None if core is None else LinkSpec(core, 0.0),
    )


def test_the_part_is_the_runs_and_counts_a_servers_float32_shard():
    assert envvars.get_int("HYBRIDAGG_PS_PART_BYTES", {}) == PS_PART_BYTES
    job = build_job(options(mode="async", servers=1), two_nodes(), PROFILE)
    assert (job.part_bytes, job.exchange_parts()) == (PS_PART_BYTES, PARTS)
    # a compact wire halves the bytes, not the parts (the run cuts elements)
    bf16 = build_job(
        options(mode="async", servers=1, wire="bf16"), two_nodes(), PROFILE
    )
    assert bf16.exchange_parts() == PARTS
    two = build_job(options(mode="async", servers=2), gpus(4), PROFILE)
    assert two.exchange_parts() == math.ceil(G / 2 / PS_PART_BYTES)
    assert replace(job, part_bytes=0).exchange_parts() == 1


@needs_simgrid
def test_a_push_in_parts_overlaps_its_update_and_reply_in_closed_form():
    # one async worker and a server on two nodes. Part i reaches the server
    # (i+1) part-transfers after the push begins; the server updates it (the
    # first part carries the push's constant) and returns it while later
    # parts move; the reply link, once the first part is back, never idles
    # (each update is shorter than a part's transfer), so the exchange is the
    # first part's push and update, then the whole reply
    job = build_job(options(mode="async", servers=1, steps=3), two_nodes(), PROFILE)
    exchange = FIRST / 1e9 + UPDATE0 + G / 1e9
    # (the run's time ends with the third update: its first part's)
    end = 3 * COMPUTE + 2 * exchange + FIRST / 1e9 + UPDATE0
    assert simulate(job).time_s == pytest.approx(end, rel=1e-6)
    # one message each way: the push, the whole update, the reply in turn
    whole = replace(job, part_bytes=0)
    update = 0.004 + G * 2e-10
    end = 3 * COMPUTE + 2 * (2 * G / 1e9 + update) + G / 1e9 + update
    assert simulate(whole).time_s == pytest.approx(end, rel=1e-6)
    # the analytic model's pipeline of three stages is near the flows'
    assert estimate(job).samples_per_sec == pytest.approx(
        32 / (COMPUTE + exchange), rel=0.05
    )


@needs_simgrid
def test_a_push_and_its_reply_in_parts_share_the_core_switch():
    # below the NICs' rate the core limits, and it carries both directions:
    # 2G over the core each exchange, and it idles at most while the server
    # updates the last part (the replies keep pace with the pushes)
    job = build_job(
        options(mode="async", servers=1, steps=3), two_nodes(core=4e8), PROFILE
    )
    exchange = 2 * G / 4e8
    last = G / PARTS * 2e-10
    # (the run's time ends with the third update: its first part's)
    two = simulate(job).time_s - (3 * COMPUTE + FIRST / 4e8 + UPDATE0)
    assert 2 * exchange * (1 - 1e-9) <= two <= 2 * (exchange + last) * (1 + 1e-9)
    assert estimate(job).samples_per_sec == pytest.approx(
        32 / (COMPUTE + exchange), rel=0.01
    )
    # one message each way: each crosses the core alone, the update between
    whole = replace(job, part_bytes=0)
    update = 0.004 + G * 2e-10
    end = 3 * COMPUTE + 2 * (2 * G / 4e8 + update) + G / 4e8 + update
    assert simulate(whole).time_s == pytest.approx(end, rel=1e-6)


@needs_simgrid
def test_a_staleness_bound_holds_a_reply_in_parts_until_it_is_whole():
    # the groups' servers on other devices: pushes in parts; bound 0 keeps
    # the fast group in lockstep with the slow one, as with whole messages
    common = dict(
        mode="hybrid", groups="0-1,2-3", servers=1, steps=40, sample_ms=1.0,
        slowdown="2-3:4",
    )  # fmt: skip
    cluster = gpus(4, bw=1e10, lat=0.0)
    free = build_job(options(**common), cluster, PACED)
    assert free.exchange_parts() == PARTS
    bound = simulate(build_job(options(**common, staleness_bound=0), cluster, PACED))
    unbound = simulate(free)
    fast, slow = bound.group_update_s
    assert unbound.group_update_s[0] < unbound.group_update_s[1] / 2
    assert fast == pytest.approx(slow, rel=0.05)
    assert bound.updates >= 40 and bound.mean_staleness <= 1.0
