"""The bench's topology and setups: who sits between the client pod and the server.

Topology (one `agent.netlab.Lab`): two isolated nodes `a` and `b`, linked;
pods `cli` and `srv` on `a`, `srv2` on `b`. `srv` and `srv2` run the bench
server (`agent.bench.server`, :8080) and `iperf3 -s` (:5201).

Setups (each a context manager yielding a `Target`):
    direct, direct-xnode          client -> server, no proxy
    haproxy-tcp, haproxy-http     HAProxy in the client pod's netns (the
                                  position of meshagent's outbound listener)
    haproxy-tls                   HAProxy in `cli` -> mTLS -> HAProxy in `srv2`
    python-floor                  `agent.bench.floor` where HAProxy runs: the
                                  least a Python relay does (HTTP loads only)
    meshagent-{iptables,ebpf}     `meshagent run` on `a` meshing `cli`, `srv`:
                                  outbound -> same-node inbound, no TLS
    meshagent-{mode}-xnode        `meshagent run` on `a` (cli) and on `b`
                                  (srv2): outbound -> mTLS -> inbound
    meshagent-ebpf-accel          as meshagent-ebpf, the agent run with
                                  MESHAGENT_EBPF_ACCEL=1 (sockops + sk_msg
                                  between same-node socket pairs)
All meshagent setups share one `meshagent controlplane` (`agent.bench.mesh`);
bench pods are lab pods named `pod<UID>` so the agents discover them.

Rules:
1. Every meshagent setup starts its agents through `start_node_agent`, the one
   place that knows how a node agent is started.
2. Only processes started here are stopped, by their Popen; the lab kills
   whatever is left when it closes.
3. `Target.proxy_pids()` lists the processes whose CPU and memory are the
   proxy's (HAProxy processes, node agent and its workers), read when asked:
   workers may be replaced.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil

from agent import config
from agent.bench import haproxy
from agent.bench.mesh import BenchPod, MeshPlane, NodeAgent, make_pod
from agent.errors import AgentError
from agent.redirect import netns

if TYPE_CHECKING:
    from agent.netlab import Lab, LabNode, LabPod

logger = logging.getLogger(__name__)

HTTP_PORT = 8080
IPERF_PORT = 5201
PROXY_HTTP_PORT = 18080  # HAProxy listeners in the client pod
PROXY_IPERF_PORT = 15201
TLS_HTTP_PORT = 18443  # HAProxy mTLS listeners in the server pod
TLS_IPERF_PORT = 15443
SERVER_NAME = "srv2.bench.local"
FLOOR_WORKERS = 2  # as many processes as the node agent has workers
ENV_ACCEL = "MESHAGENT_EBPF_ACCEL"  # agent.redirect.ebpf.ENV_ACCEL (bcc stays out of the bench)
POD_SYSCTLS = {
    "net/ipv4/tcp_tw_reuse": "1",
    "net/ipv4/ip_local_port_range": "1024 65000",
    # Not ephemeral: a conn-rate load leaves thousands of TIME_WAIT client ports, and one on
    # the agent's listener port makes the next agent's listen there fail (EADDRINUSE) for 60 s.
    "net/ipv4/ip_local_reserved_ports": f"{config.OUTBOUND_PORT},{config.INBOUND_PORT}",
    "net/core/somaxconn": "4096",
}


class BenchError(AgentError):
    """A setup could not be started."""

    def __init__(self, setup: str, reason: str) -> None:
        self.setup = setup
        self.reason = reason
        super().__init__(f"bench setup {setup}: {reason}")


@dataclass(slots=True, kw_only=True)
class Target:
    """Where the client sends its load in one setup, and whose CPU is the proxy's."""

    setup: str
    client: LabPod
    host: str
    http_port: int
    iperf_port: int
    hops: int
    mtls: bool
    roots: list[int] = field(default_factory=list)  # proxy PIDs; their children count too
    notes: str = ""
    http_aware: bool = True  # can it carry HTTP loads
    h2: bool = True  # can it carry HTTP/2 (prior knowledge)
    agents: list[NodeAgent] = field(default_factory=list)  # meshagent setups: the node agents
    accel_maps: Path | None = None  # accelerated eBPF setups: the agent's pinned maps

    def accel_counts(self) -> dict[str, int] | None:
        """The node's sk_msg counters (`agent.redirect.maps.accel_stats`), or None."""
        if self.accel_maps is None:
            return None
        from agent.redirect import maps  # noqa: PLC0415 - libbpf only when accelerating

        try:
            return maps.accel_stats(self.accel_maps)
        except maps.BpfError:
            return None

    def proxy_pids(self) -> list[int]:
        pids: list[int] = []
        for pid in self.roots:
            with contextlib.suppress(psutil.Error):
                proc = psutil.Process(pid)
                pids.append(pid)
                pids += [c.pid for c in proc.children(recursive=True)]
        return pids


