"""eBPF capture in real namespaces and cgroups (agent.netlab pods).

One redirector per module (each program file compiles once, ~1 s each on
this machine, unless the run's cache of compiled programs holds it); the
reload test loads a second set from that cache, and the cache test compiles
one more set into a cache of its own. Pod `app` is
meshed; `srv` and `ext` are plain peers (`ext` is in app's skip-subnets).
Listeners that stand in for the proxy are opened by this process inside app's
netns, as the agent does. The last test unenrolls and uninstalls, and checks
that no program, map, link or pin is left.
"""

from __future__ import annotations

import dataclasses
import hashlib
import ipaddress
import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from agent.errors import PrerequisiteError
from agent.netlab import lab
from agent.redirect import accel_sweep, ebpf_cache, ebpf_origdst, maps, netns
from agent.redirect.ebpf import EbpfRedirector
from agent.redirect.model import PROXY_MARK, CaptureSpec, PortRange, PortSet
from agent.redirect.orig_dst import original_dst

pytestmark = [pytest.mark.privileged, pytest.mark.timeout(180)]

SKIP_OUT = 9000
SKIP_IN = 7000
TIMEOUT = 5.0

CLIENT = textwrap.dedent(
    """
    import socket, sys
    host, port, mark, payload = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    if mark:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_MARK, mark)
    s.settimeout(5)
    s.connect((host, port))
    s.sendall(payload.encode())
    s.shutdown(socket.SHUT_WR)
    print(s.recv(100).decode())
    """
)


@pytest.fixture(scope="module")
def pods():
    with lab("ebpf") as lb:
        node = lb.node("n1")
        app, srv, ext = lb.pod(node, "app"), lb.pod(node, "srv"), lb.pod(node, "ext")
        yield lb, app, srv, ext


@pytest.fixture(scope="module")
def spec(pods):
    _, app, _, ext = pods
    return CaptureSpec(
        pod="test/app",
        netns=app.netns,
        pod_ip=app.ip,
        cgroup=app.cgroup,
        skip_outbound_ports=PortSet((PortRange(SKIP_OUT, SKIP_OUT),)),
        skip_inbound_ports=PortSet((PortRange(SKIP_IN, SKIP_IN),)),
        skip_subnets=(ipaddress.ip_network(f"{ext.ip}/32"),),
    )


@pytest.fixture(scope="module")
def pin_root():
    root = Path(f"/sys/fs/bpf/meshagent-test-{os.getpid()}")
    yield root
    EbpfRedirector(pin_root=root, accelerate=False).uninstall()  # no-op when the test did it


@pytest.fixture(scope="module")
def redirector(pin_root, spec):
    holder = {"r": EbpfRedirector(pin_root=pin_root, accelerate=False)}
    holder["r"].enroll(spec)
    yield holder
    holder["r"].close()


def _listen(pod, addr: str, port: int) -> socket.socket:
    s = pod.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((addr, port))
    s.listen(16)
    s.settimeout(TIMEOUT)
    return s


