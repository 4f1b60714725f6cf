"""The mesh data path end to end: real pods (netns), iptables capture, worker pools, mTLS.

Topology (agent.netlab): two isolated nodes joined by a link.
- node n1: pods `a` (sa alpha) and `b` (sa beta), clients; pod `web1` (sa web),
  a server on the same node as the clients. One WorkerPool = node n1's agent.
- node n2: pod `web2` (sa web), servers on 8080 (HTTP), 8081/8082 (HTTP),
  9000 (echo). One WorkerPool = node n2's agent.
- pod `c` on n1 is not meshed (no capture, no listeners): a raw client.
Every pod but `c` is captured with `IptablesRedirector`; the servers and
clients run in this test process with sockets made inside the pods' netns.
Each pool gets the state its node's supervisor would push.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import socket
import ssl
import time
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path

import h2.config
import h2.connection
import h2.events
import pytest
import pytest_asyncio

from agent import native
from agent.config import OUTBOUND_PORT
from agent.identity import ca
from agent.identity.names import Identity
from agent.identity.tls import SealedKey, client_context, seal
from agent.policy.model import (
    Authorization,
    MeshTLS,
    Meta,
    Network,
    ProxyProtocol,
    ServerPolicy,
)
from agent.proxy import h1msg, http1
from agent.proxy.channel import StateUpdate
from agent.proxy.listener import ListenerKind, open_pod_listeners
from agent.proxy.model import (
    Endpoint,
    MatchAll,
    MethodIs,
    PathRegex,
    Profile,
    ProtocolHint,
    RetryBudget,
    Route,
)
from agent.proxy.pool import WorkerOptions, WorkerPool, h2_lanes_for
from agent.proxy.state import Destination, NodeInfo, PodInfo, TlsMaterial
from agent.redirect import netns
from agent.redirect.annotations import build_spec
from agent.redirect.iptables import IptablesRedirector

pytestmark = [pytest.mark.privileged, pytest.mark.asyncio(loop_scope="module")]

ALPHA = Identity(sa="alpha", ns="shop")
BETA = Identity(sa="beta", ns="shop")
WEB = Identity(sa="web", ns="shop")
OTHER = Identity(sa="other", ns="shop")

VIP_WEB = "10.96.0.10"  # service on node n2 (mTLS hop)
VIP_LOCAL = "10.96.0.11"  # service on node n1 (same-node path)
VIP_ECHO = "10.96.0.12"  # opaque echo on n2
VIP_TWO = "10.96.0.13"  # two endpoints on n2 (removal, retries, timeouts)
VIP_WRONG = "10.96.0.14"  # endpoint claims another identity
VIP_LANE = "10.96.0.15"  # a good and a failing endpoint on n2 (identical requests)
VIP_RETRY = "10.96.0.16"  # a good and a failing endpoint on n2
VIP_DETECT = "10.96.0.17"  # echo on n2, protocol detected (not marked opaque)
VIP_HC_REMOTE = "10.96.0.18"  # opaque delayed echo on n2 (half-close across nodes, mTLS)
VIP_HC_LOCAL = "10.96.0.19"  # opaque delayed echo on n1 (half-close, same-node path)
VIP_H2 = "10.96.0.20"  # web2:8080 hinted h2: HTTP/1 goes upgraded (l5d-orig-proto)


# --- PKI ---------------------------------------------------------------------------


class Pki:
    def __init__(self, tmp) -> None:
        self.now = datetime.now(UTC)
        self.issuer = ca.create_mesh(tmp, created=self.now - timedelta(days=2), now=self.now)
        self.trust = self.issuer.bundle.pem

    def material(self, ident: Identity, *, expired: bool = False) -> TlsMaterial:
        when = self.now - timedelta(days=1) if expired else self.now
        chain, key, until = self.issuer.workload(
            ident, now=when, lifetime=timedelta(hours=1 if expired else 24)
        )
        sealed = seal(key)
        return TlsMaterial(
            identity=ident.dns_name,
            cert_chain_pem=chain,
            key_pem=sealed.pem,
            key_password=sealed.password,
            trust_pem=self.trust,
            not_after=until.timestamp(),
        )


# --- apps in pods -----------------------------------------------------------------------


class HttpApp(asyncio.Protocol):
    """A tiny HTTP/1.1 server: answers JSON with who called; /fail -> 500 if failing."""

    def __init__(self, name: str, hits: list, failing: bool) -> None:
        self.name = name
        self.hits = hits
        self.failing = failing
        self.parser = http1.RequestParser(decode_chunked=True)
        self.head = None
        self.body = 0

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        for ev in self.parser.feed(data):
            if isinstance(ev, http1.RequestHead):
                self.head, self.body = ev, 0
            elif isinstance(ev, http1.BodyData):
                self.body += len(ev.data)
            elif isinstance(ev, http1.MessageEnd):
                asyncio.get_running_loop().create_task(self.answer(self.head, self.body))
            else:
                self.transport.close()

    async def answer(self, head, body_len) -> None:
        cid = h1msg.get_header(head.headers, b"l5d-client-id")
        path = head.target.decode()
        self.hits.append((self.name, path, cid.decode() if cid else None))
        status = 200
        if path.startswith("/slow"):
            await asyncio.sleep(1.0)
        if path.startswith("/fail") and self.failing:
            status = 500
        seen = {"server": self.name, "client_id": cid.decode() if cid else None, "len": body_len}
        seen["marked"] = h1msg.get_header(head.headers, b"l5d-orig-proto") is not None
        payload = json.dumps(seen).encode()
        if path.startswith("/chunked"):  # the JSON in two chunks, then a trailer
            half = len(payload) // 2
            self.transport.write(
                h1msg.response_head_bytes(status, [(b"transfer-encoding", b"chunked")])
                + b"%x\r\n%s\r\n%x\r\n%s\r\n0\r\nx-end: 1\r\n\r\n"
                % (half, payload[:half], len(payload) - half, payload[half:])
            )
            return
        self.transport.write(
            h1msg.response_head_bytes(status, [(b"content-length", b"%d" % len(payload))]) + payload
        )


class Echo(asyncio.Protocol):
    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.transport.write(data)

    def eof_received(self) -> bool:
        return False


class DelayedEcho(asyncio.Protocol):
    """Keeps what it reads; after the client's FIN, waits, sends it all back, then closes.

    Only a relay that keeps the client's read side open after its half-close
    delivers the answer.
    """

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.buf = bytearray()

    def data_received(self, data: bytes) -> None:
        self.buf += data

    def eof_received(self) -> bool:
        asyncio.get_running_loop().call_later(0.3, self._answer)
        return True

    def _answer(self) -> None:
        if not self.transport.is_closing():
            self.transport.write(bytes(self.buf))
            self.transport.write_eof()
            self.transport.close()


async def serve_in(pod, port: int, factory) -> asyncio.Server:
    sock = pod.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("0.0.0.0", port))
    sock.listen(256)
    sock.setblocking(False)
    return await asyncio.get_running_loop().create_server(factory, sock=sock)


class Client:
    """A keep-alive HTTP/1.1 client from inside a pod (its connects are captured)."""

    def __init__(self, reader, writer) -> None:
        self.reader, self.writer = reader, writer
        self.parser = http1.ResponseParser()
        self.trailers = None  # the last response's, when the parser decodes chunks

    @classmethod
    async def connect(cls, pod, addr: tuple[str, int]) -> Client:
        sock = await netns.run_in_async(pod.netns, socket.socket)
        sock.setblocking(False)
        async with asyncio.timeout(5):
            await asyncio.get_running_loop().sock_connect(sock, addr)
        reader, writer = await asyncio.open_connection(sock=sock)
        return cls(reader, writer)

    async def request(self, path: str, headers=(), body: bytes = b"", method=b"GET"):
        hdrs = [(b"host", b"web"), *headers]
        if body:
            hdrs.append((b"content-length", b"%d" % len(body)))
        self.parser.expect(method)
        self.writer.write(h1msg.request_head_bytes(method, path.encode(), hdrs) + body)
        status, rhead, chunks = None, None, []
        async with asyncio.timeout(10):
            while True:
                data = await self.reader.read(65536)
                events = self.parser.feed(data) if data else self.parser.feed_eof()
                for ev in events:
                    if isinstance(ev, http1.ResponseHead):
                        status, rhead = ev.status, ev
                    elif isinstance(ev, http1.BodyData):
                        chunks.append(bytes(ev.data))
                    elif isinstance(ev, http1.MessageEnd):
                        self.trailers = ev.trailers
                        return status, rhead, b"".join(chunks)
                    else:
                        raise AssertionError(ev)  # noqa: TRY004 - a test's dispatch
                if not data:
                    raise ConnectionError("closed before the response ended")

    def close(self) -> None:
        self.writer.close()


async def raw_connect(pod, addr):
    sock = await netns.run_in_async(pod.netns, socket.socket)
    sock.setblocking(False)
    async with asyncio.timeout(5):
        await asyncio.get_running_loop().sock_connect(sock, addr)
    return sock


# --- the world -----------------------------------------------------------------------


def _pod_info(lab_pod, ident: Identity | None, node: str) -> PodInfo:
    return PodInfo(
        namespace="shop",
        name=lab_pod.name,
        ip=lab_pod.ip,
        netns=str(lab_pod.netns),
        service_account=ident.sa if ident else "default",
        identity=ident.dns_name if ident else "",
        node=node,
    )


def allow_identities(*idents: Identity, name="only") -> ServerPolicy:
    return ServerPolicy(
        protocol=ProxyProtocol.DETECT,
        authorizations=(
            Authorization(
                networks=(Network.parse("0.0.0.0/0"),),
                authentication=MeshTLS(identities=frozenset(i.dns_name for i in idents)),
                meta=Meta(name=name, kind="AuthorizationPolicy"),
            ),
        ),
        meta=Meta(name=name, kind="Server"),
    )


def _service(w: World, target: str, name: str, *endpoints: Endpoint, opaque=False) -> None:
    """Node n1's answer for `target` ("ip:port" or a name): service `name`'s endpoints."""
    port = target.rsplit(":", 1)[1]
    authority = f"{name}.shop.svc.cluster.local:{port}"
    dst = Destination(
        target=target, authority=authority, exists=True, opaque=opaque, endpoints=endpoints
    )
    w.push("n1", ("dst", target), dst)


class World:
    def __init__(self, lab, pki) -> None:
        self.lab, self.pki = lab, pki
        self.hits: list = []
        self.servers: list[asyncio.Server] = []
        self.pools: dict[str, WorkerPool] = {}
        self.answers: dict[str, dict] = {"n1": {}, "n2": {}}

    def push(self, node: str, key, value) -> None:
        self.answers[node][key] = value
        self.pools[node].broadcast(StateUpdate(key=key, value=value))

    def on_need(self, node: str):
        def need(worker_id, msg) -> None:
            value = self.answers[node].get(msg.key)
            if value is None and msg.kind == "dst":
                value = Destination(target=msg.key[1], exists=False)
            if value is not None:
                self.pools[node].broadcast(StateUpdate(key=msg.key, value=value))

        return need


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return Pki(tmp_path_factory.mktemp("pki"))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def world(module_lab, pki):
    lab = module_lab
    n1, n2 = lab.node("n1", isolated=True), lab.node("n2", isolated=True)
    lab.link(n1, n2)
    pods = {
        "a": lab.pod(n1, "a"),
        "b": lab.pod(n1, "b"),
        "web1": lab.pod(n1, "web1"),
        "c": lab.pod(n1, "c"),
        "web2": lab.pod(n2, "web2"),
    }
    w = World(lab, pki)
    w.pods = pods
    redirector = IptablesRedirector()
    for name in ("a", "b", "web1", "web2"):
        p = pods[name]
        redirector.enroll(
            build_spec(pod=f"shop/{name}", netns=p.netns, pod_ip=p.ip, pod_annotations={})
        )
    for node in ("n1", "n2"):
        options = WorkerOptions(
            stats_interval_s=0.5,
            grace_s=2.0,
            log_level="warning",
            h2_upgrade="on" if node == "n1" else "off",
            h2_lanes=h2_lanes_for(1),  # one worker per node, as the supervisor passes it
        )
        pool = WorkerPool(1, options=options, on_need=w.on_need(node))
        w.pools[node] = pool
        await pool.start(ready_timeout=20)
    idents = {"a": ALPHA, "b": BETA, "web1": WEB, "web2": WEB}
    homes = {"a": "n1", "b": "n1", "web1": "n1", "web2": "n2"}
    w.info = {n: _pod_info(pods[n], idents[n], homes[n]) for n in idents}
    for node in ("n1", "n2"):
        w.push(node, ("node",), NodeInfo(name=node))
    for name, info in w.info.items():
        node = homes[name]
        w.push(node, ("pod", info.key), info)
        w.push(node, ("pod-ip", info.ip), info.key)
        listeners = open_pod_listeners(info.netns, copies=w.pools[node].n)  # one per worker
        w.pools[node].add_listener(
            listener_id=f"{name}-out",
            pod=info.key,
            kind=ListenerKind.OUTBOUND,
            netns=info.netns,
            socks=listeners.outbound,
        )
        w.pools[node].add_listener(
            listener_id=f"{name}-in",
            pod=info.key,
            kind=ListenerKind.INBOUND,
            netns=info.netns,
            socks=listeners.inbound,
        )
    # Certificates: the clients and web2; web1 deliberately has none (the
    # same-node path must not need TLS).
    w.push("n1", ("tls", ALPHA.dns_name), pki.material(ALPHA))
    w.push("n1", ("tls", BETA.dns_name), pki.material(BETA))
    w.push("n2", ("tls", WEB.dns_name), pki.material(WEB))
    web2, web1 = pods["web2"], pods["web1"]
    ep = lambda pod, port, ident=WEB: Endpoint(addr=(pod.ip, port), tls_identity=ident.dns_name)  # noqa: E731
    _service(w, f"{VIP_WEB}:80", "web", ep(web2, 8080))
    _service(w, "web.shop.svc.cluster.local:80", "web", ep(web2, 8080))
    _service(w, f"{VIP_LOCAL}:80", "local", ep(web1, 8080))
    _service(w, f"{VIP_ECHO}:9000", "echo", ep(web2, 9000), opaque=True)
    _service(w, f"{VIP_DETECT}:9000", "echo2", ep(web2, 9000))
    _service(w, f"{VIP_WRONG}:80", "wrong", ep(web2, 8080, OTHER))
    hinted = Endpoint(
        addr=(web2.ip, 8080), tls_identity=WEB.dns_name, protocol_hint=ProtocolHint.H2
    )
    _service(w, f"{VIP_H2}:80", "h2", hinted)
    for vip, pod in ((VIP_HC_REMOTE, web2), (VIP_HC_LOCAL, web1)):
        _service(w, f"{vip}:9001", "hc", ep(pod, 9001), opaque=True)
    w.push("n1", ("policy", "shop/web1", 8080), allow_identities(ALPHA, name="web1-alpha"))
    w.push("n2", ("policy", "shop/web2", 9001), ServerPolicy.default("all-authenticated"))
    for port in (8080, 8081, 8082):
        w.push("n2", ("policy", "shop/web2", port), ServerPolicy.default("all-authenticated"))
    w.push("n2", ("policy", "shop/web2", 9000), ServerPolicy.default("all-authenticated"))
    w.servers += [
        await serve_in(web2, 8080, lambda: HttpApp("web2:8080", w.hits, failing=False)),
        await serve_in(web2, 8081, lambda: HttpApp("web2:8081", w.hits, failing=False)),
        await serve_in(web2, 8082, lambda: HttpApp("web2:8082", w.hits, failing=True)),
        await serve_in(web2, 9000, Echo),
        await serve_in(web2, 9001, DelayedEcho),
        await serve_in(web1, 9001, DelayedEcho),
        await serve_in(pods["c"], 9001, DelayedEcho),
        await serve_in(web1, 8080, lambda: HttpApp("web1:8080", w.hits, failing=False)),
        await serve_in(pods["c"], 7000, lambda: HttpApp("c:7000", w.hits, failing=False)),
    ]
    yield w
    for s in w.servers:
        s.close()
    for pool in w.pools.values():
        await pool.close()


# --- tests -----------------------------------------------------------------------------


async def test_http_keepalive_across_nodes_carries_each_pods_identity(world):
    """1,000 interleaved keep-alive requests from two pods: the server sees the right id."""
    ca_, cb = (
        await Client.connect(world.pods["a"], (VIP_WEB, 80)),
        await Client.connect(world.pods["b"], (VIP_WEB, 80)),
    )
    try:
        mismatches = 0
        forged = [
            (b"l5d-client-id", b"admin.kube-system.serviceaccount.identity.linkerd.cluster.local")
        ]

        async def run(client, ident, n):
            nonlocal mismatches
            for i in range(n):
                status, _, body = await client.request(
                    f"/x/{i}", headers=forged if i % 7 == 0 else ()
                )
                got = json.loads(body)
                if (
                    status != 200
                    or got["client_id"] != ident.dns_name
                    or got["server"] != "web2:8080"
                ):
                    mismatches += 1

        await asyncio.gather(run(ca_, ALPHA, 500), run(cb, BETA, 500))
        assert mismatches == 0
    finally:
        ca_.close()
        cb.close()


async def test_the_workers_that_proxied_run_the_compiled_request_path(world):
    """After the requests above, each node's worker has the mypyc build mapped (agent.native)."""
    assert native.state() == "active", "stale or missing build: run `bash scripts/setup`"
    for node, pool in world.pools.items():
        (pid,) = pool.pids
        assert f"{native.GROUP}__mypyc" in _maps(pid), node


