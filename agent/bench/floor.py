"""The bench's Python floor: the least an HTTP/1.1 relay in Python can do per request.

`python -m agent.bench.floor LISTEN TARGET [--workers N]` runs N uvloop
processes sharing LISTEN (SO_REUSEPORT). Each accepted connection gets its
own upstream connection to TARGET (1:1, opened at accept); bytes are
forwarded unchanged both ways; httptools parses requests and responses only
to find where messages end, and each response that ends is counted with its
latency in a plain dict, the minimum a mesh proxy records. No routing,
policy, pooling, balancing or header work.

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
import sys
import time

import httptools
import uvloop


class _Stats:
    """Per-process counts: responses by status, latency sum (what a recorder keeps)."""

    def __init__(self) -> None:
        self.by_status: dict[int, int] = {}
        self.latency_s = 0.0


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
    def __init__(self, target: tuple[str, int], stats: _Stats) -> None:
        self.target = target
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
            _, up = await loop.create_connection(lambda: _Upstream(self), *self.target)
        except OSError:
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


async def _serve(listen: tuple[str, int], target: tuple[str, int]) -> None:
    loop = asyncio.get_running_loop()
    stats = _Stats()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind(listen)
    server = await loop.create_server(lambda: _Client(target, stats), sock=sock, backlog=4096)
    stop = loop.create_future()
    loop.add_signal_handler(signal.SIGTERM, stop.set_result, None)
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
    args = parser.parse_args(argv)
    children: list[int] = []
    for _ in range(max(1, args.workers) - 1):
        pid = os.fork()
        if pid == 0:
            uvloop.run(_serve(args.listen, args.target))
            os._exit(0)
        children.append(pid)

    try:
        uvloop.run(_serve(args.listen, args.target))
    finally:
        for pid in children:
            os.kill(pid, signal.SIGTERM)
        for pid in children:
            os.waitpid(pid, 0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