def _client(pod, host: str, port: int, *, mark: int = 0, payload: str = "ping"):
    return pod.spawn(
        [sys.executable, "-c", CLIENT, host, str(port), str(mark), payload],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _serve_one(listener: socket.socket, reply: bytes = b"pong") -> tuple[socket.socket, bytes]:
    conn, _ = listener.accept()
    conn.settimeout(TIMEOUT)
    data = b""
    while chunk := conn.recv(100):
        data += chunk
    conn.sendall(reply)
    return conn, data


def _finish(proc) -> str:
    out, err = proc.communicate(timeout=TIMEOUT)
    assert proc.returncode == 0, err
    return out.strip()


@pytest.mark.parametrize("family", ["ipv4", "ipv6 socket, v4-mapped destination"])
def test_outbound_connect_arrives_at_outbound_listener_with_exact_original_destination(
    pods, spec, redirector, pin_root, family
):
    _, app, srv, _ = pods
    host = srv.ip if family == "ipv4" else f"::ffff:{srv.ip}"
    with _listen(app, "127.0.0.1", spec.outbound_port) as outbound:
        proc = _client(app, host, 8080)
        conn, data = _serve_one(outbound)
        with conn:
            assert data == b"ping"
            assert original_dst(conn) == (srv.ip, 8080)  # the getsockopt program answers
            assert ebpf_origdst.lookup(conn, maps_dir=pin_root / "maps") == (srv.ip, 8080)
        assert _finish(proc) == "pong"
    state = redirector["r"].inspect(spec)
    assert state.outbound == "captured"
    assert any(o.endswith(f"-> {srv.ip}:8080") for o in state.extra["orig_dst"])


@pytest.mark.parametrize("target", ["skipped port", "skipped subnet", "proxy mark"])
def test_outbound_bypasses_capture(pods, spec, redirector, target):
    _, app, srv, ext = pods
    peer, port, mark = {
        "skipped port": (srv, SKIP_OUT, 0),
        "skipped subnet": (ext, 8080, 0),
        "proxy mark": (srv, 8080, PROXY_MARK),
    }[target]
    with (
        _listen(app, "127.0.0.1", spec.outbound_port) as outbound,
        _listen(peer, "0.0.0.0", port) as real,
    ):
        proc = _client(app, peer.ip, port, mark=mark)
        conn, data = _serve_one(real, b"direct")
        conn.close()
        assert data == b"ping"
        assert _finish(proc) == "direct"
        outbound.setblocking(False)
        with pytest.raises(BlockingIOError):
            outbound.accept()


def test_inbound_from_another_netns_arrives_at_inbound_listener(pods, spec, redirector):
    _, app, srv, _ = pods
    with _listen(app, "0.0.0.0", spec.inbound_port) as inbound:
        redirector["r"].set_inbound_listener(spec, inbound)
        assert redirector["r"].inspect(spec).inbound == "captured"
        with srv.socket() as client:
            client.settimeout(TIMEOUT)
            client.connect((app.ip, 8080))
            conn, peer = inbound.accept()
            with conn:
                assert conn.getsockname() == (app.ip, 8080)  # the original destination
                assert peer == (srv.ip, client.getsockname()[1])
    # the listener closed, so its map entry went with it: fail closed
    assert redirector["r"].inspect(spec).inbound == "no-listener"
    with srv.socket() as client:
        client.settimeout(TIMEOUT)
        with pytest.raises(ConnectionRefusedError):
            client.connect((app.ip, 8080))


@pytest.mark.parametrize("port", [4191, 4190, SKIP_IN])
def test_inbound_to_admin_and_skipped_ports_is_not_steered(pods, spec, redirector, port):
    _, app, srv, _ = pods
    with (
        _listen(app, "0.0.0.0", spec.inbound_port) as inbound,
        _listen(app, "0.0.0.0", port) as own,
    ):
        redirector["r"].set_inbound_listener(spec, inbound)
        with srv.socket() as client:
            client.settimeout(TIMEOUT)
            client.connect((app.ip, port))
            conn, _ = own.accept()
            conn.close()
        inbound.setblocking(False)
        with pytest.raises(BlockingIOError):
            inbound.accept()


@pytest.mark.parametrize(
    "mark", [PROXY_MARK, 0], ids=["proxy forwarding (marked)", "app to itself (unmarked)"]
)
def test_connection_from_pod_to_its_own_ip_reaches_the_app_not_the_inbound_listener(
    pods, spec, redirector, mark
):
    # The worker forwards inbound traffic to the app at the pod IP from inside the pod's
    # netns; sk_lookup must not steer that back into 4143 (a loop). The app dialling its
    # own IP is left alone too, as Linkerd's iptables (`-o lo` RETURN) leaves it.
    _, app, srv, _ = pods
    with (
        _listen(app, "0.0.0.0", spec.inbound_port) as inbound,
        _listen(app, app.ip, 8080) as real,
    ):
        redirector["r"].set_inbound_listener(spec, inbound)
        assert redirector["r"].inspect(spec).inbound == "captured"
        proc = _client(app, app.ip, 8080, mark=mark)
        conn, data = _serve_one(real, b"app")
        with conn:
            assert data == b"ping"
            assert conn.getpeername()[0] == app.ip  # the pod's own address, not loopback
        assert _finish(proc) == "app"
        inbound.setblocking(False)
        with pytest.raises(BlockingIOError):
            inbound.accept()
        # the same port from another netns is still captured: the pass is only for self
        with srv.socket() as client:
            client.settimeout(TIMEOUT)
            client.connect((app.ip, 8080))
            inbound.settimeout(TIMEOUT)
            steered, _ = inbound.accept()
            steered.close()


def test_pins_survive_a_reload(pods, spec, redirector, pin_root):
    _, app, srv, _ = pods
    old = redirector["r"]
    map_ids = _map_ids(pin_root)
    old.close()  # the agent exits: only pins hold programs, maps and links
    _check_outbound_captured(app, spec, srv)
    new = EbpfRedirector(pin_root=pin_root, accelerate=False)
    redirector["r"] = new
    new.enroll(spec)  # loads again; re-opens the pinned maps; moves links to its programs
    assert set(new.loaded_from.values()) == {"cache"}  # compiled by the first, at the latest
    assert _map_ids(pin_root) == map_ids
    links = new.inspect(spec).extra["links"]
    assert links["connect4"]["prog_id"] == maps.obj_id(new._fds["connect4"])
    _check_outbound_captured(app, spec, srv)


def test_inbound_falls_back_to_iptables_when_sk_lookup_is_unavailable(pods, pin_root):
    lb, *_ = pods
    pod = lb.pod(lb.node("n2"), "fb")
    fspec = CaptureSpec(pod="test/fb", netns=pod.netns, pod_ip=pod.ip, cgroup=pod.cgroup)
    r = EbpfRedirector(pin_root=pin_root, accelerate=False, use_sk_lookup=False)
    try:
        r.enroll(fspec)
        state = r.inspect(fspec)
        assert state.inbound == "fallback-iptables"
        assert state.outbound == "captured"
        assert "sk_lookup" not in state.extra["links"]
    finally:
        r.unenroll(fspec)
        r.close()
    assert r.inspect(fspec).inbound == "missing"


def test_a_new_pin_root_loads_every_program_from_the_cache_and_captures(pods, tmp_path):
    lb, _, srv, _ = pods
    pod = lb.pod(lb.node("n3"), "cached")
    cspec = CaptureSpec(pod="test/cached", netns=pod.netns, pod_ip=pod.ip, cgroup=pod.cgroup)
    cache = tmp_path / "cache"
    first_root, second_root = (Path(f"/sys/fs/bpf/meshagent-test-{os.getpid()}-{n}") for n in "cd")
    first = EbpfRedirector(pin_root=first_root, accelerate=False, cache_dir=cache)
    try:
        first.install()
        specs = _map_specs(first_root)
    finally:
        first.close()
        first.uninstall()
    assert set(first.loaded_from.values()) == {"compiled"}
    [entries] = cache.iterdir()
    assert sorted(p.name for p in entries.iterdir()) == sorted(
        f"{n}.json" for n in first.loaded_from
    )
    second = EbpfRedirector(pin_root=second_root, accelerate=False, cache_dir=cache)
    try:
        second.enroll(cspec)  # no map pinned yet: made from the entries' specs
        assert second.loaded_from == dict.fromkeys(first.loaded_from, "cache")
        assert _map_specs(second_root) == specs
        _check_outbound_captured(pod, cspec, srv)
    finally:
        second.unenroll(cspec)
        second.close()
        second.uninstall()
    assert not second_root.exists()


def _check_outbound_captured(pod, spec: CaptureSpec, srv) -> None:
    """A connect from `pod` to srv:8080 reaches its outbound listener, which reads the
    exact original destination, and the client gets the listener's answer."""
    with _listen(pod, "127.0.0.1", spec.outbound_port) as outbound:
        proc = _client(pod, srv.ip, 8080)
        conn, _ = _serve_one(outbound)
        with conn:
            assert original_dst(conn) == (srv.ip, 8080)
        assert _finish(proc) == "pong"


def _map_specs(pin_root: Path) -> dict[str, ebpf_cache.MapSpec]:
    out = {}
    for pin in sorted((pin_root / "maps").iterdir()):
        with maps.pinned(pin) as fd:
            assert fd is not None
            out[pin.name] = ebpf_cache.map_spec_of(fd)
    return out


def _map_ids(pin_root: Path) -> dict[str, int]:
    out = {}
    for name in maps.MAP_TYPES:
        if not (pin_root / "maps" / name).exists():
            continue  # sk_msg's own maps: pinned once acceleration loads it
        with maps.PinnedMap.open(pin_root / "maps", name) as m:
            out[name] = maps.obj_id(m.fd)
    return out


def test_maps_another_version_pinned_with_other_sizes_are_refused_before_any_program_loads():
    """An upgrade onto pins whose pod config is smaller (ABI 1's 280 bytes) is a clear
    error naming the map, not the verifier's "Permission denied"."""
    root = Path(f"/sys/fs/bpf/meshagent-test-abi-{os.getpid()}")
    (root / "maps").mkdir(parents=True)
    old = ebpf_cache.MapSpec(type=1, key_size=8, value_size=280, max_entries=16, flags=0)
    os.close(ebpf_cache._create_map(root / "maps" / maps.CFG_BY_NETNS, old))
    r = EbpfRedirector(pin_root=root, accelerate=False)
    try:
        with pytest.raises(PrerequisiteError, match="another meshagent version") as info:
            r.install()
        assert "ma_cfg_netns: key/value 8/280 bytes" in str(info.value)
        assert "MESHAGENT_BPF_PIN_ROOT" in info.value.hint
        assert not (root / "progs").exists() or not any((root / "progs").iterdir())
    finally:
        r.close()
        r.uninstall()
    assert not root.exists()


# --- opt-in same-node acceleration ---------------------------------------------------------


@pytest.fixture
def accelerated(redirector, spec):
    r = redirector["r"]
    r.accelerate = True
    r.enroll(spec)
    yield r
    r.accelerate = False
    r.enroll(spec)


BULK_CLIENT = textwrap.dedent(
    """
    import hashlib, socket, sys
    host, port, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    data = bytes(i % 251 for i in range(size))
    s = socket.create_connection((host, port), timeout=10)
    for _ in range(3):  # small request/response first, then bulk
        s.sendall(b"ping")
        assert s.recv(4) == b"pong"
    s.sendall(data)
    got = b""
    while len(got) < size:
        chunk = s.recv(65536)
        assert chunk
        got += chunk
    print(hashlib.sha256(data).hexdigest(), hashlib.sha256(got).hexdigest(), len(got))
    """
)


def test_accelerated_small_exchange_and_1mib_transfer_are_byte_exact(pods, spec, accelerated):
    _, app, srv, _ = pods
    size = 1 << 20
    with _listen(app, "127.0.0.1", spec.outbound_port) as outbound:
        proc = app.spawn(
            [sys.executable, "-c", BULK_CLIENT, srv.ip, "8080", str(size)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        conn, _ = outbound.accept()
        with conn:
            conn.settimeout(10)
            assert accelerated.inspect(spec).counters["accel_sockets"] == 2
            segs = _tcp_out_segs(app)
            for _ in range(3):
                assert _recv_exact(conn, 4) == b"ping"
                conn.sendall(b"pong")
            # redirected messages skip TCP: 3 round trips over TCP would send >= 6 segments
            assert _tcp_out_segs(app) - segs < 6
            echo = _recv_exact(conn, size)
            conn.sendall(echo)
        sent, received, n = _finish(proc).split()
    assert echo == bytes(i % 251 for i in range(size))
    assert (sent, int(n)) == (received, size)


def _tcp_out_segs(pod) -> int:
    def read() -> int:
        rows = [
            line.split()
            for line in Path("/proc/thread-self/net/snmp").read_text().splitlines()
            if line.startswith("Tcp:")
        ]
        return int(rows[1][rows[0].index("OutSegs")])

    return netns.run_in(pod.netns, read)


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = conn.recv(n - len(buf))
        assert chunk, f"eof after {len(buf)} of {n} bytes"
        buf += chunk
    return bytes(buf)


# Both ends of one connection, as processes in the pod: "listen" accepts one
# connection, "connect" makes it (optionally with the proxy mark). PINGS
# small ping/pongs, then each side sends SEND bytes of its own pattern in
# CHUNK-byte writes (a thread) while it reads RECV bytes after DELAY seconds.
# Prints the sha256 and length of what it read.
PEER = textwrap.dedent(
    """
    import hashlib, socket, sys, threading, time
    role, host, port, mark = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    send, recv, chunk = (int(a) for a in sys.argv[5:8])
    delay, pings = float(sys.argv[8]), int(sys.argv[9])
    def pattern(k, n):
        return bytes((i * k) % 251 for i in range(n))
    if role == "listen":
        fam = socket.AF_INET6 if ":" in host else socket.AF_INET
        ls = socket.socket(fam)
        ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if fam == socket.AF_INET6:
            ls.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        ls.bind((host, port))
        ls.listen(4)
        print("ready", flush=True)
        ls.settimeout(20)
        s, _ = ls.accept()
    else:
        s = socket.socket()
        if mark:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_MARK, mark)
        s.settimeout(20)
        s.connect((host, port))
    s.settimeout(60)
    for _ in range(pings):
        if role == "connect":
            s.sendall(b"ping"); assert s.recv(4) == b"pong"
        else:
            assert s.recv(4) == b"ping"; s.sendall(b"pong")
    data = pattern(1 if role == "connect" else 3, send)
    def writer():
        for i in range(0, len(data), chunk):
            s.sendall(data[i : i + chunk])
    t = threading.Thread(target=writer)
    t.start()
    time.sleep(delay)
    got = bytearray()
    while len(got) < recv:
        part = s.recv(1 << 16)
        assert part, f"eof after {len(got)} of {recv}"
        got += part
    t.join()
    print(hashlib.sha256(got).hexdigest(), len(got), flush=True)
    s.close()
    """
)
MIB8 = 8 << 20


def _pattern_digest(k: int, n: int) -> str:
    return hashlib.sha256(bytes((i * k) % 251 for i in range(n))).hexdigest()


def _peer(  # noqa: PLR0913 - one connection end's knobs
    pod,
    role: str,
    host: str,
    port: int,
    *,
    mark: int = 0,
    send: int,
    recv: int,
    chunk: int,
    delay: float = 0.0,
    pings: int = 3,
):
    args = [role, host, str(port), str(mark), str(send), str(recv), str(chunk), str(delay)]
    args.append(str(pings))
    proc = pod.spawn(
        [sys.executable, "-c", PEER, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    if role == "listen":
        assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
    return proc


def _result(proc) -> tuple[str, int]:
    out, err = proc.communicate(timeout=90)
    assert proc.returncode == 0, err[-2000:]
    digest, n = out.split()
    return digest, int(n)


def _stats_delta(before: dict[str, int], r) -> dict[str, int]:
    after = maps.accel_stats(r.maps_dir)
    return {k: after[k] - before[k] for k in after}


def test_accelerated_small_messages_are_redirected_both_ways(pods, spec, accelerated):
    _, app, srv, _ = pods
    before = maps.accel_stats(accelerated.maps_dir)
    listener = _peer(app, "listen", "127.0.0.1", spec.outbound_port, send=0, recv=0, chunk=1)
    client = _peer(app, "connect", srv.ip, 8080, send=0, recv=0, chunk=1)
    assert _result(client) == (_pattern_digest(1, 0), 0)
    _result(listener)
    delta = _stats_delta(before, accelerated)
    # 3 pings + 3 pongs went app -> outbound listener and back, none over TCP
    assert delta["redirected_msgs"] == 6
    assert delta["redirected_bytes"] == 24
    assert delta["passed_msgs"] == 0


@pytest.mark.parametrize(
    ("chunk", "switch"),
    [(4096, "none: both sides keep answering"), (65536, "off_size")],
)
def test_accelerated_8mib_both_ways_at_once_arrive_byte_exact(
    pods, spec, accelerated, chunk, switch
):
    _, app, srv, _ = pods
    before = maps.accel_stats(accelerated.maps_dir)
    listener = _peer(
        app, "listen", "127.0.0.1", spec.outbound_port, send=MIB8, recv=MIB8, chunk=chunk
    )
    client = _peer(app, "connect", srv.ip, 8080, send=MIB8, recv=MIB8, chunk=chunk)
    assert _result(client) == (_pattern_digest(3, MIB8), MIB8)
    assert _result(listener) == (_pattern_digest(1, MIB8), MIB8)
    delta = _stats_delta(before, accelerated)
    assert delta["redirected_msgs"] >= 6
    if switch == "off_size":
        assert delta["off_size"] == 2  # each end's first 64 KiB write took it to TCP
        assert delta["redirected_bytes"] < 2 * 16 * 1024 + 24
    else:
        assert delta["off_size"] == 0


def test_accelerated_one_way_bulk_to_a_slow_reader_goes_back_to_tcp(pods, spec, accelerated):
    """A reader that does not read yet: after 256 KiB unanswered the sender takes the TCP
    path (its window pushes back) instead of filling the reader's queue with 8 MiB."""
    _, app, srv, _ = pods
    before = maps.accel_stats(accelerated.maps_dir)
    listener = _peer(
        app, "listen", "127.0.0.1", spec.outbound_port, send=0, recv=MIB8, chunk=4096, delay=1.0
    )
    client = _peer(app, "connect", srv.ip, 8080, send=MIB8, recv=0, chunk=4096)
    assert _result(client) == (_pattern_digest(3, 0), 0)
    assert _result(listener) == (_pattern_digest(1, MIB8), MIB8)
    delta = _stats_delta(before, accelerated)
    assert delta["off_burst"] == 1
    assert delta["redirected_bytes"] <= 256 * 1024 + 24
    assert delta["passed_msgs"] > 1000


def test_accelerated_proxy_to_app_on_the_pod_ip_and_a_dual_stack_listener(pods, spec, accelerated):
    """The proxy's hop to the app: a marked socket from the pod IP to the pod IP, accepted
    by an app listening on [::] (its socket is AF_INET6 with v4-mapped addresses)."""
    _, app, _, _ = pods
    before = maps.accel_stats(accelerated.maps_dir)
    listener = _peer(app, "listen", "::", 8081, send=MIB8, recv=MIB8, chunk=4096)
    client = _peer(app, "connect", app.ip, 8081, mark=spec.mark, send=MIB8, recv=MIB8, chunk=4096)
    assert _result(client) == (_pattern_digest(3, MIB8), MIB8)
    assert _result(listener) == (_pattern_digest(1, MIB8), MIB8)
    delta = _stats_delta(before, accelerated)
    assert delta["off_no_peer"] == 0
    assert delta["redirected_bytes"] >= 24


SKIP_ACCEL = 8090


@pytest.fixture
def accelerated_skipping(redirector, spec):
    """Acceleration on, with `SKIP_ACCEL` in the pod's skip-accel-ports."""
    r = redirector["r"]
    skipping = dataclasses.replace(
        spec, skip_accel_ports=PortSet((PortRange(SKIP_ACCEL, SKIP_ACCEL),))
    )
    r.accelerate = True
    r.enroll(skipping)
    yield r, skipping
    r.accelerate = False
    r.enroll(spec)


def _exchange(app, spec, host: str, port: int, *, mark: int = 0, at=None) -> None:  # noqa: PLR0913
    """Three pings and pongs from `app` to host:port, answered by a listener at `at`
    (default: the outbound listener the connection is redirected to)."""
    listen_host, listen_port = at or ("127.0.0.1", spec.outbound_port)
    listener = _peer(app, "listen", listen_host, listen_port, send=0, recv=0, chunk=1)
    client = _peer(app, "connect", host, port, mark=mark, send=0, recv=0, chunk=1)
    assert _result(client) == (_pattern_digest(1, 0), 0)
    _result(listener)


def test_skip_accel_ports_keep_those_connections_on_tcp_and_accelerate_the_rest(
    pods, accelerated_skipping
):
    """The app's connection to a skipped destination port, redirected to the outbound
    listener, and the proxy's marked connection to the app on a skipped port both stay on
    TCP; the same exchanges on another port are redirected (the control)."""
    _, app, srv, _ = pods
    r, spec = accelerated_skipping
    assert f"accel:{SKIP_ACCEL}" in r.inspect(spec).skipped_ports
    for host, mark, at in (
        (srv.ip, 0, None),  # app -> 127.0.0.1:4140, judged by the original destination
        (app.ip, spec.mark, ("::", None)),  # proxy -> app on the pod IP
    ):
        counted = {}
        for port in (SKIP_ACCEL, SKIP_ACCEL + 1):
            before = maps.accel_stats(r.maps_dir)
            listen_at = (at[0], port) if at else None
            _exchange(app, spec, host, port, mark=mark, at=listen_at)
            counted[port] = _stats_delta(before, r)
        assert counted[SKIP_ACCEL]["redirected_msgs"] == 0, (host, counted)
        assert counted[SKIP_ACCEL]["passed_msgs"] == 0, (host, counted)  # no sk_msg at all
        assert counted[SKIP_ACCEL + 1]["redirected_msgs"] == 6, (host, counted)


def _settled_sweeper(r, queues=None) -> accel_sweep.Sweeper:
    """A sweeper past what earlier tests left, its next tick due."""
    sweeper = accel_sweep.Sweeper(r.maps_dir, queues)
    sweeper.tick()
    time.sleep(accel_sweep.TICK_S)
    return sweeper


def _ends_on_port(r, port: int) -> int:
    """How many socket ends of connections to or from `port` ma_accel_socks holds."""
    return _entries_on_port(r, maps.ACCEL_SOCKS, port)


def _wait_for(cond, what: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_sweep_returns_a_one_way_senders_end_to_plain_tcp_and_loses_nothing(
    pods, spec, accelerated
):
    """The sender switches off at its first 64 KiB write; its peer never sent. Two ticks
    later the sender's end is out of the sockhash (plain TCP) while the reader has not read
    a byte yet, and the reader still gets all 8 MiB in order."""
    _, app, srv, _ = pods
    sweeper = _settled_sweeper(accelerated)
    port = spec.outbound_port
    before = maps.accel_stats(accelerated.maps_dir)
    listener = _peer(
        app, "listen", "127.0.0.1", port, send=0, recv=MIB8, chunk=4096, delay=2.0, pings=0
    )
    client = _peer(app, "connect", srv.ip, 8080, send=MIB8, recv=0, chunk=65536, pings=0)
    _wait_for(lambda: _stats_delta(before, accelerated)["off_size"] == 1, "no switch-off")
    assert _ends_on_port(accelerated, port) == 2
    assert sweeper.tick() == 0  # first tick: the reader's end is switched off
    time.sleep(accel_sweep.TICK_S)
    assert sweeper.tick() == 1
    assert _ends_on_port(accelerated, port) == 1  # the reader (still asleep) keeps its end
    assert listener.poll() is None
    assert _result(client) == (_pattern_digest(3, 0), 0)
    assert _result(listener) == (_pattern_digest(1, MIB8), MIB8)
    delta = _stats_delta(before, accelerated)
    assert delta["returned"] == 1
    assert delta["redirected_msgs"] == 0


def test_sweep_without_a_queue_reader_leaves_ends_whose_peer_redirected_into_them(
    pods, spec, accelerated
):
    """Ping/pongs first: each end redirected into the other. Without reading their queues
    neither is known to be empty, so both stay in the sockhash (tcp_bpf's path) for life."""
    _, app, srv, _ = pods
    sweeper = _settled_sweeper(accelerated)
    port = spec.outbound_port
    before = maps.accel_stats(accelerated.maps_dir)
    listener = _peer(app, "listen", "127.0.0.1", port, send=MIB8, recv=MIB8, chunk=65536, delay=1.0)
    client = _peer(app, "connect", srv.ip, 8080, send=MIB8, recv=MIB8, chunk=65536)
    _wait_for(lambda: _stats_delta(before, accelerated)["off_size"] == 2, "no switch-offs")
    for _ in range(3):
        assert sweeper.tick() == 0
        time.sleep(accel_sweep.TICK_S)
    assert _ends_on_port(accelerated, port) == 2
    assert _entries_on_port(accelerated, maps.ACCEL_SENT, port) == 2
    assert _result(client) == (_pattern_digest(3, MIB8), MIB8)
    assert _result(listener) == (_pattern_digest(1, MIB8), MIB8)
    assert _stats_delta(before, accelerated)["returned"] == 0
    # closed: sockops dropped both ends' records (TCP_CLOSE), and they left the sockhash
    for name in (maps.ACCEL_SENT, maps.ACCEL_STATE, maps.ACCEL_SOCKS):
        _wait_for(lambda n=name: _entries_on_port(accelerated, n, port) == 0, f"{name} kept")


def _queues(spec) -> accel_sweep.sockqueue.Queues:
    place = accel_sweep.sockqueue.Place(netns=spec.netns, cgroup=spec.cgroup)
    return accel_sweep.sockqueue.Queues(lambda: [place], list)


def _client_end_in(r, port: int) -> bool:
    """Whether the connecting end of a connection to `port` is in ma_accel_socks."""
    with r.open_map(maps.ACCEL_SOCKS) as m:
        return any(k.remote_port == port for k in m.key_list())


@pytest.mark.skipif(not accel_sweep.sockqueue.supported(), reason="FIONREAD counts TCP only")
def test_sweep_waits_until_redirected_bytes_are_read_then_returns_both_ends(
    pods, spec, accelerated
):
    """The listener's 5-byte hello is redirected into the client's queue; the client sends
    8 MiB (switched off at its first 64 KiB write) and reads the hello only after 1.5 s,
    the listener its 8 MiB only after 3 s. Until 1.5 s the sweep leaves the client's end in
    the sockhash (its queue is not empty: taking it out would drop the hello); once read,
    the end goes. The listener's goes at once: the client never redirected into it."""
    _, app, srv, _ = pods
    sweeper = _settled_sweeper(accelerated, _queues(spec))
    port = spec.outbound_port
    before = maps.accel_stats(accelerated.maps_dir)
    listener = _peer(
        app, "listen", "127.0.0.1", port, send=5, recv=MIB8, chunk=5, delay=3.0, pings=0
    )
    client = _peer(app, "connect", srv.ip, 8080, send=MIB8, recv=5, chunk=65536, delay=1.5, pings=0)
    _wait_for(lambda: _stats_delta(before, accelerated)["off_size"] == 1, "no switch-off")
    started = time.monotonic()
    for _ in range(3):
        sweeper.tick()
        time.sleep(accel_sweep.TICK_S)
    assert time.monotonic() - started < 1.2  # the client has not read its hello yet
    assert _client_end_in(accelerated, port)
    assert _ends_on_port(accelerated, port) == 1  # the listener's end went
    _wait_for(lambda: sweeper.tick() >= 0 and not _client_end_in(accelerated, port), "kept")
    assert time.monotonic() - started < 2.8  # out before the listener read: not by a close
    assert listener.poll() is None
    assert _result(client) == (_pattern_digest(3, 5), 5)
    assert _result(listener) == (_pattern_digest(1, MIB8), MIB8)
    delta = _stats_delta(before, accelerated)
    assert delta["redirected_bytes"] == 5
    assert delta["returned"] == 2


def _entries_on_port(r, name: str, port: int) -> int:
    with r.open_map(name) as m:
        return sum(1 for k in m.key_list() if port in (k.local_port, k.remote_port))


# --- keep last: removes everything --------------------------------------------------------


def test_unenroll_and_uninstall_leave_no_program_map_link_or_pin(pods, spec, redirector, pin_root):
    r = redirector["r"]
    r.unenroll(spec)
    assert not r.pod_dir(spec).exists()
    state = r.inspect(spec)
    assert (state.inbound, state.outbound) == ("missing", "missing")
    assert state.counters["links"] == 0
    r.uninstall()
    assert not pin_root.exists()
    # The kernel frees a detached program when its last reference goes, which may be after
    # uninstall returns (CI saw ma_getsockopt listed once, right after); maps go when the
    # programs that used them are freed, after an RCU grace period.
    deadline = time.monotonic() + 10
    while (_ours("prog") or _ours("map")) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _ours("prog") == []
    assert _ours("map") == []
    cgroup_ino = spec.cgroup.stat().st_ino
    netns_ino = spec.netns.stat().st_ino
    assert [i for i in _link_infos() if i.target in (cgroup_ino, netns_ino)] == []


def _ours(kind: str) -> list[str]:
    names = []
    for obj_id in maps.object_ids(kind):
        try:
            fd = maps.fd_by_id(kind, obj_id)
        except maps.BpfError:
            continue  # freed meanwhile
        try:
            info = maps.obj_info(fd)
        finally:
            os.close(fd)
        offset = 64 if kind == "prog" else 24
        name = info[offset : offset + 16].split(b"\0")[0].decode()
        if name.startswith("ma_"):
            names.append(name)
    return names


def _link_infos() -> list[maps.LinkInfo]:
    out = []
    for link_id in maps.object_ids("link"):
        try:
            fd = maps.fd_by_id("link", link_id)
        except maps.BpfError:
            continue
        try:
            out.append(maps.LinkInfo.of(fd))
        finally:
            os.close(fd)
    return out