@dataclass(slots=True, kw_only=True)
class Topology:
    lab: Lab
    a: LabNode
    b: LabNode
    cli: LabPod
    srv: LabPod
    srv2: LabPod
    workdir: Path
    mesh: MeshPlane


def _sysctls(pod: LabPod) -> None:
    def write() -> None:
        for key, value in POD_SYSCTLS.items():
            with contextlib.suppress(OSError):
                Path("/proc/sys", key).write_text(value)

    netns.run_in(pod.netns, write)


def _wait_port(pod: LabPod, host: str, port: int, within: float = 10.0) -> None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        sock = pod.socket()
        try:
            sock.settimeout(0.5)
            sock.connect((host, port))
        except OSError:
            time.sleep(0.05)
        else:
            return
        finally:
            sock.close()
    raise BenchError(pod.name, f"nothing listens on {host}:{port} after {within}s")


def build_topology(lab: Lab, workdir: Path) -> Topology:
    """Nodes, pods, servers (see the module docstring).

    Raises:
        LabError: the lab could not create them.
        BenchError: a server did not start.
    """
    a = lab.node("a", isolated=True)
    b = lab.node("b", isolated=True)
    lab.link(a, b)
    topo = Topology(
        lab=lab,
        a=a,
        b=b,
        cli=make_pod(lab, a, "cli"),
        srv=make_pod(lab, a, "srv"),
        srv2=make_pod(lab, b, "srv2"),
        workdir=workdir,
        mesh=MeshPlane(workdir=workdir),
    )
    ports = (HTTP_PORT, IPERF_PORT)
    topo.mesh.add(
        [
            BenchPod(role="cli", node=a.name, ip=topo.cli.ip),
            BenchPod(role="srv", node=a.name, ip=topo.srv.ip, ports=ports),
            BenchPod(role="srv2", node=b.name, ip=topo.srv2.ip, ports=ports),
        ]
    )
    # a process in cli from the start: node agents find pods by their processes
    topo.cli.spawn(["sleep", "86400"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for pod in (topo.cli, topo.srv, topo.srv2):
        _sysctls(pod)
    for pod in (topo.srv, topo.srv2):
        pod.spawn(
            [sys.executable, "-m", "agent.bench.server", "--port", str(HTTP_PORT)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        pod.spawn(
            ["iperf3", "-s", "-p", str(IPERF_PORT)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
    for pod in (topo.srv, topo.srv2):
        _wait_port(topo.cli, pod.ip, HTTP_PORT)
        _wait_port(topo.cli, pod.ip, IPERF_PORT)
    return topo


# --- node agent -------------------------------------------------------------------


def start_node_agent(  # noqa: PLR0913 - keyword-only settings
    topo: Topology,
    roles: list[str],
    mode: str,
    *,
    node: str,
    name: str,
    workers: int = 2,
    accel: bool = False,
) -> NodeAgent:
    """Start `meshagent run` on lab node `node` meshing the bench pods `roles` (mode:
    iptables|ebpf), with the run's shared control plane; returns once it is ready.
    `accel` runs an eBPF agent with MESHAGENT_EBPF_ACCEL=1; every other eBPF agent
    runs with it off, whatever the caller's environment says.

    Raises:
        MeshError: it exited or did not become ready within 60 s.
    """
    level = os.environ.get("MESHAGENT_BENCH_AGENT_LOG", "warning")
    env = {ENV_ACCEL: "1" if accel else "0"} if mode == "ebpf" else {}
    return topo.mesh.start_agent(
        roles, mode, node=node, name=name, workers=workers, log_level=level, env=env
    )


def _wait_http(pod: LabPod, host: str, port: int, within: float = 20.0) -> float:
    """Send GETs from `pod` until one answers 200; seconds the first answer took.

    Raises:
        BenchError: none did within `within`.
    """
    deadline = time.monotonic() + within
    last = ""
    while time.monotonic() < deadline:
        sock = pod.socket()
        try:
            sock.settimeout(5)
            started = time.monotonic()
            sock.connect((host, port))
            sock.sendall(b"GET / HTTP/1.1\r\nHost: bench\r\nConnection: close\r\n\r\n")
            data = sock.recv(4096)
            if data.startswith(b"HTTP/1.1 200"):
                return time.monotonic() - started
            last = data[:80].decode(errors="replace")
        except OSError as exc:
            last = str(exc)
        finally:
            sock.close()
        time.sleep(0.1)
    raise BenchError(pod.name, f"no 200 from {host}:{port} within {within}s (last: {last!r})")


# --- HAProxy ------------------------------------------------------------------------


def _haproxy(pod: LabPod, routes: list[haproxy.Route], path: Path) -> subprocess.Popen[Any]:
    path.write_text(haproxy.render(routes))
    check = subprocess.run(
        ["haproxy", "-c", "-f", str(path)], capture_output=True, text=True, check=False
    )
    if check.returncode != 0:
        raise BenchError("haproxy", f"config {path} rejected: {check.stderr[-1000:]}")
    return pod.spawn(
        ["haproxy", "-db", "-f", str(path)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )


def _stop(proc: subprocess.Popen[Any]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)


def make_certs(directory: Path) -> tuple[haproxy.TlsFiles, haproxy.TlsFiles]:
    """A bench CA and two ECDSA P-256 leaves (server `SERVER_NAME`, client): (server, client)."""
    from cryptography import x509  # noqa: PLC0415
    from cryptography.hazmat.primitives import hashes, serialization  # noqa: PLC0415
    from cryptography.hazmat.primitives.asymmetric import ec  # noqa: PLC0415
    from cryptography.x509.oid import NameOID  # noqa: PLC0415

    now = dt.datetime.now(dt.UTC)

    def cert(name: str, key: Any, issuer: Any, issuer_key: Any, *, ca: bool) -> x509.Certificate:
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(issuer)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if not ca:
            builder = builder.add_extension(
                x509.SubjectAlternativeName([x509.DNSName(name)]), critical=False
            )
        return builder.sign(issuer_key, hashes.SHA256())

    def pem(c: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> bytes:
        return c.public_bytes(serialization.Encoding.PEM) + key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "bench-ca")])
    ca_cert = cert("bench-ca", ca_key, ca_name, ca_key, ca=True)
    (directory / "ca.crt").write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    out = []
    for name in (SERVER_NAME, "client.bench.local"):
        key = ec.generate_private_key(ec.SECP256R1())
        path = directory / f"{name}.pem"
        path.write_bytes(pem(cert(name, key, ca_name, ca_key, ca=False), key))
        out.append(haproxy.TlsFiles(cert=str(path), ca=str(directory / "ca.crt")))
    return out[0], out[1]


# --- setups ----------------------------------------------------------------------------

SetupFn = Callable[[Topology], contextlib.AbstractContextManager[Target]]


@contextlib.contextmanager
def direct(topo: Topology) -> Iterator[Target]:
    yield Target(
        setup="direct",
        client=topo.cli,
        host=topo.srv.ip,
        http_port=HTTP_PORT,
        iperf_port=IPERF_PORT,
        hops=0,
        mtls=False,
    )


@contextlib.contextmanager
def direct_xnode(topo: Topology) -> Iterator[Target]:
    yield Target(
        setup="direct-xnode",
        client=topo.cli,
        host=topo.srv2.ip,
        http_port=HTTP_PORT,
        iperf_port=IPERF_PORT,
        hops=0,
        mtls=False,
    )


def _haproxy_one_hop(mode: str) -> SetupFn:
    @contextlib.contextmanager
    def setup(topo: Topology) -> Iterator[Target]:
        routes = [
            haproxy.Route(
                name="http",
                bind=f"127.0.0.1:{PROXY_HTTP_PORT}",
                target=f"{topo.srv.ip}:{HTTP_PORT}",
                mode=mode,
            )
        ]
        if mode == "tcp":
            routes.append(
                haproxy.Route(
                    name="iperf",
                    bind=f"127.0.0.1:{PROXY_IPERF_PORT}",
                    target=f"{topo.srv.ip}:{IPERF_PORT}",
                )
            )
        proc = _haproxy(topo.cli, routes, topo.workdir / f"haproxy-{mode}.cfg")
        try:
            _wait_port(topo.cli, "127.0.0.1", PROXY_HTTP_PORT)
            yield Target(
                setup=f"haproxy-{mode}",
                client=topo.cli,
                host="127.0.0.1",
                http_port=PROXY_HTTP_PORT,
                iperf_port=PROXY_IPERF_PORT if mode == "tcp" else 0,
                hops=1,
                mtls=False,
                roots=[proc.pid],
            )
        finally:
            _stop(proc)

    return setup


@contextlib.contextmanager
def python_floor(topo: Topology) -> Iterator[Target]:
    """The minimal Python relay (`agent.bench.floor`) where HAProxy runs: the Python floor."""
    argv = [sys.executable, "-m", "agent.bench.floor", f"127.0.0.1:{PROXY_HTTP_PORT}"]
    argv += [f"{topo.srv.ip}:{HTTP_PORT}", "--workers", str(FLOOR_WORKERS)]
    proc = topo.cli.spawn(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_port(topo.cli, "127.0.0.1", PROXY_HTTP_PORT)
        yield Target(
            setup="python-floor",
            client=topo.cli,
            host="127.0.0.1",
            http_port=PROXY_HTTP_PORT,
            iperf_port=0,
            hops=1,
            mtls=False,
            roots=[proc.pid],
            notes="minimal uvloop + httptools relay, 1:1 upstreams, no mesh work",
            h2=False,
        )
    finally:
        _stop(proc)


@contextlib.contextmanager
def haproxy_tls(topo: Topology) -> Iterator[Target]:
    server_tls, client_tls = make_certs(topo.workdir)
    out = [
        haproxy.Route(
            name=name,
            bind=f"127.0.0.1:{port}",
            target=f"{topo.srv2.ip}:{tls_port}",
            target_tls=client_tls,
            sni=SERVER_NAME,
        )
        for name, port, tls_port in (
            ("http", PROXY_HTTP_PORT, TLS_HTTP_PORT),
            ("iperf", PROXY_IPERF_PORT, TLS_IPERF_PORT),
        )
    ]
    inb = [
        haproxy.Route(
            name=name,
            bind=f"0.0.0.0:{tls_port}",
            target=f"127.0.0.1:{port}",
            bind_tls=server_tls,
        )
        for name, port, tls_port in (
            ("http", HTTP_PORT, TLS_HTTP_PORT),
            ("iperf", IPERF_PORT, TLS_IPERF_PORT),
        )
    ]
    server_side = _haproxy(topo.srv2, inb, topo.workdir / "haproxy-tls-server.cfg")
    try:
        client_side = _haproxy(topo.cli, out, topo.workdir / "haproxy-tls-client.cfg")
        try:
            _wait_port(topo.srv2, "127.0.0.1", TLS_HTTP_PORT)
            _wait_port(topo.cli, "127.0.0.1", PROXY_HTTP_PORT)
            yield Target(
                setup="haproxy-tls",
                client=topo.cli,
                host="127.0.0.1",
                http_port=PROXY_HTTP_PORT,
                iperf_port=PROXY_IPERF_PORT,
                hops=2,
                mtls=True,
                roots=[client_side.pid, server_side.pid],
                notes="mode tcp, mutual TLS 1.3 (P-256) between the two HAProxies",
            )
        finally:
            _stop(client_side)
    finally:
        _stop(server_side)


def _meshagent(mode: str, *, xnode: bool, accel: bool = False) -> SetupFn:
    @contextlib.contextmanager
    def setup(topo: Topology) -> Iterator[Target]:
        flavour = f"{mode}-accel" if accel else mode
        name = f"meshagent-{flavour}" + ("-xnode" if xnode else "")
        with contextlib.ExitStack() as stack:
            if xnode:
                plan = [(["cli"], topo.a.name), (["srv2"], topo.b.name)]
                server = topo.srv2
            else:
                plan = [(["cli", "srv"], topo.a.name)]
                server = topo.srv
            agents = []
            for roles, node in plan:
                agent = start_node_agent(
                    topo, roles, mode, node=node, name=f"{flavour}-{node}", accel=accel
                )
                stack.callback(agent.stop)
                agents.append(agent)
            # the first request pays for resolution (and, cross-node, the mTLS handshake)
            first = _wait_http(topo.cli, server.ip, HTTP_PORT)
            _wait_port(topo.cli, server.ip, IPERF_PORT)
            path = "outbound -> mTLS -> inbound (other node)" if xnode else "outbound -> inbound"
            if accel:
                path += "; sockops + sk_msg acceleration on (MESHAGENT_EBPF_ACCEL=1)"
            yield Target(
                setup=name,
                client=topo.cli,
                host=server.ip,
                http_port=HTTP_PORT,
                iperf_port=IPERF_PORT,
                hops=2,
                mtls=xnode,
                roots=[a.pid for a in agents],
                agents=agents,
                accel_maps=(agents[0].pin_root / "maps" if accel and agents[0].pin_root else None),
                notes=(
                    f"meshagent run ({mode}, 2 workers per node): {path}; "
                    f"first request {first * 1000:.0f} ms"
                ),
            )

    return setup


SETUPS: dict[str, SetupFn] = {
    "direct": direct,
    "haproxy-tcp": _haproxy_one_hop("tcp"),
    "haproxy-http": _haproxy_one_hop("http"),
    "python-floor": python_floor,
    "meshagent-iptables": _meshagent("iptables", xnode=False),
    "meshagent-ebpf": _meshagent("ebpf", xnode=False),
    "meshagent-ebpf-accel": _meshagent("ebpf", xnode=False, accel=True),
    "direct-xnode": direct_xnode,
    "haproxy-tls": haproxy_tls,
    "meshagent-iptables-xnode": _meshagent("iptables", xnode=True),
    "meshagent-ebpf-xnode": _meshagent("ebpf", xnode=True),
}


def new_workdir(base: Path | None = None) -> Path:
    """A fresh directory for configs, certificates and agent logs."""
    return Path(tempfile.mkdtemp(prefix="meshagent-bench-", dir=base))


def remove_workdir(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
