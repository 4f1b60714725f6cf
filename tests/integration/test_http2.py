"""HTTP/2 and gRPC through the mesh, per stream: real grpcio servers and clients in pods.

Topology (agent.netlab), as tests/integration/test_dataplane.py builds it:
- node n1: client pods `a` (sa alpha) and `b` (sa beta); pod `g1` (sa web)
  runs gRPC servers on 50051 and 50052 (same-node path).
- node n2: pod `g2` (sa web) runs gRPC servers on 50051 and 50052 (mTLS hop).
Servers and clients are grpcio processes started inside the pods (their
connects are captured by the pods' iptables rules); one WorkerPool per node.
The gRPC servers answer who they are and the `l5d-client-id` they saw.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import pytest
import pytest_asyncio

from agent.proxy.listener import ListenerKind, open_pod_listeners
from agent.proxy.model import Endpoint, PathRegex, Profile, Route
from agent.proxy.pool import H2_LANES, WorkerOptions, WorkerPool
from agent.proxy.state import Destination, NodeInfo
from agent.redirect import netns
from agent.redirect.annotations import build_spec
from agent.redirect.iptables import IptablesRedirector
from tests.integration.test_dataplane import (
    ALPHA,
    BETA,
    WEB,
    Pki,
    World,
    _established_to,
    _pod_info,
    allow_identities,
)

pytestmark = [pytest.mark.privileged, pytest.mark.asyncio(loop_scope="module")]

VIP_REMOTE = "10.96.1.10"  # g2:50051 + g2:50052 on n2 (mTLS)
VIP_LOCAL = "10.96.1.11"  # g1:50051 + g1:50052 on n1 (same-node path)
VIP_SLOW = "10.96.1.12"  # g2:50051 with a 0.3 s route timeout on /t.T/Slow
VIP_LOAD = "10.96.1.13"  # g2:50051 + g2:50052, balanced only by the endpoint-removal test
PORTS = (50051, 50052)
OVERRIDE_AUTHORITY = "grpc-override.shop.svc.cluster.local:50051"  # names g2's endpoints
MiB = 1 << 20

SERVER = r"""
import json, sys, time
from concurrent import futures
import grpc
name, ports = sys.argv[1], [int(p) for p in sys.argv[2:]]
servers = []
for port in ports:
    who = f"{name}:{port}"
    def echo(req, ctx, who=who):
        md = dict(ctx.invocation_metadata())
        return json.dumps({"server": who, "client_id": md.get("l5d-client-id"),
                           "len": len(req), "n": md.get("x-n")}).encode()
    def stream(req, ctx, who=who):
        for i in range(int(req or b"5")):
            time.sleep(0.2)
            yield b"%d" % i
    def big(req, ctx):
        return b"y" * len(req)
    def slow(req, ctx):
        time.sleep(1.5)
        return b"late"
    h = grpc.method_handlers_generic_handler("t.T", {
        "Echo": grpc.unary_unary_rpc_method_handler(echo),
        "Stream": grpc.unary_stream_rpc_method_handler(stream),
        "Big": grpc.unary_unary_rpc_method_handler(big),
        "Slow": grpc.unary_unary_rpc_method_handler(slow),
    })
    s = grpc.server(futures.ThreadPoolExecutor(16), options=[
        ("grpc.max_receive_message_length", 16 << 20), ("grpc.max_send_message_length", 16 << 20)])
    s.add_generic_rpc_handlers((h,))
    s.add_insecure_port(f"0.0.0.0:{port}")
    s.start()
    servers.append(s)
print("ready", flush=True)
sys.stdin.read()
"""

CLIENT = r"""
import json, sys, time
from concurrent import futures
import grpc
mode, target, raw = sys.argv[1], sys.argv[2], sys.argv[3]
arg = 0.0 if mode == "override" else float(raw)
ch = grpc.insecure_channel(target, options=[
    ("grpc.max_receive_message_length", 16 << 20), ("grpc.max_send_message_length", 16 << 20)])
