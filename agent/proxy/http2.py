"""HTTP/2 proxying per stream: a thin asyncio shell over `h2` connections.

`H2Conn` is one h2 connection (server side towards the client, client side
towards an upstream) as an `asyncio.Protocol`; `H2Stream` is one stream on
it, with a queue of what the peer sent and flow-controlled sends. `serve`
runs a client connection: each request stream gets its own task that asks a
`StreamRouter` where it goes, then forwards it on a pooled upstream
connection (`H2Pool`).

Rules:
1. Per stream: the router picks the upstream (outbound: the destination's
   balancer per stream; inbound: the app after authorizing the stream), or
   answers itself (`h2msg.Answer`: deny, no endpoint, 502...).
2. Flow control end to end, nothing buffered whole: a DATA frame's bytes are
   acknowledged to their sender (`acknowledge_received_data`, which opens
   the window again) only once the other side's h2 connection took them, and
   that side sends only what its peer's window allows, waiting for
   WINDOW_UPDATE (and for the transport to drain) otherwise. Memory per
   stream is bounded by the window we advertise (`STREAM_WINDOW`).
3. RST_STREAM both ways: a client reset cancels the upstream stream (CANCEL),
   an upstream reset resets the client stream with the same code. A stream
   error ends that stream only; a connection error ends that connection and
   resets its streams.
4. The balancer handle ends with `done(now, ok)` when the response ends;
   `ok` is `profile.classify` of the `:status` and the `grpc-status`
   (trailers, or the headers of a trailers-only response): grpc-status != 0
   is a failure. A reset or an abandoned attempt is a failure too.
5. A route timeout covers the time up to the response headers: past it the
   upstream stream is cancelled and the client gets 504 (gRPC: trailers-only
   grpc-status 4).
6. One upstream h2 connection per pool key (source pod, endpoint, identity),
   streams multiplexed on it; another is opened only when the peer's
   concurrent-stream limit is reached or the connection is going away.
   Connections idle (no stream) for `IDLE_TIMEOUT_S` are closed.
7. Metrics as HTTP/1 requests: `recorder().request` when a stream is sent
   upstream, `recorder().response` when its response ends (or the proxy
   answered); `record.REQUEST` holds an HTTP/1-shaped head of the stream's
   request in the stream's task.
8. Cost per stream is mostly h2's own work, so the shell adds little: frames
   of every stream go out in one write per connection per loop iteration
   (`flush` schedules it; `queued` writes at once past `FLUSH_BYTES` of DATA
   so `drained` sees the transport's buffer); h2's outbound header checks
   are off (h2msg rule 4: what is forwarded was checked when received); a
   bodiless request gets no request-body task; a plain end queued behind
   DATA goes in that DATA's last frame.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import weakref
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, cast

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.settings

from agent import aio
from agent.proxy import h2msg
from agent.proxy.h2msg import Answer, H2Headers
from agent.proxy.profile import classify
from agent.proxy.record import REQUEST, Labels, recorder
from agent.proxy.upstream import UpstreamError

if TYPE_CHECKING:
    from collections.abc import Hashable

    from agent.proxy.balance import Handle
    from agent.proxy.model import Route

logger = logging.getLogger(__name__)

STREAM_WINDOW = 1 << 20  # what one stream may have in flight towards us (rule 2)
CONN_WINDOW = 8 << 20
MAX_FRAME = 1 << 14
HIGH_WATER = 256 * 1024
LOW_WATER = 64 * 1024
FLUSH_BYTES = 64 * 1024  # DATA queued in h2 past this is written at once (rule 8)
IDLE_TIMEOUT_S = 60.0
ANSWER_DRAIN_S = 5.0  # after answering early, how long the rest of a request is read
CANCEL = h2.errors.ErrorCodes.CANCEL
NO_ERROR = h2.errors.ErrorCodes.NO_ERROR
_NO_TIMEOUT = contextlib.nullcontext()  # reusable; asyncio.timeout(None) costs a task lookup

Opener = Callable[[Callable[[], asyncio.Protocol]], Awaitable[tuple[asyncio.Transport, Any]]]


class StreamGoneError(Exception):
    """The stream was reset (by the peer or by us) or its connection is gone."""

    def __init__(self, code: int) -> None:
        self.code = code
        super().__init__(f"stream reset ({code})")


# --- what a stream's queue holds ----------------------------------------------------


@dataclass(slots=True)
class Head:
    headers: H2Headers
    end: bool


@dataclass(slots=True)
class Data:
    data: bytes
    flow: int  # flow-controlled length (padding included), to acknowledge


@dataclass(slots=True)
class Trailers:
    headers: H2Headers


@dataclass(slots=True)
class End:
    pass


@dataclass(slots=True)
class Reset:
    code: int


Item = Head | Data | Trailers | End | Reset
_END = End()


class H2Stream:
    """One stream: what the peer sent (queued), and sends that respect flow control."""

    __slots__ = (
        "_waiter",
        "conn",
        "gone",
        "items",
        "local_ended",
        "on_reset",
        "remote_ended",
        "request",
        "sid",
    )

    def __init__(self, conn: H2Conn, sid: int) -> None:
        self.conn = conn
        self.sid = sid
        self.items: deque[Item] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self.request: H2Headers = []  # server side: the request headers
        self.remote_ended = False
        self.local_ended = False
        self.gone: int | None = None  # the reset code once reset or lost
        self.on_reset: Callable[[int], None] | None = None  # the peer reset this stream

    # from the connection
    def push(self, item: Item) -> None:
        if isinstance(item, End | Trailers):
            self.remote_ended = True
        self.items.append(item)
        self._wake()

    def peer_reset(self, code: int) -> None:
        """The peer reset the stream, or the connection is gone."""
        if self.gone is not None:
            return
        self.gone = code
        self.items.append(Reset(code))
        self._wake()
        self.conn.wake()
        if code == NO_ERROR and self.remote_ended:
            # The peer sent its whole side and just stops reading ours (RFC 9113
            # 8.1): what is queued still goes on; nothing to propagate.
            return
        if self.on_reset is not None:
            self.on_reset(code)

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    # to the handler
    async def next(self) -> Item:
        """The next item the peer sent.

        Raises:
            StreamGoneError: the stream was reset or its connection lost.
        """
        while not self.items:
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        item = self.items.popleft()
        if isinstance(item, Reset):
            self.items.appendleft(item)  # stays gone
            raise StreamGoneError(item.code)
        return item

    def peek_end(self) -> bool:
        """Whether the next item is the plain end of the stream (not trailers)."""
        return bool(self.items) and isinstance(self.items[0], End)

    def ack(self, flow: int) -> None:
        """Bytes of one DATA item were passed on: open the sender's window again (rule 2)."""
        self.conn.ack(self.sid, flow)

    def send_headers(self, headers: H2Headers, *, end: bool = False) -> None:
        """Send headers (or trailers with `end`).

        Raises:
            StreamGoneError: the stream is gone.
        """
        self._check()
        try:
            self.conn.h2.send_headers(self.sid, h2msg.protect(headers), end_stream=end)
        except (h2.exceptions.StreamClosedError, h2.exceptions.ProtocolError) as exc:
            raise self._lost(exc) from exc
        self.local_ended = self.local_ended or end
        self.conn.flush()
        if self.local_ended and self.remote_ended:
            self.conn.forget(self)

    async def send_data(self, data: bytes, *, end: bool = False) -> None:
        """Send `data` (ending the stream with its last frame when `end`), waiting for
        window and for the transport to drain (rule 2).

        Raises:
            StreamGoneError: the stream is gone.
        """
        conn = self.conn
        view = memoryview(data)
        while view:
            self._check()
            try:
                window = conn.h2.local_flow_control_window(self.sid)
            except (h2.exceptions.StreamClosedError, h2.exceptions.ProtocolError) as exc:
                raise self._lost(exc) from exc
            size = min(window, conn.h2.max_outbound_frame_size, len(view))
            if size <= 0:
                await conn.wait_window()
                continue
            last = size == len(view)
            chunk = data if last and size == len(data) else view[:size].tobytes()
            try:
                conn.h2.send_data(self.sid, chunk, end_stream=end and last)
            except (h2.exceptions.StreamClosedError, h2.exceptions.ProtocolError) as exc:
                raise self._lost(exc) from exc
            view = view[size:]
            conn.queued(size)
            if end and last:
                self._ended()
                return
            await conn.drained()
        if end:
            self.end()

    def end(self) -> None:
        """End our side of the stream (no-op when already ended).

        Raises:
            StreamGoneError: the stream is gone.
        """
        if self.local_ended:
            return
        self._check()
        try:
            self.conn.h2.end_stream(self.sid)
        except (h2.exceptions.StreamClosedError, h2.exceptions.ProtocolError) as exc:
            raise self._lost(exc) from exc
        self.conn.flush()
        self._ended()

    def _ended(self) -> None:
        self.local_ended = True
        if self.remote_ended:
            self.conn.forget(self)

    def reset(self, code: int = CANCEL) -> None:
        """Reset the stream (no-op once gone); whoever waits on it sees it gone."""
        if self.gone is not None:
            return
        self.gone = code
        with contextlib.suppress(h2.exceptions.StreamClosedError, h2.exceptions.ProtocolError):
            self.conn.h2.reset_stream(self.sid, code)
            self.conn.flush()
        self.items.append(Reset(code))
        self._wake()
        self.conn.wake()
        self.conn.forget(self)

    def discard(self) -> None:
        """Hand back the window of DATA nobody will read (the stream is over)."""
        for item in self.items:
            if isinstance(item, Data):
                self.conn.ack(self.sid, item.flow)
        self.items.clear()
        if self.gone is not None:
            self.items.append(Reset(self.gone))

    @property
    def bodiless(self) -> bool:
        """The peer ended the stream and nothing but the end is left to read."""
        return self.remote_ended and len(self.items) == 1 and isinstance(self.items[0], End)

    def _check(self) -> None:
        if self.gone is not None:
            raise StreamGoneError(self.gone)

    def _lost(self, exc: Exception) -> StreamGoneError:
        logger.debug("stream gone", extra={"stream": self.sid, "error": str(exc)})
        self.gone = CANCEL if self.gone is None else self.gone
        return StreamGoneError(self.gone)


