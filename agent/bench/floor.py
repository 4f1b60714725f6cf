"""The bench's Python floor: the least an HTTP/1.1 relay in Python can do per request.

`python -m agent.bench.floor LISTEN TARGET [--workers N]` runs N uvloop
processes sharing LISTEN (SO_REUSEPORT). Each accepted connection gets its
own upstream connection to TARGET (1:1, opened at accept); bytes are
forwarded unchanged both ways; httptools parses requests and responses only
to find where messages end, and each response that ends is counted with its
latency in a plain dict, the minimum a mesh proxy records. No routing,
policy, pooling, balancing or header work.

With `--cert PEM --ca CA` it speaks mutual TLS 1.3 on one side, with
OpenSSL on the socket (`agent.bench.floortls`, the cheapest TLS Python has):
`--tls-listen` terminates it (a client certificate signed by CA required),
`--tls-connect SNI` originates it (the server must present SNI). One of
each, in the client's pod and in the server's, is the two-hop floor that
stands beside `haproxy-tls` (the bench setup `python-floor-tls`).

The issue's yardstick (a relay like this reached HAProxy's HTTP rate on this
kind of machine): the bench setup `python-floor` runs it where HAProxy runs,
so the report shows how much of the gap between meshagent and HAProxy is
Python itself and how much is the mesh's work.

Rules:
1. Only a bench peer: nothing of the proxy uses it, it uses nothing of the
   proxy.
2. A connection whose upstream cannot be reached is closed; a parse error
   closes that connection only.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import ssl
import sys
import time
from dataclasses import dataclass

import httptools
import uvloop

from agent.bench import floortls


class _Stats:
    """Per-process counts: responses by status, latency sum (what a recorder keeps)."""

    def __init__(self) -> None:
        self.by_status: dict[int, int] = {}
        self.latency_s = 0.0


@dataclass(frozen=True, slots=True)
class _Tls:
    """TLS on the listener (terminate), toward the target (originate), or neither."""

    listen: ssl.SSLContext | None = None
    connect: ssl.SSLContext | None = None
    sni: str | None = None


def _tls(parser: argparse.ArgumentParser, args: argparse.Namespace) -> _Tls:
    if not (args.tls_listen or args.tls_connect):
        return _Tls()
    if not (args.cert and args.ca):
        parser.error("--tls-listen and --tls-connect need --cert and --ca")
    purpose = ssl.Purpose.CLIENT_AUTH if args.tls_listen else ssl.Purpose.SERVER_AUTH
    ctx = ssl.create_default_context(purpose, cafile=args.ca)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.load_cert_chain(args.cert)
    if args.tls_listen:
        ctx.verify_mode = ssl.CERT_REQUIRED
        return _Tls(listen=ctx)
    return _Tls(connect=ctx, sni=args.tls_connect)


class _Upstream(asyncio.Protocol):
    def __init__(self, down: _Client) -> None:
        self.down = down
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.down.transport.write(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.down.transport.close()

    def on_message_complete(self) -> None:
        down = self.down
        stats = down.stats
        status = self.parser.get_status_code()
        stats.by_status[status] = stats.by_status.get(status, 0) + 1
        if down.started:
            stats.latency_s += time.monotonic() - down.started.pop(0)

    def connection_lost(self, exc: Exception | None) -> None:  # noqa: ARG002 - Protocol API
        self.down.transport.close()


class _Client(asyncio.Protocol):
    def __init__(self, target: tuple[str, int], stats: _Stats, tls: _Tls) -> None:
        self.target = target
        self.tls = tls
        self.stats = stats
        self.parser = httptools.HttpRequestParser(self)
        self.up: _Upstream | None = None
        self.waiting: list[bytes] = []
        self.started: list[float] = []
        self.transport: asyncio.Transport = None  # type: ignore[assignment]

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        asyncio.get_running_loop().create_task(self._connect())

    async def _connect(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            if self.tls.connect is None:
                _, up = await loop.create_connection(lambda: _Upstream(self), *self.target)
            else:
                up = _Upstream(self)
                await floortls.connect(self.tls.connect, self.target, self.tls.sni, up)
        except (OSError, ssl.SSLError):
            self.transport.close()
            return
        self.up = up
        assert up.transport is not None  # noqa: S101 - connected
        for data in self.waiting:
            up.transport.write(data)
        self.waiting.clear()

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.transport.close()
            return
        up = self.up
        if up is None or up.transport is None:
            self.waiting.append(data)
        else:
            up.transport.write(data)

    def on_message_begin(self) -> None:
        self.started.append(time.monotonic())

    def connection_lost(self, exc: Exception | None) -> None:  # noqa: ARG002 - Protocol API
        up = self.up
        if up is not None and up.transport is not None:
            up.transport.close()


async def _serve(listen: tuple[str, int], target: tuple[str, int], tls: _Tls) -> None:
    loop = asyncio.get_running_loop()
    stats = _Stats()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind(listen)
    stop = loop.create_future()
    loop.add_signal_handler(signal.SIGTERM, stop.set_result, None)
    if tls.listen is not None:
        sock.listen(4096)
        accepting = loop.create_task(
            floortls.serve(tls.listen, sock, lambda: _Client(target, stats, tls))
        )
        await stop
        accepting.cancel()
        return
    server = await loop.create_server(lambda: _Client(target, stats, tls), sock=sock, backlog=4096)
    async with server:
        await stop


def _addr(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host, int(port)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m agent.bench.floor", description=__doc__)
    parser.add_argument("listen", type=_addr)
    parser.add_argument("target", type=_addr)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--cert", help="PEM with the certificate chain and its key")
    parser.add_argument("--ca", help="PEM of the trust anchor for the peer's certificate")
    side = parser.add_mutually_exclusive_group()
    side.add_argument("--tls-listen", action="store_true", help="terminate mutual TLS")
    side.add_argument("--tls-connect", metavar="SNI", help="originate mutual TLS to SNI")
    args = parser.parse_args(argv)
    tls = _tls(parser, args)
    children: list[int] = []
    for _ in range(max(1, args.workers) - 1):
        pid = os.fork()
        if pid == 0:
            uvloop.run(_serve(args.listen, args.target, tls))
            os._exit(0)
        children.append(pid)

    try:
        uvloop.run(_serve(args.listen, args.target, tls))
    finally:
        for pid in children:
            os.kill(pid, signal.SIGTERM)
        for pid in children:
            os.waitpid(pid, 0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
