"""agent.proxy.upstream: SSL contexts fail closed and are cached per material; the idle pool."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from datetime import UTC, datetime
from typing import TYPE_CHECKING, cast

import pytest

from agent.identity import ca
from agent.identity.csr import check_csr, make_csr, new_key
from agent.identity.names import Identity
from agent.identity.tls import chain_pem, seal
from agent.proxy import inbound, upstream
from agent.proxy.state import PodInfo, TlsMaterial
from agent.proxy.upstream import ConnPool, TlsContexts, UpstreamError

if TYPE_CHECKING:
    from agent.proxy.worker import Worker

WEB = Identity(sa="web", ns="shop")


@pytest.fixture(scope="module")
def material(tmp_path_factory) -> TlsMaterial:
    d = tmp_path_factory.mktemp("pki")
    now = datetime.now(UTC)
    ca.create_root(d / "root", now=now)
    ca.create_issuer(d / "issuer", d / "root", now=now)
    issuer = ca.load_issuer(d / "issuer", now=now)
    key = new_key()
    leaf, chain, until = issuer.sign_leaf(check_csr(make_csr(key, WEB), WEB.dns_name), WEB, now=now)
    sealed = seal(key)
    return TlsMaterial(
        identity=WEB.dns_name,
        cert_chain_pem=chain_pem(leaf, chain),
        key_pem=sealed.pem,
        key_password=sealed.password,
        trust_pem=issuer.bundle.pem,
        not_after=until.timestamp(),
    )


def test_no_material_fails_closed():
    with pytest.raises(UpstreamError, match="no TLS material"):
        TlsContexts().client(None, WEB.dns_name, now=time.time())


def test_expired_material_fails_closed(material):
    with pytest.raises(UpstreamError, match="expired"):
        TlsContexts().server(material, WEB.dns_name, now=material.not_after + 1)


def test_garbage_key_fails_closed(material):
    bad = replace(material, key_pem=b"not a key")
    with pytest.raises(UpstreamError, match="unusable"):
        TlsContexts().client(bad, WEB.dns_name, now=time.time())


def test_contexts_are_cached_until_the_material_changes(material):
    tls = TlsContexts()
    now = time.time()
    first = tls.client(material, WEB.dns_name, now=now)
    assert tls.client(material, WEB.dns_name, now=now) is first
    renewed = replace(material, not_after=material.not_after + 1)
    assert tls.client(renewed, WEB.dns_name, now=now) is not first
    assert tls.server(material, WEB.dns_name, now=now) is not first  # server side is its own


class FakeConn:
    def __init__(self) -> None:
        self.pool_key = None
        self.idle_since = 0.0
        self.alive = True
        self.closed = False
        self.on_gone = None

    @property
    def reusable(self) -> bool:
        return self.alive and not self.closed

    def close(self) -> None:
        self.closed = True
        self.lose()

    def lose(self) -> None:
        """What `connection_lost` does for the pool (UpstreamConn)."""
        gone, self.on_gone = self.on_gone, None
        if gone is not None:
            gone(self)


async def test_pool_reuses_live_connections_per_key_and_skips_dead_ones():
    pool = ConnPool(idle_timeout=60)
    made: list[FakeConn] = []

    async def opener():
        made.append(FakeConn())
        return made[-1]

    c1, reused = await pool.acquire("k", opener)
    assert not reused
    pool.release(c1)
    c2, reused = await pool.acquire("k", opener)
    assert (c2, reused) == (c1, True)
    other, _ = await pool.acquire("other", opener)
    assert other is not c1
    pool.release(c1)
    c1.alive = False  # the server closed it while idle
    c3, reused = await pool.acquire("k", opener)
    assert not reused
    assert c3 is not c1
    assert c1.closed
    pool.close()


async def test_pool_counts_its_connections_per_key_until_each_is_lost():
    pool = ConnPool()
    made: list[FakeConn] = []

    async def opener():
        made.append(FakeConn())
        return made[-1]

    assert not pool.crowded("k", 2)  # nothing to share: open one
    a, _ = await pool.acquire("k", opener)
    b, _ = await pool.acquire("k", opener)
    await pool.acquire("other", opener)
    assert (pool.live("k"), pool.live("other")) == (2, 1)
    assert pool.crowded("k", 2)  # both busy
    assert not pool.crowded("k", 3)
    assert not pool.crowded("other", 2)
    pool.release(a)
    assert not pool.crowded("k", 2)  # an idle one to take
    assert pool.take("k") is a
    assert pool.crowded("k", 2)
    b.lose()  # the upstream closed it mid-exchange: the pool never saw it again
    assert pool.live("k") == 1
    assert not pool.crowded("k", 2)
    a.lose()
    b.lose()  # told once only
    assert pool.live("k") == 0

    async def lost_at_once():
        conn = FakeConn()
        conn.alive = False  # lost before the pool could listen
        return conn

    await pool.acquire("k", lost_at_once)
    assert pool.live("k") == 0
    made[2].close()  # the busy one to "other", closed by its exchange
    assert pool.live("other") == 0
    pool.close()


async def test_a_connection_being_opened_counts_and_a_failed_one_does_not():
    # A burst of requests must not open a connection each: the first ones count
    # while their connections are still being opened (h1toh2 rule 7).
    pool = ConnPool()
    gate = asyncio.Event()

    async def slow_opener():
        await gate.wait()
        return FakeConn()

    async def failing_opener():
        raise OSError("refused")

    first = asyncio.ensure_future(pool.acquire("k", slow_opener))
    second = asyncio.ensure_future(pool.acquire("k", slow_opener))
    await asyncio.sleep(0)
    assert pool.live("k") == 2
    assert pool.crowded("k", 2)
    gate.set()
    (a, _), (b, _) = await first, await second
    assert pool.live("k") == 2
    with pytest.raises(OSError, match="refused"):
        await pool.acquire("k", failing_opener)
    assert pool.live("k") == 2
    a.close()
    b.close()
    assert pool.live("k") == 0


def test_equal_keys_become_one_key_object_per_upstream():
    # rule 6: each client connection's router builds its own key tuple for an upstream;
    # the pool hands back the first one, so its last-key memo finds it by identity.
    pool = ConnPool()
    first = ("app", "/run/netns/b", ("10.0.0.5", int("8080")))
    again = ("app", "/run/netns/b", ("10.0.0.5", int("8080")))
    assert first == again
    assert first is not again
    assert pool.canonical(first) is first
    assert pool.canonical(again) is first
    other = ("app", "/run/netns/b", ("10.0.0.5", 9090))
    assert pool.canonical(other) is other


def test_a_full_key_set_starts_over_and_still_answers_equal_keys():
    pool = ConnPool()
    for n in range(upstream.KEYS_MAX):
        pool.canonical(("k", n))
    kept = pool.canonical(("k", 0))
    assert kept == ("k", 0)
    fresh = pool.canonical(("k", upstream.KEYS_MAX))  # over the limit: the set restarts
    assert pool.canonical(("k", upstream.KEYS_MAX)) is fresh
    assert pool.canonical(("k", 0)) == ("k", 0)


class _Worker:
    """Only the key of the worker's plane (agent.proxy.plane.plane_of): nothing is opened."""


