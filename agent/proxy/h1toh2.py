"""Outbound: an HTTP/1 request sent upgraded, as an h2 stream to the peer proxy.

The HTTP/1 connection's coroutine (agent.proxy.httpproxy `HttpConn`) calls
`send` for an attempt whose `Target` has an h2 pool (the endpoint's inbound
takes `l5d-orig-proto`, agent.proxy.origproto), then `respond` with what came
back. The stream is one of many on the worker's connection to that endpoint
(agent.proxy.h2pool): every client connection's requests to it share one TLS
session, and the frames of one loop iteration leave in one write.

Rules:
1. `send` is `HttpConn._send`'s twin: the request goes as h2 headers (END_STREAM
   when it has no body), its body as DATA as it arrives (END_STREAM on the last DATA
   when the end came with it), the attempt's result is
   the response's HEADERS. A reset or a lost connection before them is an
   `UpstreamError` (502), which the caller may retry like an HTTP/1 failure.
2. `respond` writes the response as HTTP/1 (origproto rule 3): the head joins the
   first body bytes or the end in one write; each DATA is acknowledged to the
   peer (reopening its window) once written to the client, and a client that
   cannot take more (`write_paused`) is waited for first, so memory per request
   stays bounded by the stream's window. A response whose rest is already queued
   (up to `WHOLE_BYTES`) is held whole for the batch (agent.proxy.writes rules 3
   and 5), as the callbacks' are: written one by one, a loop batch of upgraded
   POSTs' responses cost a system call and a client wake-up each (bench/RESULTS.md,
   fifty-second pass).
3. A stream that breaks after the head was written aborts the client connection
   (as an HTTP/1 upstream that breaks does); either way the stream is closed
   and discarded, so it holds no reference cycle (agent.proxy.http2 rule 8).
4. Per connection the h2 headers of the last request head are remembered by the
   head's identity (parsed heads are shared objects, agent.proxy.http1), as
   `HttpConn._head_bytes` does for HTTP/1; the lists themselves are shared by every
   connection of the worker that sends the same fields (`SHARED`, read-only), so the
   lane's HPACK encoder finds a repeat by identity (agent.proxy.h2hpack rule 5).
5. A worker keeps `Worker.h2_lanes` h2 connections per endpoint, each client
   connection sending on one of them (agent.proxy.h2pool rule 2).
6. In callbacks (`start_now`, httpproxy rule 7): a request that arrived whole, whose
   lane has an established h2 connection that takes its body at once (one DATA frame
   within the windows, `H2Conn.takes_body`), is opened on it from the client's
   `data_received`, HEADERS and DATA in one write, and
   answered from the stream's callbacks (`UpExchange`, the client connection's callback
   exchange while it lasts): what one batch of frames brought leaves in one client
   write, a whole response held to the end of the loop's batch (agent.proxy.writes).
   A client that cannot take more hands the rest of the body to a task (as `respond`
   writes it); a stream that breaks before the head is answered 502, after it the
   client is aborted, as on the coroutine path (which serves everything else).
7. `--h2-upgrade auto` (the default) upgrades a request only when multiplexing pays:
   its target's HTTP/1 pool has no idle connection and `AUTO_PLAIN` busy ones
   (`ConnPool.crowded`, agent.proxy.upstream rule 5), or its client connection's lane
   has a stream open (`H2Pool.busy`). One request at a time, or a few,
   go as plain HTTP/1 inside mTLS on pooled connections, which costs less per
   request when nothing shares a TLS record; beyond that, requests share the lane's
   h2 connection instead of opening more TLS connections (bench/RESULTS.md,
   eighteenth pass), and keep joining it while it is busy: an idle HTTP/1 connection
   taken beside a busy lane writes its own record and wakes the loop on its own,
   splitting the lane's batches (fifty-second pass: auto at 0.90x `on`'s requests/s
   at saturation before, 0.99x after). `on` upgrades every request, `off` none.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final

from agent import aio
from agent.proxy import h1msg, h2msg, origproto
from agent.proxy.h1client import ClientGoneError
from agent.proxy.h2stream import CANCEL, Data, End, H2Stream, Head, StreamGoneError, Trailers
from agent.proxy.http1 import BodyData, Framing, MessageEnd, ProtocolError, RequestHead
from agent.proxy.profile import classify
from agent.proxy.record import recorder
from agent.proxy.upstream import UpstreamError

if TYPE_CHECKING:
    from collections.abc import Hashable

    from agent.proxy.h1plan import Plan, Target
    from agent.proxy.h2msg import H2Headers
    from agent.proxy.h2pool import H2Pool
    from agent.proxy.httpproxy import HttpConn


AUTO_PLAIN: Final = 2  # rule 7: busy HTTP/1 connections per target before upgrading
WHOLE_BYTES: Final = 64 * 1024  # a queued response body held whole at most (rule 2)


class Upgraded:
    """An upgraded attempt's stream and the response HEADERS it got."""

    __slots__ = ("head", "status", "stream")

    def __init__(self, stream: H2Stream, head: Head, status: int) -> None:
        self.stream = stream
        self.head = head
        self.status = status