md = (("l5d-client-id", "admin.kube-system.serviceaccount.identity.linkerd.cluster.local"),)
def code(e):
    return e.code().value[0]
out = {}
if mode == "unary":  # `arg` concurrent calls on the one channel (one h2 connection)
    echo = ch.unary_unary("/t.T/Echo")
    futs = [echo.future(b"hi", metadata=md, timeout=20) for _ in range(int(arg))]
    res = []
    for f in futs:
        try:
            res.append({"code": 0, **json.loads(f.result())})
        except grpc.RpcError as e:
            res.append({"code": code(e), "details": e.details()})
    out["calls"] = res
elif mode == "override":  # `raw`: the l5d-dst-override authority
    echo = ch.unary_unary("/t.T/Echo")
    res = []
    for _ in range(4):
        try:
            res.append({"code": 0, **json.loads(echo(
                b"o", metadata=md + (("l5d-dst-override", raw),), timeout=20))})
        except grpc.RpcError as e:
            res.append({"code": code(e), "details": e.details()})
    out["calls"] = res
elif mode == "stream":
    t0, times = time.monotonic(), []
    for msg in ch.unary_stream("/t.T/Stream")(b"%d" % int(arg), timeout=20):
        times.append(time.monotonic() - t0)
    out["times"] = times
elif mode == "big":
    got = ch.unary_unary("/t.T/Big")(b"x" * int(arg), timeout=30)
    out["len"], out["ok"] = len(got), got == b"y" * int(arg)
elif mode == "slow":
    t0 = time.monotonic()
    try:
        ch.unary_unary("/t.T/Slow")(b"", timeout=20)
        out["code"] = 0
    except grpc.RpcError as e:
        out["code"], out["details"] = code(e), e.details()
    out["took"] = time.monotonic() - t0
elif mode == "load":  # calls for `arg` seconds, 8 in flight
    echo = ch.unary_unary("/t.T/Echo")
    deadline, res = time.monotonic() + arg, []
    def one():
        try:
            return json.loads(echo(b"l", timeout=20))["server"]
        except grpc.RpcError as e:
            return f"error {code(e)} {e.details()}"
    with futures.ThreadPoolExecutor(8) as ex:
        while time.monotonic() < deadline:
            res += list(ex.map(lambda _: one(), range(8)))
    out["servers"] = res
ch.close()
print(json.dumps(out), flush=True)
"""

# Calls on one h2 connection (hyper-h2, whose encoder makes every repeated header block
# the same bytes): `count` calls, a line on stdin, `count` more. `vary`: each call carries
# its own `x-n` (a new table entry, so no block repeats). Prints each call's grpc-status
# and, when it succeeded, the `l5d-client-id` and `x-n` the server saw.
REPEAT = r"""
import json, socket, sys
import h2.config, h2.connection, h2.events
host, port, count, vary = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
sock = socket.create_connection((host, port), timeout=20)
conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
conn.initiate_connection()
sock.sendall(conn.data_to_send())
head = [(":method", "POST"), (":scheme", "http"), (":authority", f"{host}:{port}"),
        (":path", "/t.T/Echo"), ("content-type", "application/grpc"), ("te", "trailers")]
calls = 0
def call():
    global calls
    calls += 1
    sid = conn.get_next_available_stream_id()
    conn.send_headers(sid, head + ([("x-n", str(calls))] if vary else []))
    conn.send_data(sid, b"\0\0\0\0\2hi", end_stream=True)
    sock.sendall(conn.data_to_send())
    status, body = None, b""
    while True:
        data = sock.recv(65536)
        if not data:
            raise SystemExit("connection closed")
        for ev in conn.receive_data(data):
            if isinstance(ev, (h2.events.ResponseReceived, h2.events.TrailersReceived)):
                got = dict((bytes(k), bytes(v)) for k, v in ev.headers)
                status = got.get(b"grpc-status", status)
            elif isinstance(ev, h2.events.DataReceived):
                body += ev.data
                conn.acknowledge_received_data(ev.flow_controlled_length, sid)
            elif isinstance(ev, h2.events.StreamEnded) and ev.stream_id == sid:
                sock.sendall(conn.data_to_send())
                seen = json.loads(body[5:]) if body else {}
                return [int(status), seen.get("client_id"), seen.get("n")]
        sock.sendall(conn.data_to_send())
