"""The admin server over real TCP: every endpoint, readiness, scrubbing, local-only changes."""

from __future__ import annotations

import asyncio
import http.client
import json
import logging
import socket

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from prometheus_client.parser import text_string_to_metric_families

from agent.admin.aggregate import Exposition
from agent.admin.controls import LogLevelControl, ReadinessGate
from agent.admin.metrics import PodMeta, Tls, WorkerMetrics
from agent.admin.node import NodeMetrics
from agent.admin.server import AdminServer, is_local_caller
from agent.admin.tap import TapHub

PEM = (
    ec.generate_private_key(ec.SECP256R1())
    .private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    .decode()
)
WEB = PodMeta(namespace="shop", pod="web-1", owner_kind="deployment", owner_name="web")


def request(port: int, method: str, path: str, body: bytes | None = None, host: str = "127.0.0.1"):
    conn = http.client.HTTPConnection(host, port, timeout=10)
    try:
        conn.request(method, path, body=body)
        resp = conn.getresponse()
        return resp.status, dict(resp.getheaders()), resp.read()
    finally:
        conn.close()


async def call(port: int, method: str, path: str, body: bytes | None = None):
    return await asyncio.to_thread(request, port, method, path, body)


@pytest.fixture
def root_level():
    before = logging.getLogger().level
    yield
    logging.getLogger().setLevel(before)


@pytest.fixture
async def admin(root_level):
    exposition = Exposition()
    node = NodeMetrics()
    exposition.add_source(node.families)
    worker = WorkerMetrics(1, incarnation=4242)
    s = worker.http(
        WEB,
        direction="inbound",
        authority="web:80",
        target=("10.42.0.7", 80),
        tls=Tls.no_identity("not_provided_by_remote"),
    )
    for status in (200, 200, 200, 500):
        s.request()
        s.response(status, 12.0, status < 500)
    exposition.aggregator.update(worker.snapshot())
    gate = ReadinessGate()
    dump = {
        "pods": [{"namespace": "shop", "name": "web-1"}],
        "certificates": [{"identity": "web.shop", "not_after": 1.9e9, "key_pem": PEM}],
        "leak": PEM,
        "listeners": [{"port": 4143, "notes": ["fine", PEM]}],
    }
    server = AdminServer(
        host="127.0.0.1",
        port=0,
        metrics=exposition.render,
        ready=gate.check,
        config_dump=lambda: dump,
        log_level=LogLevelControl("info"),
        tap=TapHub(capacity=16),
    )
    await server.start()
    try:
        yield server, gate, node
    finally:
        await server.close()


async def test_live(admin):
    server, _, _ = admin
    status, _, body = await call(server.port, "GET", "/live")
    assert (status, body) == (200, b"live\n")


async def test_ready_flips_with_the_gate(admin):
    server, gate, _ = admin
    status, _, body = await call(server.port, "GET", "/ready")
    assert status == 503
    assert b"workers: workers not up" in body
    assert b"control_plane" in body
    for name in ("redirects", "workers", "certificates"):
        gate.set(name, True)
    status, _, body = await call(server.port, "GET", "/ready")
    assert status == 503
    assert body.decode().splitlines() == [
        "not ready",
        "control_plane: control plane has not answered yet",
    ]
    gate.set("control_plane", True)
    assert (await call(server.port, "GET", "/ready"))[::2] == (200, b"ready\n")
    gate.set("certificates", False, "web.shop expired")
    status, _, body = await call(server.port, "GET", "/ready")
    assert status == 503
    assert b"certificates: web.shop expired" in body


