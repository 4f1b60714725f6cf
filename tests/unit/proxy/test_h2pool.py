"""agent.proxy.h2pool (its pure parts): lanes are handed out round robin, within the count."""

from __future__ import annotations

from agent.proxy import h2pool
from agent.proxy.pool import H2_LANES


def test_lanes_go_round_robin_within_the_pools_count():
    three = h2pool.H2Pool(3)
    got = [three.next_lane() for _ in range(9)]
    assert set(got) == {0, 1, 2}
    assert all(got[i] != got[i + 1] for i in range(8))  # consecutive connections differ
    one = h2pool.H2Pool(1)
    assert {one.next_lane() for _ in range(5)} == {0}
    assert h2pool.H2Pool().lanes == H2_LANES