SHARED_MAX: Final = 1024  # header lists `shared` keeps (rule 4); cleared whole when full
_SHARED: Final[dict[tuple[Any, ...], H2Headers]] = {}


def shared(headers: H2Headers) -> H2Headers:
    """The worker's one list equal to `headers` (rule 4): `headers` itself the first time.
    Equal lists have the same fields, never-indexed marks included: `upgrade_request`
    marks none."""
    key = tuple(headers)
    got = _SHARED.get(key)
    if got is None:
        if len(_SHARED) >= SHARED_MAX:
            _SHARED.clear()
        got = _SHARED[key] = headers
    return got


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
        if headers is not None:
            headers = shared(headers)
        self.head = head
        self.rewrite = rewrite
        self.headers = headers
        return headers


def lane_key(conn: HttpConn, target: Target, pool: H2Pool) -> Hashable:
    """The pool key of the client connection's lane to `target` (h2pool rule 3): the
    pool's one object for it, kept by the connection for its last h2 key."""
    h2_key = target.h2_key
    if conn.h2_key_of is h2_key and conn.h2_key is not None:
        return conn.h2_key
    key = pool.lane_key(h2_key, lane_of(conn, pool))
    conn.h2_key_of = h2_key
    conn.h2_key = key
    return key


def lane_of(conn: HttpConn, pool: H2Pool) -> int:
    """The client connection's lane (rule 5), picked at its first upgraded request."""
    lane = conn.h2_lane
    if lane < 0:
        lane = conn.h2_lane = pool.next_lane()
    return lane


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
    key = lane_key(conn, target, pool)
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
            end = down.take_end()  # already here: END_STREAM on this DATA, no frame of its own
            await stream.send_data(bytes(ev.data), end=end)
            if end:
                return
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
            conn.batch.hold(conn.transport, out, lane=True)  # whole: writes rules 3, 5
        elif not _whole_out(conn, stream, out, chunked=chunked):
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
        latency_s=conn.now() - t0,
        failure=failure,
    )
    return keep


def _whole_out(conn: HttpConn, stream: H2Stream, out: bytes, *, chunked: bool) -> bool:
    """Hold the response `out` begins for the batch when the rest of it is queued on
    `stream` and at most `WHOLE_BYTES` (rule 2): as the callbacks' responses are, so the
    responses of one read of the lane leave in one system call, not one write each."""
    if not stream.whole_within(WHOLE_BYTES):
        return False
    parts = [out]
    if not origproto.take_body(stream, parts, chunked=chunked, limit=WHOLE_BYTES + 1):
        raise StreamGoneError(CANCEL)  # ended, yet its end was not queued: cannot be
    conn.batch.hold(conn.transport, b"".join(parts), lane=True)  # writes rules 3, 5
    return True


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
        elif isinstance(item, (Trailers, End)):
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


# --- in callbacks (rule 6) -------------------------------------------------------------


def start_now(  # noqa: PLR0913, PLR0917 - the facts of one request
    conn: HttpConn,
    head: RequestHead,
    plan: Plan,
    target: Target,
    t0: float,
    body: list[bytes | memoryview],
) -> bool:
    """Open `head` upgraded from the client's callbacks (rule 6), with its whole `body`;
    False, with nothing done, when it may not be upgraded, its lane has no established
    connection, or that connection cannot send the body at once."""
    pool = target.h2
    if pool is None or not origproto.upgradable(head):
        return False
    headers = conn.h2_memo.headers_for(head, target)
    if headers is None:
        return False
    data = b"".join(body) if body else b""
    stream = pool.stream_now(lane_key(conn, target, pool), headers, end=True, body=data)
    if stream is None:
        return False
    fast = UpExchange(conn, stream, head, plan, target, t0)
    conn.fast = fast
    stream.sink = fast.on_stream
    return True


