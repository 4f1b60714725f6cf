"""agent.proxy.tlsio: TLS over an accepted transport, real sockets and real mTLS.

The module's rules on asyncio's loop and on uvloop (the workers' loop): a server that
read the ClientHello before it decided to terminate (`initial`), data both ways and in
order across records of every size (one of exactly READ_CHUNK), reading paused with
records waiting, half-close (rule 3), and bad bytes that end their own connection only
(rule 4).
"""

from __future__ import annotations

import asyncio
import contextlib
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import pytest

from agent.identity import ca
from agent.identity.names import Identity
from agent.identity.tls import client_context, peer_identity, server_context
from agent.proxy.tlsio import READ_CHUNK, TlsHandshakeError, TlsTransport

if TYPE_CHECKING:
    import ssl
    from collections.abc import AsyncIterator

HOST = "127.0.0.1"
CLIENT = Identity(sa="web", ns="shop")
SERVER = Identity(sa="api", ns="shop")


def _context(issuer: ca.Issuer, identity: Identity, make: Any) -> ssl.SSLContext:
    chain, key, _ = issuer.workload(identity, now=datetime.now(UTC))
    return make(chain, key, issuer.bundle.pem)


@pytest.fixture(scope="module")
def contexts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, ssl.SSLContext]:
    issuer = ca.create_mesh(tmp_path_factory.mktemp("mesh"))
    foreign = ca.create_mesh(tmp_path_factory.mktemp("foreign"))
    return {
        "client": _context(issuer, CLIENT, client_context),
        "server": _context(issuer, SERVER, server_context),
        "foreign_client": _context(foreign, CLIENT, client_context),
    }


class _Peer(asyncio.Protocol):
    """Records what a TLS transport delivers."""

    def __init__(self, *, keep_open: bool = False) -> None:
        self.keep_open = keep_open
        self.data = bytearray()
        self.grew = asyncio.Event()
        self.eof = asyncio.Event()
        self.lost = asyncio.Event()
        self.lost_exc: Exception | None = None

    def data_received(self, data: bytes) -> None:
        self.data += data
        self.grew.set()

    def eof_received(self) -> bool:
        self.eof.set()
        return self.keep_open

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost_exc = exc
        self.lost.set()

    async def until(self, size: int) -> bytes:
        while len(self.data) < size:
            self.grew.clear()
            await asyncio.wait_for(self.grew.wait(), 10)
        return bytes(self.data)


class _FirstChunk(asyncio.Protocol):
    """The worker's accept: reads the first chunk, then stops reading (`Held.prefix`)."""

    def __init__(self, got: asyncio.Queue[tuple[asyncio.Transport, bytes]]) -> None:
        self.got = got
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        assert self.transport is not None
        self.transport.pause_reading()
        self.got.put_nowait((self.transport, data))


@contextlib.asynccontextmanager
async def _pair(
    contexts: dict[str, ssl.SSLContext],
    server_peer: _Peer,
    client_peer: _Peer,
    client: str = "client",
) -> AsyncIterator[tuple[TlsTransport, TlsTransport]]:
    """A client TlsTransport and the server's, made from the ClientHello it read first;
    both closed, and the listener with them, when the block ends."""
    loop = asyncio.get_running_loop()
    accepted: asyncio.Queue[tuple[asyncio.Transport, bytes]] = asyncio.Queue()
    srv = await loop.create_server(lambda: _FirstChunk(accepted), HOST, 0)
    port = srv.sockets[0].getsockname()[1]
    raw, _ = await loop.create_connection(asyncio.Protocol, HOST, port)
    ctls = TlsTransport(raw, contexts[client], server_side=False, server_hostname=SERVER.dns_name)

    async def server_side() -> TlsTransport:
        sraw, prefix = await accepted.get()
        assert prefix[:1] == b"\x16"  # a TLS handshake record: the ClientHello
        stls = TlsTransport(sraw, contexts["server"], server_side=True, initial=prefix)
        await stls.handshake(5)
        return stls

    try:
        _, stls = await asyncio.gather(ctls.handshake(5), server_side())
    except BaseException:
        ctls.abort()
        srv.close()
        raise
    try:
        for tls, peer in ((ctls, client_peer), (stls, server_peer)):
            tls.set_protocol(peer)
            peer.connection_made(tls)
            tls.resume_reading()
        yield ctls, stls
    finally:
        ctls.close()
        stls.close()
        srv.close()