def _maps(pid: int) -> str:
    return Path(f"/proc/{pid}/maps").read_text()


async def test_same_node_path_needs_no_tls_and_enforces_the_target_policy(world):
    ca_ = await Client.connect(world.pods["a"], (VIP_LOCAL, 80))
    cb = await Client.connect(world.pods["b"], (VIP_LOCAL, 80))
    try:
        for _ in range(20):
            status, _, body = await ca_.request("/local")
            assert status == 200
            assert json.loads(body) == {
                "server": "web1:8080",
                "client_id": ALPHA.dns_name,
                "len": 0,
                "marked": False,
            }
        status, head, _ = await cb.request("/local")  # beta is not allowed on web1:8080
        assert status == 403
        assert h1msg.get_header(head.headers, b"l5d-proxy-error") is not None
    finally:
        ca_.close()
        cb.close()


async def test_new_connections_from_two_pods_each_get_their_own_identity_and_policy(world):
    """One request per connection, alternating alpha and beta, on each node's one worker:
    what the worker shares between connections (outbound rule 5: hops, label sets, shared
    decisions) is per client, so each connection is the one its pod makes alone."""

    async def once(pod: str, vip: str) -> tuple[int | None, bytes]:
        client = await Client.connect(world.pods[pod], (vip, 80))
        try:
            status, _, body = await client.request("/fresh")
        finally:
            client.close()
        return status, body

    for _ in range(10):
        status, body = await once("a", VIP_LOCAL)  # same node: alpha allowed
        assert (status, json.loads(body)["client_id"]) == (200, ALPHA.dns_name)
        status, _ = await once("b", VIP_LOCAL)  # beta is not allowed on web1:8080
        assert status == 403
        for pod, ident in (("a", ALPHA), ("b", BETA)):  # across nodes: both allowed
            status, body = await once(pod, VIP_WEB)
            assert (status, json.loads(body)["client_id"]) == (200, ident.dns_name)


