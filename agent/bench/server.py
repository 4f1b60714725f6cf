"""The bench's test server: HTTP/1.1 keep-alive and h2c (prior knowledge), tiny answers.

`python -m agent.bench.server --port 8080 [--port 8081...] [--echo-port 7080...]`
runs inside the server pod (started with `LabPod.spawn`), on uvloop, and answers
every request `200 ok` (2 bytes), on each port alike; on each echo port it sends
back what it reads (rule 4).

Rules:
1. A connection whose first bytes are the HTTP/2 preface speaks h2c (the
   proxy's own codec, agent.proxy.h2codec: hyper-h2 capped every setup at about
   15k h2 requests/s, below what the proxies do); any other speaks HTTP/1.1
   (`httptools`), keep-alive unless the request says `Connection: close`.
2. One process, one loop: the server's cost is the same in every setup.
3. An h2 stream the client has already reset or closed when its answer is
   written is skipped; the connection and its other streams go on.
4. An echo port speaks no protocol: every byte read is written back as it came,
   in order (opaque TCP, netperf TCP_RR's server; agent.bench.loadgen rule 6). It
   runs on the same loop as the HTTP ports (rule 2).
"""

from __future__ import annotations

import argparse
import asyncio
import sys

import httptools

from agent import aio
from agent.proxy import h2conn
from agent.proxy.h2codec import H2Codec
from agent.proxy.h2events import (
    ConnectionTerminated,
    DataReceived,
    H2ConnectionError,
    H2StreamClosedError,
    RequestReceived,
)
from agent.proxy.h2frame import PREFACE, ErrorCode

BODY = b"ok"
HEADERS = [(b":status", b"200"), (b"content-length", b"2")]
RESPONSE = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 2\r\n\r\n" + BODY
RESPONSE_CLOSE = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 2\r\n"
    b"Connection: close\r\n\r\n" + BODY
)


class _Http1:
    """HTTP/1.1 on one connection."""

    def __init__(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        self.parser = httptools.HttpRequestParser(self)

    def feed(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.transport.close()

    def on_message_complete(self) -> None:
        if self.parser.should_keep_alive():
            self.transport.write(RESPONSE)
        else:
            self.transport.write(RESPONSE_CLOSE)
            self.transport.close()


class _H2:
    """h2c on one connection."""

    def __init__(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        self.conn = H2Codec(
            client_side=False,
            stream_window=h2conn.STREAM_WINDOW,
            conn_window=h2conn.CONN_WINDOW,
            max_streams=h2conn.MAX_STREAMS,
        )
        self.conn.initiate()
        self.transport.write(self.conn.data_to_send())

    def feed(self, data: bytes) -> None:
        try:
            events = self.conn.receive(data)
        except H2ConnectionError:  # GOAWAY queued: send it, end the connection
            self.transport.write(self.conn.data_to_send())
            self.transport.close()
            return
        for event in events:
            if isinstance(event, ConnectionTerminated):
                self.transport.close()
                return
            if isinstance(event, DataReceived):
                self.conn.acknowledge(event.sid, event.flow)
            elif isinstance(event, RequestReceived):
                try:
                    if self.conn.window(event.sid) < len(BODY):  # a client that reads nothing
                        self.conn.reset_stream(event.sid, ErrorCode.REFUSED_STREAM)
                        continue
                    self.conn.send_headers(event.sid, HEADERS, end=False)
                    self.conn.send_data(event.sid, BODY, end=True)
                except H2StreamClosedError:
                    # reset by the client later in this same batch (h2load does at
                    # the end of a run): that stream gets no answer, the rest go on
                    continue
        out = self.conn.data_to_send()
        if out:
            self.transport.write(out)


class _Server(asyncio.Protocol):
    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buf = b""
        self.proto: _Http1 | _H2 | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment] # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        if self.proto is not None:
            self.proto.feed(data)
            return
        assert self.transport is not None  # noqa: S101 - after connection_made
        self.buf += data
        if len(self.buf) < len(PREFACE) and PREFACE.startswith(self.buf):
            return  # could still be the h2 preface
        h2c = self.buf.startswith(PREFACE)
        self.proto = _H2(self.transport) if h2c else _Http1(self.transport)
        data, self.buf = self.buf, b""
        self.proto.feed(data)


class _Echo(asyncio.Protocol):
    """Rule 4: what comes in goes back out."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment] # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        assert self.transport is not None  # noqa: S101 - after connection_made
        self.transport.write(data)


async def start(host: str, port: int, *, echo: bool = False) -> asyncio.Server:
    """Listen on `host:port` (0: any free port) and answer on the running loop: HTTP, or
    with `echo` send back what comes (rule 4)."""
    loop = asyncio.get_running_loop()
    proto = _Echo if echo else _Server
    return await loop.create_server(proto, host, port, backlog=4096, reuse_address=True)


async def serve(host: str, ports: list[int], echo_ports: list[int] | None = None) -> None:
    """Answer on each of `ports`, and echo on each of `echo_ports`, from this one loop
    (rules 2 and 4)."""
    servers = [await start(host, port) for port in ports]
    servers += [await start(host, port, echo=True) for port in echo_ports or []]
    await asyncio.gather(*(server.serve_forever() for server in servers))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m agent.bench.server")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, action="append", help="repeat for more (default 8080)")
    p.add_argument("--echo-port", type=int, action="append", help="rule 4; repeat for more")
    args = p.parse_args(argv)
    aio.run(serve(args.host, args.port or [8080], args.echo_port))
    return 0


if __name__ == "__main__":
    sys.exit(main())
