"""agent.proxy.h2pool (its pure parts): lanes are handed out round robin, within the count."""

from __future__ import annotations

import asyncio

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


def test_busy_remembers_a_lane_without_connections_until_its_first_opens():
    """Rule 3: `busy` keeps its answer for the last key asked, none found included; the
    lane's first connection makes it ask again."""
    pool = h2pool.H2Pool(1)
    key = pool.lane_key(("10.0.0.2", 4143, "srv.ns"), 0)

    async def opener(factory):
        return None, factory()

    async def main() -> None:
        assert not pool.busy(key)
        assert not pool.busy(key)  # remembered: nothing to ask the dict again
        conn = await pool._conn(key, opener)  # opens the lane's first
        conn.streams[1] = object()  # a request on it
        assert pool.busy(key)
        conn.streams.clear()
        assert not pool.busy(key)

    asyncio.run(main())
