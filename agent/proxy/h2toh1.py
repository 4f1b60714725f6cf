"""Inbound: an upgraded h2 stream (`l5d-orig-proto`) served by the app over HTTP/1.

A Linkerd-compatible outbound proxy (ours, agent.proxy.h1toh2, or
linkerd2-proxy) sends an app's HTTP/1 requests to a meshed pod as h2 streams
marked `l5d-orig-proto`. The inbound stream router (agent.proxy.h2route)
authorizes the stream as any other and hands it here: the request goes to the
app as the HTTP/1 request it stands for (agent.proxy.origproto), on the
worker's pooled keep-alive connections to the app, and the app's response
comes back as the stream's response, marked again.

Rules:
1. The app's connections are pooled under their own key (`("h1down", ...)`):
   their parser decodes chunked bodies (an h2 body has no chunk framing), so
   they never mix with the HTTP/1 path's connections, which pass chunks raw.
2. The request body is sent as it arrives (chunk-encoded when it has no
   `content-length`), each DATA acknowledged once written; the response head
   is read after the body was sent, as the HTTP/1 path does. What of the body
   already arrived with the head (up to `JOIN_BYTES`) leaves in the head's write,
   and a request that arrived whole is held for the batch (agent.proxy.writes) as
   rule 5's are: written apart, the head and a 1 KiB body cost the app two
   wake-ups and the worker two system calls per request (bench/RESULTS.md,
   fifty-second pass).
3. A response that arrived whole goes out as HEADERS + one DATA with
   END_STREAM (or trailers: a chunked body's become the stream's, origproto
   rule 5); a longer one is sent as it arrives, and the app connection's
   reading pauses while more than `HIGH_WATER` bytes wait for the stream's window.
4. Failures before the response head answer 502 (`l5d-proxy-error`), as the
   HTTP/2 path does; after it, the stream is reset and the app connection
   dropped. The app connection goes back to the pool only after a complete,
   keep-alive exchange.
5. In callbacks (`serve_now`, called by agent.proxy.h2serve): a stream that is
   bodiless, or whose body (up to `JOIN_BYTES`) and end came in the read its head came
   in, with an idle pooled app connection is held for the app, head and body in one
   write (agent.proxy.writes: the streams of one read of the lane reach the app in one
   system call), and its
   response answered from the app connection's callbacks (`DownExchange`, the
   connection's exchange) when it ends in the read its head came in; a response
   still arriving goes on in a task (`rest`) with what came so far, as does a
   body the stream's window does not take at once. Callbacks run in the client
   connection's context with `record.REQUEST` set to the stream's request.
6. Metrics: a stream served in a task had its request counted by agent.proxy.http2 and
   counts its response here (`record`). One served in callbacks counts both here: at
   once with its response through the connection's bound handle (h2serve's
   `Starter.exchanged`, record rule 5), or the request alone where it fails or goes on
   in a task (`counted`).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, Final, cast

from agent.proxy import h2msg, http1, origproto, writes
from agent.proxy.h1upstream import HIGH_WATER, Exchange, UpstreamConn
from agent.proxy.h2frame import ErrorCode
from agent.proxy.h2stream import CANCEL, Data, End, H2Stream, StreamGoneError, Trailers
from agent.proxy.http1 import BodyData, MessageEnd, ProtocolError, ResponseHead, Upgraded
from agent.proxy.profile import classify
from agent.proxy.record import REQUEST, recorder
from agent.proxy.upstream import UpstreamError

if TYPE_CHECKING:
    from collections.abc import Coroutine, Hashable

    from agent.proxy.h2serve import Starter
    from agent.proxy.record import Labels
    from agent.proxy.upstream import ConnPool, TransportOpener


JOIN_BYTES: Final = 64 * 1024  # of a request's body sent with its head at most (rule 2)


def _decoding_conn() -> UpstreamConn:
    conn = UpstreamConn()
    conn.parser = http1.ResponseParser(decode_chunked=True)  # rule 1
    return conn


class Downgrade:
    """An inbound connection's way to the app over HTTP/1, for its upgraded streams."""

    __slots__ = ("_last", "batch", "key", "labels", "open", "pool")

    def __init__(
        self, pool: ConnPool, key: Hashable, opener: TransportOpener, labels: Labels
    ) -> None:
        self.pool = pool
        # an object, one per upstream: the pool finds it by identity (upstream rule 6)
        self.key: Hashable = pool.canonical(("h1down", key))
        self.open = opener
        self.labels = labels
        self._last: tuple[ResponseHead, h2msg.H2Headers] | None = None
        self.batch = writes.batch_for(asyncio.get_running_loop())

    async def serve(self, down: H2Stream, request: origproto.Downgraded, t0: float) -> None:
        """Serve one upgraded stream end to end (rules 2-4)."""
        loop = down.conn.loop
        try:
            up, exch = await self._send(down, request)
        except UpstreamError as exc:
            self.fail(down, exc, loop.time() - t0)
            return
        try:
            resp = await exch.head
        except UpstreamError as exc:
            up.abort()
            self.fail(down, exc, loop.time() - t0)
            return
        except BaseException:
            up.abort()
            raise
        await self.rest(down, up, exch, resp, t0)

    async def rest(
        self, down: H2Stream, up: UpstreamConn, exch: Exchange, resp: ResponseHead, t0: float
    ) -> None:
        """The stream's response from the app's head on (rules 3, 4)."""
        loop = down.conn.loop
        try:
            await self._respond(down, up, exch, resp)
        except UpstreamError:
            up.abort()
            down.reset(ErrorCode.INTERNAL_ERROR)
            self.record(resp.status, loop.time() - t0)
            return
        except BaseException:
            up.abort()
            raise
        self.release(up, resp)
        self.record(resp.status, loop.time() - t0)

    def release(self, up: UpstreamConn, resp: ResponseHead) -> None:
        """The exchange is complete: the app connection back to the pool, or closed."""
        up.finish()
        if resp.keep_alive:
            self.pool.release(up)  # which closes it when not reusable
        else:
            up.close()

    def serve_now(
        self,
        down: H2Stream,
        request: origproto.Downgraded,
        t0: float,
        starter: Starter,
    ) -> bool:
        """`serve` in callbacks (rule 5): False, with nothing done, when the stream's body
        has not all arrived (or is past `JOIN_BYTES`) or no app connection is idle."""
        bodiless = down.bodiless
        if not bodiless and not down.whole_within(JOIN_BYTES):
            return False
        up = self.pool.take(self.key)
        if up is None:
            return False
        conn = cast("UpstreamConn", up)
        tr = conn.transport
        assert tr is not None  # noqa: S101 - pooled connections are connected
        head, chunked = request.head_bytes(end=bodiless)
        if bodiless:
            down.drop_end()
        else:
            parts = [head]
            # whole (checked above): the body and its end are queued, so this takes all
            origproto.take_body(down, parts, chunked=chunked, limit=JOIN_BYTES + 1)
            head = b"".join(parts)
        conn.begin_with(DownExchange(self, down, conn, t0, starter), request.method)
        self.batch.hold(tr, head)  # agent.proxy.writes
        return True

    def headers_for(self, resp: ResponseHead) -> h2msg.H2Headers:
        """The stream's response headers for the app's head (the last one's remembered)."""
        last = self._last
        if last is not None and last[0] is resp:
            return last[1]
        headers = origproto.upgrade_response(resp)
        self._last = (resp, headers)
        return headers

    async def _send(
        self, down: H2Stream, request: origproto.Downgraded
    ) -> tuple[UpstreamConn, Exchange]:
        """The request on a pooled app connection, its body streamed (rule 2)."""
        up = self.pool.take(self.key)
        if up is None:
            opener = self.open

            async def connect() -> UpstreamConn:
                _, proto = await opener(_decoding_conn)
                return cast("UpstreamConn", proto)

            up, _ = await self.pool.acquire(self.key, connect)
        conn = cast("UpstreamConn", up)
        exch = conn.begin(request.method, None)
        tr = conn.transport
        assert tr is not None  # noqa: S101 - connected by the opener
        bodiless = down.bodiless
        head, chunked = request.head_bytes(end=bodiless)
        try:
            if bodiless:
                tr.write(head)
                down.drop_end()
            else:
                parts = [head]
                if origproto.take_body(down, parts, chunked=chunked, limit=JOIN_BYTES):  # rule 2
                    self.batch.hold(tr, b"".join(parts))
                else:
                    tr.write(b"".join(parts) if len(parts) > 1 else head)
                    await _body_in(down, conn, chunked=chunked)
        except BaseException:
            conn.abort()
            raise
        return conn, exch

    async def _respond(
        self, down: H2Stream, up: UpstreamConn, exch: Exchange, resp: ResponseHead
    ) -> None:
        """The app's response as the stream's (rule 3)."""
        headers = self.headers_for(resp)
        if exch.ended:  # the whole response is here
            body = b"".join(exch.pending)
            exch.pending.clear()
            if not body and not exch.trailers:
                down.send_headers(headers, end=True)
                return
            down.send_headers(headers)
            await _last(down, body, exch.trailers)
            return
        down.send_headers(headers)
        sink = _Sink(up)
        exch.forward_to(sink)
        loop = down.conn.loop
        while True:
            if sink.parts:
                data = b"".join(sink.parts)
                sink.take()
                if exch.ended:
                    await _last(down, data, exch.trailers)
                    return
                await down.send_data(data)
                continue
            if exch.error is not None:
                raise exch.error
            if exch.ended:
                await _last(down, b"", exch.trailers)
                return
            fut: asyncio.Future[None] = loop.create_future()
            sink.waiter = fut
            exch.done = fut  # the exchange resolves it at the end, fails it on an error
            try:
                await fut
            finally:
                sink.waiter = None
                exch.done = None

    def fail(self, down: H2Stream, exc: UpstreamError, latency_s: float) -> None:
        """No response head from the app: the proxy answers (rule 4)."""
        answer = h2msg.answer_for(exc.status, str(exc), grpc=False)
        down.send_headers(h2msg.answer_headers(answer), end=True)
        self.record(exc.status, latency_s)

    def record(self, status: int, latency_s: float) -> None:
        """The response of a stream whose request was counted already (rule 6)."""
        failure = classify(None, status, None)
        recorder().response(
            "inbound", self.labels, status=status, latency_s=latency_s, failure=failure
        )

    def counted(self) -> None:
        """The request of a callback stream that is not answered in callbacks (rule 6)."""
        recorder().request("inbound", self.labels)


