"""The bench's peer setups: no proxy, HAProxy, and the Python floor, where meshagent would sit.

    direct, direct-xnode          client -> server, no proxy
    haproxy-tcp, haproxy-http     HAProxy in the client pod's netns (the
                                  position of meshagent's outbound listener)
    haproxy-tls                   HAProxy in `cli` -> mTLS -> HAProxy in `srv2`
                                  (certificates from `make_certs`), mode tcp
    haproxy-tls-h1, haproxy-tls-h2
                                  the same two hops in mode http (parsed on
                                  both, as the mesh's proxies do), HTTP/1.1 or
                                  h2 between them
    python-floor                  `agent.bench.floor` where HAProxy runs: the
                                  least a Python relay does (HTTP loads only)
    python-floor-tls              the floor where haproxy-tls runs: floor in
                                  `cli` -> mTLS -> floor in `srv2`

Each setup is a context manager over an `agent.bench.topology.Topology`
yielding a `Target`; `agent.bench.setups.SETUPS` names them.

Rules:
1. A setup yields only once its proxies listen (seen from the pod that
   connects to them: across nodes the client pod to the far proxy too) and a
   request through them is answered (topology rule 10), and stops them, by their
   Popen, when it exits; the lab kills whatever is left when it closes. Their
   stderr (HAProxy's abnormal connections: `agent.bench.haproxy` rule 3) is the
   `Target`'s `logs`.
2. HAProxy configurations are rendered by `agent.bench.haproxy` and checked
   with `haproxy -c` before HAProxy starts.
3. Certificates are made per run in the work directory (ECDSA P-256, valid a
   day); cryptography is imported only when they are made.
4. HAProxy's threads and the floor's processes: `topology.per_node` of the
   nodes their path spans (topology rule 4), as many as a node agent's workers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import subprocess
import sys
from typing import TYPE_CHECKING, Any

from agent.bench import haproxy
from agent.bench.topology import (
    ECHO_PLAIN_PORT,
    ECHO_PORT,
    ECHO_SIDE_PORT,
    HTTP_PORT,
    IPERF_PORT,
    PLAIN_PORT,
    PROXY_HTTP_PORT,
    PROXY_IPERF_PORT,
    SIDE_L7_HTTP_PORT,
    SIDE_L7_TLS_PORT,
    SIDE_PORT,
    TLS_HTTP_PORT,
    TLS_IPERF_PORT,
    BenchError,
    SetupFn,
    Target,
    Topology,
    per_node,
    wait_answer,
    wait_port,
)

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path

    from agent.netlab import LabPod

SERVER_NAME = "srv2.bench.local"


def _haproxy(
    pod: LabPod, routes: list[haproxy.Route], path: Path, *, nodes: int
) -> subprocess.Popen[Any]:
    path.write_text(haproxy.render(routes, threads=per_node(nodes)))
    check = subprocess.run(
        ["haproxy", "-c", "-f", str(path)], capture_output=True, text=True, check=False
    )
    if check.returncode != 0:
        raise BenchError("haproxy", f"config {path} rejected: {check.stderr[-1000:]}")
    return _spawn_logged(pod, ["haproxy", "-db", "-f", str(path)], log_of(path))


def log_of(path: Path) -> Path:
    """Where the peer started from config `path` (or named `path`) writes its stderr."""
    return path.with_suffix(".log")


def _spawn_logged(pod: LabPod, argv: list[str], log: Path) -> subprocess.Popen[Any]:
    """`argv` in `pod`, its stderr appended to `log`: a peer that cannot listen says why
    there, and `wait_port` quotes it."""
    with log.open("ab") as err:
        return pod.spawn(argv, stdout=subprocess.DEVNULL, stderr=err)


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


def _direct(
    setup: str, topo: Topology, host: str, port: int = HTTP_PORT, echo_port: int = ECHO_PORT
) -> Target:
    """The client straight to the server at `host`: no proxy."""
    return Target(
        setup=setup,
        client=topo.cli,
        host=host,
        http_port=port,
        echo_port=echo_port,
        iperf_port=IPERF_PORT,
        hops=0,
        mtls=False,
    )


@contextlib.contextmanager
def direct(topo: Topology) -> Iterator[Target]:
    yield _direct("direct", topo, topo.srv.ip)


@contextlib.contextmanager
def direct_xnode(topo: Topology) -> Iterator[Target]:
    yield _direct("direct-xnode", topo, topo.srv2.ip)


def haproxy_one_hop(mode: str, server_port: int = HTTP_PORT) -> SetupFn:
    """haproxy-`mode` (tcp|http): one HAProxy in `cli` in front of `srv`'s `server_port`
    (iperf too for tcp)."""

    @contextlib.contextmanager
    def setup(topo: Topology) -> Iterator[Target]:
        routes = [
            haproxy.Route(
                name="http",
                bind=f"127.0.0.1:{PROXY_HTTP_PORT}",
                target=f"{topo.srv.ip}:{server_port}",
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
        cfg = topo.workdir / f"haproxy-{mode}.cfg"
        proc = _haproxy(topo.cli, routes, cfg, nodes=1)
        try:
            wait_port(topo.cli, "127.0.0.1", PROXY_HTTP_PORT, proc=proc, log=log_of(cfg))
            wait_answer(topo.cli, "127.0.0.1", PROXY_HTTP_PORT, logs=[log_of(cfg)])
            yield Target(
                setup=f"haproxy-{mode}",
                client=topo.cli,
                host="127.0.0.1",
                http_port=PROXY_HTTP_PORT,
                iperf_port=PROXY_IPERF_PORT if mode == "tcp" else 0,
                hops=1,
                mtls=False,
                roots=[proc.pid],
                logs=[log_of(cfg)],
            )
        finally:
            _stop(proc)

    return setup


@contextlib.contextmanager
def side_peers(topo: Topology, *, cross: str | None) -> Iterator[list[Target]]:
    """The peers a meshagent setup is measured beside, taking turns (agent.bench.harness
    rule 10), while its node agents mesh `HTTP_PORT`: to the server's `SIDE_PORT`, which
    the mesh skips (topology rule 6), `direct` and `haproxy-http` on one node (`srv`);
    across nodes (`srv2`) `direct-xnode`, `haproxy-tls` and the L7 peer `cross` names
    (`h1` or `h2` between its hops: agent.bench.report rule 8) on its own ports."""
    if cross is not None:
        l7 = haproxy_two_hop(cross, SIDE_PORT, (SIDE_L7_HTTP_PORT, SIDE_L7_TLS_PORT))
        with haproxy_two_hop("tcp", SIDE_PORT)(topo) as proxy, l7(topo) as l7_proxy:
            direct = _direct("direct-xnode", topo, topo.srv2.ip, SIDE_PORT, ECHO_SIDE_PORT)
            yield [direct, proxy, l7_proxy]
        return
    with haproxy_one_hop("http", SIDE_PORT)(topo) as proxy:
        yield [_direct("direct", topo, topo.srv.ip, SIDE_PORT, ECHO_SIDE_PORT), proxy]


@contextlib.contextmanager
def accel_side_peers(
    topo: Topology, accelerated: Target, plain_setup: str
) -> Iterator[list[Target]]:
    """The peers sockmap's setup is measured beside (agent.bench.harness rule 10): `direct`
    to the server's `SIDE_PORT` (`ECHO_SIDE_PORT` for echo), and its own node agent's
    plain path, named `plain_setup`: `accelerated`'s client and server on `PLAIN_PORT`
    (`ECHO_PLAIN_PORT`), which the mesh meshes and acceleration skips (topology rules 7
    and 8)."""
    plain = dataclasses.replace(
        accelerated,
        setup=plain_setup,
        http_port=PLAIN_PORT,
        echo_port=ECHO_PLAIN_PORT,
        roots=[],
        agents=[],
        accel_maps=None,
    )
    yield [_direct("direct", topo, topo.srv.ip, SIDE_PORT, ECHO_SIDE_PORT), plain]


def _floor(  # noqa: PLR0913 - where it runs, listens, forwards, its TLS, workers and log
    pod: LabPod, listen: str, target: str, tls: list[str], *, nodes: int, log: Path
) -> subprocess.Popen[Any]:
    argv = [sys.executable, "-m", "agent.bench.floor", listen, target]
    argv += ["--workers", str(per_node(nodes)), *tls]
    return _spawn_logged(pod, argv, log)


@contextlib.contextmanager
def python_floor(topo: Topology) -> Iterator[Target]:
    """The minimal Python relay (`agent.bench.floor`) where HAProxy runs: the Python floor."""
    log = log_of(topo.workdir / "python-floor")
    proc = _floor(
        topo.cli,
        f"127.0.0.1:{PROXY_HTTP_PORT}",
        f"{topo.srv.ip}:{HTTP_PORT}",
        [],
        nodes=1,
        log=log,
    )
    try:
        wait_port(topo.cli, "127.0.0.1", PROXY_HTTP_PORT, proc=proc, log=log)
        wait_answer(topo.cli, "127.0.0.1", PROXY_HTTP_PORT, logs=[log])
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
            logs=[log],
        )
    finally:
        _stop(proc)


@contextlib.contextmanager
def python_floor_tls(topo: Topology) -> Iterator[Target]:
    """The floor on haproxy-tls's two hops: `cli` -> mutual TLS 1.3 -> `srv2` -> server."""
    server_tls, client_tls = make_certs(topo.workdir)
    server_log = log_of(topo.workdir / "python-floor-tls-server")
    client_log = log_of(topo.workdir / "python-floor-tls-client")
    server_side = _floor(
        topo.srv2,
        f"0.0.0.0:{TLS_HTTP_PORT}",
        f"127.0.0.1:{HTTP_PORT}",
        ["--cert", server_tls.cert, "--ca", server_tls.ca, "--tls-listen"],
        nodes=2,
        log=server_log,
    )
    try:
        client_side = _floor(
            topo.cli,
            f"127.0.0.1:{PROXY_HTTP_PORT}",
            f"{topo.srv2.ip}:{TLS_HTTP_PORT}",
            ["--cert", client_tls.cert, "--ca", client_tls.ca, "--tls-connect", SERVER_NAME],
            nodes=2,
            log=client_log,
        )
        try:
            wait_port(topo.srv2, "127.0.0.1", TLS_HTTP_PORT, proc=server_side, log=server_log)
            wait_port(topo.cli, "127.0.0.1", PROXY_HTTP_PORT, proc=client_side, log=client_log)
            wait_port(topo.cli, topo.srv2.ip, TLS_HTTP_PORT)  # the hop across nodes
            logs = [client_log, server_log]
            wait_answer(topo.cli, "127.0.0.1", PROXY_HTTP_PORT, logs=logs)
            yield Target(
                setup="python-floor-tls",
                client=topo.cli,
                host="127.0.0.1",
                http_port=PROXY_HTTP_PORT,
                iperf_port=0,
                hops=2,
                mtls=True,
                roots=[client_side.pid, server_side.pid],
                notes="the floor on both hops, mutual TLS 1.3 (P-256), OpenSSL on the socket",
                h2=False,
                logs=logs,
            )
        finally:
            _stop(client_side)
    finally:
        _stop(server_side)