async def test_a_connection_to_the_outbound_listener_itself_is_refused(world):
    """Its target resolves to the listener: the proxy must not connect to itself."""
    client = await Client.connect(world.pods["a"], ("127.0.0.1", OUTBOUND_PORT))
    try:
        with pytest.raises(ConnectionError):
            await client.request("/loop")
    finally:
        client.close()
    ok = await Client.connect(world.pods["a"], (VIP_LOCAL, 80))  # the worker serves on
    try:
        assert (await ok.request("/after"))[0] == 200
    finally:
        ok.close()


async def test_l5d_dst_override_routes_by_authority(world):
    c = await Client.connect(world.pods["a"], (VIP_LOCAL, 80))
    try:
        status, _, body = await c.request(
            "/o", headers=[(b"l5d-dst-override", b"web.shop.svc.cluster.local:80")]
        )
        assert status == 200
        assert json.loads(body)["server"] == "web2:8080"
    finally:
        c.close()


async def test_endpoint_with_another_identity_is_refused(world):
    c = await Client.connect(world.pods["a"], (VIP_WRONG, 80))
    try:
        status, head, _ = await c.request("/w")
        # web2's inbound sees an SNI that is not its identity, so it never completes
        # a handshake as OTHER: the hop fails, and nothing reaches the app.
        assert status == 502
        assert b"tls handshake" in h1msg.get_header(head.headers, b"l5d-proxy-error")
    finally:
        c.close()


