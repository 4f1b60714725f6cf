"""The bench's topology: one pod lab, its pods tuned for load, the servers in them.

One `agent.netlab.Lab`: two isolated nodes `a` and `b`, linked; pods `cli` and
`srv` on `a`, `srv2` on `b`. `srv` and `srv2` run the bench server
(`agent.bench.server`, :8080, :8081 outside the mesh: `SIDE_PORT`, and :8082 meshed
but never accelerated: `PLAIN_PORT`; its echo ports the same three ways, :7080, :7081
and :7082: rule 8) and `iperf3 -s` (:5201). Bench pods are lab pods
named `pod<UID>` (`agent.bench.mesh.make_pod`) so node agents discover them.
Also here: `Target`, what every setup (`agent.bench.setups`) yields, and
`BenchError`, what a setup raises when it cannot start.

Rules:
1. `build_topology` returns only once both servers answer on every port, seen
   from `cli`; every pod gets `POD_SYSCTLS` first.
2. A pod's sysctls are written from a thread inside its netns (/proc/sys/net
   follows the thread's netns); one the kernel refuses is skipped.
3. `Target.proxy_pids()` lists the processes whose CPU and memory are the
   proxy's (its roots and all their children), read when asked: workers may be
   replaced.
4. Each simulated node's proxies get that node's share of the machine: every
   proxy instance on a path over N nodes (HAProxy's threads, the floor's
   processes, a node agent's workers) runs `per_node(N)` of them, the
   machine's CPUs divided by N. Two nodes on one machine are two machines'
   proxies squeezed onto its CPUs: with a full set of workers each, the
   cross-node path ran twice as many proxy processes as CPUs, and each switch
   between them cost (bench/RESULTS.md, twentieth pass).
5. Each simulated node runs on its own CPUs (`placed`, the run's `--placement
   split`, the default): on a path over N nodes, node `a` (the client, the
   outbound proxy) gets the first 1/N of the machine's CPUs and node `b` (the
   far proxy, its server) the next, for every setup alike; a path over one node
   gets them all. Processes a node's pods and agent start inherit its CPUs;
   the servers already running are moved. Without it (`--placement shared`)
   the scheduler runs either node's processes on any CPU, so a node's proxy
   can use the time the other node leaves idle, which two machines never lend
   each other: it flattered the cross-node h2 path, whose nodes wait on each
   other's batches, by about an eighth (bench/RESULTS.md, twenty-eighth pass).
6. The pods' manifests keep the side-by-side peers (agent.bench.harness rule 10)
   out of the mesh: `cli` skips outbound `SIDE_PORT`, `PROXY_HTTP_PORT`,
   `TLS_HTTP_PORT` and the L7 peer's pair (`SIDE_L7_HTTP_PORT`,
   `SIDE_L7_TLS_PORT`), `srv` skips inbound `SIDE_PORT`, `srv2` inbound
   `SIDE_PORT`, `TLS_HTTP_PORT` (haproxy-tls's hop) and `SIDE_L7_TLS_PORT` (the L7
   peer's), so a node agent meshes `HTTP_PORT` only while the peers run beside it.
7. `cli` and `srv` skip `PLAIN_PORT` in sockmap acceleration (skip-accel-ports):
   meshed like `HTTP_PORT`, never accelerated, the plain path sockmap's
   side-by-side loads compare with. Without acceleration it is `HTTP_PORT`'s twin.
8. The servers' echo ports (agent.bench.server rule 4) mirror those three for the
   opaque TCP side-by-side loads (`tcp-side-N`, agent.bench.harness rule 10):
   `ECHO_PORT` meshed and accelerated, `ECHO_SIDE_PORT` skipped as `SIDE_PORT` is
   (cli outbound, srv and srv2 inbound), `ECHO_PLAIN_PORT` in cli's and srv's
   skip-accel-ports as `PLAIN_PORT` is. srv's and srv2's manifests name the two meshed
   ones in `config.linkerd.io/opaque-ports`, so the control plane's profile and
   policy say opaque and the node agent relays them byte for byte, with no protocol
   detection (its metrics count TCP connections to them, no HTTP requests).
9. Twin pods for the peers measured in turns with a meshagent setup
   (`saturate-side`, agent.bench.harness rule 10): `pcli` and `psrv` on `a`, `psrv2`
   on `b`, named so no node agent discovers them and in no manifest, the bench
   server (:8080 only) in `psrv` and `psrv2`; built for runs that have that load
   (`build_topology(..., twins=)`). `twin(topo)` is the topology with them in
   `cli`, `srv` and `srv2`'s places, so a peer setup started on it is the one measured
   alone, in pods no capture touches: an iptables capture's REDIRECT turns on
   connection tracking for its whole pod, and a peer in the meshed pods paid it on
   every packet (haproxy-http 16% and haproxy-tls 19% slower saturated in turns there;
   tried instead: raw-table NOTRACK rules for the peers' ports, a match on every
   packet of both paths, and both ran 7-20% below their rates alone:
   bench/RESULTS.md, fifty-sixth pass).
10. A setup is started when a request through its whole path is answered
   (`wait_answer`), not when its listeners are up: a hop that drops or refuses
   behind a listening proxy shows as no requests and no errors in a short turn
   (HAProxy holds the client while it retries a refused server for 3 s), which
   read as a peer that measured nothing rather than one that could not start.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil

from agent import config
from agent.bench.mesh import BenchPod, MeshPlane, NodeAgent, make_pod
from agent.errors import AgentError
from agent.redirect import netns
from agent.redirect.annotations import (
    OPAQUE_PORTS,
    SKIP_ACCEL_PORTS,
    SKIP_INBOUND_PORTS,
    SKIP_OUTBOUND_PORTS,
)

if TYPE_CHECKING:
    from agent.netlab import Lab, LabNode, LabPod

HTTP_PORT = 8080
# The servers' second port, outside the mesh: the pods' manifests skip it (cli's
# outbound, srv's and srv2's inbound), so the side-by-side loads (agent.bench.harness
# rule 10, `peers.side_peers`) reach the same server process directly and through
# HAProxy while a node agent meshes HTTP_PORT.
SIDE_PORT = 8081
# The servers' third port: meshed, but the pods' manifests leave it out of eBPF
# sockmap acceleration (`config.meshagent.io/skip-accel-ports`, cli's and srv's), so
# sockmap's side-by-side loads run its accelerated path (HTTP_PORT) and the plain one
# on one node agent, taking turns (agent.bench.harness rule 10).
PLAIN_PORT = 8082
# The servers' echo ports (rule 8), the three above's twins for opaque TCP: meshed and
# accelerated, outside the mesh, meshed but never accelerated.
ECHO_PORT = 7080
ECHO_SIDE_PORT = 7081
ECHO_PLAIN_PORT = 7082
ECHO_PORTS = (ECHO_PORT, ECHO_SIDE_PORT, ECHO_PLAIN_PORT)
IPERF_PORT = 5201
PROXY_HTTP_PORT = 18080  # HAProxy's (and the floor's) listeners in the client pod
PROXY_IPERF_PORT = 15201
TLS_HTTP_PORT = 18443  # HAProxy's mTLS listeners in the server pod
# The L7 peer's pair when it runs beside haproxy-tls (cross-node side by side, rule 6)
SIDE_L7_HTTP_PORT = 18081
SIDE_L7_TLS_PORT = 18444
TLS_IPERF_PORT = 15443
# Every port a setup listens on: the agent's, the servers', the peers'.
LISTEN_PORTS = tuple(
    sorted(
        (
            config.OUTBOUND_PORT,
            config.INBOUND_PORT,
            HTTP_PORT,
            SIDE_PORT,
            PLAIN_PORT,
            *ECHO_PORTS,
            IPERF_PORT,
            PROXY_HTTP_PORT,
            PROXY_IPERF_PORT,
            TLS_HTTP_PORT,
            TLS_IPERF_PORT,
            SIDE_L7_HTTP_PORT,
            SIDE_L7_TLS_PORT,
        )
    )
)
POD_SYSCTLS = {
    "net/ipv4/tcp_tw_reuse": "1",
    "net/ipv4/ip_local_port_range": "1024 65000",
    # Not ephemeral: a conn-rate load leaves tens of thousands of TIME_WAIT client ports,
    # and one on a listener port makes the next setup's listen there fail (EADDRINUSE; its
    # SO_REUSEADDR does not help, the client had none) for 60 s. At 8,000 connections/s
    # the next HAProxy met one on 18080 in most rounds.
    "net/ipv4/ip_local_reserved_ports": ",".join(map(str, LISTEN_PORTS)),
    "net/core/somaxconn": "4096",
}


def per_node(nodes: int) -> int:
    """Workers (threads, processes) of each proxy instance on a path over `nodes` nodes (rule 4)."""
    return max(1, len(os.sched_getaffinity(0)) // nodes)


def split_cpus(cpus: Collection[int], nodes: int) -> list[frozenset[int]]:
    """The CPUs of each of `nodes` nodes (rule 5): consecutive equal shares of `cpus` in
    order, `per_node`'s count each (the remainder unused); every node gets all of them
    when there are fewer CPUs than nodes.

    Raises:
        ValueError: no CPUs, or fewer than one node.
    """
    if not cpus or nodes < 1:
        raise ValueError(f"cannot split CPUs {sorted(cpus)} over {nodes} nodes")
    ordered = sorted(cpus)
    share = len(ordered) // nodes
    if share == 0:
        return [frozenset(ordered)] * nodes
    return [frozenset(ordered[i * share : (i + 1) * share]) for i in range(nodes)]


@contextlib.contextmanager
def placed(topo: Topology, nodes: int) -> Iterator[None]:
    """Nodes `a` and `b` on their CPUs for a path over `nodes` nodes, then anywhere again
    (rule 5). A path over one node gives `a` all of them, and `b`, idle, too.

    Raises:
        LabError: a pod could not be placed.
    """
    shares = split_cpus(os.sched_getaffinity(0), nodes)
    try:
        topo.lab.place(topo.a, shares[0])
        topo.lab.place(topo.b, shares[-1])
        yield
    finally:
        topo.lab.place(topo.a, None)
        topo.lab.place(topo.b, None)


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
    echo_port: int = 0  # the server's echo port on this path (rule 8), 0: none
    agents: list[NodeAgent] = field(default_factory=list)  # meshagent setups: the node agents
    accel_maps: Path | None = None  # accelerated eBPF setups: the agent's pinned maps
    logs: list[Path] = field(default_factory=list)  # its processes' stderr (peers)

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
    """The lab, its two nodes and three pods, the work directory, the shared control plane."""

    lab: Lab
    a: LabNode
    b: LabNode
    cli: LabPod
    srv: LabPod
    srv2: LabPod
    workdir: Path
    mesh: MeshPlane
    # rule 9's twins, outside the mesh (None: a topology built without them)
    peer_cli: LabPod | None = None
    peer_srv: LabPod | None = None
    peer_srv2: LabPod | None = None


def twin(topo: Topology) -> Topology:
    """`topo` with rule 9's twin pods in the meshed pods' places.

    Raises:
        BenchError: `topo` was built without them.
    """
    if topo.peer_cli is None or topo.peer_srv is None or topo.peer_srv2 is None:
        raise BenchError("saturate-side", "the topology has no twin pods for the peers")
    return dataclasses.replace(
        topo, cli=topo.peer_cli, srv=topo.peer_srv, srv2=topo.peer_srv2, peer_cli=None
    )


SetupFn = Callable[[Topology], contextlib.AbstractContextManager[Target]]


def tune_pod(pod: LabPod) -> None:
    """Write `POD_SYSCTLS` in `pod`'s netns (rule 2)."""

    def write() -> None:
        for key, value in POD_SYSCTLS.items():
            with contextlib.suppress(OSError):
                Path("/proc/sys", key).write_text(value)

    netns.run_in(pod.netns, write)