def haproxy_two_hop(
    between: str,
    server_port: int = HTTP_PORT,
    listen: tuple[int, int] = (PROXY_HTTP_PORT, TLS_HTTP_PORT),
) -> SetupFn:
    """HAProxy in `cli` -> mutual TLS 1.3 -> HAProxy in `srv2` -> the server's
    `server_port` (iperf too for tcp on `HTTP_PORT`; the side-by-side peers on
    `SIDE_PORT` carry HTTP only), listening on `listen`'s ports: cli's, srv2's TLS one
    (the L7 peer beside haproxy-tls takes its own pair).

    `between`: `tcp` (haproxy-tls) relays bytes, iperf3 too: what mTLS alone
    costs. `h1` (haproxy-tls-h1) and `h2` (haproxy-tls-h2) run `mode http` on both
    hops, parsing every request and response as the mesh's outbound and inbound
    do, with HTTP/1.1 or h2 (ALPN) on the kept-alive TLS connections between
    them: the L7 peers of the `-h1-xnode` setups and of the ones that upgrade to
    h2 between the proxies (auto, on).
    """
    name = "haproxy-tls" if between == "tcp" else f"haproxy-tls-{between}"
    mode = "tcp" if between == "tcp" else "http"
    alpn = "h2" if between == "h2" else ""
    # (route, the app's port in srv2, the client-side listener, the TLS listener)
    ports = [("http", server_port, *listen)]
    if mode == "tcp" and server_port == HTTP_PORT:
        ports.append(("iperf", IPERF_PORT, PROXY_IPERF_PORT, TLS_IPERF_PORT))

    @contextlib.contextmanager
    def setup(topo: Topology) -> Iterator[Target]:
        server_tls, client_tls = make_certs(topo.workdir)
        out = [
            haproxy.Route(
                name=route,
                bind=f"127.0.0.1:{port}",
                target=f"{topo.srv2.ip}:{tls_port}",
                mode=mode,
                target_tls=client_tls,
                sni=SERVER_NAME,
                alpn=alpn,
            )
            for route, _, port, tls_port in ports
        ]
        inb = [
            haproxy.Route(
                name=route,
                bind=f"0.0.0.0:{tls_port}",
                target=f"127.0.0.1:{app_port}",
                mode=mode,
                bind_tls=server_tls,
                alpn=alpn,
            )
            for route, app_port, _, tls_port in ports
        ]
        server_cfg = topo.workdir / f"{name}-server.cfg"
        client_cfg = topo.workdir / f"{name}-client.cfg"
        server_side = _haproxy(topo.srv2, inb, server_cfg, nodes=2)
        try:
            client_side = _haproxy(topo.cli, out, client_cfg, nodes=2)
            try:
                server_log, client_log = log_of(server_cfg), log_of(client_cfg)
                wait_port(topo.srv2, "127.0.0.1", listen[1], proc=server_side, log=server_log)
                wait_port(topo.cli, "127.0.0.1", listen[0], proc=client_side, log=client_log)
                wait_port(topo.cli, topo.srv2.ip, listen[1])  # the hop across nodes
                logs = [client_log, server_log]
                wait_answer(topo.cli, "127.0.0.1", listen[0], logs=logs)
                yield Target(
                    setup=name,
                    client=topo.cli,
                    host="127.0.0.1",
                    http_port=listen[0],
                    iperf_port=PROXY_IPERF_PORT if len(ports) > 1 else 0,
                    hops=2,
                    mtls=True,
                    roots=[client_side.pid, server_side.pid],
                    notes=(
                        f"mode {mode}, mutual TLS 1.3 (P-256) between the two HAProxies"
                        + (f", {between} on it" if mode == "http" else "")
                    ),
                    logs=logs,
                )
            finally:
                _stop(client_side)
        finally:
            _stop(server_side)

    return setup


haproxy_tls = haproxy_two_hop("tcp")
haproxy_tls_h1 = haproxy_two_hop("h1")
haproxy_tls_h2 = haproxy_two_hop("h2")
