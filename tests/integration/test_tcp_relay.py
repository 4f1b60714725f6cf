"""The opaque TCP relay on real loopback sockets, on uvloop (agent.aio.new_loop).

Each test runs one loop holding the client, the relay front (accept, pause,
`open_relay`) and the upstream server, all on 127.0.0.1 in this process.
"""

from __future__ import annotations

import asyncio
import os
import socket
import struct
from collections.abc import Awaitable, Callable
from typing import Self

from agent import aio
from agent.proxy import tcp

Upstream = Callable[[socket.socket], Awaitable[None]]


class _Front(asyncio.Protocol):
    """Parks each accepted connection on a `tcp.Held` at once (tcp rule 8: its first
    bytes and EOF land there), then splices it (`Held` is compiled: no subclass here)."""

    def __init__(self, rig: Rig) -> None:
        self.rig = rig

    def connection_made(self, transport) -> None:
        held = tcp.hold(transport)
        self.rig.tasks.append(aio.spawn(self.rig.splice(held), name="splice"))


class Rig:
    """client -> relay front -> upstream server, with the relays kept for inspection."""

    def __init__(self, upstream: Upstream, **relay_kw) -> None:
        self.upstream = upstream
        self.relay_kw = relay_kw
        self.relays: list[tcp.Relay] = []
        self.tasks: list[asyncio.Task] = []
        self.up_socks: list[socket.socket] = []

    async def __aenter__(self) -> Self:
        loop = asyncio.get_running_loop()
        self.up_listener = socket.create_server(("127.0.0.1", 0))
        self.up_listener.setblocking(False)
        self.tasks.append(aio.spawn(self._serve_upstream(), name="upstream"))
        self.front = await loop.create_server(lambda: _Front(self), "127.0.0.1", 0)
        self.front_addr = self.front.sockets[0].getsockname()
        return self

    async def __aexit__(self, *exc) -> None:
        self.front.close()
        for relay in self.relays:
            relay.abort()
        await aio.cancel_and_wait(self.tasks)
        for sock in self.up_socks:
            sock.close()
        self.up_listener.close()
        await self.front.wait_closed()

    async def _serve_upstream(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            sock, _ = await loop.sock_accept(self.up_listener)
            sock.setblocking(False)
            self.up_socks.append(sock)
            self.tasks.append(aio.spawn(self.upstream(sock), name="upstream-conn"))

    async def splice(self, held: tcp.Held) -> None:
        loop = asyncio.get_running_loop()
        sock = socket.socket()
        sock.setblocking(False)
        await loop.sock_connect(sock, self.up_listener.getsockname())
        relay = await tcp.open_relay(
            held.transport, sock, prefix=bytes(held.prefix), eof=held.eof, **self.relay_kw
        )
        self.relays.append(relay)

    async def client(self) -> socket.socket:
        loop = asyncio.get_running_loop()
        sock = socket.socket()
        sock.setblocking(False)
        await loop.sock_connect(sock, self.front_addr)
        return sock

    async def one_relay(self) -> tcp.Relay:
        async with asyncio.timeout(5):
            while not self.relays:  # noqa: ASYNC110 - set by another task
                await asyncio.sleep(0.01)
        return self.relays[0]


async def _read_to_eof(sock: socket.socket) -> bytes:
    loop = asyncio.get_running_loop()
    out = bytearray()
    while chunk := await loop.sock_recv(sock, 65536):
        out += chunk
    return bytes(out)


async def _echo(sock: socket.socket) -> None:
    loop = asyncio.get_running_loop()
    while data := await loop.sock_recv(sock, 65536):
        await loop.sock_sendall(sock, data)
    sock.shutdown(socket.SHUT_WR)


def test_client_half_close_reaches_server_which_can_still_answer():
    seen: list[bytes] = []

    async def answer_after_eof(sock: socket.socket) -> None:
        data = await _read_to_eof(sock)  # returns only once the client's EOF came through
        seen.append(data)
        await asyncio.get_running_loop().sock_sendall(sock, b"got %d bytes" % len(data))
        sock.shutdown(socket.SHUT_WR)

    async def main() -> None:
        async with Rig(answer_after_eof) as rig:
            client = await rig.client()
            try:
                loop = asyncio.get_running_loop()
                await loop.sock_sendall(client, b"hello relay")
                client.shutdown(socket.SHUT_WR)
                async with asyncio.timeout(5):
                    reply = await _read_to_eof(client)
                assert seen == [b"hello relay"]
                assert reply == b"got 11 bytes"
                relay = await rig.one_relay()
                async with asyncio.timeout(5):
                    await relay.wait()
                assert relay.reason == "eof"
                assert (relay.bytes_up, relay.bytes_down) == (11, 12)
            finally:
                client.close()

    aio.run(main())


def test_eight_mib_round_trip_is_byte_exact():
    payload = os.urandom(8 * 1024 * 1024)

    async def main() -> None:
        async with Rig(_echo) as rig:
            client = await rig.client()
            loop = asyncio.get_running_loop()

            async def send() -> None:
                await loop.sock_sendall(client, payload)
                client.shutdown(socket.SHUT_WR)

            try:
                sender = aio.spawn(send(), name="send")
                async with asyncio.timeout(30):
                    echoed = await _read_to_eof(client)
                    await sender
                assert len(echoed) == len(payload)
                assert echoed == payload
                relay = await rig.one_relay()
                async with asyncio.timeout(5):
                    await relay.wait()
                assert relay.bytes_up == relay.bytes_down == len(payload)
            finally:
                client.close()

    aio.run(main())


def test_upstream_that_never_reads_keeps_relay_buffer_bounded():
    high, low = 64 * 1024, 16 * 1024
    read_chunk = 256 * 1024  # the most one read callback can deliver past the pause

    async def never_read(sock: socket.socket) -> None:
        await asyncio.sleep(3600)

    async def main() -> None:
        async with Rig(never_read, high_water=high, low_water=low) as rig:
            client = await rig.client()
            try:
                relay = await rig.one_relay()
                chunk = b"x" * 65536
                sent, stalled_for, peak = 0, 0.0, 0
                # Push up to 256 MiB; the relay must stop reading long before.
                while sent < 256 * 1024 * 1024 and stalled_for < 1.0:
                    try:
                        sent += client.send(chunk)
                        stalled_for = 0.0
                    except BlockingIOError:
                        await asyncio.sleep(0.05)
                        stalled_for += 0.05
                    peak = max(peak, relay.write_buffer_sizes()[1])
                assert stalled_for >= 1.0, f"sender never stalled after {sent} bytes"
                assert sent < 64 * 1024 * 1024
                assert peak <= high + read_chunk, f"relay buffered {peak} bytes"
                assert not relay.downstream.transport.is_reading()
                # What the relay read is what the kernel took upstream plus its bounded buffer.
                assert relay.bytes_up <= sent
            finally:
                client.close()

    aio.run(main())


def test_idle_connection_is_closed_but_a_trickling_one_is_not():
    async def hold(sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while await loop.sock_recv(sock, 65536):
            pass

    async def main() -> None:
        async with Rig(hold, idle_timeout=0.4) as rig:
            loop = asyncio.get_running_loop()
            idle = await rig.client()
            busy = await rig.client()
            try:
                t0 = loop.time()
                deadline = t0 + 1.5
                closed_at = None
                while loop.time() < deadline:
                    await loop.sock_sendall(busy, b".")
                    await asyncio.sleep(0.1)
                    if closed_at is None:
                        try:
                            if idle.recv(1) == b"":
                                closed_at = loop.time()
                        except BlockingIOError:
                            pass
                        except ConnectionResetError:
                            closed_at = loop.time()
                assert closed_at is not None, "idle connection was not closed"
                assert 0.3 <= closed_at - t0 <= 1.2
                reasons = sorted(r.reason for r in rig.relays)
                assert reasons == ["", "idle"]  # the trickling one still runs
            finally:
                idle.close()
                busy.close()

    aio.run(main())


def test_client_reset_resets_upstream():
    async def main() -> None:
        ended = asyncio.Event()
        how: list[str] = []

        async def wait_eof(sock: socket.socket) -> None:
            try:
                await _read_to_eof(sock)
                how.append("eof")
            except ConnectionResetError:
                how.append("reset")
            ended.set()

        async with Rig(wait_eof) as rig:
            client = await rig.client()
            relay = await rig.one_relay()
            client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            client.close()  # RST
            async with asyncio.timeout(5):
                await ended.wait()
                await relay.wait()
            assert relay.reason == "reset"
            assert how == ["reset"]  # rule 9: passed on, not turned into an end of stream

    aio.run(main())


def test_bytes_sent_while_upstream_is_still_connecting_are_not_lost():
    """Regression: uvloop reads right after connection_made; attach must pause."""

    async def main() -> None:
        async with Rig(_echo) as rig:
            loop = asyncio.get_running_loop()

            async def slow_splice(held: tcp.Held) -> None:
                relay = tcp.Relay()
                relay.attach(held.transport, bytes(held.prefix), eof=held.eof)
                await asyncio.sleep(0.3)  # the client keeps sending meanwhile
                sock = socket.socket()
                sock.setblocking(False)
                await loop.sock_connect(sock, rig.up_listener.getsockname())
                await loop.create_connection(relay.upstream_protocol, sock=sock)
                relay.start()
                rig.relays.append(relay)

            rig.splice = slow_splice
            client = await rig.client()
            try:
                await asyncio.sleep(0.1)  # attach happens first, with nothing read yet
                sent = b""
                for i in range(10):
                    part = b"part %d;" % i
                    await loop.sock_sendall(client, part)
                    sent += part
                    await asyncio.sleep(0.05)
                client.shutdown(socket.SHUT_WR)
                async with asyncio.timeout(5):
                    assert await _read_to_eof(client) == sent
            finally:
                client.close()

    aio.run(main())


def test_upstream_reset_reaches_the_client_as_a_reset_after_what_was_sent():
    """Rule 9: an upstream that resets must not look like one that ended its stream."""
    sent = os.urandom(300_000)

    async def send_then_reset(sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        await loop.sock_sendall(sock, sent)
        await asyncio.sleep(0.2)  # the bytes are in the relay or with the client
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()  # RST

    async def main() -> None:
        async with Rig(send_then_reset) as rig:
            client = await rig.client()
            relay = await rig.one_relay()
            got = bytearray()
            loop = asyncio.get_running_loop()
            async with asyncio.timeout(5):
                await relay.wait()
                await asyncio.sleep(0.1)  # the reset reaches the client's socket
                try:
                    while chunk := await loop.sock_recv(client, 65536):
                        got += chunk
                    ended = "eof"
                except ConnectionResetError:
                    ended = "reset"
            client.close()
            assert relay.reason == "reset"
            assert ended == "reset"
            assert bytes(got) == sent[: len(got)]

    aio.run(main())


def test_upstream_that_closes_cleanly_ends_the_client_with_eof_and_every_byte():
    sent = os.urandom(300_000)

    async def send_then_close(sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        await loop.sock_sendall(sock, sent)
        sock.close()  # FIN: nothing unread

    async def main() -> None:
        async with Rig(send_then_close) as rig:
            client = await rig.client()
            relay = await rig.one_relay()
            client.shutdown(socket.SHUT_WR)
            async with asyncio.timeout(5):
                got = await _read_to_eof(client)
                await relay.wait()
            client.close()
            assert got == sent
            assert relay.reason in {"eof", "lost"}

    aio.run(main())
