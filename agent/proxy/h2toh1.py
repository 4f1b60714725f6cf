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
   is read after the body was sent, as the HTTP/1 path does.
3. A response that arrived whole goes out as HEADERS + one DATA with
   END_STREAM (or trailers: a chunked body's become the stream's, origproto
   rule 5); a longer one is sent as it arrives, and the app connection's
   reading pauses while more than `HIGH_WATER` bytes wait for the stream's window.
4. Failures before the response head answer 502 (`l5d-proxy-error`), as the
   HTTP/2 path does; after it, the stream is reset and the app connection
   dropped. The app connection goes back to the pool only after a complete,
   keep-alive exchange.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, cast

from agent.proxy import h2msg, http1, origproto
from agent.proxy.h1upstream import HIGH_WATER, UpstreamConn
from agent.proxy.h2frame import ErrorCode
from agent.proxy.h2stream import CANCEL, Data, End, H2Stream, StreamGoneError, Trailers
from agent.proxy.profile import classify
from agent.proxy.record import recorder
from agent.proxy.upstream import UpstreamError

if TYPE_CHECKING:
    from collections.abc import Hashable

    from agent.proxy.h1upstream import Exchange
    from agent.proxy.http1 import ResponseHead
    from agent.proxy.record import Labels
    from agent.proxy.upstream import ConnPool, TransportOpener


def _decoding_conn() -> UpstreamConn:
    conn = UpstreamConn()
    conn.parser = http1.ResponseParser(decode_chunked=True)  # rule 1
    return conn


class Downgrade:
    """An inbound connection's way to the app over HTTP/1, for its upgraded streams."""

    __slots__ = ("_last", "key", "labels", "open", "pool")

    def __init__(
        self, pool: ConnPool, key: Hashable, opener: TransportOpener, labels: Labels
    ) -> None:
        self.pool = pool
        self.key = ("h1down", key)
        self.open = opener
        self.labels = labels
        self._last: tuple[ResponseHead, h2msg.H2Headers] | None = None

    async def serve(self, down: H2Stream, request: origproto.Downgraded, t0: float) -> None:
        """Serve one upgraded stream end to end (rules 2-4)."""
        loop = down.conn.loop
        try:
            up, exch = await self._send(down, request)
        except UpstreamError as exc:
            self._fail(down, exc, loop.time() - t0)
            return
        try:
            resp = await exch.head
        except UpstreamError as exc:
            up.abort()
            self._fail(down, exc, loop.time() - t0)
            return
        except BaseException:
            up.abort()
            raise
        try:
            await self._respond(down, up, exch, resp)
        except UpstreamError:
            up.abort()
            down.reset(ErrorCode.INTERNAL_ERROR)
            self._record(resp.status, loop.time() - t0)
            return
        except BaseException:
            up.abort()
            raise
        up.finish()
        if resp.keep_alive and up.reusable:
            self.pool.release(up)
        else:
            up.close()
        self._record(resp.status, loop.time() - t0)

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
            tr.write(head)
            if bodiless:
                down.items.popleft()  # the end
            else:
                await _body_in(down, conn, chunked=chunked)
        except BaseException:
            conn.abort()
            raise
        return conn, exch

    async def _respond(
        self, down: H2Stream, up: UpstreamConn, exch: Exchange, resp: ResponseHead
    ) -> None:
        """The app's response as the stream's (rule 3)."""
        last = self._last
        if last is not None and last[0] is resp:
            headers = last[1]
        else:
            headers = origproto.upgrade_response(resp)
            self._last = (resp, headers)
        if exch.ended:  # the whole response is here
            body = b"".join(exch.pending)
            exch.pending.clear()
            if not body and not exch.trailers:
                down.send_headers(headers, end=True)
                return
            down.send_headers(headers)
            await _last(down, exch, body)
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
                    await _last(down, exch, data)
                    return
                await down.send_data(data)
                continue
            if exch.error is not None:
                raise exch.error
            if exch.ended:
                await _last(down, exch, b"")
                return
            fut: asyncio.Future[None] = loop.create_future()
            sink.waiter = fut
            exch.done = fut  # the exchange resolves it at the end, fails it on an error
            try:
                await fut
            finally:
                sink.waiter = None
                exch.done = None

    def _fail(self, down: H2Stream, exc: UpstreamError, latency_s: float) -> None:
        """No response head from the app: the proxy answers (rule 4)."""
        answer = h2msg.answer_for(exc.status, str(exc), grpc=False)
        down.send_headers(h2msg.answer_headers(answer), end=True)
        self._record(exc.status, latency_s)

    def _record(self, status: int, latency_s: float) -> None:
        failure = classify(None, status, None)
        recorder().response(
            "inbound", self.labels, status=status, latency_s=latency_s, failure=failure
        )


async def _last(down: H2Stream, exch: Exchange, body: bytes) -> None:
    """The end of the stream's response: its last bytes, then the app's trailers if it
    sent any (origproto rule 5), else END_STREAM on the last DATA."""
    tail = exch.trailers
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
        elif isinstance(item, Trailers | End):
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
