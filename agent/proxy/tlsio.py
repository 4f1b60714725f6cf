"""TLS on an already-accepted transport whose first bytes were already read.

Why not `loop.start_tls`: the worker reads the first chunk of every accepted
connection before a handler runs (`Held.prefix`), and inbound must read the
ClientHello to see its SNI before deciding to terminate TLS at all. Those bytes
are gone from the socket, and `start_tls` cannot be handed them. So the TLS
record layer runs here over `ssl.MemoryBIO`s (what asyncio's own sslproto
does), fed with the bytes already read, and the result is an
`asyncio.Transport` that the HTTP proxy and the TCP relay use like any other.

Rules:
1. `TlsTransport(raw, ctx, server_side=..., initial=...)` takes the raw
   transport over (`set_protocol`); `await handshake(timeout)` completes the
   handshake or raises `TlsHandshakeError`; only then is plaintext delivered to
   the protocol set with `set_protocol`.
2. Reading plaintext honours `pause_reading`: records stay in the BIO until
   `resume_reading`. Write backpressure is the raw transport's.
3. Half-close as TLS 1.3 defines it (RFC 8446 6.1: close_notify closes the
   sender's write side only): `write_eof()` sends close_notify and shuts
   the raw socket's write side; reading goes on until the peer's
   close_notify, which the protocol sees as `eof_received()` (return True
   to keep writing). `close()` sends close_notify (if not sent yet), then
   closes the raw transport. Records already received and not yet read when
   `write_eof()` runs are decrypted first and delivered in order later:
   OpenSSL's shutdown reads on after sending close_notify, and application
   data it meets there is an error that ends every later read.
4. Callbacks never raise into the loop: a TLS error aborts the connection.

Compiled with mypyc (agent.native): every request of a cross-node hop passes through
here twice on each side. Per record the session's reads and writes go to the C object
under `ssl.SSLObject` (`_sslobj`, where CPython keeps it), not through ssl.py's
interpreted wrapper methods, and the established session skips the handshake step.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections import deque
from typing import TYPE_CHECKING, Any, Final, cast

from agent.errors import AgentError

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

# Plaintext read per read call: one record's worth. A TLS record carries at most 2^14
# bytes of plaintext (RFC 8446 5.1) and OpenSSL's read returns at most one record, so a
# larger n only allocates more (read(n) allocates n bytes first; above glibc's mmap
# threshold, 128 KiB, that is an mmap and page faults per call: measured 15 us per small
# record with 256 KiB). A read that returns less than n has emptied the session's buffer.
READ_CHUNK: Final = 16 * 1024


def _decrypt(read: Callable[[int], bytes]) -> bytes | None:
    """One read of plaintext: its bytes; b"" at the end of the stream (close_notify, or the
    raw EOF without one); None when no whole record is left to decrypt.

    Raises:
        ssl.SSLError, OSError: the stream is broken.
    """
    try:
        return read(READ_CHUNK)
    except ssl.SSLWantReadError:
        return None
    except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
        return b""


def closing(transport: asyncio.BaseTransport) -> bool:
    """`transport.is_closing()`; a `TlsTransport`'s called natively, where a transport
    typed as any asyncio transport is asked by name (a method lookup per call)."""
    if isinstance(transport, TlsTransport):
        return transport.is_closing()
    return transport.is_closing()


class TlsHandshakeError(AgentError):
    """The TLS handshake failed (bad certificate, no certificate, wrong protocol...)."""

    def __init__(self, peer: str, reason: str) -> None:
        self.peer = peer
        self.reason = reason
        super().__init__(f"tls handshake with {peer}: {reason}")


class _RawSide(asyncio.Protocol):
    """The raw transport's protocol: hands everything to the TlsTransport."""

    __slots__ = ("tls",)

    def __init__(self, tls: TlsTransport) -> None:
        self.tls = tls

    def data_received(self, data: bytes) -> None:
        self.tls._raw_data(data)  # noqa: SLF001 - same module

    def eof_received(self) -> bool:
        return self.tls._raw_eof()  # noqa: SLF001

    def connection_lost(self, exc: Exception | None) -> None:
        self.tls._raw_lost(exc)  # noqa: SLF001

    def pause_writing(self) -> None:
        proto = self.tls._proto  # noqa: SLF001
        if proto is not None:
            proto.pause_writing()

    def resume_writing(self) -> None:
        proto = self.tls._proto  # noqa: SLF001
        if proto is not None:
            proto.resume_writing()