class UpExchange:
    """A request upgraded in callbacks (rule 6): the client connection's callback
    exchange while its stream's response comes."""

    __slots__ = (
        "chunked",
        "conn",
        "failure",
        "head",
        "keep",
        "out",
        "plan",
        "status",
        "stream",
        "t0",
        "target",
    )

    def __init__(  # noqa: PLR0913, PLR0917 - the facts of one request
        self,
        conn: HttpConn,
        stream: H2Stream,
        head: RequestHead,
        plan: Plan,
        target: Target,
        t0: float,
    ) -> None:
        self.conn = conn
        self.stream = stream
        self.head = head
        self.plan = plan
        self.target = target
        self.t0 = t0
        self.status: int | None = None  # the response's, once its head is taken
        self.out: list[bytes] = []  # for the client, written once per batch of frames
        self.chunked = False
        self.keep = True
        self.failure = False

    def on_stream(self, stream: H2Stream) -> None:
        """The stream's sink (agent.proxy.h2stream): called outside the client's context."""
        if self.conn.fast is not self:  # the client connection went on without it
            stream.close()  # its sink too (`discard`)
            return
        self.conn.in_ctx(self._on_items)

    def _on_items(self) -> None:
        stream = self.stream
        while True:
            try:
                item = stream.next_now()
            except StreamGoneError as exc:
                self._broken(f"h2 stream reset ({exc.code})")
                return
            if item is None:
                break
            if self.status is None:
                if not isinstance(item, Head):
                    self._broken(f"h2 response began with {type(item).__name__}")
                    return
                self._head(item)
                if item.end:
                    self._finish()
                    return
            elif isinstance(item, Data):
                self.out.append(origproto.chunk(item.data) if self.chunked else item.data)
                stream.ack(item.flow)
            elif isinstance(item, (Trailers, End)):
                if self.chunked:
                    tail = item.headers if isinstance(item, Trailers) else None
                    self.out.append(origproto.last_chunk(tail))
                self._finish()
                return
        self._flush()

    def _head(self, item: Head) -> None:
        status = h2msg.status_of(item.headers) or 502
        self.status = status
        self.failure = classify(self.plan.route, status)
        out, self.chunked, self.keep = origproto.downgrade_response(
            item.headers, self.head, end=item.end
        )
        self.out.append(out)

    def _flush(self) -> None:
        """What came so far to the client; past its high water the rest goes on in a task."""
        out = self.out
        if out:
            self.conn.write(out[0] if len(out) == 1 else b"".join(out))
            out.clear()
        conn = self.conn
        if conn.write_paused and self.status is not None:
            self.stream.sink = None
            aio.spawn(self._rest(), name="h2-upgraded-rest")

    async def _rest(self) -> None:
        """The rest of the body once the client drained (as `respond` writes it)."""
        try:
            await self.conn.client_drained()
            if self.conn.down.lost:
                raise ClientGoneError  # noqa: TRY301
            await _body_out(self.conn, self.stream, b"", chunked=self.chunked)
        except (StreamGoneError, ClientGoneError):
            self._abort_client()
            return
        self._finish()

    def _finish(self) -> None:
        """The response is complete: settle the endpoint, metrics; the next request."""
        conn = self.conn
        self.stream.close()
        out = self.out
        if out:
            data = out[0] if len(out) == 1 else b"".join(out)
            conn.batch.hold(conn.transport, data, lane=True)  # writes rule 5
            out.clear()
        status = self.status
        assert status is not None  # noqa: S101 - the end comes after the head
        now = conn.now()
        target = self.target
        if target.handle is not None:
            target.handle.done(now, not self.failure)
        keep = self.keep and self.head.keep_alive
        conn.exchanged(target.labels, status, now - self.t0, failure=self.failure, keep=keep)

    def _broken(self, reason: str) -> None:
        """The stream broke: 502 before the response head, else the client is aborted."""
        if self.status is not None:  # the head is out (or on its way): nothing to tell
            self._abort_client()
            return
        conn = self.conn
        self.stream.close()
        target = self.target
        if target.handle is not None:
            target.handle.done(conn.now(), ok=False)
        conn.fast = None
        conn.answer_failed(
            502, f"upstream: {reason}", self.t0, target.labels, keep_alive=self.head.keep_alive
        )
        conn.pump()

    def _abort_client(self) -> None:
        conn = self.conn
        self.stream.close()
        if self.target.handle is not None:
            self.target.handle.done(conn.now(), ok=False)
        if conn.fast is self:
            conn.fast = None
        conn.transport.abort()
        conn.stop = True
        conn.pump()

    def lost(self) -> None:
        """The client went away (or its connection ends): the stream is cancelled."""
        self.stream.close()
        if self.target.handle is not None:
            self.target.handle.cancel()
        if self.conn.fast is self:
            self.conn.fast = None
