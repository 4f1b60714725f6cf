"""One h2 connection as an `asyncio.Protocol`: the server side towards a client, or the
client side towards an upstream (agent.proxy.http2's rules 2, 3, 6 and 8).

It feeds received bytes to its `H2Codec` (agent.proxy.h2codec), turns events into
items on its `H2Stream`s (agent.proxy.h2stream), hands new request streams to
`on_incoming` (or `next_incoming`), and writes what the codec queued once per loop
iteration (`flush`), at once past `FLUSH_BYTES`. After a batch of frames it calls the
sinks of the streams that got something (`touch`, `run_sinks`), then `on_incoming` for
each new request stream: what one read brought is seen whole (a request's DATA and
end, a response's head and end), so it goes on in as few frames.

A lane is paced (`paced`: the connection runs over the mesh's mTLS, so its peer is
another node's proxy, on other CPUs). Holding every frame to the end of the iteration
would hand that peer the whole batch at once, after this side made all of it, and the
two nodes would take turns, each idle while the other works. So a lane also writes
early (`write_early`): the client side when the streams it opened since its last write
are at least as many as the peer holds (sent, unanswered); the server side when the
streams it finished since its last write are at least as many as it still works on.
A batch goes out in a few writes, each large enough to keep the peer busy while this
side makes the next (bench/RESULTS.md, thirtieth pass).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from typing import TYPE_CHECKING, Final, cast

from agent.proxy import h2events, h2msg
from agent.proxy.h2codec import H2Codec
from agent.proxy.h2events import H2ConnectionError, H2StreamClosedError
from agent.proxy.h2frame import ErrorCode
from agent.proxy.h2stream import CANCEL, END, Data, H2Stream, Head, Item, StreamGoneError, Trailers
from agent.proxy.tlsio import TlsTransport

if TYPE_CHECKING:
    from collections.abc import Callable, Hashable

    from agent.proxy.h2msg import H2Headers


logger = logging.getLogger(__name__)

STREAM_WINDOW: Final = 1 << 20  # what one stream may have in flight towards us (http2 rule 2)
CONN_WINDOW: Final = 8 << 20
HIGH_WATER: Final = 256 * 1024
LOW_WATER: Final = 64 * 1024
# DATA queued in the codec past this is written at once (http2 rule 8)
FLUSH_BYTES: Final = 64 * 1024
IDLE_TIMEOUT_S: Final = 60.0
MAX_STREAMS: Final = 1000  # concurrent streams a peer may open towards us


def write_early(held: int, other: int) -> bool:
    """Whether a paced connection writes now (module doc): it holds `held` streams back
    since its last write (opened, client side; finished, server side), against `other`
    (the streams the peer holds, client side; those still in progress, server side)."""
    return held > 0 and held >= other


class H2Conn(asyncio.Protocol):
    """One h2 connection (either side); see the module rules."""

    def __init__(self, *, client_side: bool) -> None:
        # Made in the running loop; kept, as asyncio.get_running_loop() is a getpid()
        # system call each time (rule 8 of agent.proxy.http2).
        self.loop = asyncio.get_running_loop()
        self.h2 = H2Codec(
            client_side=client_side,
            stream_window=STREAM_WINDOW,
            conn_window=CONN_WINDOW,
            max_streams=MAX_STREAMS,
        )
        self.client_side = client_side
        self.transport: asyncio.Transport | None = None
        self.streams: dict[int, H2Stream] = {}
        self.incoming: deque[H2Stream] = deque()  # server side: new request streams
        self.closed = False
        self.going_away = False
        self.pool_key: Hashable = None
        self._write_paused = False
        self._flush_soon = False
        self._queued = 0  # DATA bytes handed to the codec since the last write
        self.paced = False  # a lane between proxies (module doc); set on connection_made
        self._held = 0  # streams opened (client) or finished (server) since the last write
        self._waiters: list[asyncio.Future[None]] = []  # window or drain or news
        self._idle: asyncio.TimerHandle | None = None
        self.on_idle: Callable[[H2Conn], None] | None = None
        # Server side: given each new request stream after the batch it came in (else
        # queued for `next_incoming`).
        self.on_incoming: Callable[[H2Stream], None] | None = None
        self.touched: list[H2Stream] = []  # streams whose sink is due
        self._batch = False  # in a batch: touched sinks run at its end
        self._sinks_soon = False

    # --- asyncio callbacks --------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        tr = cast("asyncio.Transport", transport)
        self.transport = tr
        self.paced = isinstance(tr, TlsTransport)
        tr.set_write_buffer_limits(HIGH_WATER, LOW_WATER)
        self.h2.initiate()
        self.flush()

    def data_received(self, data: bytes) -> None:
        self._batch = True
        try:
            ok = self._receive(data)
        finally:
            self._batch = False
            if self.touched:
                self.run_sinks()
        start = self.on_incoming
        if ok and start is not None:
            incoming = self.incoming
            while incoming:
                start(incoming.popleft())
        self.flush()

    def _receive(self, data: bytes) -> bool:
        """Feed the codec and dispatch its events; False after a connection error."""
        try:
            events = self.h2.receive(data)
        except H2ConnectionError as exc:
            logger.info("h2 protocol error, closing", extra={"error": str(exc)})
            self.flush()  # the GOAWAY
            self.close()
            return False
        for ev in events:
            self._event(ev)
        return True

    def eof_received(self) -> bool:
        return False

    def connection_lost(self, exc: Exception | None) -> None:  # noqa: ARG002 - Protocol API
        self.closed = True
        for stream in list(self.streams.values()):
            stream.peer_reset(CANCEL)
        self.streams.clear()
        self.wake()
        if self._idle is not None:
            self._idle.cancel()
        if self.on_idle is not None:
            self.on_idle(self)

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        self.wake()

    # --- events (one isinstance chain, no await) -------------------------------------

    def _event(self, ev: h2events.Event) -> None:  # noqa: C901, PLR0912 - the dispatch table
        if isinstance(ev, h2events.DataReceived):
            stream = self.streams.get(ev.sid)
            if stream is None or stream.gone is not None:
                self.ack(ev.sid, ev.flow)
                return
            if ev.flow:
                stream.push(Data(ev.data, ev.flow))
            if ev.end:
                self._ended(ev.sid)
        elif isinstance(ev, h2events.RequestReceived):
            stream = H2Stream(self, ev.sid)
            stream.request = ev.headers
            self.streams[stream.sid] = stream
            self._busy()
            self.incoming.append(stream)
            if ev.end:
                self._ended(ev.sid)
            if self.on_incoming is None:
                self.wake()
        elif isinstance(ev, h2events.ResponseReceived):
            self._push(ev.sid, Head(ev.headers, end=False))
            if ev.end:
                self._ended(ev.sid)
        elif isinstance(ev, h2events.TrailersReceived):
            self._push(ev.sid, Trailers(ev.headers))
            self._ended(ev.sid)
        elif isinstance(ev, h2events.StreamReset):
            stream = self.streams.pop(ev.sid, None)
            if stream is not None:
                stream.peer_reset(ev.code)
                self._maybe_idle()
        elif isinstance(ev, h2events.WindowUpdated):
            self.wake()
        elif isinstance(ev, h2events.ConnectionTerminated):
            self._goaway(ev.last_sid)
        else:
            msg = f"BUG: unknown h2 event {ev!r}"
            raise AssertionError(msg)  # noqa: TRY004 - a bug, not bad input

    def _push(self, sid: int, item: Item) -> None:
        stream = self.streams.get(sid)
        if stream is not None:
            stream.push(item)

    def _ended(self, sid: int) -> None:
        stream = self.streams.get(sid)
        if stream is None:
            return
        last = stream.items[-1] if stream.items else None
        if isinstance(last, Head):  # a trailers-only (or bodiless) response
            last.end = True
            stream.remote_ended = True
        elif not isinstance(last, Trailers):  # trailers end the stream already
            stream.push(END)
        if stream.local_ended:
            self.forget(stream)

    def _goaway(self, last_stream_id: int) -> None:
        self.going_away = True
        if self.client_side:
            for sid, stream in list(self.streams.items()):
                if sid > last_stream_id:
                    self.streams.pop(sid, None)
                    stream.peer_reset(ErrorCode.REFUSED_STREAM)
        if not self.streams:
            self.close()

    # --- sinks (streams served in callbacks) -------------------------------------------

    def touch(self, stream: H2Stream) -> None:
        """`stream` got something for its sink: call it at the end of this batch of frames,
        or soon when no batch is running."""
        if stream.touched:
            return
        stream.touched = True
        self.touched.append(stream)
        if not self._batch and not self._sinks_soon:
            self._sinks_soon = True
            self.loop.call_soon(self.run_sinks)

    def run_sinks(self) -> None:
        """Call each touched stream's sink once (a sink that fails resets its stream)."""
        self._sinks_soon = False
        batch = self._batch
        self._batch = True
        try:
            while self.touched:
                touched, self.touched = self.touched, []
                for stream in touched:
                    stream.touched = False
                    sink = stream.sink
                    if sink is None:
                        continue
                    try:
                        sink(stream)
                    except Exception:
                        logger.exception("h2 stream callback failed", extra={"stream": stream.sid})
                        stream.sink = None
                        stream.reset(ErrorCode.INTERNAL_ERROR)
        finally:
            self._batch = batch

    # --- helpers -------------------------------------------------------------------

    def flush(self) -> None:
        """Write what the codec queued at the end of this loop iteration (rule 8): one write for
        the frames of every stream that sent something meanwhile."""
        if not self._flush_soon:
            self._flush_soon = True
            self.loop.call_soon(self.flush_now)

    def queued(self, size: int) -> None:
        """`size` DATA bytes went to the codec: write soon, or now past `FLUSH_BYTES` so that
        the transport's buffer (and so `drained`) sees them (rule 2)."""
        self._queued += size
        if self._queued >= FLUSH_BYTES:
            self.flush_now()
        else:
            self.flush()

    def flush_now(self) -> None:
        """Write what the codec queued now."""
        self._flush_soon = False
        self._queued = 0
        self._held = 0
        data = self.h2.data_to_send()
        tr = self.transport
        if data and tr is not None and not tr.is_closing():
            tr.write(data)

    def ack(self, sid: int, flow: int) -> None:
        if flow <= 0 or self.closed or sid <= 0:
            return
        self.h2.acknowledge(sid, flow)
        self.flush()

    def forget(self, stream: H2Stream) -> None:
        """The stream is over on both sides (or reset): stop routing frames to it."""
        streams = self.streams
        if streams.get(stream.sid) is stream:
            del streams[stream.sid]
            if self.paced and not self.client_side:
                self._held += 1
                if write_early(self._held, len(streams)):
                    self.flush_now()
        self._maybe_idle()

    def _busy(self) -> None:
        if self._idle is not None:
            self._idle.cancel()
            self._idle = None

    def _maybe_idle(self) -> None:
        if self.streams or self.closed:
            return
        if self.going_away:
            self.close()
        elif self.client_side and self._idle is None:
            self._idle = self.loop.call_later(IDLE_TIMEOUT_S, self._idle_close)

    def _idle_close(self) -> None:
        self._idle = None
        if not self.streams:
            self.close()

    def wake(self) -> None:
        """Wake every coroutine waiting on this connection (window, drain, news)."""
        waiters, self._waiters = self._waiters, []
        for w in waiters:
            if not w.done():
                w.set_result(None)

    async def wait_window(self) -> None:
        """Until a WINDOW_UPDATE, a settings change, or the connection ends."""
        if self.closed:
            return
        fut = self.loop.create_future()
        self._waiters.append(fut)
        await fut

    def takes_now(self, size: int) -> bool:
        """Whether `size` more DATA bytes go to the codec without `drained` waiting after
        them: the transport is not paused and they stay under `FLUSH_BYTES` (no write)."""
        return not self._write_paused and self._queued + size < FLUSH_BYTES

    async def drained(self) -> None:
        """Until the transport's write buffer is below low water (or it is gone)."""
        while self._write_paused and not self.closed:
            fut = self.loop.create_future()
            self._waiters.append(fut)
            await fut

    async def next_incoming(self) -> H2Stream | None:
        """Server side: the next request stream; None once the connection is closed."""
        while not self.incoming:
            if self.closed:
                return None
            fut = self.loop.create_future()
            self._waiters.append(fut)
            await fut
        return self.incoming.popleft()

    # --- client side -----------------------------------------------------------------

    @property
    def usable(self) -> bool:
        """Can carry one more stream now (rule 6)."""
        if self.closed or self.going_away or self.transport is None:
            return False
        if self.transport.is_closing():
            return False
        return len(self.streams) < self.h2.remote_max_streams

    def takes_body(self, size: int) -> bool:
        """Whether a stream opened now can send a body of `size` bytes with its HEADERS
        (`open_stream`'s `body`): one DATA frame within the windows, and no write
        (`takes_now`)."""
        return size <= self.h2.new_stream_window() and self.takes_now(size)

    def open_stream(self, headers: H2Headers, *, end: bool, body: bytes = b"") -> H2Stream:
        """Start a request stream; `body`, when given, follows the HEADERS as one DATA
        frame in the same write (`end` then ends the stream on it). The caller checked
        `takes_body`.

        Raises:
            StreamGoneError: the connection cannot take it any more.
        """
        try:
            sid = self.h2.open_stream(h2msg.protect(headers), end=end and not body)
            if body:
                self.h2.send_data(sid, body, end=end)
        except (H2StreamClosedError, H2ConnectionError) as exc:
            self.going_away = True
            raise StreamGoneError(ErrorCode.REFUSED_STREAM) from exc
        self._queued += len(body)
        stream = H2Stream(self, sid)
        self.streams[sid] = stream
        stream.local_ended = end
        self._busy()
        if self.paced:
            self._held += 1
            if write_early(self._held, len(self.streams) - self._held):
                self.flush_now()
                return stream
        self.flush()
        return stream

    def close(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.h2.close()
            self.flush_now()
            self.transport.close()
