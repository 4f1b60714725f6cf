"""The recorder's per-connection caches and bound handles count exactly (agent.admin.observe)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import TYPE_CHECKING, Any

import pytest

from agent import aio
from agent.admin.observe import REPORT_S, Observer
from agent.admin.tapping import TAP
from agent.proxy import channel as ch
from agent.proxy import record
from agent.proxy.listener import ListenerKind
from agent.proxy.state import POD, PodInfo
from agent.proxy.worker import ListenerInfo, Worker
from tests.unit.proxy.test_accept import bare_conn

if TYPE_CHECKING:
    from agent.proxy.accept import Conn

POD_KEY = "ns/web"


def _pod() -> PodInfo:
    return PodInfo(
        namespace="ns", name="web", ip="10.0.0.5", netns="/x", identity="web.ns.serviceaccount"
    )


def _conn() -> Conn:
    # What the recorder reads: the accepting listener and its own record.
    return bare_conn(
        ListenerInfo(listener_id="in", pod=POD_KEY, kind=ListenerKind.INBOUND, netns="/x")
    )


def _family(obs: Observer, name: str) -> dict[Any, Any]:
    return obs.m.snapshot().families.get(name, {})


@pytest.fixture
def observer() -> Observer:
    worker = Worker(worker_id=0)
    worker.state.apply(ch.StateUpdate(key=(POD, POD_KEY), value=_pod()))
    return Observer(worker)


@pytest.fixture
def conn() -> Any:
    c = _conn()
    token = record.CONN.set(c)
    yield c
    record.CONN.reset(token)


LABELS = {"direction": "inbound", "namespace": "ns", "pod": "web", "target_port": "80"}


def test_requests_with_one_or_equal_label_dicts_count_into_one_series(
    observer: Observer, conn: Any
) -> None:
    labels = dict(LABELS)
    observer.request("inbound", labels)
    observer.request("inbound", labels)
    observer.request("inbound", dict(LABELS))  # equal content, other object
    values = list(_family(observer, "request_total").values())
    assert values == [3]


def test_alternating_statuses_are_counted_apart(observer: Observer, conn: Any) -> None:
    labels = dict(LABELS)
    for status in (200, 503, 200, 200, 503):
        observer.response("inbound", labels, status=status, latency_s=0.001, failure=status >= 500)
    by_status = {dict(k)["status_code"]: v for k, v in _family(observer, "response_total").items()}
    assert by_status == {"200": 3, "503": 2}


def test_exchange_counts_what_request_and_response_count(observer: Observer, conn: Any) -> None:
    labels = dict(LABELS)
    observer.request("inbound", labels)
    observer.response("inbound", labels, status=200, latency_s=0.002, failure=False)
    observer.exchange("inbound", labels, status=200, latency_s=0.002, failure=False)
    observer.exchange("inbound", labels, status=502, latency_s=0.004, failure=True)
    assert list(_family(observer, "request_total").values()) == [3]
    by_class = {
        (dict(k)["status_code"], dict(k)["classification"]): v
        for k, v in _family(observer, "response_total").items()
    }
    assert by_class == {("200", "success"): 2, ("502", "failure"): 1}


def test_series_dropped_for_a_departed_pod_are_not_counted_into_from_the_cache(
    observer: Observer, conn: Any
) -> None:
    labels = dict(LABELS)
    observer.request("inbound", labels)
    observer.worker.state.apply(ch.StateDelete(key=(POD, POD_KEY)))
    assert observer.forget_departed() == [POD_KEY]
    assert _family(observer, "request_total") == {}
    observer.worker.state.apply(ch.StateUpdate(key=(POD, POD_KEY), value=_pod()))
    observer.request("inbound", labels)  # same connection, same label dict
    assert list(_family(observer, "request_total").values()) == [1]


def test_authz_counts_stay_exact_with_the_connection_cache(observer: Observer, conn: Any) -> None:
    labels = {**LABELS, "srv_kind": "server", "srv_name": "web-http"}
    observer.request("inbound", dict(LABELS))  # opens the connection's record
    for allowed in (True, True, False, True):
        observer.authz(labels, allowed=allowed, http=True)
    assert sum(_family(observer, "inbound_http_authz_allow_total").values()) == 3
    assert sum(_family(observer, "inbound_http_authz_deny_total").values()) == 1


def test_bound_http_counts_as_exchange_does_and_opens_the_connection_at_first_use(
    observer: Observer, conn: Any
) -> None:
    labels = dict(LABELS)
    bound = observer.bind_http("inbound", labels)
    assert bound.labels is labels
    assert conn.obs is None  # binding alone is not a request (rule 3: opened at the first)
    bound.exchange(200, 0.002, False)
    bound.exchange(502, 0.004, True)
    observer.exchange("inbound", labels, status=200, latency_s=0.002, failure=False)
    assert list(_family(observer, "request_total").values()) == [3]
    assert list(_family(observer, "tcp_open_total").values()) == [1]
    by_class = {
        (dict(k)["status_code"], dict(k)["classification"]): v
        for k, v in _family(observer, "response_total").items()
    }
    assert by_class == {("200", "success"): 2, ("502", "failure"): 1}


def test_bound_handles_resolve_again_after_the_series_are_dropped(
    observer: Observer, conn: Any
) -> None:
    labels = {**LABELS, "srv_kind": "server", "srv_name": "web-http"}
    http = observer.bind_http("inbound", labels)
    allow = observer.bind_authz(labels, allowed=True, http=True)
    http.exchange(200, 0.001, False)
    allow.count()
    observer.worker.state.apply(ch.StateDelete(key=(POD, POD_KEY)))
    assert observer.forget_departed() == [POD_KEY]
    assert _family(observer, "request_total") == {}
    observer.worker.state.apply(ch.StateUpdate(key=(POD, POD_KEY), value=_pod()))
    http.exchange(200, 0.001, False)  # the same handles, held by the same connection
    allow.count()
    allow.count()
    assert list(_family(observer, "request_total").values()) == [1]
    assert list(_family(observer, "inbound_http_authz_allow_total").values()) == [2]


def test_bound_authz_counts_its_own_outcome_beside_unbound_calls(
    observer: Observer, conn: Any
) -> None:
    labels = {**LABELS, "srv_kind": "server", "srv_name": "web-http"}
    allow = observer.bind_authz(labels, allowed=True, http=True)
    deny = observer.bind_authz(labels, allowed=False, http=True)
    assert allow.labels is labels
    for _ in range(3):
        allow.count()
    deny.count()
    observer.authz(labels, allowed=True, http=True)
    assert sum(_family(observer, "inbound_http_authz_allow_total").values()) == 4
    assert sum(_family(observer, "inbound_http_authz_deny_total").values()) == 1


def test_a_bound_authz_counts_for_its_pod_on_the_pods_later_connections(
    observer: Observer, conn: Any
) -> None:
    # record rule 5: an outbound router's memo keeps one for the client's connections
    labels = {**LABELS, "srv_kind": "server", "srv_name": "web-http"}
    allow = observer.bind_authz(labels, allowed=True, http=True)
    allow.count()
    later = record.CONN.set(_conn())  # the pod's next connection; the first one is gone
    try:
        allow.count()
        observer.authz(labels, allowed=True, http=True)
    finally:
        record.CONN.reset(later)
    assert list(_family(observer, "inbound_http_authz_allow_total").values()) == [3]


def test_a_failing_handle_is_logged_and_never_raises(
    observer: Observer, conn: Any, caplog: pytest.LogCaptureFixture
) -> None:
    # A label value no series can be keyed by: resolving the handle fails inside it.
    bound = observer.bind_http("inbound", {**LABELS, "pod": ["web"]})  # type: ignore[dict-item]
    bound.exchange(200, 0.001, False)
    bound.exchange(200, 0.001, False)
    bugs = [r for r in caplog.records if r.getMessage().startswith("BUG: recording failed")]
    assert len(bugs) == 1  # once per kind


def test_a_bound_handle_sees_a_tap_start_and_stop_while_its_connection_is_open(
    observer: Observer, conn: Any
) -> None:
    bound = observer.bind_http("inbound", dict(LABELS))
    bound.exchange(200, 0.001, False)  # no tap yet: no event
    assert observer.take_tap() is None
    tap = ch.StateUpdate(key=(TAP,), value=frozenset({POD_KEY}))
    observer.worker.state.apply(tap)
    bound.exchange(201, 0.001, False)  # the same handle, after the tap began
    msg = observer.take_tap()
    assert msg is not None
    assert [e["status"] for e in msg.events] == [201]
    observer.worker.state.apply(ch.StateDelete(key=(TAP,)))
    bound.exchange(202, 0.001, False)
    assert observer.take_tap() is None
    assert list(_family(observer, "request_total").values()) == [3]


class _Supervisor:
    """The supervisor's end of a worker's channel over a real socketpair: what it got."""

    def __init__(self, observer: Observer) -> None:
        sup_sock, worker_sock = ch.pair()
        self.got: list[ch.Message] = []
        self.arrived = asyncio.Event()
        self.end = ch.Channel(
            sup_sock, on_message=self._on_message, on_closed=self.arrived.set, name="sup"
        )
        self.end.start()
        self.worker = observer.worker
        self.worker._channel = ch.Channel(  # what Worker.run sets up
            worker_sock, on_message=lambda _: None, on_closed=lambda: None, name="worker"
        )

    def _on_message(self, msg: ch.Message) -> None:
        self.got.append(msg)
        self.arrived.set()

    async def first(self) -> list[ch.Message]:
        """What came, once something did (within a few report periods)."""
        async with asyncio.timeout(5 * REPORT_S):
            while not self.got:
                self.arrived.clear()
                await self.arrived.wait()
        return self.got

    def close(self) -> None:
        assert self.worker._channel is not None
        self.worker._channel.close()
        self.end.close()


async def test_a_tap_event_is_sent_soon_after_it_came_and_not_with_the_next_report(
    observer: Observer, conn: Any
) -> None:
    sup = _Supervisor(observer)
    observer.worker.state.apply(ch.StateUpdate(key=(TAP,), value=frozenset({POD_KEY})))
    run = aio.spawn(observer.run(), name="metrics-report")
    try:
        await asyncio.sleep(0)  # run() has started: it times the flushes
        observer.bind_http("inbound", dict(LABELS)).exchange(200, 0.001, False)
        got = await sup.first()
        # The event came on its own timer: before the first report's metrics.
        assert [type(m) for m in got] == [ch.TapEvents]
        assert [e["status"] for e in got[0].events] == [200]  # type: ignore[union-attr]
    finally:
        run.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await run
        sup.close()


async def test_a_report_is_stamped_with_when_its_snapshot_was_taken(
    observer: Observer, conn: Any
) -> None:
    # Rule 5: a reader waiting for a stamp past a moment holds every count made before it.
    sup = _Supervisor(observer)
    try:
        observer.bind_http("inbound", dict(LABELS)).exchange(200, 0.001, False)
        before = time.time()
        observer.report()
        after = time.time()
        [msg] = await sup.first()
        assert isinstance(msg, ch.Metrics)
        families = msg.snapshot.families
        [stamp] = families["meshagent_worker_last_report_timestamp_seconds"].items()
        assert dict(stamp[0]) == {"process": "worker", "worker": "0"}
        assert before <= stamp[1] <= after
        assert list(families["request_total"].values()) == [1]
    finally:
        sup.close()
