"""agent.proxy.h2conn: a lane (an h2 connection over the mesh's mTLS) writes early, an
h2 connection over plain TCP once per loop iteration. Real sockets and real mTLS, on
both loops.

A client side opening 32 streams in one callback writes after the 1st, 2nd, 4th, 8th,
16th and 32nd (what it holds back reaches what the peer holds); a server side answering
32 streams in one callback writes after the 16th, 24th, 28th, 30th, 31st and 32nd
(what it holds back reaches what it still works on). Every stream and response arrives.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import pytest

from agent.identity import ca
from agent.identity.names import Identity
from agent.identity.tls import client_context, server_context
from agent.proxy.h2conn import H2Conn
from agent.proxy.h2stream import Head
from agent.proxy.tlsio import TlsTransport

if TYPE_CHECKING:
    import ssl
    from collections.abc import AsyncIterator

    from agent.proxy.h2stream import H2Stream

CLIENT = Identity(sa="web", ns="shop")
SERVER = Identity(sa="api", ns="shop")
STREAMS = 32
HEAD = [(b":method", b"GET"), (b":scheme", b"http"), (b":path", b"/"), (b":authority", b"x")]
OK = [(b":status", b"200")]


@pytest.fixture(scope="module")
def contexts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, ssl.SSLContext]:
    issuer = ca.create_mesh(tmp_path_factory.mktemp("mesh"))
    now = datetime.now(UTC)
    chain, key, _ = issuer.workload(CLIENT, now=now)
    client = client_context(chain, key, issuer.bundle.pem)
    chain, key, _ = issuer.workload(SERVER, now=now)
    return {"client": client, "server": server_context(chain, key, issuer.bundle.pem)}


class _Spy:
    """A connection's transport, noting how many streams had been handled at each write."""

    def __init__(self, real: asyncio.Transport) -> None:
        self.real = real
        self.handled = 0  # streams opened (client side) or answered (server side), this one too
        self.at: list[int] = []

    def write(self, data: bytes) -> None:
        self.at.append(self.handled)
        self.real.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


async def _transports(
    contexts: dict[str, ssl.SSLContext] | None,
) -> tuple[asyncio.Transport, asyncio.Transport]:
    """A connected (client, server) pair of transports: mTLS ones, or plain without
    `contexts`."""
    loop = asyncio.get_running_loop()
    a, b = socket.socketpair()
    raw_c, _ = await loop.connect_accepted_socket(asyncio.Protocol, a)
    raw_s, _ = await loop.connect_accepted_socket(asyncio.Protocol, b)
    if contexts is None:
        return raw_c, raw_s
    ctls = TlsTransport(
        raw_c, contexts["client"], server_side=False, server_hostname=SERVER.dns_name
    )
    stls = TlsTransport(raw_s, contexts["server"], server_side=True)
    await asyncio.gather(ctls.handshake(5), stls.handshake(5))
    return ctls, stls


@contextlib.asynccontextmanager
async def _connected(
    contexts: dict[str, ssl.SSLContext] | None,
) -> AsyncIterator[tuple[H2Conn, H2Conn]]:
    """A client and a server H2Conn over `_transports`, closed when the block ends."""
    ctr, str_ = await _transports(contexts)
    client, server = H2Conn(client_side=True), H2Conn(client_side=False)
    for tr, conn in ((ctr, client), (str_, server)):
        tr.set_protocol(conn)
        conn.connection_made(tr)
        tr.resume_reading()
    try:
        yield client, server
    finally:
        client.close()
        server.close()


async def _incoming(server: H2Conn, n: int) -> list[H2Stream]:
    got = []
    async with asyncio.timeout(10):
        for _ in range(n):
            stream = await server.next_incoming()
            assert stream is not None
            got.append(stream)
    return got


