"""The bench's Python floor relay (agent.bench.floor) over real sockets on 127.0.0.1.

It is a bench peer, so only its behaviour is tested: keep-alive requests come
back unchanged, a broken request closes that connection only, SIGTERM stops
every process it forked; two floors chained by mutual TLS relay requests, and
a peer without the right certificate or name gets nothing through.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from typing import TYPE_CHECKING

import psutil
import pytest

from agent import aio
from agent.bench import server
from agent.bench.mesh import free_port
from agent.bench.peers import SERVER_NAME, make_certs

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path

HOST = "127.0.0.1"


@pytest.fixture
def upstream() -> Iterator[int]:
    """The bench server on a thread's loop; its port."""
    port = free_port()
    ready = threading.Event()
    loop_and_stop: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        loop_and_stop.append((loop, stop))
        accepted: list[server._Server] = []

        def factory() -> server._Server:
            accepted.append(server._Server())
            return accepted[-1]

        srv = await loop.create_server(factory, HOST, port, reuse_address=True)
        ready.set()
        async with srv:
            await stop.wait()
        # Close what the relay left open before the loop closes: an EOF handled while
        # the loop closes would leave a transport behind (uvloop: EBUSY on close).
        for conn in accepted:
            if conn.transport is not None:
                conn.transport.close()
        await asyncio.sleep(0.05)

    t = threading.Thread(target=lambda: aio.run(run()), daemon=True)
    t.start()
    assert ready.wait(5)
    try:
        yield port
    finally:
        loop, stop = loop_and_stop[0]
        loop.call_soon_threadsafe(stop.set)
        t.join(5)


@contextlib.contextmanager
def _floor(target: int, *tls: str) -> Iterator[tuple[int, subprocess.Popen[bytes]]]:
    """`agent.bench.floor` listening on a free port, relaying to `target`; (port, process)."""
    port = free_port()
    argv = [sys.executable, "-m", "agent.bench.floor", f"{HOST}:{port}", f"{HOST}:{target}"]
    proc = subprocess.Popen([*argv, *tls])
    try:
        for _ in range(100):
            try:
                socket.create_connection((HOST, port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.05)
        yield port, proc
    finally:
        if proc.poll() is None:
            for child in psutil.Process(proc.pid).children(recursive=True):
                child.kill()
            proc.kill()
        proc.wait(5)


@pytest.fixture
def floor(upstream: int) -> Iterator[tuple[int, subprocess.Popen[bytes]]]:
    with _floor(upstream) as got:
        yield got


def _get(sock: socket.socket, path: bytes) -> bytes:
    sock.sendall(b"GET " + path + b" HTTP/1.1\r\nHost: floor\r\n\r\n")
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(4096)
        assert chunk, "connection closed"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    while len(body) < length:
        body += sock.recv(4096)
    return head.split(b"\r\n", 1)[0]


def test_keepalive_requests_are_relayed_and_a_broken_one_closes_only_its_connection(
    floor: tuple[int, subprocess.Popen[bytes]],
) -> None:
    port, _ = floor
    good = socket.create_connection((HOST, port), timeout=5)
    bad = socket.create_connection((HOST, port), timeout=5)
    try:
        for i in range(5):
            assert _get(good, b"/k%d" % i) == b"HTTP/1.1 200 OK"
        bad.sendall(b"NOT HTTP AT ALL\x00\r\n\r\n")
        assert bad.recv(4096) == b""  # closed by the relay
        assert _get(good, b"/after") == b"HTTP/1.1 200 OK"
    finally:
        good.close()
        bad.close()


def test_sigterm_stops_the_relay_and_every_process_it_forked(
    floor: tuple[int, subprocess.Popen[bytes]],
) -> None:
    _, proc = floor
    children = psutil.Process(proc.pid).children(recursive=True)
    assert len(children) == 1  # two workers by default: the parent and one fork
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(10) == 0
    gone, alive = psutil.wait_procs(children, timeout=5)
    assert not alive
    assert len(gone) == 1


def test_two_floors_relay_over_mutual_tls(upstream: int, tmp_path: Path) -> None:
    server_tls, client_tls = make_certs(tmp_path)
    listen = ["--cert", server_tls.cert, "--ca", server_tls.ca, "--tls-listen"]
    connect = ["--cert", client_tls.cert, "--ca", client_tls.ca, "--tls-connect", SERVER_NAME]
    with _floor(upstream, *listen) as (tls_port, _), _floor(tls_port, *connect) as (port, _):
        sock = socket.create_connection((HOST, port), timeout=5)
        try:
            for i in range(5):
                assert _get(sock, b"/tls%d" % i) == b"HTTP/1.1 200 OK"
        finally:
            sock.close()
        # Straight to the TLS side: answered with a client certificate, refused without.
        with_cert = ssl.create_default_context(cafile=server_tls.ca)
        with_cert.load_cert_chain(client_tls.cert)
        assert _tls_answer(tls_port, with_cert) == b"HTTP/1.1 200 OK"
        without = ssl.create_default_context(cafile=server_tls.ca)
        assert _tls_answer(tls_port, without) is None


def _tls_answer(port: int, ctx: ssl.SSLContext) -> bytes | None:
    """The status line a TLS GET to `port` gets, or None when refused (alert or close)."""
    try:
        with (
            socket.create_connection((HOST, port), timeout=5) as raw,
            ctx.wrap_socket(raw, server_hostname=SERVER_NAME) as tls,
        ):
            tls.sendall(b"GET / HTTP/1.1\r\nHost: floor\r\n\r\n")
            data = tls.recv(4096)
    except (ssl.SSLError, ConnectionError):
        return None
    return data.split(b"\r\n", 1)[0] if data else None


def test_a_floor_expecting_another_name_relays_nothing(upstream: int, tmp_path: Path) -> None:
    server_tls, client_tls = make_certs(tmp_path)
    listen = ["--cert", server_tls.cert, "--ca", server_tls.ca, "--tls-listen"]
    connect = ["--cert", client_tls.cert, "--ca", client_tls.ca, "--tls-connect", "other.local"]
    with _floor(upstream, *listen) as (tls_port, _), _floor(tls_port, *connect) as (port, _):
        sock = socket.create_connection((HOST, port), timeout=5)
        try:
            sock.sendall(b"GET / HTTP/1.1\r\nHost: floor\r\n\r\n")
            assert sock.recv(4096) == b""  # the handshake failed: the client is closed
        finally:
            sock.close()


def test_tls_without_certificates_is_a_usage_error() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "agent.bench.floor", f"{HOST}:1", f"{HOST}:2", "--tls-listen"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 2
    assert "--tls-listen and --tls-connect need --cert and --ca" in done.stderr