class H2Conn(asyncio.Protocol):
    """One h2 connection (either side); see the module rules."""

    def __init__(self, *, client_side: bool) -> None:
        config = h2.config.H2Configuration(
            client_side=client_side,
            header_encoding=None,
            validate_outbound_headers=False,  # h2msg rule 4 (rule 8)
            normalize_outbound_headers=False,
        )
        self.h2 = h2.connection.H2Connection(config=config)
        self.client_side = client_side
        self.transport: asyncio.Transport | None = None
        self.streams: dict[int, H2Stream] = {}
        self.incoming: deque[H2Stream] = deque()  # server side: new request streams
        self.closed = False
        self.going_away = False
        self.pool_key: Hashable = None
        self._write_paused = False
        self._flush_soon = False
        self._queued = 0  # DATA bytes handed to h2 since the last write
        self._waiters: list[asyncio.Future[None]] = []  # window or drain or news
        self._idle: asyncio.TimerHandle | None = None
        self.on_idle: Callable[[H2Conn], None] | None = None

    # --- asyncio callbacks --------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        tr = cast("asyncio.Transport", transport)
        self.transport = tr
        tr.set_write_buffer_limits(HIGH_WATER, LOW_WATER)
        values = {
            h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: STREAM_WINDOW,
            h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: 1000,
        }
        if self.client_side:
            values[h2.settings.SettingCodes.ENABLE_PUSH] = 0
        self.h2.local_settings = h2.settings.Settings(
            client=self.client_side, initial_values=values
        )
        self.h2.initiate_connection()
        self.h2.increment_flow_control_window(CONN_WINDOW - 65535)
        self.flush()

    def data_received(self, data: bytes) -> None:
        try:
            events = self.h2.receive_data(data)
        except h2.exceptions.ProtocolError as exc:
            logger.info("h2 protocol error, closing", extra={"error": str(exc)})
            self.flush()  # the GOAWAY
            self.close()
            return
        for ev in events:
            self._event(ev)
        self.flush()

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

    def _event(self, ev: h2.events.Event) -> None:  # noqa: C901, PLR0912 - the dispatch table
        if isinstance(ev, h2.events.DataReceived):
            stream = self.streams.get(ev.stream_id or 0)
            if stream is None or stream.gone is not None:
                self.ack(ev.stream_id or 0, ev.flow_controlled_length or 0)
            else:
                stream.push(Data(ev.data or b"", ev.flow_controlled_length or 0))
        elif isinstance(ev, h2.events.RequestReceived):
            stream = H2Stream(self, ev.stream_id or 0)
            stream.request = list(cast("H2Headers", ev.headers or []))
            self.streams[stream.sid] = stream
            self._busy()
            self.incoming.append(stream)
            self.wake()
        elif isinstance(ev, h2.events.ResponseReceived):
            self._push(ev.stream_id, Head(list(cast("H2Headers", ev.headers or [])), end=False))
        elif isinstance(ev, h2.events.TrailersReceived):
            self._push(ev.stream_id, Trailers(list(cast("H2Headers", ev.headers or []))))
        elif isinstance(ev, h2.events.StreamEnded):
            self._ended(ev.stream_id or 0)
        elif isinstance(ev, h2.events.StreamReset):
            stream = self.streams.pop(ev.stream_id or 0, None)
            if stream is not None:
                stream.peer_reset(int(ev.error_code or 0))
                self._maybe_idle()
        elif isinstance(ev, h2.events.WindowUpdated | h2.events.RemoteSettingsChanged):
            self.wake()
        elif isinstance(ev, h2.events.ConnectionTerminated):
            self._goaway(ev.last_stream_id or 0)
        elif isinstance(
            ev,
            h2.events.InformationalResponseReceived
            | h2.events.SettingsAcknowledged
            | h2.events.PingReceived
            | h2.events.PingAckReceived
            | h2.events.PriorityUpdated
            | h2.events.UnknownFrameReceived
            | h2.events.AlternativeServiceAvailable
            | h2.events.PushedStreamReceived,
        ):
            pass  # nothing to forward: 1xx are dropped, pushes are refused by h2 settings
        else:
            logger.debug("h2 event ignored", extra={"event": type(ev).__name__})

    def _push(self, sid: int | None, item: Item) -> None:
        stream = self.streams.get(sid or 0)
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
            stream.push(_END)
        if stream.local_ended:
            self.forget(stream)

    def _goaway(self, last_stream_id: int) -> None:
        self.going_away = True
        if self.client_side:
            for sid, stream in list(self.streams.items()):
                if sid > last_stream_id:
                    self.streams.pop(sid, None)
                    stream.peer_reset(h2.errors.ErrorCodes.REFUSED_STREAM)
        if not self.streams:
            self.close()

    # --- helpers -------------------------------------------------------------------

    def flush(self) -> None:
        """Write what h2 queued at the end of this loop iteration (rule 8): one write for
        the frames of every stream that sent something meanwhile."""
        if not self._flush_soon:
            self._flush_soon = True
            asyncio.get_running_loop().call_soon(self.flush_now)

    def queued(self, size: int) -> None:
        """`size` DATA bytes went to h2: write soon, or now past `FLUSH_BYTES` so that
        the transport's buffer (and so `drained`) sees them (rule 2)."""
        self._queued += size
        if self._queued >= FLUSH_BYTES:
            self.flush_now()
        else:
            self.flush()

    def flush_now(self) -> None:
        """Write what h2 queued now."""
        self._flush_soon = False
        self._queued = 0
        data = self.h2.data_to_send()
        tr = self.transport
        if data and tr is not None and not tr.is_closing():
            tr.write(data)

    def ack(self, sid: int, flow: int) -> None:
        if flow <= 0 or self.closed or sid <= 0:
            return
        with contextlib.suppress(h2.exceptions.ProtocolError):
            self.h2.acknowledge_received_data(flow, sid)
            self.flush()

    def forget(self, stream: H2Stream) -> None:
        """The stream is over on both sides (or reset): stop routing frames to it."""
        if self.streams.get(stream.sid) is stream:
            del self.streams[stream.sid]
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
            loop = asyncio.get_running_loop()
            self._idle = loop.call_later(IDLE_TIMEOUT_S, self._idle_close)

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
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        await fut

    async def drained(self) -> None:
        """Until the transport's write buffer is below low water (or it is gone)."""
        while self._write_paused and not self.closed:
            fut = asyncio.get_running_loop().create_future()
            self._waiters.append(fut)
            await fut

    async def next_incoming(self) -> H2Stream | None:
        """Server side: the next request stream; None once the connection is closed."""
        while not self.incoming:
            if self.closed:
                return None
            fut = asyncio.get_running_loop().create_future()
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
        # Our own count: h2's `open_outbound_streams` walks every stream.
        return len(self.streams) < self.h2.remote_settings.max_concurrent_streams

    def open_stream(self, headers: H2Headers, *, end: bool) -> H2Stream:
        """Start a request stream.

        Raises:
            StreamGoneError: the connection cannot take it any more.
        """
        try:
            sid = self.h2.get_next_available_stream_id()
            stream = H2Stream(self, sid)
            self.streams[sid] = stream
            self.h2.send_headers(sid, h2msg.protect(headers), end_stream=end)
        except (h2.exceptions.ProtocolError, h2.exceptions.NoAvailableStreamIDError) as exc:
            self.going_away = True
            raise StreamGoneError(h2.errors.ErrorCodes.REFUSED_STREAM) from exc
        stream.local_ended = end
        self._busy()
        self.flush()
        return stream

    def close(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            with contextlib.suppress(h2.exceptions.ProtocolError):
                self.h2.close_connection()
            self.flush_now()
            self.transport.close()


# --- the upstream pool ------------------------------------------------------------------


class H2Pool:
    """One multiplexed upstream h2 connection per key (rule 6), for one worker's loop."""

    def __init__(self) -> None:
        self._conns: dict[Hashable, list[H2Conn]] = {}
        self._opening: dict[Hashable, asyncio.Future[H2Conn]] = {}
        self.opened = 0

    async def stream(
        self, key: Hashable, opener: Opener, headers: H2Headers, *, end: bool
    ) -> H2Stream:
        """A new request stream to `key`'s upstream, opening a connection if needed.

        Raises:
            UpstreamError: connecting failed (or whatever `opener` raises).
        """
        for _ in range(3):
            conn = await self._conn(key, opener)
            try:
                return conn.open_stream(headers, end=end)
            except StreamGoneError:
                continue
        raise UpstreamError(str(key), "upstream h2 connections refuse new streams")

    async def _conn(self, key: Hashable, opener: Opener) -> H2Conn:
        while True:
            for conn in self._conns.get(key, ()):
                if conn.usable:
                    return conn
            pending = self._opening.get(key)
            if pending is None:
                break
            with contextlib.suppress(UpstreamError):
                await asyncio.shield(pending)
                continue
            break
        fut: asyncio.Future[H2Conn] = asyncio.get_running_loop().create_future()
        self._opening[key] = fut
        try:
            _, proto = await opener(lambda: H2Conn(client_side=True))
        except BaseException as exc:
            err = exc if isinstance(exc, UpstreamError) else UpstreamError(str(key), repr(exc))
            fut.set_exception(err)
            fut.exception()
            raise
        finally:
            if self._opening.get(key) is fut:
                del self._opening[key]
        conn = cast("H2Conn", proto)
        conn.pool_key = key
        conn.on_idle = self._drop
        self._conns.setdefault(key, []).append(conn)
        self.opened += 1
        if not fut.done():
            fut.set_result(conn)
        return conn

    def _drop(self, conn: H2Conn) -> None:
        conns = self._conns.get(conn.pool_key)
        if conns is not None and conn in conns:
            conns.remove(conn)
            if not conns:
                del self._conns[conn.pool_key]

    def count(self, key: Hashable | None = None) -> int:
        """Open upstream connections (for `key`, or all)."""
        if key is not None:
            return len(self._conns.get(key, ()))
        return sum(len(v) for v in self._conns.values())

    def close(self) -> None:
        for conns in list(self._conns.values()):
            for conn in list(conns):
                conn.close()
        self._conns.clear()


# --- routing a stream ---------------------------------------------------------------------


@dataclass(slots=True, kw_only=True)
class Routed:
    """Where one stream goes: a pool key, how to connect, the headers to send."""

    key: Hashable
    open: Opener
    headers: H2Headers
    handle: Handle | None = None
    route: Route | None = None
    timeout_s: float | None = None
    labels: Labels = field(default_factory=dict)


class StreamRouter(Protocol):
    """Decides, per stream, where it goes (outbound) or whether it may (inbound)."""

    direction: str

    async def route(self, headers: H2Headers) -> Routed | Answer:
        """The upstream for a request with these headers, or the proxy's answer."""
        ...


# --- serving a client connection ----------------------------------------------------------


async def serve(
    transport: asyncio.Transport,
    router: StreamRouter,
    pool: H2Pool,
    prefix: bytes,
    *,
    eof: bool,
) -> int:
    """Serve an h2 client connection whose reading is paused; the number of streams seen."""
    conn = H2Conn(client_side=False)
    transport.set_protocol(conn)
    conn.connection_made(transport)
    if prefix:
        conn.data_received(prefix)
    if eof:
        conn.close()
    elif not conn.closed:
        transport.resume_reading()
    tasks: set[asyncio.Task[None]] = set()
    count = 0
    try:
        while True:
            stream = await conn.next_incoming()
            if stream is None:
                break
            count += 1
            task = aio.spawn(proxy_stream(stream, router, pool), name=f"h2-stream-{stream.sid}")
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        if tasks:
            await asyncio.wait(list(tasks))
    finally:
        for task in list(tasks):
            task.cancel()
        conn.close()
    return count


async def proxy_stream(down: H2Stream, router: StreamRouter, pool: H2Pool) -> None:  # noqa: C901 - one stream's life, in order
    """Serve one request stream end to end (rules 1-5, 7)."""
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    REQUEST.set(h2msg.request_head(down.request))
    grpc = h2msg.is_grpc(down.request)
    up: H2Stream | None = None
    routed: Routed | None = None
    pump: asyncio.Task[int | None] | None = None
    try:
        got = await router.route(down.request)
        if isinstance(got, Answer):
            await _answer(down, got, router.direction, {}, t0)
            return
        routed = got
        recorder().request(router.direction, routed.labels)
        deadline = t0 + routed.timeout_s if routed.timeout_s is not None else None
        try:
            async with _NO_TIMEOUT if deadline is None else asyncio.timeout_at(deadline):
                up = await pool.stream(routed.key, routed.open, routed.headers, end=down.bodiless)
                pump = _link(down, up)
                head = await _response_head(up)
        except (TimeoutError, UpstreamError) as exc:
            if pump is not None:
                pump.cancel()
            status, why = (
                (504, "request timed out")
                if isinstance(exc, TimeoutError)
                else (
                    getattr(exc, "status", 502),
                    str(exc),
                )
            )
            await _fail(down, up, routed, router.direction, t0, (status, why), grpc=grpc)
            return
        await _respond(down, up, head, routed, router.direction, t0)
        if pump is not None and not pump.done():
            # The response ended first: the request may go on for a while (rule 3).
            done, _ = await asyncio.wait([pump], timeout=ANSWER_DRAIN_S)
            if not done:
                pump.cancel()
                down.reset(NO_ERROR)
    except StreamGoneError:
        if routed is not None and routed.handle is not None:
            routed.handle.done(loop.time(), ok=False)
        down.reset(CANCEL)
        if up is not None:
            up.reset(CANCEL)
    finally:
        if pump is not None and not pump.done():
            pump.cancel()
        if routed is not None and routed.handle is not None:
            routed.handle.cancel()  # no-op when done already
        _close(down)
        if up is not None:
            _close(up)


def _close(stream: H2Stream) -> None:
    """The stream's task is over: reset it unless it ended both ways; free its window."""
    if stream.gone is None and not (stream.local_ended and stream.remote_ended):
        stream.reset(CANCEL)
    stream.discard()
    stream.conn.forget(stream)


def _link(down: H2Stream, up: H2Stream) -> asyncio.Task[int | None] | None:
    """Resets travel both ways (rule 3); the task forwarding the request body, if any."""
    down.on_reset = lambda _code: up.reset(CANCEL)
    up.on_reset = down.reset
    if up.local_ended:  # the request had no body: no task for it
        return None
    return aio.spawn(_pump(down, up), name="h2-request-body")


async def _response_head(up: H2Stream) -> Head:
    item = await up.next()
    if not isinstance(item, Head):
        raise UpstreamError("upstream", f"response began with {type(item).__name__}")
    return item


async def _respond(  # noqa: PLR0913, PLR0917 - the facts of one response
    down: H2Stream,
    up: H2Stream,
    head: Head,
    routed: Routed,
    direction: str,
    t0: float,
) -> None:
    status = h2msg.status_of(head.headers)
    down.send_headers(head.headers, end=head.end)
    grpc_status = h2msg.grpc_status(head.headers) if head.end else None
    if not head.end:
        grpc_status = await _pump(up, down, propagate=True)
    now = asyncio.get_running_loop().time()
    failure = classify(routed.route, status, grpc_status)
    if routed.handle is not None:
        routed.handle.done(now, ok=not failure)
    recorder().response(
        direction, routed.labels, status=status, latency_s=now - t0, failure=failure
    )


async def _pump(src: H2Stream, dst: H2Stream, *, propagate: bool = False) -> int | None:
    """Forward DATA and trailers from `src` to `dst` until the end; the grpc-status seen.

    A reset on either side resets the other (rule 3) and ends the pump
    (re-raised when `propagate`). Each DATA item is acknowledged to `src`'s
    sender once `dst` took it (rule 2).
    """
    try:
        while True:
            item = await src.next()
            if isinstance(item, Data):
                if await _forward(src, dst, item):
                    return None
            elif isinstance(item, Trailers):
                dst.send_headers(item.headers, end=True)
                return h2msg.grpc_status(item.headers)
            elif isinstance(item, End):
                if not (dst.gone == NO_ERROR and dst.remote_ended):
                    dst.end()
                return None
            else:  # a second HEADERS that is not trailers
                raise StreamGoneError(h2.errors.ErrorCodes.PROTOCOL_ERROR)  # noqa: TRY301
    except StreamGoneError as exc:
        src.reset(CANCEL)
        dst.reset(exc.code)
        if propagate:
            raise
        return None


async def _forward(src: H2Stream, dst: H2Stream, item: Data) -> bool:
    """Send one DATA item on, then acknowledge it to `src`'s sender; True when the
    stream is over for `dst` (the plain end queued behind it went in the last frame).

    Raises:
        StreamGoneError: `dst` is gone (and not just done reading a complete stream).
    """
    end = src.peek_end()
    try:
        await dst.send_data(item.data, end=end)
    except StreamGoneError:
        if dst.gone == NO_ERROR and dst.remote_ended:
            await _discard_rest(src)  # the response is complete: rule 3
            return True
        raise
    finally:
        src.ack(item.flow)
    if end and src.peek_end():
        src.items.popleft()
    return end


async def _discard_rest(src: H2Stream) -> None:
    """Read what is left of `src` (acknowledging it) until its end."""
    while True:
        item = await src.next()
        if isinstance(item, Data):
            src.ack(item.flow)
        elif isinstance(item, Trailers | End):
            return


async def _drain_request(down: H2Stream) -> None:
    """We answered first: read (and discard) the rest of the request, else reset it."""
    try:
        async with asyncio.timeout(ANSWER_DRAIN_S):
            while True:
                item = await down.next()
                if isinstance(item, Data):
                    down.ack(item.flow)
                elif isinstance(item, Trailers | End):
                    return
    except (TimeoutError, StreamGoneError):
        down.reset(NO_ERROR)


async def _fail(  # noqa: PLR0913, PLR0917 - the facts of one failed stream
    down: H2Stream,
    up: H2Stream | None,
    routed: Routed,
    direction: str,
    t0: float,
    why: tuple[int, str],
    *,
    grpc: bool,
) -> None:
    down.on_reset = None
    if up is not None:
        up.on_reset = None
        up.reset(CANCEL)
    if routed.handle is not None:
        routed.handle.done(asyncio.get_running_loop().time(), ok=False)
    answer = h2msg.answer_for(why[0], why[1], grpc=grpc)
    await _answer(down, answer, direction, routed.labels, t0)


async def _answer(
    down: H2Stream, answer: Answer, direction: str, labels: Labels, t0: float
) -> None:
    """Answer the stream ourselves, then read the rest of its request."""
    down.send_headers(h2msg.answer_headers(answer), end=True)
    status, failure = h2msg.answer_outcome(answer)
    recorder().response(
        direction,
        labels,
        status=status,
        latency_s=asyncio.get_running_loop().time() - t0,
        failure=failure,
    )
    if not down.remote_ended:
        await _drain_request(down)


# --- per-worker pools ---------------------------------------------------------------------

_POOLS: weakref.WeakKeyDictionary[Any, H2Pool] = weakref.WeakKeyDictionary()


def pool_of(worker: Any) -> H2Pool:
    """The h2 upstream pool of a worker (made on first use)."""
    pool = _POOLS.get(worker)
    if pool is None:
        pool = _POOLS[worker] = H2Pool()
    return pool
