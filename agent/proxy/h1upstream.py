"""The upstream side of HTTP/1.1 proxying: a pooled connection and the exchange on it.

`UpstreamConn` is the asyncio protocol of one keep-alive connection to an
endpoint (or a pod's app); `ConnPool` (agent.proxy.upstream) keeps it between
exchanges. While a request is out, the connection feeds the response events
its parser yields to the current exchange (`on_events`), or a whole
response in one read as it came (`on_whole`); between
exchanges any byte from the upstream makes it unusable.

Three kinds of exchange use it: `Exchange`, which resolves a future for the
connection's coroutine (the general path), the callback path's exchange
(agent.proxy.h1fast's `CallbackExchange`), which answers the client from inside
these callbacks, and its twin for an upgraded h2 stream given to the app as
HTTP/1 (agent.proxy.h2toh1's `DownExchange`). The connection holds any as their
union, so the compiled build calls them directly.

Rules:
1. The connection never outlives a broken exchange: protocol errors, EOF or
   loss before the response ended fail the exchange (`fail`), and the
   caller aborts the connection.
2. `reusable` is the pool's test: alive, no EOF, no exchange, parser between
   messages.
3. Backpressure: `write_paused` mirrors the transport's pause_writing;
   `drained()` waits for it to clear. The proxy pauses this connection's
   reading while its client cannot take more; `finish` resumes it, so a
   pause never outlives the exchange it was for (a pooled connection that
   does not read would never see its next response).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Final, cast

from agent.proxy import http1
from agent.proxy.http1 import BodyData, MessageEnd, ProtocolError, ResponseHead, Upgraded
from agent.proxy.tlsio import TlsTransport, closing

if TYPE_CHECKING:
    from collections.abc import Callable, Hashable

    from agent.proxy.h1fast import CallbackExchange
    from agent.proxy.h2toh1 import DownExchange
    from agent.proxy.upstream import Pooled, UpstreamError

HIGH_WATER: Final = 256 * 1024
LOW_WATER: Final = 64 * 1024


def _failed(reason: str) -> UpstreamError:
    """The upstream's failure. Imported here, when one happens: agent.proxy.upstream
    imports this module at its top (its pool checks `UpstreamConn` by type, agent.native
    rule 12), so this one cannot import it there."""
    from agent.proxy.upstream import UpstreamError  # noqa: PLC0415 - see above

    return UpstreamError("upstream", reason)


class Exchange:
    """One request/response on an upstream connection, awaited by a coroutine."""

    __slots__ = (
        "done",
        "down",
        "ended",
        "error",
        "got_bytes",
        "head",
        "interim",
        "interim_to",
        "loop",
        "pending",
        "trailers",
    )

    def __init__(
        self, loop: asyncio.AbstractEventLoop, interim_to: asyncio.Transport | None
    ) -> None:
        self.loop = loop
        self.head: asyncio.Future[ResponseHead] = loop.create_future()
        # Made only when the shell must wait for the end (`wait_end`): most small
        # responses have ended by the time their head is forwarded.
        self.done: asyncio.Future[None] | None = None
        self.error: UpstreamError | None = None  # a failure after the head, before the end
        self.pending: list[bytes | memoryview] = []
        self.down: asyncio.Transport | None = None
        self.ended = False
        self.got_bytes = False
        self.interim = False
        self.interim_to = interim_to  # the client, when it waits for `100 Continue`
        # A decoded chunked body's trailers (agent.proxy.h2toh1 sends them on as h2's).
        self.trailers: http1.Headers | None = None

    def on_events(self, events: list[http1.Event]) -> None:
        for ev in events:
            self.on_event(ev)

    def on_whole(self, head: ResponseHead, data: bytes) -> None:
        self.on_events(http1.whole_events(head, data))

    def on_event(self, ev: http1.Event) -> None:
        self.got_bytes = True
        if isinstance(ev, BodyData):
            if self.down is not None:
                self.down.write(ev.data)
            else:
                self.pending.append(ev.data)
        elif isinstance(ev, ResponseHead):
            self._on_head(ev)
        elif isinstance(ev, MessageEnd):
            if self.interim:
                self.interim = False
                return
            self.ended = True
            self.trailers = ev.trailers
            done = self.done
            if self.down is not None and done is not None and not done.done():
                done.set_result(None)
        elif isinstance(ev, ProtocolError):
            self.fail(_failed(f"bad response: {ev.reason}"))
        elif isinstance(ev, Upgraded):
            self.fail(_failed("protocol switch is not supported here"))
        else:
            raise AssertionError(f"BUG: unexpected response event {ev!r}")  # noqa: TRY004 - STYLE dispatch

    def _on_head(self, head: ResponseHead) -> None:
        if head.status < 200:
            self.interim = True
            if head.status == 100 and self.interim_to is not None:
                self.interim_to.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        elif not self.head.done():
            self.head.set_result(head)

    def fail(self, err: UpstreamError) -> None:
        if not self.head.done():
            self.head.set_exception(err)
            self.head.exception()  # whoever awaits still gets it; nobody else must
            return
        if self.error is not None or (self.ended and self.down is not None):
            return  # failed already, or complete
        self.error = err
        done = self.done
        if done is not None and not done.done():
            done.set_exception(err)
            done.exception()

    async def wait_end(self) -> None:
        """Until the forwarded response has ended.

        Raises:
            UpstreamError: the upstream failed after the head.
        """
        if self.error is None and not self.ended:
            self.done = self.loop.create_future()
            await self.done
        if self.error is not None:
            raise self.error

    def forward_to(self, down: asyncio.Transport) -> None:
        for data in self.pending:
            down.write(data)
        self.pending.clear()
        self.down = down


class UpstreamConn(asyncio.Protocol):
    """An upstream HTTP/1.1 connection (pooled between exchanges)."""

    __slots__ = (
        "_drain",
        "eof",
        "exch",
        "idle_since",
        "loop",
        "lost",
        "on_gone",
        "parser",
        "pool_key",
        "transport",
        "write_paused",
    )

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = http1.ResponseParser()
        self.pool_key: Hashable = None
        self.idle_since = 0.0
        self.on_gone: Callable[[Pooled], None] | None = None  # the pool's count (upstream rule 5)
        self.exch: Exchange | CallbackExchange | DownExchange | None = None
        self.lost = False
        self.eof = False
        self.write_paused = False
        self._drain: asyncio.Future[None] | None = None
        # Kept once: asyncio.get_running_loop() is a getpid() in CPython 3.11 (http2 rule 8).
        self.loop: asyncio.AbstractEventLoop | None = None

    # protocol callbacks
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        tr = cast("asyncio.Transport", transport)
        self.transport = tr
        tr.set_write_buffer_limits(HIGH_WATER, LOW_WATER)

    def data_received(self, data: bytes) -> None:
        exch = self.exch
        if exch is None:  # bytes between exchanges: the connection is unusable
            self.lost = True
            if self.transport is not None:
                self.transport.abort()
            return
        parser = self.parser
        head = parser.whole(data)
        if head is not None:
            exch.on_whole(head, data)
        else:
            exch.on_events(parser.feed(data))

    def eof_received(self) -> bool:
        self.eof = True
        exch = self.exch
        if exch is not None:
            exch.on_events(self.parser.feed_eof())
            exch = self.exch  # the events may have ended the exchange
            if exch is not None and not exch.ended:
                exch.fail(_failed("closed before the response ended"))
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        gone = self.on_gone
        if gone is not None:
            self.on_gone = None
            gone(self)
        exch = self.exch
        if exch is not None and not exch.ended:
            reason = f"connection lost: {exc}" if exc else "connection closed"
            exch.fail(_failed(reason))
        self._wake()

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        self._wake()

    def _wake(self) -> None:
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)
        self._drain = None

    async def drained(self) -> None:
        """Until the write buffer is below low water (or the connection is gone)."""
        while self.write_paused and not self.lost:
            self._drain = self._loop().create_future()
            await self._drain

    # pool API
    @property
    def reusable(self) -> bool:
        tr = self.transport
        return (
            not self.lost
            and not self.eof
            and self.exch is None
            and tr is not None
            and not closing(tr)
            and self.parser.between_messages
        )

    def close(self) -> None:
        self.lost = True
        if self.transport is not None:
            self.transport.close()

    def abort(self) -> None:
        self.lost = True
        if self.transport is not None:
            self.transport.abort()

    def begin(self, method: bytes, interim_to: asyncio.Transport | None) -> Exchange:
        """Start an awaited exchange for a request with `method`."""
        exch = Exchange(self._loop(), interim_to)
        self.exch = exch
        self.parser.expect(method)
        return exch

    def _loop(self) -> asyncio.AbstractEventLoop:
        loop = self.loop
        if loop is None:
            loop = self.loop = asyncio.get_running_loop()
        return loop

    def begin_with(self, sink: CallbackExchange | DownExchange, method: bytes) -> None:
        """Start an exchange whose events go to `sink` (the callback path)."""
        self.exch = sink
        self.parser.expect(method)

    def finish(self) -> None:
        """The exchange ended. Reading resumes if a slow client had paused it (rule 3)."""
        self.exch = None
        tr = self.transport
        if isinstance(tr, TlsTransport):  # compiled: called natively, not by name
            if not tr.is_reading() and not tr.is_closing():
                tr.resume_reading()
        elif tr is not None and not tr.is_reading() and not tr.is_closing():
            tr.resume_reading()