WAIT_PORT_S = 10.0  # a setup's listener is up within this, or the setup failed


def wait_port(
    pod: LabPod,
    host: str,
    port: int,
    *,
    proc: subprocess.Popen[Any] | None = None,
    log: Path | None = None,
) -> None:
    """Return once `host:port` accepts a connection from `pod`. Given the process that
    should listen there (`proc`) and where its stderr goes (`log`), stop waiting when it
    exits, and say why in the error: its exit status and the end of its log.

    Raises:
        BenchError: nothing did within `WAIT_PORT_S`, or `proc` exited first.
    """
    within = WAIT_PORT_S
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise BenchError(
                pod.name,
                f"{_name(proc)} exited with {proc.returncode} before it listened on "
                f"{host}:{port}{log_tail(log)}",
            )
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
    raise BenchError(pod.name, f"nothing listens on {host}:{port} after {within}s{log_tail(log)}")


WAIT_ANSWER_S = 20.0  # a setup's path answers a request within this, or it failed


def wait_answer(
    pod: LabPod, host: str, port: int, *, within: float = WAIT_ANSWER_S, logs: Collection[Path] = ()
) -> float:
    """Send GETs from `pod` to `host:port` until one is answered 200; the seconds the
    answered one took (the first request pays for resolution and handshakes). A path
    whose listeners are up may still not carry a request (rule 10).

    Raises:
        BenchError: none was within `within`; it says what the last one got, and the
            end of each of `logs` (the setup's processes' stderr).
    """
    deadline = time.monotonic() + within
    last = ""
    while time.monotonic() < deadline:
        sock = pod.socket()
        try:
            sock.settimeout(min(5.0, max(0.1, deadline - time.monotonic())))
            started = time.monotonic()
            sock.connect((host, port))
            sock.sendall(b"GET / HTTP/1.1\r\nHost: bench\r\nConnection: close\r\n\r\n")
            data = sock.recv(4096)
            if data.startswith(b"HTTP/1.1 200"):
                return time.monotonic() - started
            last = data[:80].decode(errors="replace") if data else "closed without an answer"
        except OSError as exc:
            last = str(exc) or type(exc).__name__
        finally:
            sock.close()
        time.sleep(0.1)
    tails = "".join(log_tail(log) for log in logs)
    said = f"no 200 from {host}:{port} within {within}s (last: {last!r})"
    raise BenchError(pod.name, said + tails)