print(json.dumps([call() for _ in range(count)]), flush=True)
sys.stdin.readline()
print(json.dumps([call() for _ in range(count)]), flush=True)
"""


def _dst(vip: str, pod, ports=PORTS, *, ident=WEB, profile=None) -> Destination:
    return Destination(
        target=f"{vip}:50051",
        authority=f"grpc-{vip}.shop.svc.cluster.local:50051",
        exists=True,
        endpoints=tuple(Endpoint(addr=(pod.ip, p), tls_identity=ident.dns_name) for p in ports),
        profile=profile,
    )


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return Pki(tmp_path_factory.mktemp("pki"))


def _start_server(pod, name: str) -> subprocess.Popen:
    proc = pod.spawn(
        [sys.executable, "-c", SERVER, name, *map(str, PORTS)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    line = proc.stdout.readline()
    assert line.strip() == "ready", f"grpc server in {name} did not start"
    return proc


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def world(module_lab, pki):
    lab = module_lab
    n1, n2 = lab.node("n1", isolated=True), lab.node("n2", isolated=True)
    lab.link(n1, n2)
    pods = {"a": lab.pod(n1, "a"), "b": lab.pod(n1, "b"), "g1": lab.pod(n1, "g1")}
    pods["g2"] = lab.pod(n2, "g2")
    w = World(lab, pki)
    w.pods = pods
    redirector = IptablesRedirector()
    for name, p in pods.items():
        redirector.enroll(
            build_spec(pod=f"shop/{name}", netns=p.netns, pod_ip=p.ip, pod_annotations={})
        )
    procs: list[subprocess.Popen] = []
    try:
        for node in ("n1", "n2"):
            options = WorkerOptions(stats_interval_s=0.5, grace_s=2.0, log_level="warning")
            pool = WorkerPool(1, options=options, on_need=w.on_need(node))
            w.pools[node] = pool
            await pool.start(ready_timeout=20)
        idents = {"a": ALPHA, "b": BETA, "g1": WEB, "g2": WEB}
        homes = {"a": "n1", "b": "n1", "g1": "n1", "g2": "n2"}
        w.info = {n: _pod_info(pods[n], idents[n], homes[n]) for n in idents}
        for node in ("n1", "n2"):
            w.push(node, ("node",), NodeInfo(name=node))
        for name, info in w.info.items():
            node = homes[name]
            w.push(node, ("pod", info.key), info)
            w.push(node, ("pod-ip", info.ip), info.key)
            listeners = open_pod_listeners(info.netns)  # one socket for all workers
            for kind, socks in (
                (ListenerKind.OUTBOUND, listeners.outbound),
                (ListenerKind.INBOUND, listeners.inbound),
            ):
                w.pools[node].add_listener(
                    listener_id=f"{name}-{kind.value}",
                    pod=info.key,
                    kind=kind,
                    netns=info.netns,
                    socks=socks,
                )
        w.push("n1", ("tls", ALPHA.dns_name), pki.material(ALPHA))
        w.push("n1", ("tls", BETA.dns_name), pki.material(BETA))
        w.push("n2", ("tls", WEB.dns_name), pki.material(WEB))
        w.push("n1", ("dst", f"{VIP_REMOTE}:50051"), _dst(VIP_REMOTE, pods["g2"]))
        w.push("n1", ("dst", f"{VIP_LOCAL}:50051"), _dst(VIP_LOCAL, pods["g1"]))
        w.push("n1", ("dst", OVERRIDE_AUTHORITY), _dst(VIP_REMOTE, pods["g2"]))
        # Its own balancer: another test's long streaming call leaves a peak RTT
        # on one VIP_REMOTE endpoint, which P2C then avoids for seconds.
        w.push("n1", ("dst", f"{VIP_LOAD}:50051"), _dst(VIP_LOAD, pods["g2"]))
        slow = Route(name="slow", condition=PathRegex("/t.T/Slow"), timeout_s=0.3)
        w.push(
            "n1",
            ("dst", f"{VIP_SLOW}:50051"),
            _dst(VIP_SLOW, pods["g2"], (50051,), profile=Profile(routes=(slow,))),
        )
        for port in PORTS:
            w.push("n1", ("policy", "shop/g1", port), allow_identities(ALPHA, name="g1-alpha"))
            w.push("n2", ("policy", "shop/g2", port), allow_identities(ALPHA, name="g2-alpha"))
        procs += [_start_server(pods["g1"], "g1"), _start_server(pods["g2"], "g2")]
        yield w
    finally:
        for proc in procs:
            proc.kill()
            proc.communicate()
            lab.untrack(proc)
        for pool in w.pools.values():
            await pool.close()


async def grpc_client(pod, mode: str, vip: str, arg: float | str = 0, limit_s: float = 60) -> dict:
    argv = [sys.executable, "-c", CLIENT, mode, f"{vip}:50051", str(arg)]
    done = await asyncio.to_thread(pod.run, argv, timeout=limit_s)
    return json.loads(done.stdout)


WHERE = {"remote": (VIP_REMOTE, "g2"), "local": (VIP_LOCAL, "g1")}


# --- tests -----------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["remote", "local"])
async def test_concurrent_unary_calls_on_one_connection_spread_over_both_endpoints(world, where):
    vip, srv = WHERE[where]
    out = await grpc_client(world.pods["a"], "unary", vip, 200)
    calls = out["calls"]
    assert [c["code"] for c in calls] == [0] * 200
    servers = {c["server"] for c in calls}
    assert servers == {f"{srv}:50051", f"{srv}:50052"}  # per-stream balancing
    assert {c["client_id"] for c in calls} == {ALPHA.dns_name}  # the forged id was replaced


async def test_client_connections_spread_over_the_workers_lanes_to_each_endpoint(world):
    """h2pool rule 2: the peer's kernel gives each connection to one of its workers, so
    one worker's streams to a remote endpoint go on up to H2_LANES connections, not one
    (the pool's default: this world starts its pools as a node of several workers)."""
    outs = await asyncio.gather(
        *(grpc_client(world.pods["a"], "unary", VIP_REMOTE, 20) for _ in range(2 * H2_LANES))
    )
    assert [c["code"] for out in outs for c in out["calls"]] == [0] * 20 * 2 * H2_LANES
    ip = world.pods["g2"].ip
    counts = [
        await netns.run_in_async(world.pods["a"].netns, lambda p=port: _established_to((ip, p)))
        for port in PORTS
    ]
    # One worker per node here: without lanes, one connection per endpoint.
    assert all(1 <= n <= H2_LANES for n in counts), counts
    assert sum(counts) > len(PORTS), counts


async def test_server_streaming_call_streams_across_nodes(world):
    out = await grpc_client(world.pods["a"], "stream", VIP_REMOTE, 6)
    times = out["times"]
    assert len(times) == 6
    assert times[-1] - times[0] > 0.8  # messages arrived as sent (0.2 s apart), not at once


@pytest.mark.parametrize("where", ["remote", "local"])
async def test_policy_denies_with_permission_denied_and_allows_alpha(world, where):
    vip, _ = WHERE[where]
    denied = await grpc_client(world.pods["b"], "unary", vip, 3)
    assert [c["code"] for c in denied["calls"]] == [7] * 3  # PERMISSION_DENIED
    allowed = await grpc_client(world.pods["a"], "unary", vip, 3)
    assert [c["code"] for c in allowed["calls"]] == [0] * 3
    assert [c["client_id"] for c in allowed["calls"]] == [ALPHA.dns_name] * 3


@pytest.mark.parametrize("vary", [False, True], ids=["identical", "varying"])
@pytest.mark.parametrize("where", ["remote", "local"])
async def test_a_policy_change_applies_to_the_next_alike_stream_on_a_connection(world, where, vary):
    """h2route's `_Repeat`: a stream with the last stream's header list (identical) or
    routing facts (varying) reuses its decision only within one state generation, and
    sends its own headers; a policy pushed in between decides the next one."""
    vip, srv = WHERE[where]
    node = "n1" if where == "local" else "n2"
    argv = [sys.executable, "-c", REPEAT, vip, "50051", "4", "1" if vary else "0"]
    proc = world.pods["a"].spawn(
        argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        first = await asyncio.to_thread(proc.stdout.readline)
        for port in PORTS:  # alpha no longer allowed
            world.push(node, ("policy", f"shop/{srv}", port), allow_identities(BETA, name="beta"))
        await asyncio.sleep(0.5)  # the push reaches the worker
        stdout, stderr = await asyncio.to_thread(proc.communicate, "go\n", 30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        world.lab.untrack(proc)
        for port in PORTS:
            world.push(
                node, ("policy", f"shop/{srv}", port), allow_identities(ALPHA, name=f"{srv}-alpha")
            )
    assert proc.returncode == 0, stderr
    ns = [str(n) if vary else None for n in range(1, 5)]
    assert json.loads(first) == [[0, ALPHA.dns_name, n] for n in ns]
    assert json.loads(stdout) == [[7, None, None]] * 4  # PERMISSION_DENIED, same connection


async def test_endpoint_removed_mid_load_loses_no_call(world):
    key = ("dst", f"{VIP_LOAD}:50051")
    pod = world.pods["a"]
    argv = [sys.executable, "-c", CLIENT, "load", f"{VIP_LOAD}:50051", "2.5"]
    proc = pod.spawn(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        await asyncio.sleep(1.0)
        world.push("n1", key, _dst(VIP_LOAD, world.pods["g2"], (50051,)))
        removed_at = time.monotonic()
        stdout, stderr = await asyncio.to_thread(proc.communicate, timeout=60)
    finally:
        world.lab.untrack(proc)
        world.push("n1", key, _dst(VIP_LOAD, world.pods["g2"]))
    assert proc.returncode == 0, stderr
    servers = json.loads(stdout)["servers"]
    assert len(servers) > 50
    assert [s for s in servers if s.startswith("error")] == []
    assert set(servers) == {"g2:50051", "g2:50052"}  # both served before the removal
    assert time.monotonic() > removed_at
    assert servers[-8:] == ["g2:50051"] * 8  # only the remaining endpoint at the end


@pytest.mark.parametrize("where", ["remote", "local"])
async def test_4_mib_messages_cross_with_flow_control(world, where):
    vip, _ = WHERE[where]
    out = await grpc_client(world.pods["a"], "big", vip, 4 * MiB)
    assert out == {"len": 4 * MiB, "ok": True}


async def test_route_timeout_answers_deadline_exceeded(world):
    out = await grpc_client(world.pods["a"], "slow", VIP_SLOW)
    assert out["code"] == 4  # DEADLINE_EXCEEDED, from the proxy's trailers-only answer
    assert out["took"] < 1.2
    assert "timed out" in out["details"]


async def test_l5d_dst_override_routes_each_stream_by_authority(world):
    # Sent to the same-node VIP, overridden to an authority whose endpoints are on n2.
    out = await grpc_client(world.pods["a"], "override", VIP_LOCAL, OVERRIDE_AUTHORITY)
    calls = out["calls"]
    assert [c["code"] for c in calls] == [0] * 4
    assert {c["server"].split(":")[0] for c in calls} == {"g2"}
    unknown = await grpc_client(world.pods["a"], "override", VIP_LOCAL, "nowhere.shop:1")
    # No destination answer for it in this world: UNAVAILABLE (14) after the wait.
    assert {c["code"] for c in unknown["calls"]} == {14}
