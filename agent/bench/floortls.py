"""The floor's TLS: OpenSSL on the socket itself, the cheapest TLS Python has.

An `ssl.SSLSocket` (non-blocking) read and written from loop callbacks
(`add_reader` / `add_writer`): OpenSSL reads records straight from the socket
and writes them straight to it, no memory BIO and no copy through the loop's
buffers. Measured on the bench's two-hop topology it is cheaper than uvloop's
TLS transport (which maps a fresh read buffer per read) and as cheap as a
memory-BIO transport; `agent.bench.floor --tls-*` uses it.

Rules:
1. Only a bench peer (like `agent.bench.floor`): nothing of the proxy uses it.
2. A TLS or socket error closes that connection only; the peer's EOF closes
   it (the floor has no half-close).
3. `connect` and `serve` hand the protocol a transport only after the
   handshake; a failed handshake closes the socket and reaches no protocol.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable

READ_CHUNK = 64 * 1024  # one record holds at most 16 KiB; below glibc's mmap threshold
_AGAIN = (ssl.SSLWantReadError, ssl.SSLWantWriteError, BlockingIOError)


class SocketTls(asyncio.Transport):
    """A connected, handshaken `SSLSocket` as a transport for `proto`."""

    def __init__(self, sock: ssl.SSLSocket, proto: asyncio.Protocol) -> None:
        super().__init__()
        self._loop = asyncio.get_running_loop()
        self._sock = sock
        self._fd = sock.fileno()
        self._proto = proto
        self._pending = bytearray()  # what the socket did not take yet
        self._closed = False

    def start(self) -> None:
        self._proto.connection_made(self)
        if not self._closed:
            self._loop.add_reader(self._fd, self._readable)

    def _readable(self) -> None:
        sock = self._sock
        while not self._closed:
            try:
                data = sock.recv(READ_CHUNK)
            except _AGAIN:
                return
            except (OSError, ssl.SSLError):
                self.close()
                return
            if not data:  # close_notify or EOF
                self.close()
                return
            self._proto.data_received(data)
            if not sock.pending():  # no decrypted bytes left: the next read would block
                return

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self._closed:
            return
        if self._pending:
            self._pending += data
            return
        try:
            sent = self._sock.send(data)
        except _AGAIN:
            sent = 0
        except (OSError, ssl.SSLError):
            self.close()
            return
        if sent < len(data):
            self._pending += memoryview(data)[sent:]
            self._loop.add_writer(self._fd, self._writable)

    def _writable(self) -> None:
        try:
            sent = self._sock.send(self._pending)
        except _AGAIN:
            return
        except (OSError, ssl.SSLError):
            self.close()
            return
        del self._pending[:sent]
        if not self._pending:
            self._loop.remove_writer(self._fd)

    def is_closing(self) -> bool:
        return self._closed

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._loop.remove_reader(self._fd)
        self._loop.remove_writer(self._fd)
        self._sock.close()
        self._proto.connection_lost(None)

    def abort(self) -> None:
        self.close()


async def _handshake(sock: ssl.SSLSocket) -> None:
    loop = asyncio.get_running_loop()
    fd = sock.fileno()
    while True:
        try:
            sock.do_handshake()
        except ssl.SSLWantReadError:
            add, remove = loop.add_reader, loop.remove_reader
        except ssl.SSLWantWriteError:
            add, remove = loop.add_writer, loop.remove_writer
        else:
            return
        ready: asyncio.Future[None] = loop.create_future()
        add(fd, ready.set_result, None)
        try:
            await ready
        finally:
            remove(fd)


async def connect(
    ctx: ssl.SSLContext, target: tuple[str, int], sni: str | None, proto: asyncio.Protocol
) -> SocketTls:
    """Connect to `target`, handshake as a client expecting `sni`, start `proto` on it.

    Raises:
        OSError, ssl.SSLError: connect or handshake failed (rule 3).
    """
    raw = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    raw.setblocking(False)  # noqa: FBT003 - socket API
    raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        await asyncio.get_running_loop().sock_connect(raw, target)
        sock = ctx.wrap_socket(raw, server_hostname=sni, do_handshake_on_connect=False)
    except BaseException:
        raw.close()
        raise
    try:
        await _handshake(sock)
    except BaseException:
        sock.close()
        raise
    tls = SocketTls(sock, proto)
    tls.start()
    return tls


async def serve(
    ctx: ssl.SSLContext, listener: socket.socket, factory: Callable[[], asyncio.Protocol]
) -> None:
    """Accept on `listener` (listening) forever; each connection's handshake, then `factory()`."""
    loop = asyncio.get_running_loop()
    listener.setblocking(False)  # noqa: FBT003 - socket API
    handshakes: set[asyncio.Task[None]] = set()

    async def one(raw: socket.socket) -> None:
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock = ctx.wrap_socket(raw, server_side=True, do_handshake_on_connect=False)
        try:
            await _handshake(sock)
        except (OSError, ssl.SSLError):
            sock.close()
            return
        SocketTls(sock, factory()).start()

    while True:
        raw, _ = await loop.sock_accept(listener)
        raw.setblocking(False)  # noqa: FBT003 - socket API
        task = loop.create_task(one(raw))
        handshakes.add(task)
        task.add_done_callback(handshakes.discard)
