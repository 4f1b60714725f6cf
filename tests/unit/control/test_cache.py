"""The state cache follows destination.proto's update rules, versions and reports each change."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from agent.control.cache import (
    DestinationKey,
    EndpointSet,
    IdentityKey,
    PolicyKey,
    ProfileKey,
    StateCache,
)
from agent.control.convert import EndpointsUpdate
from agent.policy.model import ServerPolicy
from agent.proxy.model import Endpoint, Profile

WEB = DestinationKey("web.shop.svc.cluster.local:8080")


def ep(last: int, weight: int = 10_000) -> Endpoint:
    return Endpoint(addr=(f"10.0.0.{last}", 8080), weight=weight)


def add(*eps: Endpoint) -> EndpointsUpdate:
    return EndpointsUpdate(added=eps)


def remove(*lasts: int) -> EndpointsUpdate:
    return EndpointsUpdate(removed=tuple((f"10.0.0.{n}", 8080) for n in lasts))


def none(exists: bool) -> EndpointsUpdate:
    return EndpointsUpdate(no_endpoints=exists)


def recording() -> tuple[StateCache, list]:
    seen: list = []
    return StateCache(on_change=lambda k, v: seen.append((k, v))), seen


def addrs(cache: StateCache, key: DestinationKey = WEB) -> list[int]:
    s = cache.endpoints(key)
    assert s is not None
    return [int(e.addr[0].rsplit(".", 1)[1]) for e in s.endpoints]


def test_unknown_destination_is_none_before_the_first_message():
    cache = StateCache()
    assert cache.endpoints(WEB) is None
    assert cache.entry(WEB) is None


def test_add_accumulates_and_replaces_by_address():
    cache = StateCache()
    cache.apply_update(WEB, add(ep(2), ep(1)))
    cache.apply_update(WEB, add(ep(3), ep(1, weight=5)))
    assert addrs(cache) == [1, 2, 3]
    assert cache.endpoints(WEB).by_addr()[("10.0.0.1", 8080)].weight == 5
    assert cache.endpoints(WEB).exists is True


def test_first_message_empty_add_means_exists_with_no_endpoints():
    cache = StateCache()
    assert cache.apply_update(WEB, add()) is True
    assert cache.endpoints(WEB) == EndpointSet(endpoints=(), exists=True)


def test_remove_of_the_last_endpoint_leaves_an_empty_existing_set():
    cache = StateCache()
    cache.apply_update(WEB, add(ep(1)))
    cache.apply_update(WEB, remove(1))
    assert cache.endpoints(WEB) == EndpointSet(endpoints=(), exists=True)
    # ... which is what no_endpoints{exists: true} says: applying it changes nothing.
    assert cache.apply_update(WEB, none(exists=True)) is False


def test_no_endpoints_clears_and_records_existence():
    cache = StateCache()
    cache.apply_update(WEB, add(ep(1), ep(2)))
    cache.apply_update(WEB, none(exists=False))
    assert cache.endpoints(WEB) == EndpointSet(endpoints=(), exists=False)
    cache.apply_update(WEB, add(ep(3)))
    assert addrs(cache) == [3]
    assert cache.endpoints(WEB).exists is True


def test_no_endpoints_then_add_is_not_the_same_as_add_alone():
    # proto: "`no_endpoints` followed by an `add` is *not* equivalent to just sending the `add`".
    a, b = StateCache(), StateCache()
    for cache in (a, b):
        cache.apply_update(WEB, add(ep(1)))
    a.apply_update(WEB, none(exists=True))
    a.apply_update(WEB, add(ep(2)))
    b.apply_update(WEB, add(ep(2)))
    assert addrs(a) == [2]
    assert addrs(b) == [1, 2]


def test_remove_then_no_endpoints_equals_no_endpoints_alone():
    a, b = StateCache(), StateCache()
    for cache in (a, b):
        cache.apply_update(WEB, add(ep(1), ep(2)))
    a.apply_update(WEB, remove(1))
    a.apply_update(WEB, none(exists=False))
    b.apply_update(WEB, none(exists=False))
    assert a.endpoints(WEB) == b.endpoints(WEB)


def test_redundant_messages_change_nothing_and_report_nothing():
    cache, seen = recording()
    cache.apply_update(WEB, add(ep(1)))
    version = cache.entry(WEB).version
    assert cache.apply_update(WEB, add(ep(1))) is False
    assert cache.apply_update(WEB, remove(9)) is False
    assert cache.entry(WEB).version == version
    assert len(seen) == 1


def test_stale_set_is_served_until_the_first_message_of_a_new_subscription():
    cache, seen = recording()
    cache.apply_update(WEB, add(ep(1), ep(2)))
    cache.begin_subscription(WEB)
    assert cache.is_stale(WEB)
    assert addrs(cache) == [1, 2]  # still served while reconnecting
    cache.apply_update(WEB, add(ep(2), ep(3)))  # first message of the new stream
    assert not cache.is_stale(WEB)
    assert addrs(cache) == [2, 3]  # replaced, not merged: 1 is gone
    cache.apply_update(WEB, add(ep(4)))  # later messages merge again
    assert addrs(cache) == [2, 3, 4]
    assert [v for _, v in seen][-2].endpoints == (ep(2), ep(3))


def test_first_message_remove_after_resubscribe_leaves_nothing_stale():
    cache = StateCache()
    cache.apply_update(WEB, add(ep(1), ep(2)))
    cache.begin_subscription(WEB)
    cache.apply_update(WEB, remove(1))
    assert addrs(cache) == []


def test_begin_subscription_on_unknown_key_is_not_stale():
    cache = StateCache()
    cache.begin_subscription(WEB)
    assert not cache.is_stale(WEB)
    assert cache.endpoints(WEB) is None


def test_versions_increase_across_keys_and_on_change_sees_each_change():
    cache, seen = recording()
    other = DestinationKey("10.96.0.10:53")
    cache.apply_update(WEB, add(ep(1)))
    cache.apply_update(other, none(exists=False))
    cache.apply_update(WEB, remove(1))
    assert [k for k, _ in seen] == [WEB, other, WEB]
    assert cache.entry(WEB).version == 3 > cache.entry(other).version == 2
    assert cache.version == 3


def test_whole_values_replace_and_equal_values_are_not_changes():
    cache, seen = recording()
    pkey, qkey, ikey = (
        ProfileKey(WEB.target, "shop"),
        PolicyKey("shop", "web-1", 8080),
        IdentityKey("shop", "web"),
    )
    assert cache.set(pkey, Profile(fqn="web.shop.svc.cluster.local")) is True
    assert cache.set(pkey, Profile(fqn="web.shop.svc.cluster.local")) is False
    assert cache.set(pkey, Profile(fqn="web.shop.svc.cluster.local", opaque_protocol=True)) is True
    assert cache.set(qkey, ServerPolicy.invalid()) is True
    assert cache.profile(pkey).opaque_protocol is True
    assert cache.policy(qkey).valid is False
    assert cache.identity(ikey) is None
    assert len(seen) == 3


def test_drop_forgets_and_reports_none():
    cache, seen = recording()
    cache.apply_update(WEB, add(ep(1)))
    cache.begin_subscription(WEB)
    assert cache.drop(WEB) is True
    assert cache.endpoints(WEB) is None
    assert not cache.is_stale(WEB)
    assert seen[-1] == (WEB, None)
    assert cache.drop(WEB) is False
    key = PolicyKey("shop", "web-1", 80)
    cache.set(key, ServerPolicy.invalid())
    assert cache.set(key, None) is True
    assert cache.policy(key) is None


def test_items_is_a_snapshot_of_every_entry():
    cache = StateCache()
    cache.apply_update(WEB, add(ep(1)))
    cache.set(PolicyKey("shop", "web-1", 80), ServerPolicy.invalid())
    snapshot = dict(cache.items())
    assert set(snapshot) == {WEB, PolicyKey("shop", "web-1", 80)}
    assert len(cache) == 2


updates = st.one_of(
    st.lists(st.integers(1, 6), max_size=4).map(lambda ns: add(*(ep(n) for n in ns))),
    st.lists(st.integers(1, 6), max_size=4).map(lambda ns: remove(*ns)),
    st.booleans().map(none),
)


@given(st.lists(updates, max_size=12))
def test_cache_matches_a_model_of_the_proto_rules(seq):
    cache = StateCache()
    model: set[int] = set()
    exists = True
    for u in seq:
        cache.apply_update(WEB, u)
        if u.no_endpoints is not None:
            model, exists = set(), u.no_endpoints
        else:
            exists = True
        model -= {int(a[0].rsplit(".", 1)[1]) for a in u.removed}
        model |= {int(e.addr[0].rsplit(".", 1)[1]) for e in u.added}
        assert addrs(cache) == sorted(model)
        assert cache.endpoints(WEB).exists is exists