def _open_all(client: H2Conn) -> tuple[_Spy, list[H2Stream]]:
    """Open `STREAMS` bodiless streams in this one callback, noting the writes."""
    assert client.transport is not None
    spy = _Spy(client.transport)
    client.transport = spy  # type: ignore[assignment]
    streams = []
    for _ in range(STREAMS):
        spy.handled += 1  # the write happens inside the call
        streams.append(client.open_stream(HEAD, end=True))
    return spy, streams


def _answer_all(server: H2Conn, streams: list[H2Stream]) -> _Spy:
    """Answer every stream in this one callback, noting the writes."""
    assert server.transport is not None
    spy = _Spy(server.transport)
    server.transport = spy  # type: ignore[assignment]
    for stream in streams:
        spy.handled += 1
        stream.send_headers(OK, end=True)
    return spy


async def _statuses(streams: list[H2Stream]) -> list[bytes]:
    """Each stream's response `:status`."""
    out = []
    async with asyncio.timeout(10):
        for s in streams:
            head = await s.next()
            assert isinstance(head, Head)
            out.append(dict(head.headers)[b":status"])
    return out


def test_a_lane_writes_a_batch_of_new_streams_early_and_every_one_arrives(run, contexts):
    async def body() -> None:
        async with _connected(contexts) as (client, server):
            assert client.paced
            assert server.paced
            await asyncio.sleep(0.05)  # the settings exchange is over
            spy, _ = _open_all(client)
            assert spy.at == [1, 2, 4, 8, 16, 32]  # before the loop iteration ended
            await asyncio.sleep(0)
            assert spy.at == [1, 2, 4, 8, 16, 32]  # nothing was left for the end
            assert len(await _incoming(server, STREAMS)) == STREAMS

    run(body)


def test_a_lane_writes_a_batch_of_answers_early_and_every_one_arrives(run, contexts):
    async def body() -> None:
        async with _connected(contexts) as (client, server):
            _, ups = _open_all(client)
            downs = await _incoming(server, STREAMS)
            spy = _answer_all(server, downs)
            assert spy.at == [16, 24, 28, 30, 31, 32]
            assert await _statuses(ups) == [b"200"] * STREAMS

    run(body)


def test_plain_h2_writes_each_batch_once_at_the_end_of_the_iteration(run):
    async def body() -> None:
        async with _connected(None) as (client, server):
            assert not client.paced
            assert not server.paced
            await asyncio.sleep(0.05)
            spy, ups = _open_all(client)
            assert spy.at == []
            await asyncio.sleep(0)
            assert spy.at == [STREAMS]  # one write, after the callback
            downs = await _incoming(server, STREAMS)
            answers = _answer_all(server, downs)
            assert answers.at == []
            await asyncio.sleep(0)
            assert answers.at == [STREAMS]
            assert await _statuses(ups) == [b"200"] * STREAMS

    run(body)


def test_a_stream_opened_with_its_body_leaves_headers_and_data_in_one_write(run, contexts):
    # h2conn `open_stream(body=...)` (agent.proxy.h1toh2 rule 6): the HEADERS and one DATA
    # frame with END_STREAM go in the lane's one early write; the peer gets them together.
    post = [(b":method", b"POST"), *HEAD[1:]]
    payload = b"p" * 1024

    async def body() -> None:
        async with _connected(contexts) as (client, server):
            await asyncio.sleep(0.05)  # the settings exchange is over
            assert client.takes_body(len(payload))
            assert not client.takes_body(client.h2.max_outbound_frame_size + 1)  # one frame
            assert client.transport is not None
            spy = _Spy(client.transport)
            client.transport = spy  # type: ignore[assignment]
            spy.handled = 1
            up = client.open_stream(post, end=True, body=payload)
            assert up.local_ended
            assert spy.at == [1]  # one write, before the loop iteration ended
            [down] = await _incoming(server, 1)
            assert down.remote_ended  # the end came in the read the head came in
            assert down.queued_bytes() == len(payload)
            got = down.next_now()
            assert got is not None
            assert getattr(got, "data", None) == payload
            down.send_headers(OK, end=True)
            assert await _statuses([up]) == [b"200"]

    run(body)