def test_inbound_targets_of_two_connections_share_their_pool_key():
    # the inbound's app target is built per client connection (agent.proxy.inbound)
    worker = _Worker()
    pod = PodInfo(namespace="shop", name="web-1", ip="10.0.0.5", netns="/run/netns/b", identity="x")
    one = inbound.app_target(cast("Worker", worker), pod, 8080, "a.b")
    two = inbound.app_target(cast("Worker", worker), pod, 8080, "c.d")
    assert one.key is two.key
    assert one.key == ("app", "/run/netns/b", ("10.0.0.5", 8080))
    assert inbound.app_target(cast("Worker", worker), pod, 9090, "a.b").key != one.key


async def test_pool_closes_connections_beyond_its_idle_limit():
    pool = ConnPool(max_idle=1)
    a, b = FakeConn(), FakeConn()
    a.pool_key = b.pool_key = "k"
    pool.release(a)
    pool.release(b)
    assert pool.idle_count("k") == 1
    assert b.closed
    pool.close()
    assert a.closed


async def test_pool_keys_are_equal_keys_whether_or_not_the_same_object():
    """The pool remembers the last key's list by identity; equal keys still share it,
    and a sweep that replaces the lists leaves no stale memory behind."""
    pool = ConnPool(idle_timeout=60)
    first, other = FakeConn(), FakeConn()
    first.pool_key = ("tls", "ns", ("10.0.0.1", 80))
    other.pool_key = ("tls", "ns", ("10.0.0.2", 80))
    pool.release(first)
    pool.release(other)
    equal_key = (*first.pool_key,)  # equal, another object
    assert equal_key is not first.pool_key
    assert pool.take(equal_key) is first
    assert pool.take(first.pool_key) is None  # taken: the memory is the same list
    pool.release(first)
    pool._sweep()  # the sweep rebuilds every key's list
    again = FakeConn()
    again.pool_key = first.pool_key
    pool.release(again)  # into the swept list, not a remembered one
    assert pool.idle_count(equal_key) == 2
    assert pool.take(equal_key) is again
    assert pool.take(other.pool_key) is other
    pool.close()
    assert first.closed
