"""Responses of tapped pods become bounded tap events (agent.admin.tapping)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import pytest

from agent.admin.tapping import TAP_RING, Tapping
from agent.proxy import channel as ch
from agent.proxy import h2msg, record
from agent.proxy.listener import ListenerKind
from agent.proxy.state import POD, POD_IP, PodInfo
from agent.proxy.worker import ListenerInfo, Worker
from tests.unit.proxy.test_accept import bare_conn

if TYPE_CHECKING:
    from agent.proxy.accept import Conn

INBOUND = {"direction": "inbound", "namespace": "ns", "pod": "web", "target_port": "80"}


def _pod(name: str, ip: str) -> PodInfo:
    return PodInfo(
        namespace="ns", name=name, ip=ip, netns="/x", identity=f"{name}.ns.serviceaccount"
    )


@pytest.fixture
def tapping() -> Tapping:
    worker = Worker(worker_id=3)
    for name, ip in (("web", "10.0.0.5"), ("api", "10.0.0.6")):
        worker.state.apply(ch.StateUpdate(key=(POD, f"ns/{name}"), value=_pod(name, ip)))
    worker.state.apply(ch.StateUpdate(key=(POD_IP, "10.0.0.6"), value="ns/api"))
    return Tapping(worker)


@pytest.fixture
def conn() -> Conn:
    # What tapping reads: the accepting listener and the client's address.
    listener = ListenerInfo(listener_id="l", pod="ns/web", kind=ListenerKind.INBOUND, netns="/x")
    return bare_conn(listener, peer=("10.0.0.9", 5555))


def _tap(tapping: Tapping, taps: Any, conn: Conn, labels: dict[str, str], **facts: Any) -> None:
    direction = labels.get("direction", "outbound")
    tapping._tap(taps, conn=conn, direction=direction, labels=labels, **facts)


def test_only_a_tapped_pods_response_becomes_an_event(tapping: Tapping, conn: Conn) -> None:
    _tap(tapping, frozenset({"ns/web"}), conn, INBOUND, status=200, latency_ms=1.5)
    _tap(tapping, frozenset({"ns/other"}), conn, INBOUND, status=200, latency_ms=1.5)
    msg = tapping.take_tap()
    assert msg is not None
    assert msg.worker_id == 3
    assert msg.dropped == 0
    (event,) = msg.events
    assert event["pod"] == "ns/web"
    assert (event["direction"], event["status"], event["latency_ms"]) == ("inbound", 200, 1.5)
    assert event["src"] == "10.0.0.9:5555"
    assert tapping.take_tap() is None


def test_the_request_head_gives_method_path_without_query_and_host(
    tapping: Tapping, conn: Conn
) -> None:
    head = SimpleNamespace(method=b"GET", target=b"/a/b?c=1", headers=[(b"Host", b"web:80")])
    token = record.REQUEST.set(head)
    try:
        _tap(tapping, frozenset({"*"}), conn, INBOUND, status=204, latency_ms=0.25)
    finally:
        record.REQUEST.reset(token)
    (event,) = tapping.tap_ring
    assert (event["method"], event["path"], event["authority"]) == ("GET", "/a/b", "web:80")


def test_an_h2_streams_head_gives_method_path_and_authority_as_host(
    tapping: Tapping, conn: Conn
) -> None:
    headers = [(b":method", b"POST"), (b":path", b"/t.T/Echo?x=1"), (b":authority", b"svc:50051")]
    token = record.REQUEST.set(h2msg.RequestHead(headers))
    try:
        _tap(tapping, frozenset({"*"}), conn, INBOUND, status=200, latency_ms=0.5)
    finally:
        record.REQUEST.reset(token)
    (event,) = tapping.tap_ring
    assert (event["method"], event["path"], event["authority"]) == (
        "POST",
        "/t.T/Echo",
        "svc:50051",
    )


def test_a_full_ring_drops_the_oldest_events_and_counts_them(tapping: Tapping, conn: Conn) -> None:
    for i in range(TAP_RING + 2):
        _tap(tapping, frozenset({"*"}), conn, INBOUND, status=200, latency_ms=float(i))
    msg = tapping.take_tap()
    assert msg is not None
    assert msg.dropped == 2
    assert len(msg.events) == TAP_RING
    assert msg.events[0]["latency_ms"] == 2.0
    assert tapping.tap_dropped == 0
    assert not tapping.tap_ring


def test_a_same_node_request_is_the_called_pods_inbound_event(tapping: Tapping, conn: Conn) -> None:
    labels = {"authority": "api.ns.svc.cluster.local:80", "dst_addr": "10.0.0.6:80", "hop": "local"}
    _tap(tapping, frozenset({"ns/api"}), conn, labels, status=200, latency_ms=1.0)
    (event,) = tapping.tap_ring
    assert (event["pod"], event["direction"], event["from_pod"]) == ("ns/api", "inbound", "ns/web")
    assert event["client_id"] == "web.ns.serviceaccount"
    assert event["tls"] == "true"