async def test_expired_source_certificate_fails_closed(world):
    world.push("n1", ("tls", BETA.dns_name), world.pki.material(BETA, expired=True))
    c = await Client.connect(world.pods["b"], (VIP_WEB, 80))
    try:
        status, head, _ = await c.request("/e")
        assert status == 502
        assert b"expired" in h1msg.get_header(head.headers, b"l5d-proxy-error")
    finally:
        c.close()
        world.push("n1", ("tls", BETA.dns_name), world.pki.material(BETA))


async def _tls_to_web2(world, ctx):
    """A TLS client from the unmeshed pod c straight at web2:8080 (captured to its inbound)."""
    sock = await raw_connect(world.pods["c"], (world.pods["web2"].ip, 8080))
    reader, writer = await asyncio.open_connection(
        sock=sock, ssl=ctx, server_hostname=WEB.dns_name, ssl_handshake_timeout=5
    )
    try:
        writer.write(b"GET /t HTTP/1.1\r\nhost: web\r\n\r\n")
        got = b""
        async with asyncio.timeout(5):
            while not got.endswith(b"}"):
                chunk = await reader.read(65536)
                if not chunk:
                    break
                got += chunk
        return got
    finally:
        writer.close()


def _client_ctx(material: TlsMaterial, trust: bytes | None = None) -> ssl.SSLContext:
    key = SealedKey(pem=material.key_pem, password=material.key_password)
    return client_context(material.cert_chain_pem, key, trust or material.trust_pem)