async def test_metrics_scrape_parses_with_exact_values(admin):
    server, _, node = admin
    node.set_enrolled_pods("iptables", 3)
    status, headers, body = await call(server.port, "GET", "/metrics")
    assert status == 200
    assert headers["Content-Type"].startswith("text/plain; version=0.0.4")
    fams = {f.name: f for f in text_string_to_metric_families(body.decode())}
    resp = {
        (s.labels["classification"], s.labels["status_code"]): s.value
        for s in fams["response"].samples
    }
    assert resp == {("success", "200"): 3, ("failure", "500"): 1}
    (req,) = fams["request"].samples
    assert req.labels == {
        "namespace": "shop",
        "pod": "web-1",
        "deployment": "web",
        "direction": "inbound",
        "authority": "web:80",
        "target_addr": "10.42.0.7:80",
        "target_ip": "10.42.0.7",
        "target_port": "80",
        "tls": "no_identity",
        "no_tls_reason": "not_provided_by_remote",
    }
    assert req.value == 4
    (enrolled,) = fams["meshagent_enrolled_pods"].samples
    assert (enrolled.labels, enrolled.value) == ({"mode": "iptables"}, 3)
    cpu = {s.labels["process"] for s in fams["process_cpu_seconds"].samples}
    assert cpu == {"supervisor"}


async def test_config_dump_never_contains_a_private_key(admin):
    server, _, _ = admin
    status, headers, body = await call(server.port, "GET", "/config_dump")
    assert status == 200
    assert headers["Content-Type"] == "application/json"
    assert b"PRIVATE KEY" not in body
    data = json.loads(body)
    assert data["pods"] == [{"namespace": "shop", "name": "web-1"}]
    assert data["certificates"] == [{"identity": "web.shop", "not_after": 1.9e9}]
    assert data["listeners"] == [{"port": 4143, "notes": ["fine"]}]
    assert "leak" not in data


async def test_log_level_get_and_put_from_host_loopback(admin):
    server, _, _ = admin
    assert (await call(server.port, "GET", "/proxy-log-level"))[::2] == (200, b"info\n")
    status, _, _ = await call(server.port, "PUT", "/proxy-log-level", b"agent.proxy=debug,warn")
    assert status == 204
    assert (await call(server.port, "GET", "/proxy-log-level"))[2] == b"agent.proxy=debug,warn\n"
    assert logging.getLogger("agent.proxy").level == logging.DEBUG
    logging.getLogger("agent.proxy").setLevel(logging.NOTSET)
    status, _, body = await call(server.port, "PUT", "/proxy-log-level", b"chatty")
    assert status == 400
    assert b"unknown level" in body


async def test_unknown_paths_methods_and_oversized_requests(admin):
    server, _, _ = admin
    assert (await call(server.port, "GET", "/nope"))[0] == 404
    status, headers, _ = await call(server.port, "POST", "/metrics", b"x")
    assert (status, headers["Allow"]) == (405, "GET")
    assert (await call(server.port, "PUT", "/proxy-log-level", b"x" * 70_000))[0] == 413


async def test_garbage_gets_400_and_server_keeps_serving(admin):
    server, _, _ = admin

    def garbage() -> bytes:
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:
            s.sendall(b"\x16\x03\x01 not http at all\r\n\r\n")
            return s.recv(1024)

    assert (await asyncio.to_thread(garbage)).startswith(b"HTTP/1.1 400")
    assert (await call(server.port, "GET", "/live"))[0] == 200


async def test_keep_alive_serves_several_requests_on_one_connection(admin):
    server, _, _ = admin

    def two() -> list[int]:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=5)
        try:
            out = []
            for path in ("/live", "/metrics", "/proxy-log-level"):
                conn.request("GET", path)
                r = conn.getresponse()
                r.read()
                out.append(r.status)
            return out
        finally:
            conn.close()

    assert await asyncio.to_thread(two) == [200, 200, 200]


async def test_failing_provider_gives_500_not_a_dead_server(root_level):
    def broken() -> str:
        raise RuntimeError("boom")

    server = AdminServer(host="127.0.0.1", port=0, metrics=broken, ready=ReadinessGate().check)
    async with server:
        assert (await call(server.port, "GET", "/metrics"))[0] == 500
        assert (await call(server.port, "GET", "/live"))[0] == 200