class DownExchange:
    """An upgraded stream's exchange with the app, in callbacks (rule 5): the app
    connection's exchange, as agent.proxy.h1fast's `CallbackExchange` is."""

    __slots__ = (
        "down",
        "ended",
        "in_ctx",
        "interim",
        "parts",
        "request",
        "resp",
        "starter",
        "t0",
        "up",
        "way",
    )

    def __init__(
        self, way: Downgrade, down: H2Stream, up: UpstreamConn, t0: float, starter: Starter
    ) -> None:
        self.way = way
        self.down = down
        self.up = up
        self.t0 = t0
        self.starter = starter  # the client connection's: its tasks and bound handle
        self.in_ctx = starter.in_ctx  # the client connection's bound `Context.run`
        self.request = REQUEST.get()  # the stream's, set by the caller in `in_ctx`
        self.resp: ResponseHead | None = None
        self.parts: list[bytes | memoryview] = []
        self.interim = False
        self.ended = False  # answered, failed or handed over: the connection's exchange no more

    # What UpstreamConn calls (outside the connection's context)
    def on_events(self, events: list[http1.Event]) -> None:
        if not self.ended:
            self.in_ctx(self._on_events, events)

    def on_whole(self, head: ResponseHead, data: bytes) -> None:
        self.on_events(http1.whole_events(head, data))

    def fail(self, err: UpstreamError) -> None:
        if not self.ended:
            self.in_ctx(self._fail, err)

    def _on_events(self, events: list[http1.Event]) -> None:
        for ev in events:
            if isinstance(ev, BodyData):
                self.parts.append(ev.data)
            elif isinstance(ev, ResponseHead):
                if ev.status < 200:
                    self.interim = True
                else:
                    self.resp = ev
            elif isinstance(ev, MessageEnd):
                if self.interim:
                    self.interim = False
                else:
                    self._answer(ev.trailers)
                    return
            elif isinstance(ev, ProtocolError):
                self._fail(UpstreamError("upstream", f"bad response: {ev.reason}"))
                return
            elif isinstance(ev, Upgraded):
                self._fail(UpstreamError("upstream", "protocol switch is not supported here"))
                return
        if self.resp is not None:
            self._hand_over()

    def _answer(self, tail: http1.Headers | None) -> None:
        """The whole response is here: the stream's HEADERS, DATA and end (rule 3)."""
        self.ended = True
        down, up, way = self.down, self.up, self.way
        resp = self.resp
        assert resp is not None  # noqa: S101 - the parser ends a message only after its head
        headers = way.headers_for(resp)
        body = b"".join(self.parts)
        self.parts = []
        rest = False
        try:
            if not body and not tail:
                down.send_headers(headers, end=True)
            else:
                down.send_headers(headers)
                rest = not (body and not tail and down.send_data_now(body, end=True))
        except StreamGoneError:
            up.finish()
            up.abort()
            down.reset(CANCEL)
            down.close()
            REQUEST.set(self.request)
            way.counted()
            return
        way.release(up, resp)
        REQUEST.set(self.request)
        status = resp.status
        self.starter.exchanged(
            way.labels, status, down.conn.loop.time() - self.t0, classify(None, status, None)
        )
        if rest:  # the window did not take the body at once, or trailers follow it
            self.starter.spawn(_then_close(down, _last(down, body, tail)))
        else:
            down.close()

    def _fail(self, err: UpstreamError) -> None:
        """No response from the app: the proxy answers 502 (rule 4)."""
        self.ended = True
        up, down = self.up, self.down
        up.finish()
        up.abort()
        REQUEST.set(self.request)
        self.way.counted()
        try:
            self.way.fail(down, err, down.conn.loop.time() - self.t0)
        except StreamGoneError:
            down.reset(CANCEL)
        down.close()

    def _hand_over(self) -> None:
        """The response goes on past this read: a task takes it from its head (`rest`)."""
        self.ended = True
        resp = self.resp
        assert resp is not None  # noqa: S101 - checked by the caller
        down, up = self.down, self.up
        exch = Exchange(down.conn.loop, None)
        exch.got_bytes = True
        exch.pending = self.parts
        exch.head.set_result(resp)
        up.exch = exch
        REQUEST.set(self.request)
        self.way.counted()
        self.starter.spawn(_then_close(down, self.way.rest(down, up, exch, resp, self.t0)))


