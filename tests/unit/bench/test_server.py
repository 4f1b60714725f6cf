"""The bench's test server over a real 127.0.0.1 socket: h2c streams, resets, HTTP/1.1."""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING

import h2.config
import h2.connection
import h2.events
import pytest

from agent import aio
from agent.bench import mesh, server

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

REQUEST = [(":method", "GET"), (":path", "/"), (":scheme", "http"), (":authority", "s")]


@pytest.fixture
async def port() -> AsyncIterator[int]:
    srv = await server.start("127.0.0.1", 0)
    try:
        yield srv.sockets[0].getsockname()[1]
    finally:
        srv.close()
        await srv.wait_closed()


class _Client:
    """An h2 client on one real connection; collects the server's events per stream."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        self.conn.initiate_connection()
        self.ended: set[int] = set()
        self.bodies: dict[int, bytes] = {}
        self.statuses: dict[int, bytes] = {}
        self.terminated = False

    def flush(self) -> None:
        self.writer.write(self.conn.data_to_send())

    async def read_until(self, streams: set[int]) -> None:
        async with asyncio.timeout(5.0):
            while not streams <= self.ended and not self.terminated:
                data = await self.reader.read(65536)
                if not data:
                    return
                for event in self.conn.receive_data(data):
                    if isinstance(event, h2.events.ResponseReceived):
                        self.statuses[event.stream_id] = dict(event.headers)[b":status"]
                    elif isinstance(event, h2.events.DataReceived):
                        self.bodies[event.stream_id] = (
                            self.bodies.get(event.stream_id, b"") + event.data
                        )
                        self.conn.acknowledge_received_data(
                            event.flow_controlled_length, event.stream_id
                        )
                    elif isinstance(event, h2.events.StreamEnded):
                        self.ended.add(event.stream_id)
                    elif isinstance(event, h2.events.ConnectionTerminated):
                        self.terminated = True
                self.flush()
                await self.writer.drain()


@pytest.fixture
async def client(port: int) -> AsyncIterator[_Client]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        yield _Client(reader, writer)
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


async def test_h2_streams_each_get_200_ok(client: _Client):
    for sid in (1, 3, 5):
        client.conn.send_headers(sid, REQUEST, end_stream=True)
    client.flush()
    await client.read_until({1, 3, 5})
    assert client.ended == {1, 3, 5}
    assert client.statuses == {1: b"200", 3: b"200", 5: b"200"}
    assert client.bodies == {1: b"ok", 3: b"ok", 5: b"ok"}


@pytest.mark.parametrize("reset", [1, 3, 5])
async def test_h2_stream_reset_before_its_response_leaves_the_connection_and_other_streams_alone(
    client: _Client, reset: int
):
    # preface, SETTINGS, three requests and the reset of one of them leave in one write,
    # so the server reads the request and its reset in the same batch of frames
    for sid in (1, 3, 5):
        client.conn.send_headers(sid, REQUEST, end_stream=True)
    client.conn.reset_stream(reset)
    client.flush()
    others = {1, 3, 5} - {reset}
    await client.read_until(others)
    assert client.ended == others
    assert not client.terminated
    assert reset not in client.statuses
    # the connection stays open: a later stream on it is answered
    client.conn.send_headers(7, REQUEST, end_stream=True)
    client.flush()
    await client.read_until(others | {7})
    assert client.statuses[7] == b"200"
    assert client.bodies[7] == b"ok"
    assert not client.terminated
    assert not client.writer.is_closing()


async def test_http1_keep_alive_then_connection_close(port: int):
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(b"GET / HTTP/1.1\r\nHost: s\r\n\r\n")
        head = await reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200 OK\r\n")
        assert await reader.readexactly(2) == b"ok"
        writer.write(b"GET / HTTP/1.1\r\nHost: s\r\nConnection: close\r\n\r\n")
        rest = await reader.read()  # until the server closes
        assert rest.startswith(b"HTTP/1.1 200 OK\r\n")
        assert b"Connection: close\r\n" in rest
        assert rest.endswith(b"\r\n\r\nok")
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


def _free_ports(n: int) -> list[int]:
    """`n` free ports for the server to take (`mesh.free_port`: outside the ephemeral range)."""
    ports: set[int] = set()
    while len(ports) < n:
        ports.add(mesh.free_port())
    return sorted(ports)


@contextlib.asynccontextmanager
async def serving(
    http_ports: list[int], echo_ports: list[int] | None = None
) -> AsyncIterator[None]:
    """`server.serve` on these ports for the block."""
    task = aio.spawn(server.serve("127.0.0.1", http_ports, echo_ports), name="server")
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def connect(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection to `port` once the server listens there (within a second)."""
    for _ in range(50):
        try:
            return await asyncio.open_connection("127.0.0.1", port)
        except ConnectionRefusedError:
            await asyncio.sleep(0.02)
    return await asyncio.open_connection("127.0.0.1", port)


async def test_one_server_answers_on_every_port_it_is_given():
    ports = _free_ports(2)
    async with serving(ports):
        for port in ports:
            reader, writer = await connect(port)
            writer.write(b"GET / HTTP/1.1\r\nHost: s\r\nConnection: close\r\n\r\n")
            assert (await reader.read()).startswith(b"HTTP/1.1 200 OK\r\n")
            writer.close()


async def test_an_echo_port_sends_back_every_byte_in_order_and_beside_http_on_one_loop():
    """Rule 4: opaque TCP, no framing: what a client writes, in pieces or at once, comes back
    unchanged; the HTTP port of the same `serve` still answers HTTP."""
    http_port, echo_port = _free_ports(2)
    async with serving([http_port], [echo_port]):
        reader, writer = await connect(echo_port)
        sent = bytes(range(256)) * 4  # every byte value, HTTP's preface-looking ones too
        for start in range(0, len(sent), 100):
            writer.write(sent[start : start + 100])
        assert await reader.readexactly(len(sent)) == sent
        writer.write(b"GET / HTTP/1.1\r\n\r\n")  # an echo port does not speak HTTP
        assert await reader.readexactly(18) == b"GET / HTTP/1.1\r\n\r\n"
        writer.close()
        reader, writer = await connect(http_port)
        writer.write(b"GET / HTTP/1.1\r\nHost: s\r\nConnection: close\r\n\r\n")
        assert (await reader.read()).startswith(b"HTTP/1.1 200 OK\r\n")
        writer.close()