def test_a_server_that_read_the_client_hello_first_terminates_and_both_sides_talk(run, contexts):
    async def body() -> None:
        server, client = _Peer(), _Peer()
        async with _pair(contexts, server, client) as (ctls, stls):
            assert peer_identity(stls.get_extra_info("ssl_object")) == CLIENT.dns_name
            assert peer_identity(ctls.get_extra_info("ssl_object")) == SERVER.dns_name
            assert ctls.get_extra_info("cipher")[1] == "TLSv1.3"
            ctls.write(b"ping")
            assert await server.until(4) == b"ping"
            stls.writelines([b"po", b"ng"])
            assert await client.until(4) == b"pong"

    run(body)


def test_records_of_every_size_arrive_whole_and_in_order(run, contexts):
    sizes = [1, READ_CHUNK - 1, READ_CHUNK, READ_CHUNK + 1, 3 * READ_CHUNK, 1 << 20, 7]

    async def body() -> None:
        server, client = _Peer(), _Peer()
        async with _pair(contexts, server, client) as (ctls, stls):
            sent = b"".join(bytes([i % 251]) * n for i, n in enumerate(sizes))
            offset = 0
            for n in sizes:  # one write per size: records of exactly READ_CHUNK among them
                ctls.write(sent[offset : offset + n])
                offset += n
            assert await server.until(len(sent)) == sent
            stls.write(sent)  # back in one write: many full records in one raw read
            assert await client.until(len(sent)) == sent

    run(body)


def test_paused_reading_keeps_records_until_resumed(run, contexts):
    async def body() -> None:
        server, client = _Peer(), _Peer()
        async with _pair(contexts, server, client) as (ctls, stls):
            stls.pause_reading()
            assert not stls.is_reading()
            ctls.write(b"held")
            await asyncio.sleep(0.2)
            assert server.data == b""
            stls.resume_reading()
            assert await server.until(4) == b"held"

    run(body)


def test_half_close_the_server_answers_after_the_clients_close_notify(run, contexts):
    async def body() -> None:
        server, client = _Peer(keep_open=True), _Peer()
        async with _pair(contexts, server, client) as (ctls, stls):
            ctls.write(b"last words")
            assert ctls.can_write_eof()
            ctls.write_eof()
            await asyncio.wait_for(server.eof.wait(), 5)
            assert server.data == b"last words"
            assert not server.lost.is_set()
            stls.write(b"answer after eof")
            assert await client.until(16) == b"answer after eof"
            stls.close()
            await asyncio.wait_for(client.eof.wait(), 5)
            await asyncio.wait_for(client.lost.wait(), 5)
            await asyncio.wait_for(server.lost.wait(), 5)

    run(body)


class _PausesAtFirstRecord(_Peer):
    """Stops reading after its first delivery, as a relay does when its other side is
    full: the rest of what the raw transport read stays in the session, undecrypted."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport: Any = transport

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if len(self.data) == len(data):
            self.transport.pause_reading()


def test_half_close_while_records_wait_unread_loses_none_of_them(run, contexts):
    """Rule 3 with records received and not yet read: sending close_notify must not
    swallow them (OpenSSL's shutdown reads on and takes application data for an error)."""
    payload = bytes(range(256)) * 4096  # 1 MiB

    async def body() -> None:
        server, client = _Peer(keep_open=True), _PausesAtFirstRecord(keep_open=True)
        async with _pair(contexts, server, client) as (ctls, stls):
            stls.write(payload)
            await client.until(1)
            await asyncio.sleep(0.1)  # the rest of the raw read waits in the session
            assert ctls._in.pending > 0  # the state this test is about
            ctls.write_eof()
            await asyncio.wait_for(server.eof.wait(), 5)
            stls.write(b"and after the client's close_notify")
            stls.write_eof()
            ctls.resume_reading()
            await asyncio.wait_for(client.eof.wait(), 5)
            assert bytes(client.data) == payload + b"and after the client's close_notify"

    run(body)


def test_bytes_that_are_not_tls_end_their_connection_only(run, contexts):
    async def body() -> None:
        bad_server, good_server = _Peer(), _Peer()
        async with (
            _pair(contexts, bad_server, _Peer()) as (bad, _),
            _pair(contexts, good_server, _Peer()) as (good, _),
        ):
            bad._raw.write(b"\x17\x03\x03\x00\x05garbage")  # a forged record
            await asyncio.wait_for(bad_server.lost.wait(), 5)
            assert bad_server.data == b""
            good.write(b"still fine")
            assert await good_server.until(10) == b"still fine"

    run(body)


def test_a_client_of_another_mesh_fails_the_handshake(run, contexts):
    async def body() -> None:
        with pytest.raises(TlsHandshakeError, match=r"tls handshake with 127\.0\.0\.1:"):
            async with _pair(contexts, _Peer(), _Peer(), client="foreign_client"):
                pass

    run(body)