async def test_tap_streams_json_lines_to_a_local_reader(admin):
    server, _, _ = admin
    hub = server.tap
    reader = asyncio.ensure_future(
        asyncio.to_thread(request, server.port, "GET", "/tap?limit=3&pod=web")
    )
    for _ in range(200):
        if hub.subscribers:
            break
        await asyncio.sleep(0.01)
    assert hub.subscribers == 1
    for n in range(5):
        hub.publish({"pod": "web" if n != 1 else "db", "n": n})
    status, headers, body = await asyncio.wait_for(reader, 10)
    assert status == 200
    assert headers["Content-Type"] == "application/x-ndjson"
    assert [json.loads(line)["n"] for line in body.splitlines()] == [0, 2, 3]
    for _ in range(200):
        if not hub.subscribers:
            break
        await asyncio.sleep(0.01)
    assert hub.subscribers == 0


async def test_tap_reader_that_leaves_is_unsubscribed(admin):
    server, _, _ = admin
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    try:
        sock.sendall(b"GET /tap HTTP/1.1\r\nHost: x\r\n\r\n")
        head = await asyncio.to_thread(sock.recv, 4096)
        assert head.startswith(b"HTTP/1.1 200")
    finally:
        sock.close()
    for _ in range(200):
        if not server.tap.subscribers:
            break
        await asyncio.sleep(0.01)
    assert server.tap.subscribers == 0


@pytest.mark.parametrize(
    ("peer", "local", "expected"),
    [
        (("127.0.0.1", 5000), ("127.0.0.1", 4191), True),
        (("127.0.0.53", 5000), ("127.0.0.1", 4191), True),
        (("::1", 5000, 0, 0), ("::1", 4191, 0, 0), True),
        (("::ffff:127.0.0.1", 5000, 0, 0), ("::ffff:127.0.0.1", 4191, 0, 0), True),
        (("10.200.1.2", 5000), ("10.200.1.1", 4191), False),
        (("127.0.0.1", 5000), ("10.200.1.1", 4191), False),
        (None, ("127.0.0.1", 4191), False),
    ],
)
def test_local_caller_rule(peer, local, expected):
    assert is_local_caller(peer, local) is expected


# --- from a pod's network namespace -------------------------------------------------------


def _pod_request(pod, addr: tuple[str, int], raw: bytes) -> bytes:
    s = pod.socket()
    try:
        s.settimeout(10)
        s.connect(addr)
        s.sendall(raw)
        chunks = []
        while True:
            data = s.recv(4096)
            if not data:
                break
            chunks.append(data)
        return b"".join(chunks)
    finally:
        s.close()


@pytest.mark.privileged
async def test_put_from_a_pod_netns_is_forbidden_but_host_loopback_works(lab, root_level):
    node = lab.node("n1")
    pod = lab.pod(node, "client")
    server = AdminServer(host="0.0.0.0", port=0, metrics=str, ready=ReadinessGate().check)
    async with server:
        node_addr = (node.gateway, server.port)
        put = (
            b"PUT /proxy-log-level HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n"
            b"Connection: close\r\n\r\ndebug"
        )
        live = b"GET /live HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        # The pod reaches the server (so a refusal is a decision, not a network failure)...
        got = await asyncio.to_thread(_pod_request, pod, node_addr, live)
        assert got.startswith(b"HTTP/1.1 200")
        # ...but may not change anything, although it is "local" in its own netns.
        got = await asyncio.to_thread(_pod_request, pod, node_addr, put)
        assert got.startswith(b"HTTP/1.1 403")
        assert server.log_level.current == "info"
        tap = b"GET /tap HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        assert (await asyncio.to_thread(_pod_request, pod, node_addr, tap)).startswith(
            b"HTTP/1.1 403"
        )
        # The pod's own 127.0.0.1 is not the host's: nothing listens there.
        with pytest.raises(ConnectionRefusedError):
            await asyncio.to_thread(_pod_request, pod, ("127.0.0.1", server.port), live)
        # From the host's loopback the same PUT works.
        status, _, _ = await call(server.port, "PUT", "/proxy-log-level", b"debug")
        assert status == 204
        assert server.log_level.current == "debug"
