"""Tap fan-out: bounded rings, slow readers drop, filters."""

from __future__ import annotations

import json

import pytest

from agent.admin.tap import TapFull, TapHub


async def test_slow_reader_loses_oldest_and_is_told_how_many():
    hub = TapHub(capacity=3)
    with hub.subscribe() as sub:
        for i in range(10):
            hub.publish({"n": i})  # never blocks though nobody reads
        batch = [json.loads(line) for line in await sub.next_batch()]
    assert batch == [{"dropped": 7}, {"n": 7}, {"n": 8}, {"n": 9}]
    assert sub.dropped == 7
    assert hub.subscribers == 0


async def test_filters_select_events_per_reader():
    hub = TapHub()
    with hub.subscribe({"pod": "web"}) as web, hub.subscribe() as everything:
        hub.publish({"pod": "web", "n": 1})
        hub.publish({"pod": "db", "n": 2})
        assert [json.loads(x)["n"] for x in await web.next_batch()] == [1]
        assert [json.loads(x)["n"] for x in await everything.next_batch()] == [1, 2]


def test_publish_without_readers_costs_nothing():
    hub = TapHub()
    hub.publish({"n": 1})
    assert hub.published == 0


def test_reader_limit():
    hub = TapHub(max_subscribers=1)
    sub = hub.subscribe()
    with pytest.raises(TapFull):
        hub.subscribe()
    sub.close()
    hub.subscribe().close()


def test_on_change_reports_the_tapped_pods_as_readers_come_and_go():
    hub = TapHub()
    seen: list[frozenset[str]] = []
    hub.on_change = seen.append
    web = hub.subscribe({"pod": "shop/web"})
    web2 = hub.subscribe({"pod": "shop/web"})  # same set: no news
    anything = hub.subscribe()
    anything.close()
    web.close()
    web2.close()
    web2.close()  # twice is harmless
    assert seen == [
        frozenset({"shop/web"}),
        frozenset({"shop/web", "*"}),
        frozenset({"shop/web"}),
        frozenset(),
    ]
