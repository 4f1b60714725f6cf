"""agent.proxy.inbound's pure helpers (TLS sniff verdicts, request paths, deny answers) and
`authorize_http`, the one decision step of HTTP/1 requests and HTTP/2 streams, against the
worker's real state copy (`WorkerState`): a policy change reaches the next request even
when the per-connection cache or the last-head memo would answer."""

from __future__ import annotations

import asyncio
import ipaddress
import ssl
from types import SimpleNamespace

import pytest

from agent.policy.authorize import Decision, Reason
from agent.policy.model import (
    Authorization,
    HttpRoute,
    HttpRouteMatch,
    MeshTLS,
    Meta,
    Network,
    PathKind,
    ServerPolicy,
    Unauthenticated,
)
from agent.proxy import channel as ch
from agent.proxy import h1msg, http1, record
from agent.proxy.detect import NEED_MORE
from agent.proxy.inbound import (
    _PLAIN,
    AuthzCache,
    _sniff_tls,
    authorize_http,
    current_policy,
    deny_answer,
    path_of,
)
from agent.proxy.state import NodeInfo
from agent.proxy.wstate import WorkerState


def _client_hello(sni: str | None) -> bytes:
    """A real ClientHello, produced by OpenSSL through memory BIOs."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    out = ssl.MemoryBIO()
    obj = ctx.wrap_bio(ssl.MemoryBIO(), out, server_hostname=sni)
    with pytest.raises(ssl.SSLWantReadError):
        obj.do_handshake()
    return out.read()


def test_sniff_returns_the_sni_of_a_client_hello():
    assert _sniff_tls(
        _client_hello("web.shop.serviceaccount.identity.linkerd.cluster.local"), False
    ) == ("web.shop.serviceaccount.identity.linkerd.cluster.local")


def test_sniff_waits_for_the_rest_of_a_partial_hello_and_gives_up_at_eof():
    hello = _client_hello("a.b")
    assert _sniff_tls(hello[:3], False) is NEED_MORE
    assert _sniff_tls(hello[:40], False) is NEED_MORE
    assert _sniff_tls(hello[:40], True) is None  # TLS, but no name known: passed through


def test_sniff_says_plain_for_http_and_for_an_empty_eof():
    assert _sniff_tls(b"GET / HTTP/1.1\r\n", False) is _PLAIN
    assert _sniff_tls(b"", True) is _PLAIN


@pytest.mark.parametrize(
    ("target", "path"),
    [
        (b"/a/b?x=1", "/a/b"),
        (b"http://web.shop:80/a?q", "/a"),
        (b"http://web.shop", "/"),
        (b"*", "*"),
    ],
)
def test_path_of_drops_authority_and_query(target, path):
    assert path_of(target) == path


def _denied(reason=Reason.UNAUTHORIZED) -> Decision:
    return Decision(allowed=False, reason=reason, server=Meta(name="web"))


def test_deny_is_403_with_proxy_error_header():
    answer = deny_answer(_denied(), [(b"host", b"x")])
    assert answer.status == 403
    assert answer.response.startswith(b"HTTP/1.1 403 Forbidden\r\n")
    assert b"l5d-proxy-error: unauthorized request on server web" in answer.response


def test_deny_for_grpc_is_status_7_with_http_200():
    answer = deny_answer(_denied(), [(b"Content-Type", b"application/grpc+proto")])
    parser = http1.ResponseParser()
    parser.expect(b"POST")
    head = parser.feed(answer.response)[0]
    assert head.status == 200
    assert h1msg.get_header(head.headers, b"grpc-status") == b"7"


def test_deny_without_a_route_is_404():
    assert deny_answer(_denied(Reason.NO_ROUTE), []).status == 404


# --- authorize_http -----------------------------------------------------------------

KEY = ("policy", "shop/web", 8080)
WEB = "web.shop.serviceaccount.identity.linkerd.cluster.local"
FACTS = {
    "client_ip": ipaddress.ip_address("10.1.2.3"),
    "identity": None,
    "tls": False,
    "port": 8080,
    "labels": {"direction": "inbound", "pod": "web"},
}


def _authz(authn, name):
    return Authorization(
        networks=(Network.parse("0.0.0.0/0"),),
        authentication=authn,
        meta=Meta(name=name, kind="authorizationpolicy", group="policy.linkerd.io"),
    )


def _policy(name: str, authn) -> ServerPolicy:
    """GET /items/... allowed to `authn`; nothing else routed."""
    route = HttpRoute(
        meta=Meta(name="items", kind="HTTPRoute", group="policy.linkerd.io"),
        matches=(HttpRouteMatch(path_kind=PathKind.PREFIX, path="/items", method="GET"),),
        authorizations=(_authz(authn, f"{name}-authz"),),
    )
    return ServerPolicy(meta=Meta(name=name, kind="server"), http_routes=(route,))


OPEN = _policy("open", Unauthenticated())
WEB_ONLY = _policy("web-only", MeshTLS(identities=frozenset({WEB})))


class Counted:
    """A Recorder that keeps its authz calls (the metrics plugin's interface)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str | None, bool]] = []

    def authz(self, labels, *, allowed, http):
        assert http is True
        self.calls.append((labels.get("authz_name") or labels.get("route_name"), allowed))

    def bind_authz(self, labels, *, allowed, http):
        counted = self

        class Bound(record.BoundAuthz):  # a Python subclass of the compiled handle
            def count(self) -> None:
                counted.authz(labels, allowed=allowed, http=http)

        return Bound(labels)


@pytest.fixture
def counted(monkeypatch):
    rec = Counted()
    monkeypatch.setattr(record, "RECORDER", rec)
    return rec


@pytest.fixture
def worker():
    w = SimpleNamespace(state=WorkerState(lambda _need: None))
    w.state.apply(ch.StateUpdate(key=KEY, value=OPEN))
    return w


def test_decides_by_method_and_path_without_the_query_and_counts_each(worker, counted):
    allowed, tally = authorize_http(worker, KEY, b"GET", b"/items/1?x=2", **FACTS)
    assert tally.labels["pod"] == "web"
    assert tally.labels["route_name"] == "items"
    assert allowed.allowed
    assert allowed.route is not None
    assert allowed.route.name == "items"
    no_route, _ = authorize_http(worker, KEY, b"POST", b"/items/1", **FACTS)
    assert not no_route.allowed
    assert no_route.reason is Reason.NO_ROUTE
    assert [a for _, a in counted.calls] == [True, False]


def test_a_repeated_head_is_counted_every_time_and_sees_a_policy_change(worker, counted):
    cache = AuthzCache()
    head = object()  # the parser's head object: one per distinct head
    for _ in range(3):
        decision, _ = authorize_http(
            worker, KEY, b"GET", b"/items/1", cache=cache, token=head, **FACTS
        )
        assert decision.allowed
    assert len(counted.calls) == 3
    worker.state.apply(ch.StateUpdate(key=KEY, value=WEB_ONLY))
    denied, _ = authorize_http(worker, KEY, b"GET", b"/items/1", cache=cache, token=head, **FACTS)
    assert not denied.allowed
    assert denied.reason is Reason.UNAUTHORIZED
    assert counted.calls[-1][1] is False


def test_a_stream_without_a_token_uses_the_cache_until_the_policy_object_changes(worker, counted):
    cache = AuthzCache()
    first, _ = authorize_http(worker, KEY, b"GET", b"/items/7", cache=cache, **FACTS)
    again, _ = authorize_http(worker, KEY, b"GET", b"/items/7", cache=cache, **FACTS)
    assert again is first  # the cached decision
    worker.state.apply(ch.StateUpdate(key="unrelated", value=1))  # the policy object stays
    assert authorize_http(worker, KEY, b"GET", b"/items/7", cache=cache, **FACTS)[0] is first
    worker.state.apply(ch.StateUpdate(key=KEY, value=WEB_ONLY))
    assert not authorize_http(worker, KEY, b"GET", b"/items/7", cache=cache, **FACTS)[0].allowed
    assert [a for _, a in counted.calls] == [True, True, True, False]


def test_a_new_connection_reuses_the_workers_decision_for_the_same_client_facts(worker, counted):
    """Each connection has its own cache; the worker's shared decisions still make a new
    connection's first request from a known client one lookup. Anything `decide` reads
    that differs (address, identity, labels, the policy object) decides afresh."""
    first, tally = authorize_http(worker, KEY, b"GET", b"/items/7", cache=AuthzCache(), **FACTS)
    again, other = authorize_http(worker, KEY, b"GET", b"/items/7", cache=AuthzCache(), **FACTS)
    assert again is first
    assert other is not tally  # each connection counts with a handle of its own
    assert other.labels == tally.labels
    elsewhere = {**FACTS, "client_ip": ipaddress.ip_address("10.9.9.9")}
    assert authorize_http(worker, KEY, b"GET", b"/items/7", **elsewhere)[0] is not first
    relabelled = {**FACTS, "labels": {"direction": "inbound", "pod": "web-2"}}
    decision, handle = authorize_http(worker, KEY, b"GET", b"/items/7", **relabelled)
    assert decision is not first
    assert handle.labels["pod"] == "web-2"
    worker.state.apply(ch.StateUpdate(key=KEY, value=WEB_ONLY))
    denied, _ = authorize_http(worker, KEY, b"GET", b"/items/7", cache=AuthzCache(), **FACTS)
    assert not denied.allowed
    assert [a for _, a in counted.calls] == [True, True, True, True, False]


def test_the_verified_identity_is_what_a_mesh_only_policy_admits(worker, counted):
    worker.state.apply(ch.StateUpdate(key=KEY, value=WEB_ONLY))
    facts = {**FACTS, "identity": WEB, "tls": True}
    assert authorize_http(worker, KEY, b"GET", b"/items/1", **facts)[0].allowed
    assert not authorize_http(worker, KEY, b"GET", b"/items/1", **FACTS)[0].allowed


def test_a_port_whose_policy_wait_timed_out_gets_the_nodes_default_at_once_until_it_comes():
    """inbound rule 5: one connection waits (here a short `want` stands in for its
    `POLICY_WAIT_S`); the next ones take the node's default without waiting, until the
    policy arrives."""
    key = ("policy", "shop/web", 9000)
    w = SimpleNamespace(state=WorkerState(lambda _need: None))
    w.state.apply(
        ch.StateUpdate(key=("node",), value=NodeInfo(name="n", default_inbound_policy="deny"))
    )

    async def scenario() -> None:
        with pytest.raises(TimeoutError):
            await w.state.want(key, kind="policy", wait_s=0.01)
        got = await asyncio.wait_for(current_policy(w, key), 0.2)  # POLICY_WAIT_S is 1 s
        assert got == ServerPolicy.default("deny")
        w.state.apply(ch.StateUpdate(key=key, value=OPEN))
        assert await asyncio.wait_for(current_policy(w, key), 0.2) is OPEN

    asyncio.run(scenario())
