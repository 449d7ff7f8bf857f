"""The rule for how many servers a job needs."""

from __future__ import annotations

import pytest

from hybridagg.ps import servers_needed

MIB = 2**20


def test_servers_cover_the_groups_bytes_at_the_lesser_of_link_and_update():
    # two groups at 4 updates/s of a 100 MiB model: 800 MiB/s each way; a
    # server updates 1000 MiB/s but its link carries 125 MB/s (1 Gbit/s)
    got = servers_needed(100 * MIB, [4.0, 4.0], 1000 * MIB, 125e6)
    assert got.binding == "link"
    assert got.demand_bytes_per_sec == 800 * MIB
    # 838.9 MB/s over 0.8 x 125 MB/s: 8.4, so 9 servers
    assert got.servers == 9 and not got.capped
    # on shared memory the update rate binds: 800 / (0.8 x 1000) = 1 server
    shm = servers_needed(100 * MIB, [4.0, 4.0], 1000 * MIB)
    assert (shm.servers, shm.binding) == (1, "update")
    # one more update a second per group tips it to two
    assert servers_needed(100 * MIB, [5.0, 5.0], 1000 * MIB).servers == 2


def test_async_needs_twice_the_servers_of_hybrid_for_the_same_samples():
    # the design's point: 4 groups of one worker push twice the updates of
    # 2 groups of two for the same samples per second
    # (a ResNet-50 at 10 updates/s per group over 10 Gbit/s links: 0.8 x
    # 1.25 GB/s is 1 GB/s per server; hybrid sends 1.97 GB/s, async 3.94)
    hybrid = servers_needed(94 * MIB, [10.0, 10.0], 2000 * MIB, 1.25e9)
    asynch = servers_needed(94 * MIB, [10.0] * 4, 2000 * MIB, 1.25e9)
    assert asynch.demand_bytes_per_sec == 2 * hybrid.demand_bytes_per_sec
    assert (hybrid.servers, asynch.servers) == (2, 4)


def test_no_more_servers_than_parts_and_at_least_one():
    small = servers_needed(1 * MIB, [1000.0] * 8, 10 * MIB, 1e6)
    assert small.servers == 1 and small.capped
    assert servers_needed(64 * MIB, [0.0], 1 * MIB).servers == 1
    assert servers_needed(64 * MIB, [100.0], 1 * MIB, part_bytes=8 * MIB).servers == 8


@pytest.mark.parametrize(
    ("args", "kw", "message"),
    [
        ((0, [1.0], 1.0), {}, "model_bytes"),
        ((1, [], 1.0), {}, "update_rates"),
        ((1, [-1.0], 1.0), {}, "update_rates"),
        ((1, [1.0], 0.0), {}, "update and link rates"),
        ((1, [1.0], 1.0, 0.0), {}, "update and link rates"),
        ((1, [1.0], 1.0), {"headroom": 0.0}, "headroom"),
        ((1, [1.0], 1.0), {"headroom": 1.5}, "headroom"),
    ],
)
def test_bad_input_is_refused(args, kw, message):
    with pytest.raises(ValueError, match=message):
        servers_needed(*args, **kw)