@pytest.mark.parametrize("case", ["valid", "foreign-ca", "expired", "no-client-cert"])
async def test_inbound_mtls_accepts_only_valid_client_certificates(world, case, tmp_path):
    pki = world.pki
    if case == "valid":
        ctx = _client_ctx(pki.material(ALPHA))
    elif case == "foreign-ca":
        foreign = Pki(tmp_path)
        ctx = _client_ctx(foreign.material(ALPHA), trust=pki.trust)
    elif case == "expired":
        ctx = _client_ctx(pki.material(ALPHA, expired=True))
    else:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.check_hostname = False
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3
        ctx.load_verify_locations(cadata=pki.trust.decode())
    try:
        got = await _tls_to_web2(world, ctx)
    except (ssl.SSLError, ConnectionError, OSError):
        got = b""
    if case == "valid":
        assert got.startswith(b"HTTP/1.1 200")
        assert ALPHA.dns_name.encode() in got
    else:
        assert not got.startswith(b"HTTP/1.1 200")


async def test_inbound_deny_answers_403(world):
    key = ("policy", "shop/web2", 8080)
    world.push("n2", key, allow_identities(BETA, name="beta-only"))
    try:
        ca_, cb = (
            await Client.connect(world.pods["a"], (VIP_WEB, 80)),
            await Client.connect(world.pods["b"], (VIP_WEB, 80)),
        )
        status_a, _head, _ = await ca_.request("/deny")
        status_b, _, _ = await cb.request("/deny")
        grpc_status, ghead, _ = await ca_.request(
            "/pkg.Svc/M", headers=[(b"content-type", b"application/grpc")], method=b"POST"
        )
        ca_.close()
        cb.close()
    finally:
        world.push("n2", key, ServerPolicy.default("all-authenticated"))
    assert (status_a, status_b) == (403, 200)
    assert grpc_status == 200
    assert h1msg.get_header(ghead.headers, b"grpc-status") == b"7"


async def test_policy_change_applies_to_the_next_identical_request_on_a_live_connection(world):
    """Per-connection memos (same head object, same state) must not outlive a state change."""
    remote, local = ("policy", "shop/web2", 8080), ("policy", "shop/web1", 8080)
    c_remote = await Client.connect(world.pods["a"], (VIP_WEB, 80))
    c_local = await Client.connect(world.pods["a"], (VIP_LOCAL, 80))
    try:
        for _ in range(3):
            assert (await c_remote.request("/same"))[0] == 200
            assert (await c_local.request("/same"))[0] == 200
        world.push("n2", remote, allow_identities(BETA, name="beta-only"))
        world.push("n1", local, allow_identities(BETA, name="beta-only-here"))
        await asyncio.sleep(0.3)  # the broadcast reaches every worker
        assert (await c_remote.request("/same"))[0] == 403
        assert (await c_local.request("/same"))[0] == 403
        world.push("n2", remote, ServerPolicy.default("all-authenticated"))
        world.push("n1", local, allow_identities(ALPHA, name="web1-alpha"))
        await asyncio.sleep(0.3)
        assert (await c_remote.request("/same"))[0] == 200
        assert (await c_local.request("/same"))[0] == 200
    finally:
        world.push("n2", remote, ServerPolicy.default("all-authenticated"))
        world.push("n1", local, allow_identities(ALPHA, name="web1-alpha"))
        c_remote.close()
        c_local.close()


async def test_opaque_relay_is_byte_exact_for_1_mib(world):
    sock = await raw_connect(world.pods["a"], (VIP_ECHO, 9000))
    loop = asyncio.get_running_loop()
    payload = secrets.token_bytes(1 << 20)
    try:
        send = asyncio.ensure_future(loop.sock_sendall(sock, payload))
        got = bytearray()
        async with asyncio.timeout(20):
            while len(got) < len(payload):
                chunk = await loop.sock_recv(sock, 1 << 16)
                assert chunk
                got += chunk
        await send
        assert bytes(got) == payload
    finally:
        sock.close()


async def _send_half_close_read_all(pod, addr, payload: bytes) -> bytes:
    """Send `payload`, shut down writing, read until EOF (issue 4: half-close)."""
    sock = await raw_connect(pod, addr)
    loop = asyncio.get_running_loop()
    try:
        await loop.sock_sendall(sock, payload)
        sock.shutdown(socket.SHUT_WR)
        got = bytearray()
        async with asyncio.timeout(10):
            while chunk := await loop.sock_recv(sock, 1 << 16):
                got += chunk
        return bytes(got)
    finally:
        sock.close()


