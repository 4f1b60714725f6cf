"""Outbound: an HTTP/1 request sent upgraded, as an h2 stream to the peer proxy.

The HTTP/1 connection's coroutine (agent.proxy.httpproxy `HttpConn`) calls
`send` for an attempt whose `Target` has an h2 pool (the endpoint's inbound
takes `l5d-orig-proto`, agent.proxy.origproto), then `respond` with what came
back. The stream is one of many on the worker's connection to that endpoint
(agent.proxy.h2pool): every client connection's requests to it share one TLS
session, and the frames of one loop iteration leave in one write.

Rules:
1. `send` is `HttpConn._send`'s twin: the request goes as h2 headers (END_STREAM
   when it has no body), its body as DATA as it arrives, the attempt's result is
   the response's HEADERS. A reset or a lost connection before them is an
   `UpstreamError` (502), which the caller may retry like an HTTP/1 failure.
2. `respond` writes the response as HTTP/1 (origproto rule 3): the head joins the
   first body bytes or the end in one write; each DATA is acknowledged to the
   peer (reopening its window) once written to the client, and a client that
   cannot take more (`write_paused`) is waited for first, so memory per request
   stays bounded by the stream's window.
3. A stream that breaks after the head was written aborts the client connection
   (as an HTTP/1 upstream that breaks does); either way the stream is closed
   and discarded, so it holds no reference cycle (agent.proxy.http2 rule 8).
4. Per connection the h2 headers of the last request head are remembered by the
   head's identity (parsed heads are shared objects, agent.proxy.http1), as
   `HttpConn._head_bytes` does for HTTP/1.
5. A worker keeps `h2pool.LANES` h2 connections per endpoint, each client
   connection sending on one of them (agent.proxy.h2pool rule 2).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from agent.proxy import h1msg, h2msg, origproto
from agent.proxy.h1client import ClientGoneError
from agent.proxy.h2stream import CANCEL, Data, End, H2Stream, Head, StreamGoneError, Trailers
from agent.proxy.http1 import BodyData, Framing, MessageEnd, ProtocolError, RequestHead
from agent.proxy.record import recorder
from agent.proxy.upstream import UpstreamError

if TYPE_CHECKING:
    from agent.proxy.h1plan import Target
    from agent.proxy.h2msg import H2Headers
    from agent.proxy.httpproxy import HttpConn


class Upgraded:
    """An upgraded attempt's stream and the response HEADERS it got."""

    __slots__ = ("head", "status", "stream")

    def __init__(self, stream: H2Stream, head: Head, status: int) -> None:
        self.stream = stream
        self.head = head
        self.status = status


class Memo:
    """The h2 headers of a connection's last upgraded request head (rule 4)."""

    __slots__ = ("head", "headers", "rewrite")

    def __init__(self) -> None:
        self.head: RequestHead | None = None
        self.rewrite: object = None
        self.headers: H2Headers | None = None

    def headers_for(self, head: RequestHead, target: Target) -> H2Headers | None:
        rewrite = target.rewrite
        if self.head is head and self.rewrite is rewrite:
            return self.headers
        fields = head.headers if rewrite is None else rewrite(head.headers)
        headers = origproto.upgrade_request(head, fields)
        self.head = head
        self.rewrite = rewrite
        self.headers = headers
        return headers


async def send(
    conn: HttpConn, target: Target, head: RequestHead, replay: bytes | None
) -> Upgraded | None:
    """Send one attempt over h2 (rule 1); None: this request cannot be upgraded.

    Raises:
        UpstreamError: connecting failed, or the stream broke before the response.
        ClientGoneError: the client went away while its body was being sent.
    """
    pool = target.h2
    assert pool is not None  # noqa: S101 - the caller checked
    headers = conn.h2_memo.headers_for(head, target)
    if headers is None:
        return None
    bodiless = head.framing is Framing.NONE
    conn.body_done = replay is not None
    key = (target.h2_key, conn.h2_lane)
    stream = await pool.stream(key, target.open, headers, end=bodiless or replay == b"")
    try:
        if replay:
            await stream.send_data(replay, end=True)
        elif not conn.body_done and not (bodiless and conn.down.take_end()):
            await _body(conn, stream)  # bodiless: only the end is left to read
        conn.body_done = True
        item = await stream.next()
        if not isinstance(item, Head):
            raise UpstreamError("upstream", f"h2 response began with {type(item).__name__}")  # noqa: TRY301
    except StreamGoneError as exc:
        stream.close()
        raise UpstreamError("upstream", f"h2 stream reset ({exc.code})") from None
    except BaseException:
        stream.close()
        raise
    return Upgraded(stream, item, h2msg.status_of(item.headers) or 502)


async def _body(conn: HttpConn, stream: H2Stream) -> None:
    """The client's request body, as DATA, until its end (END_STREAM)."""
    down = conn.down
    while True:
        ev = await down.next_event()
        if isinstance(ev, BodyData):
            await stream.send_data(bytes(ev.data))
        elif isinstance(ev, MessageEnd):
            if not stream.local_ended:
                stream.end()
            return
        else:  # client gone or broken body
            if isinstance(ev, ProtocolError):
                conn.write(h1msg.error_response(ev.status, ev.reason, close=True))
            raise ClientGoneError


async def respond(  # noqa: PLR0913 - the facts of one response
    conn: HttpConn,
    head: RequestHead,
    target: Target,
    got: Upgraded,
    *,
    t0: float,
    failure: bool,
) -> bool:
    """Answer the client from the upgraded stream (rules 2, 3); whether it may go on."""
    stream = got.stream
    resp = got.head
    out, chunked, keep = origproto.downgrade_response(resp.headers, head, end=resp.end)
    try:
        if resp.end:
            conn.write(out)
        else:
            await _body_out(conn, stream, out, chunked=chunked)
    except (StreamGoneError, ClientGoneError):
        conn.end_handle(target, ok=False)
        conn.transport.abort()
        raise ClientGoneError from None
    finally:
        stream.close()
    conn.end_handle(target, ok=not failure)
    recorder().response(
        conn.router.direction,
        target.labels,
        status=got.status,
        latency_s=conn.loop.time() - t0,
        failure=failure,
    )
    return keep


async def _body_out(conn: HttpConn, stream: H2Stream, out: bytes, *, chunked: bool) -> None:
    """The response body to the client, `out` (the head) joined to its first write."""
    pending = out
    while True:
        item = await stream.next()
        if isinstance(item, Data):
            data = item.data
            if chunked:
                data = origproto.chunk(data)
            conn.write(pending + data if pending else data)
            pending = b""
            stream.ack(item.flow)
            if conn.write_paused:
                await conn.client_drained()
            if conn.down.lost:
                raise ClientGoneError
        elif isinstance(item, Trailers | End):
            tail = b""
            if chunked:
                tail = origproto.last_chunk(item.headers if isinstance(item, Trailers) else None)
            if pending or tail:
                conn.write(pending + tail)
            return
        else:
            raise StreamGoneError(CANCEL)


def cancel(got: Upgraded) -> None:
    """Drop an attempt whose response is not used (retried)."""
    got.stream.close()