async def _then_close(down: H2Stream, work: Coroutine[Any, Any, None]) -> None:
    """Finish `down`'s response in a task (`work`), then close the stream; reset when it
    went away meanwhile."""
    try:
        await work
    except StreamGoneError:
        down.reset(CANCEL)
    finally:
        down.close()


async def _last(down: H2Stream, body: bytes, tail: http1.Headers | None) -> None:
    """The end of the stream's response: its last bytes, then the app's trailers if it
    sent any (origproto rule 5), else END_STREAM on the last DATA."""
    if body:
        await down.send_data(body, end=not tail)
    if tail:
        down.send_headers(origproto.upgrade_trailers(tail), end=True)
    elif not body:
        down.end()


async def _body_in(down: H2Stream, up: UpstreamConn, *, chunked: bool) -> None:
    """The stream's request body to the app, until its end (rule 2)."""
    tr = up.transport
    assert tr is not None  # noqa: S101
    while True:
        item = await down.next()
        if isinstance(item, Data):
            tr.write(origproto.chunk(item.data) if chunked else item.data)
            down.ack(item.flow)
            if up.write_paused:
                await up.drained()
        elif isinstance(item, (Trailers, End)):
            if chunked:
                tail = item.headers if isinstance(item, Trailers) else None
                tr.write(origproto.last_chunk(tail))
            return
        else:
            raise StreamGoneError(CANCEL)


class _Sink(asyncio.Transport):
    """Where a streamed response's body goes (`Exchange.forward_to`): queued for the
    stream, the app connection's reading paused past `HIGH_WATER` (rule 3)."""

    def __init__(self, up: UpstreamConn) -> None:
        super().__init__()
        self.up = up
        self.parts: list[bytes] = []
        self.size = 0
        self.waiter: asyncio.Future[None] | None = None

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.parts.append(bytes(data))
        self.size += len(data)
        tr = self.up.transport
        if self.size > HIGH_WATER and tr is not None and tr.is_reading():
            tr.pause_reading()
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    def take(self) -> None:
        self.parts.clear()
        self.size = 0
        tr = self.up.transport
        if tr is not None and not tr.is_reading() and not tr.is_closing():
            tr.resume_reading()