@pytest.mark.parametrize("where", ["cross-node-mtls", "same-node", "not-meshed-forward"])
async def test_opaque_half_close_delivers_the_answer_sent_after_the_clients_fin(world, where):
    """Issue 4: a client FIN ends only its direction; the server's later answer arrives."""
    addr = {
        "cross-node-mtls": (VIP_HC_REMOTE, 9001),
        "same-node": (VIP_HC_LOCAL, 9001),
        "not-meshed-forward": (world.pods["c"].ip, 9001),
    }[where]
    payload = secrets.token_bytes(300_000)
    assert await _send_half_close_read_all(world.pods["a"], addr, payload) == payload


async def test_not_a_mesh_service_is_forwarded_to_the_original_destination(world):
    c = await Client.connect(world.pods["a"], (world.pods["c"].ip, 7000))
    try:
        status, _, body = await c.request("/plain")
        assert status == 200
        assert json.loads(body) == {
            "server": "c:7000",
            "client_id": None,
            "len": 0,
            "marked": False,
        }
    finally:
        c.close()


def _two(world, *, ports=(8080, 8081), routes=(), vip=VIP_TWO) -> Destination:
    web2 = world.pods["web2"]
    return Destination(
        target=f"{vip}:80",
        authority="two.shop.svc.cluster.local:80",
        exists=True,
        endpoints=tuple(Endpoint(addr=(web2.ip, p), tls_identity=WEB.dns_name) for p in ports),
        profile=Profile(routes=routes, retry_budget=RetryBudget()) if routes else None,
    )


async def test_endpoint_removal_mid_load_loses_no_request(world):
    world.push("n1", ("dst", f"{VIP_TWO}:80"), _two(world))
    clients = [await Client.connect(world.pods["a"], (VIP_TWO, 80)) for _ in range(4)]
    results: list[int] = []
    removed_at: list[float] = []

    async def load(c):
        for i in range(150):
            status, _, body = await c.request(f"/r/{i}")
            results.append(status)
            srv = json.loads(body)["server"]
            if removed_at and time.monotonic() > removed_at[0] + 0.5:
                assert srv == "web2:8080"

    async def remove():
        await asyncio.sleep(0.3)
        world.push("n1", ("dst", f"{VIP_TWO}:80"), _two(world, ports=(8080,)))
        removed_at.append(time.monotonic())

    try:
        await asyncio.gather(*(load(c) for c in clients), remove())
    finally:
        for c in clients:
            c.close()
    assert results == [200] * 600
    assert removed_at


async def test_retryable_route_hides_a_failing_endpoint(world):
    route = Route(
        name="fail", condition=MatchAll((MethodIs("GET"), PathRegex("/fail.*"))), is_retryable=True
    )
    dst = _two(world, ports=(8082, 8081), routes=(route,), vip=VIP_RETRY)
    world.push("n1", ("dst", f"{VIP_RETRY}:80"), dst)
    c = await Client.connect(world.pods["a"], (VIP_RETRY, 80))
    before = len([h for h in world.hits if h[0] == "web2:8082"])
    try:
        statuses = [(await c.request(f"/fail/{i}"))[0] for i in range(40)]
    finally:
        c.close()
    assert statuses == [200] * 40
    assert len([h for h in world.hits if h[0] == "web2:8082"]) > before  # the bad one was tried


async def test_identical_requests_on_one_connection_are_balanced_one_by_one(world):
    """The outbound lane (one decision reused for a repeated head) still lets the balancer
    pick per request: failure accrual moves the same request to the other endpoint."""
    key = ("dst", f"{VIP_LANE}:80")
    # web2:8081 answers one slow request first: its Peak-EWMA cost jumps to ~1 s, so the
    # balancer prefers the failing web2:8082 until accrual ejects it (7 failures).
    world.push("n1", key, _two(world, ports=(8081,), vip=VIP_LANE))
    c = await Client.connect(world.pods["a"], (VIP_LANE, 80))
    try:
        assert (await c.request("/slow"))[0] == 200
        world.push("n1", key, _two(world, ports=(8082, 8081), vip=VIP_LANE))
        await asyncio.sleep(0.3)  # the broadcast reaches the worker
        answers = [await c.request("/fail/same") for _ in range(20)]
    finally:
        c.close()
    got = [(status, json.loads(body)["server"]) for status, _, body in answers]
    assert got == [(500, "web2:8082")] * 7 + [(200, "web2:8081")] * 13


async def test_route_timeout_answers_504(world):
    route = Route(name="slow", condition=PathRegex("/slow.*"), timeout_s=0.3)
    world.push("n1", ("dst", f"{VIP_TWO}:80"), _two(world, ports=(8080,), routes=(route,)))
    c = await Client.connect(world.pods["a"], (VIP_TWO, 80))
    try:
        t0 = time.monotonic()
        status, head, _ = await c.request("/slow")
        took = time.monotonic() - t0
        assert status == 504
        assert h1msg.get_header(head.headers, b"l5d-proxy-error") is not None
        assert took < 0.9
        status, _, _ = await c.request("/fast")  # the connection still serves
        assert status == 200
    finally:
        c.close()