class TlsTransport(asyncio.Transport):
    """A TLS session over `raw`, as a transport; see the module rules."""

    def __init__(
        self,
        raw: asyncio.Transport,
        ctx: ssl.SSLContext,
        *,
        server_side: bool,
        server_hostname: str | None = None,
        initial: bytes = b"",
    ) -> None:
        super().__init__()
        self._loop = asyncio.get_running_loop()
        self._raw = raw
        self._in = ssl.MemoryBIO()
        self._out = ssl.MemoryBIO()
        self._obj = ctx.wrap_bio(
            self._in, self._out, server_side=server_side, server_hostname=server_hostname
        )
        # The C session ssl.SSLObject wraps: the same read/write/pending/do_handshake,
        # raising the same exceptions, without an interpreted call each (module docstring).
        self._ssl: Any = getattr(self._obj, "_sslobj", self._obj)
        # Per record: bound once, called without a method lookup each time.
        self._ssl_read: Callable[[int], bytes] = self._ssl.read
        self._ssl_write: Callable[[bytes | bytearray | memoryview], int] = self._ssl.write
        self._in_write: Callable[[bytes], int] = self._in.write
        self._out_read: Callable[[], bytes] = self._out.read
        self._raw_write: Callable[[bytes], None] = raw.write
        self._proto: asyncio.Protocol | None = None
        self._proto_data: Callable[[bytes], None] | None = None  # its data_received
        self._done: asyncio.Future[None] = self._loop.create_future()
        self._established = False  # the handshake completed (`_done` holds its result)
        self._paused = False
        self._closing = False
        self._eof = False  # the peer's close_notify (or EOF) was delivered
        self._eof_sent = False  # our close_notify is queued
        self._lost = False
        self._deliver_soon = False
        # Decrypted before our close_notify, not delivered yet (rule 3): b"" is the peer's
        # end of stream, None a TLS error. None while there is nothing.
        self._ahead: deque[bytes | None] | None = None
        peer = raw.get_extra_info("peername")
        self._peer = f"{peer[0]}:{peer[1]}" if peer else "?"
        raw.set_protocol(_RawSide(self))
        if initial:
            self._in.write(initial)

    # --- handshake ---------------------------------------------------------------

    async def handshake(self, timeout: float) -> None:  # noqa: ASYNC109 - a deadline parameter
        """Complete the handshake.

        Raises:
            TlsHandshakeError: it failed, the peer left, or it took over `timeout` s.
        """
        self._step()
        if not self._done.done():
            self._raw.resume_reading()
        try:
            async with asyncio.timeout(timeout):
                await asyncio.shield(self._done)
        except TimeoutError:
            raise TlsHandshakeError(self._peer, f"no handshake within {timeout}s") from None
        self._raw.pause_reading()  # until a protocol is set and resumes

    def _step(self) -> None:
        if self._done.done():
            self._deliver()
            return
        try:
            self._ssl.do_handshake()
        except ssl.SSLWantReadError:
            self._flush()
            return
        except (ssl.SSLError, OSError) as exc:
            self._flush()  # send the alert
            self._fail(str(exc))
            return
        self._flush()
        self._established = True
        self._done.set_result(None)

    def _fail(self, reason: str) -> None:
        if not self._done.done():
            self._done.set_exception(TlsHandshakeError(self._peer, reason))
            self._done.exception()  # retrieved by `handshake`, or nobody cares
        self._closing = True
        self._raw.close()

    # --- raw side ------------------------------------------------------------

    def _raw_data(self, data: bytes) -> None:
        self._in_write(data)
        if self._established:
            self._deliver()
        else:
            self._step()

    def _raw_eof(self) -> bool:
        if not self._done.done():
            self._fail("peer closed during the handshake")
            return False
        self._in.write_eof()
        self._deliver()
        return True

    def _raw_lost(self, exc: Exception | None) -> None:
        self._lost = True
        if not self._done.done():
            self._fail(f"connection lost: {exc}" if exc else "connection closed")
        proto = self._proto
        if proto is not None:
            proto.connection_lost(exc)

    def _deliver(self) -> None:
        """Hand decrypted bytes to the protocol while it reads."""
        self._deliver_soon = False
        proto = self._proto
        deliver = self._proto_data
        if proto is None or deliver is None or not self._established or self._lost:
            return
        read = self._ssl_read
        bio = self._in
        while not self._paused and not self._eof:
            if self._ahead is not None:
                if not self._deliver_ahead(proto, deliver):
                    break
                continue
            try:
                data = _decrypt(read)
            except (ssl.SSLError, OSError):
                self.abort()
                return
            if data is None:
                break
            if not data:
                self._peer_ended(proto)
                break
            deliver(data)
            if (
                not bio.pending
                and not bio.eof
                and (len(data) < READ_CHUNK or not self._ssl.pending())
            ):
                break  # nothing left to decrypt: skip the read that would raise SSLWantReadError
        self._flush()

    def _deliver_ahead(self, proto: asyncio.Protocol, deliver: Callable[[bytes], None]) -> bool:
        """Hand over what `_read_ahead` kept; True when it is all gone and reading goes on."""
        ahead = self._ahead
        while ahead and not self._paused:
            data = ahead.popleft()
            if data is None:
                self.abort()
                return False
            if not data:
                self._ahead = None
                self._peer_ended(proto)
                return False
            deliver(data)
        if ahead:
            return False  # paused
        self._ahead = None
        return True

    def _peer_ended(self, proto: asyncio.Protocol) -> None:
        self._eof = True
        if not proto.eof_received():
            self.close()

    def _read_ahead(self) -> None:
        """Decrypt every whole record received so far into `_ahead` (rule 3)."""
        if self._eof:
            return
        ahead: deque[bytes | None] = deque()  # runs once: our close_notify goes once
        read = self._ssl_read
        while not ahead or ahead[-1]:
            try:
                data = _decrypt(read)
            except (ssl.SSLError, OSError):
                ahead.append(None)
                break
            if data is None:
                break
            ahead.append(data)
        if ahead:
            self._ahead = ahead
            if not self._paused and not self._deliver_soon:
                self._deliver_soon = True
                self._loop.call_soon(self._deliver)

    def _flush(self) -> None:
        if self._out.pending and not self._raw.is_closing():
            self._raw_write(self._out_read())

    # --- transport API -------------------------------------------------------

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self._proto = cast("asyncio.Protocol", protocol)
        self._proto_data = self._proto.data_received

    def get_protocol(self) -> asyncio.BaseProtocol:
        assert self._proto is not None  # noqa: S101 - set before use
        return self._proto

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        if name == "ssl_object":
            return self._obj
        if name == "peercert":
            return self._obj.getpeercert()
        if name == "cipher":
            return self._obj.cipher()
        return self._raw.get_extra_info(name, default)

    def is_reading(self) -> bool:
        return not self._paused

    def pause_reading(self) -> None:
        self._paused = True
        if not self._raw.is_closing():
            self._raw.pause_reading()

    def resume_reading(self) -> None:
        self._paused = False
        if not self._raw.is_closing():
            self._raw.resume_reading()
        if not self._deliver_soon:  # records may already sit in the BIO
            self._deliver_soon = True
            self._loop.call_soon(self._deliver)

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self._closing or self._lost or self._eof_sent:
            return
        try:
            self._ssl_write(data)
        except (ssl.SSLError, OSError):
            self.abort()
            return
        if not self._raw.is_closing():  # a record is pending: no need to ask
            self._raw_write(self._out_read())

    def writelines(self, list_of_data: Iterable[bytes | bytearray | memoryview]) -> None:
        """Encrypt every buffer, then hand the records to the raw transport in one write."""
        if self._closing or self._lost or self._eof_sent:
            return
        encrypt = self._ssl_write
        try:
            for data in list_of_data:
                encrypt(data)
        except (ssl.SSLError, OSError):
            self.abort()
            return
        self._flush()

    def can_write_eof(self) -> bool:
        return self._established and not self._lost

    def write_eof(self) -> None:
        """Send close_notify and shut the raw write side; reading goes on (rule 3)."""
        if self._closing or self._lost or self._eof_sent:
            return
        self._send_close_notify(keep_reading=True)
        if not self._raw.is_closing() and self._raw.can_write_eof():
            self._raw.write_eof()

    def _send_close_notify(self, *, keep_reading: bool = False) -> None:
        if self._eof_sent or not self._established or self._lost:
            return
        self._eof_sent = True
        if keep_reading:
            self._read_ahead()
        # unwrap() queues close_notify, then wants the peer's: with memory BIOs and
        # nothing whole left to read that is SSLWantReadError, and reading application
        # data still works.
        with contextlib.suppress(ssl.SSLError, OSError, ValueError):
            self._obj.unwrap()
        self._flush()

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        self._raw.set_write_buffer_limits(high, low)

    def get_write_buffer_size(self) -> int:
        return self._raw.get_write_buffer_size() + self._out.pending

    def is_closing(self) -> bool:
        return self._closing or self._raw.is_closing()

    def close(self) -> None:
        if self._closing:
            return
        self._send_close_notify()
        self._closing = True
        self._raw.close()

    def abort(self) -> None:
        self._closing = True
        self._raw.abort()