def _name(proc: subprocess.Popen[Any]) -> str:
    """The program `proc` runs, past a wrapper's `--` (`LabPod.spawn`'s nsenter)."""
    args = [str(a) for a in proc.args] if isinstance(proc.args, list | tuple) else [str(proc.args)]
    if "--" in args[:-1]:
        args = args[len(args) - args[::-1].index("--") :]
    return Path(args[0]).name if args else "?"


def log_tail(log: Path | None, size: int = 600) -> str:
    """`; its log: ...` with the end of `log`, or nothing when there is none or it is empty."""
    if log is None or not log.exists():
        return ""
    text = log.read_text(errors="replace").strip()
    return f"; its log ({log}): {text[-size:]}" if text else ""


def build_topology(lab: Lab, workdir: Path, *, twins: bool = True) -> Topology:
    """Nodes, pods, servers (see the module docstring); rule 9's twin pods when `twins`
    (a run without `saturate-side` has no use for them).

    Raises:
        LabError: the lab could not create them.
        BenchError: a server did not start.
    """
    a = lab.node("a", isolated=True)
    b = lab.node("b", isolated=True)
    lab.link(a, b)
    pcli, psrv, psrv2 = _twin_pods(lab, a, b) if twins else (None, None, None)
    topo = Topology(
        lab=lab,
        a=a,
        b=b,
        cli=make_pod(lab, a, "cli"),
        srv=make_pod(lab, a, "srv"),
        srv2=make_pod(lab, b, "srv2"),
        workdir=workdir,
        mesh=MeshPlane(workdir=workdir),
        peer_cli=pcli,
        peer_srv=psrv,
        peer_srv2=psrv2,
    )
    ports = (HTTP_PORT, PLAIN_PORT, ECHO_PORT, ECHO_PLAIN_PORT, IPERF_PORT)
    # the side-by-side peers' ports stay outside the mesh: the server's second port (and
    # its echo twin), and across nodes haproxy-tls's hop from cli to its listener in srv2
    # (rule 6); the third port (and its echo twin) is meshed but never accelerated
    # (rule 7); the meshed echo ports are opaque (rule 8)
    plain = (SKIP_ACCEL_PORTS, _ports(PLAIN_PORT, ECHO_PLAIN_PORT))
    opaque = (OPAQUE_PORTS, _ports(ECHO_PORT, ECHO_PLAIN_PORT))
    peers_out = (SIDE_PORT, PROXY_HTTP_PORT, TLS_HTTP_PORT, SIDE_L7_HTTP_PORT, SIDE_L7_TLS_PORT)
    skip_out = ((SKIP_OUTBOUND_PORTS, _ports(*peers_out, ECHO_SIDE_PORT)), plain)
    skip_in = ((SKIP_INBOUND_PORTS, _ports(SIDE_PORT, ECHO_SIDE_PORT)), plain, opaque)
    peers_in2 = (SIDE_PORT, TLS_HTTP_PORT, SIDE_L7_TLS_PORT, ECHO_SIDE_PORT)
    skip_in2 = ((SKIP_INBOUND_PORTS, _ports(*peers_in2)), opaque)
    topo.mesh.add(
        [
            BenchPod(role="cli", node=a.name, ip=topo.cli.ip, annotations=skip_out),
            BenchPod(role="srv", node=a.name, ip=topo.srv.ip, ports=ports, annotations=skip_in),
            BenchPod(role="srv2", node=b.name, ip=topo.srv2.ip, ports=ports, annotations=skip_in2),
        ]
    )
    # a process in cli from the start: node agents find pods by their processes
    topo.cli.spawn(["sleep", "86400"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for pod in (topo.cli, topo.srv, topo.srv2):
        tune_pod(pod)
    server = [sys.executable, "-m", "agent.bench.server"]
    for pod in (topo.srv, topo.srv2):
        argv = [*server, *(f"--port={port}" for port in (HTTP_PORT, SIDE_PORT, PLAIN_PORT))]
        argv += [f"--echo-port={port}" for port in ECHO_PORTS]
        pod.spawn(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        pod.spawn(
            ["iperf3", "-s", "-p", str(IPERF_PORT)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
    for pod in (topo.srv, topo.srv2):
        for port in (HTTP_PORT, SIDE_PORT, PLAIN_PORT, *ECHO_PORTS, IPERF_PORT):
            wait_port(topo.cli, pod.ip, port)
    return topo


def _twin_pods(lab: Lab, a: LabNode, b: LabNode) -> tuple[LabPod, LabPod, LabPod]:
    """Rule 9's pods (`pcli`, `psrv`, `psrv2`), tuned, their servers answering."""
    pcli, psrv, psrv2 = lab.pod(a, "pcli"), lab.pod(a, "psrv"), lab.pod(b, "psrv2")
    for pod in (pcli, psrv, psrv2):
        tune_pod(pod)
    server = [sys.executable, "-m", "agent.bench.server", f"--port={HTTP_PORT}"]
    for pod in (psrv, psrv2):
        pod.spawn(server, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for pod in (psrv, psrv2):
        wait_port(pcli, pod.ip, HTTP_PORT)
    return pcli, psrv, psrv2


def _ports(*ports: int) -> str:
    """An annotation's port list: `8081,7081`."""
    return ",".join(map(str, ports))


def new_workdir(base: Path | None = None) -> Path:
    """A fresh directory for configs, certificates and agent logs."""
    return Path(tempfile.mkdtemp(prefix="meshagent-bench-", dir=base))


def remove_workdir(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