async def test_policy_revocation_closes_a_live_tcp_connection_within_2s(world):
    key = ("policy", "shop/web2", 9000)
    world.push(
        "n2", key, replace(ServerPolicy.default("all-authenticated"), protocol=ProxyProtocol.OPAQUE)
    )
    sock = await raw_connect(world.pods["a"], (VIP_ECHO, 9000))
    loop = asyncio.get_running_loop()
    try:
        await loop.sock_sendall(sock, b"ping")
        async with asyncio.timeout(5):
            assert await loop.sock_recv(sock, 16) == b"ping"
        world.push("n2", key, allow_identities(BETA, name="beta-only"))
        t0 = time.monotonic()
        async with asyncio.timeout(2.0):
            while True:
                try:
                    data = await loop.sock_recv(sock, 16)
                except ConnectionResetError:
                    break
                if not data:
                    break
        assert time.monotonic() - t0 < 2.0
    finally:
        sock.close()
        world.push("n2", key, ServerPolicy.default("all-authenticated"))


async def test_http2_prior_knowledge_is_answered_by_the_proxy_not_relayed_raw(world):
    """h2 is detected and terminated per stream (tests/integration/test_http2.py covers the
    streams): the proxy answers the preface with its own SETTINGS frame."""
    sock = await raw_connect(world.pods["a"], (VIP_DETECT, 9000))
    loop = asyncio.get_running_loop()
    try:
        await loop.sock_sendall(
            sock, b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
        )
        async with asyncio.timeout(5):
            head = await loop.sock_recv(sock, 9)
        assert len(head) == 9
        assert head[3] == 0x4  # a SETTINGS frame from the proxy's h2 server
    finally:
        sock.close()


async def test_pipelined_requests_are_answered_in_order(world):
    c = await Client.connect(world.pods["a"], (VIP_WEB, 80))
    try:
        paths = [f"/p/{i}" for i in range(10)]
        for _ in paths:
            c.parser.expect(b"GET")
        c.writer.write(
            b"".join(
                h1msg.request_head_bytes(b"GET", p.encode(), [(b"host", b"web")]) for p in paths
            )
        )
        seen: list[int] = []
        async with asyncio.timeout(10):
            while len(seen) < len(paths):
                events = c.parser.feed(await c.reader.read(65536))
                seen += [ev.status for ev in events if isinstance(ev, http1.ResponseHead)]
        assert seen == [200] * 10
        order = [h[1] for h in world.hits if h[1].startswith("/p/")][-10:]
        assert order == paths
    finally:
        c.close()


async def test_chunked_request_body_streams_through(world):
    c = await Client.connect(world.pods["a"], (VIP_WEB, 80))
    try:
        chunks = [secrets.token_bytes(n) for n in (1, 1000, 70000, 5)]
        body = b"".join(b"%x\r\n" % len(ch) + ch + b"\r\n" for ch in chunks) + b"0\r\n\r\n"
        c.parser.expect(b"POST")
        c.writer.write(
            h1msg.request_head_bytes(
                b"POST", b"/upload", [(b"host", b"web"), (b"transfer-encoding", b"chunked")]
            )
            + body
        )
        got = b""
        async with asyncio.timeout(10):
            while not got.endswith(b"}"):
                got += await c.reader.read(65536)
        assert got.startswith(b"HTTP/1.1 200")
        # the app decodes the chunks: every payload byte arrived, framing intact
        assert json.loads(got.partition(b"\r\n\r\n")[2])["len"] == sum(map(len, chunks))
    finally:
        c.close()


# --- HTTP/1 upgraded to h2 between the proxies (l5d-orig-proto) ------------------------


async def test_http1_to_an_endpoint_hinted_h2_crosses_upgraded_and_answers_as_http1(world):
    c = await Client.connect(world.pods["a"], (VIP_H2, 80))
    c.parser = http1.ResponseParser(decode_chunked=True)
    try:
        status, head, body = await c.request("/up")
        assert status == 200
        seen = {"server": "web2:8080", "client_id": ALPHA.dns_name, "len": 0, "marked": False}
        assert json.loads(body) == seen
        assert h1msg.get_header(head.headers, b"l5d-orig-proto") is None
        assert head.content_length == len(body)
        for n in (1, 1024, 16_384):  # whole: in callbacks on both nodes once the lane is up
            status, _, body = await c.request("/small-post", body=b"p" * n, method=b"POST")
            assert (status, json.loads(body)) == (200, {**seen, "len": n})
        big = secrets.token_bytes(200_000)  # past the stream's window: flow control both ways
        status, _, body = await c.request("/post", body=big, method=b"POST")
        assert (status, json.loads(body)["len"]) == (200, len(big))
        status, head, body = await c.request("/chunked")  # chunked by the app, DATA between
        assert status == 200
        assert head.framing is http1.Framing.CHUNKED  # no length known: chunked again
        assert json.loads(body) == seen
        assert c.trailers == [(b"x-end", b"1")]  # the app's trailer, as h2's between nodes
        status, head, body = await c.request("/head", method=b"HEAD")
        assert (status, body) == (200, b"")
    finally:
        c.close()


def _established_to(addr: tuple[str, int]) -> int:
    """Established TCP connections of this thread's netns to `addr` (IPv4)."""
    ip = socket.inet_aton(addr[0])[::-1].hex().upper()
    want = f"{ip}:{addr[1]:04X}"
    with Path("/proc/thread-self/net/tcp").open() as f:
        rows = [line.split() for line in f.readlines()[1:]]
    return sum(1 for r in rows if r[2] == want and r[3] == "01")


async def test_concurrent_http1_clients_share_one_upgraded_connection(world):
    web2 = (world.pods["web2"].ip, 8080)
    netns_a = world.pods["a"].netns
    before = await netns.run_in_async(netns_a, lambda: _established_to(web2))
    clients = [await Client.connect(world.pods["a"], (VIP_H2, 80)) for _ in range(12)]
    try:
        calls = [asyncio.ensure_future(c.request("/slow")) for c in clients]
        await asyncio.sleep(0.5)  # every request is in flight: the app holds each for 1 s
        during = await netns.run_in_async(netns_a, lambda: _established_to(web2))
        answers = await asyncio.gather(*calls)
    finally:
        for c in clients:
            c.close()
    assert [status for status, _, _ in answers] == [200] * 12
    # HTTP/1 between the proxies would hold a connection per request in flight; the
    # worker's one h2 lane to the endpoint (a node of one worker, agent.proxy.h2pool
    # rule 2; earlier tests may have opened it) carries all 12.
    assert during - before <= h2_lanes_for(1) < 12


async def _h2_to_web2(world, headers, body: bytes):
    """A TLS + h2 client (hyper-h2) from the unmeshed pod c at web2:8080, as another
    Linkerd proxy would call it: the response's headers, body and trailers."""
    ctx = _client_ctx(world.pki.material(ALPHA))
    sock = await raw_connect(world.pods["c"], (world.pods["web2"].ip, 8080))
    reader, writer = await asyncio.open_connection(
        sock=sock, ssl=ctx, server_hostname=WEB.dns_name, ssl_handshake_timeout=5
    )
    conn = h2.connection.H2Connection(
        h2.config.H2Configuration(client_side=True, header_encoding=None)
    )
    conn.initiate_connection()
    sid = conn.get_next_available_stream_id()
    conn.send_headers(sid, headers, end_stream=not body)
    if body:
        conn.send_data(sid, body, end_stream=True)
    writer.write(conn.data_to_send())
    got: dict = {}
    data_in = b""
    trailers: dict = {}
    try:
        async with asyncio.timeout(10):
            while True:
                data = await reader.read(65536)
                assert data, "connection closed before the stream ended"
                for ev in conn.receive_data(data):
                    if isinstance(ev, h2.events.ResponseReceived):
                        got = dict(ev.headers)
                    elif isinstance(ev, h2.events.TrailersReceived):
                        trailers = dict(ev.headers)
                    elif isinstance(ev, h2.events.DataReceived):
                        data_in += ev.data
                        conn.acknowledge_received_data(ev.flow_controlled_length, sid)
                    elif isinstance(ev, h2.events.StreamEnded | h2.events.StreamReset):
                        return got, data_in, trailers
                writer.write(conn.data_to_send())
    finally:
        writer.close()


async def test_inbound_gives_a_marked_h2_stream_to_the_http1_app_and_marks_the_answer(world):
    headers = [*_marked(b"POST", b"/chunked"), (b"l5d-client-id", b"forged.example")]
    got, body, trailers = await _h2_to_web2(world, headers, b"y" * 1000)  # chunked to the app
    assert got[b":status"] == b"200"
    assert got[b"l5d-orig-proto"] == b"HTTP/1.1"
    assert b"transfer-encoding" not in got
    assert trailers == {b"x-end": b"1"}  # the app's chunked trailer, as the stream's
    assert json.loads(body) == {
        "server": "web2:8080",
        "client_id": ALPHA.dns_name,  # the verified identity, not the forged one
        "len": 1000,
        "marked": False,
    }


def _marked(method: bytes, path: bytes) -> list[tuple[bytes, bytes]]:
    """An upgraded HTTP/1.1 request's h2 headers, as a peer proxy sends them."""
    return [
        (b":method", method),
        (b":scheme", b"http"),
        (b":authority", b"web"),
        (b":path", path),
        (b"l5d-orig-proto", b"HTTP/1.1"),
    ]


@contextlib.asynccontextmanager
async def _web2_8080_policy(world, policy: ServerPolicy):
    """web2:8080 under `policy` for the block, then back to the world's default."""
    key = ("policy", "shop/web2", 8080)
    world.push("n2", key, policy)
    try:
        await asyncio.sleep(0.3)
        yield
    finally:
        world.push("n2", key, ServerPolicy.default("all-authenticated"))


async def test_inbound_applies_policy_to_marked_streams(world):
    async with _web2_8080_policy(world, allow_identities(BETA, name="beta-only")):
        got, _, _ = await _h2_to_web2(world, _marked(b"GET", b"/denied"), b"")
        assert got[b":status"] == b"403"
        assert not any(h[1] == "/denied" for h in world.hits)


async def test_a_port_whose_policy_says_http1_takes_marked_streams_and_plain_http1(world):
    http1_only = replace(ServerPolicy.default("all-authenticated"), protocol=ProxyProtocol.HTTP1)
    async with _web2_8080_policy(world, http1_only):
        got, body, _ = await _h2_to_web2(world, _marked(b"GET", b"/h1port"), b"")
        assert (got[b":status"], json.loads(body)["client_id"]) == (b"200", ALPHA.dns_name)
        plain = await _tls_to_web2(world, _client_ctx(world.pki.material(ALPHA)))
        assert plain.startswith(b"HTTP/1.1 200")
