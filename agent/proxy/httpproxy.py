"""HTTP/1.1 proxying of one client connection: a thin asyncio shell over agent.proxy.http1.

One coroutine per client connection (`HttpConn.serve`) reads requests in
order and, for each, asks a `Router` where it goes (outbound: balanced
endpoint; inbound: the app after authorization), sends it on a pooled
keep-alive upstream connection and streams the response back.

Rules:
1. In order: the next request is read only after the previous response was
   fully written, so pipelined requests are answered in order (later ones
   wait in the parser's buffer; reading pauses when too much is queued).
2. Bodies stream: request body chunks are written upstream as they arrive,
   response body chunks are written to the client from the upstream
   protocol's callback; neither is copied or buffered whole. Chunked bodies
   pass through raw (`Transfer-Encoding: chunked` kept).
   The one exception: a request on a retryable route whose body is at most
   `REPLAY_LIMIT` bytes (and not chunked) is read whole first so it can be
   sent again; larger bodies are not retried. At most `MAX_ATTEMPTS` tries
   per request, each retry paid from the destination's retry budget.
3. Hop-by-hop headers are dropped both ways; the upstream side is always
   keep-alive; the client side keeps alive unless it asked not to or the
   response is delimited by close.
4. A route timeout covers everything up to the response head (retries
   included): past it the client gets 504 and the attempt is abandoned. The
   response body, once started, is not timed.
5. Failures: connect/TLS/identity errors are 502, no endpoint 503, deny 403
   (gRPC: status 7); each proxy answer carries `l5d-proxy-error`. An
   upstream that breaks after the head was forwarded aborts the client too.
6. Backpressure both ways: a slow client pauses the upstream's reading, a
   slow upstream pauses the client's reading.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, cast

from agent.proxy import http1
from agent.proxy.http1 import (
    BodyData,
    Framing,
    MessageEnd,
    ProtocolError,
    RequestHead,
    ResponseHead,
    Upgraded,
)
from agent.proxy.profile import classify, should_retry
from agent.proxy.record import REQUEST, Labels, recorder
from agent.proxy.upstream import ConnPool, UpstreamError

if TYPE_CHECKING:
    from agent.proxy.balance import Handle
    from agent.proxy.model import Route
    from agent.proxy.profile import RetryBudgetState

logger = logging.getLogger(__name__)

REPLAY_LIMIT = 64 * 1024
MAX_ATTEMPTS = 5  # per request, original included; the retry budget bounds the total too
HIGH_WATER = 256 * 1024
LOW_WATER = 64 * 1024
MAX_QUEUED_EVENTS = 256
COALESCE_LIMIT = 16 * 1024  # body bytes copied to join a head in one write; more go separately
_KEEP_TE = frozenset({b"transfer-encoding"})
_NO_KEEP: frozenset[bytes] = frozenset()

Opener = Callable[[Callable[[], asyncio.Protocol]], Awaitable[tuple[asyncio.Transport, Any]]]


@dataclass(slots=True, kw_only=True)
class Reject:
    """Answer the request with this proxy response instead of forwarding it."""

    status: int
    response: bytes
    close: bool = False


@dataclass(slots=True, kw_only=True)
class Target:
    """Where one attempt goes: a pool key, how to open a connection, header rewrite."""

    key: Hashable
    open: Opener
    rewrite: Callable[[http1.Headers], http1.Headers] | None = None
    handle: Handle | None = None  # balancer handle: done(now, ok) when the attempt ends
    labels: Labels = field(default_factory=dict)


@dataclass(slots=True, kw_only=True)
class Plan:
    """How to serve one request: its route (retries, timeout, classes) and target choice."""

    choose: Callable[[int], Awaitable[Target | Reject]]  # attempt number -> target
    route: Route | None = None
    budget: RetryBudgetState | None = None
    timeout_s: float | None = None
    labels: Labels = field(default_factory=dict)


class Router(Protocol):
    """Decides, per request, where it goes (outbound) or whether it may (inbound)."""

    direction: str

    async def plan(self, head: RequestHead) -> Plan | Reject:
        """The plan for `head`, or a proxy answer."""
        ...


class _ClientGoneError(Exception):
    """The client vanished or sent a broken request; the connection ends."""


# --- upstream side -------------------------------------------------------------


class _Exchange:
    """One request/response on an upstream connection."""

    __slots__ = (
        "done",
        "down",
        "ended",
        "error",
        "got_bytes",
        "head",
        "interim",
        "interim_to",
        "pending",
    )

    def __init__(
        self, loop: asyncio.AbstractEventLoop, interim_to: asyncio.Transport | None
    ) -> None:
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
            done = self.done
            if self.down is not None and done is not None and not done.done():
                done.set_result(None)
        elif isinstance(ev, ProtocolError):
            self.fail(UpstreamError("upstream", f"bad response: {ev.reason}"))
        elif isinstance(ev, Upgraded):
            self.fail(UpstreamError("upstream", "protocol switch is not supported here"))
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
            self.done = asyncio.get_running_loop().create_future()
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
        "lost",
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
        self.exch: _Exchange | None = None
        self.lost = False
        self.eof = False
        self.write_paused = False
        self._drain: asyncio.Future[None] | None = None

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
        for ev in self.parser.feed(data):
            exch.on_event(ev)

    def eof_received(self) -> bool:
        self.eof = True
        exch = self.exch
        if exch is not None:
            for ev in self.parser.feed_eof():
                exch.on_event(ev)
            if not exch.ended:
                exch.fail(UpstreamError("upstream", "closed before the response ended"))
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        exch = self.exch
        if exch is not None and not exch.ended:
            reason = f"connection lost: {exc}" if exc else "connection closed"
            exch.fail(UpstreamError("upstream", reason))
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
            self._drain = asyncio.get_running_loop().create_future()
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
            and not tr.is_closing()
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

    def begin(self, method: bytes, interim_to: asyncio.Transport | None) -> _Exchange:
        loop = asyncio.get_running_loop()
        self.exch = exch = _Exchange(loop, interim_to)
        self.parser.expect(method)
        return exch

    def finish(self) -> None:
        self.exch = None


# --- client side -------------------------------------------------------------------


class _Down(asyncio.Protocol):
    """The client connection's protocol: parse requests, queue events for the coroutine."""

    def __init__(self, conn: HttpConn) -> None:
        self.conn = conn
        self.transport: asyncio.Transport | None = None
        self.parser = http1.RequestParser()
        self.events: deque[http1.Event] = deque()
        self.queued = 0
        self.paused = False
        self.eof = False
        self.lost = False
        self._waiter: asyncio.Future[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        tr = cast("asyncio.Transport", transport)
        self.transport = tr
        tr.set_write_buffer_limits(HIGH_WATER, LOW_WATER)

    def data_received(self, data: bytes) -> None:
        evs = self.parser.feed(data)
        for ev in evs:
            if type(ev) is BodyData:
                self.queued += len(ev.data)
        self.events.extend(evs)
        if (self.queued > HIGH_WATER or len(self.events) > MAX_QUEUED_EVENTS) and not self.paused:
            self.paused = True
            if self.transport is not None:
                self.transport.pause_reading()
        self._wake()

    def eof_received(self) -> bool:
        self.events.extend(self.parser.feed_eof())
        self.eof = True
        self._wake()
        return True  # keep our side open to answer

    def connection_lost(self, exc: Exception | None) -> None:  # noqa: ARG002 - Protocol API
        self.lost = True
        self.conn.client_lost()
        self._wake()

    def pause_writing(self) -> None:
        self.conn.client_write_paused(paused=True)

    def resume_writing(self) -> None:
        self.conn.client_write_paused(paused=False)

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)
        self._waiter = None

    def take_end(self) -> bool:
        """Consume a queued `MessageEnd` without waiting; whether there was one next."""
        events = self.events
        if events and type(events[0]) is MessageEnd:
            events.popleft()
            return True
        return False

    async def next_event(self) -> http1.Event | None:
        """The next parsed event; None when the client is gone or done sending."""
        while not self.events:
            if self.lost or self.eof:
                return None
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        ev = self.events.popleft()
        if type(ev) is BodyData:
            self.queued -= len(ev.data)
        if self.paused and self.queued <= LOW_WATER and len(self.events) < MAX_QUEUED_EVENTS // 2:
            self.paused = False
            if self.transport is not None and not self.lost:
                self.transport.resume_reading()
        return ev


class HttpConn:
    """Serves one client connection; see the module rules."""

    def __init__(self, transport: asyncio.Transport, router: Router, pool: ConnPool) -> None:
        self.router = router
        self.pool = pool
        self.down = _Down(self)
        self.transport = transport
        self.current: UpstreamConn | None = None
        self.requests = 0
        self.body_done = False  # the current request's body was read from the client
        self._write_paused = False
        self._loop = asyncio.get_running_loop()

    def attach(self, prefix: bytes = b"", *, eof: bool = False) -> None:
        """Take over `transport` (paused) and feed what was already read."""
        tr = self.transport
        tr.set_protocol(self.down)
        self.down.connection_made(tr)
        tr.pause_reading()
        if prefix:
            self.down.data_received(prefix)
        if eof:
            self.down.eof_received()
        elif not self.down.paused:
            tr.resume_reading()

    # callbacks from _Down
    def client_lost(self) -> None:
        up = self.current
        if up is not None:
            up.abort()

    def client_write_paused(self, *, paused: bool) -> None:
        self._write_paused = paused
        up = self.current
        if up is not None and up.transport is not None and not up.lost:
            if paused:
                up.transport.pause_reading()
            else:
                up.transport.resume_reading()

    # the coroutine
    async def serve(self) -> None:
        """Serve requests until the client is done or the connection must close."""
        try:
            while True:
                ev = await self.down.next_event()
                if ev is None:
                    break
                if isinstance(ev, ProtocolError):
                    self._write(http1.error_response(ev.status, ev.reason, close=True))
                    break
                if not isinstance(ev, RequestHead):
                    logger.error("BUG: request event out of place", extra={"event": repr(ev)})
                    break
                self.requests += 1
                if not await self._request(ev):
                    break
        except _ClientGoneError:
            pass
        finally:
            if self.current is not None:
                self.current.abort()
                self.current = None
            if not self.transport.is_closing():
                self.transport.close()

    def _write(self, data: bytes) -> None:
        if not self.transport.is_closing():
            self.transport.write(data)

    async def _request(self, head: RequestHead) -> bool:
        """Serve one request; whether the client connection may carry another."""
        t0 = self._loop.time()
        REQUEST.set(head)  # for the recorder (agent.proxy.record rule 4)
        if head.upgrade is not None or head.method == b"CONNECT":
            await self._skip_body()
            return self._answer(reject(501, "upgrade not supported", close=True), t0, {})
        plan = await self.router.plan(head)
        if isinstance(plan, Reject):
            await self._skip_body()
            return self._answer(plan, t0, {}) and head.keep_alive
        replay: bytes | None = None
        route = plan.route
        if (
            route is not None
            and route.is_retryable
            and plan.budget is not None
            and head.framing is not Framing.CHUNKED
            and (head.content_length or 0) <= REPLAY_LIMIT
            and not head.expect_continue
        ):
            replay = await self._read_body()
        if plan.budget is not None:
            plan.budget.deposit(t0)
        deadline = t0 + plan.timeout_s if plan.timeout_s is not None else None
        return await self._attempts(head, plan, replay, t0, deadline)

    async def _attempts(
        self,
        head: RequestHead,
        plan: Plan,
        replay: bytes | None,
        t0: float,
        deadline: float | None,
    ) -> bool:
        route = plan.route
        self.body_done = replay is not None
        attempt = 0
        while True:
            attempt += 1
            target = await plan.choose(attempt)
            if isinstance(target, Reject):
                if not self.body_done:
                    await self._skip_body()
                return self._answer(target, t0, plan.labels) and head.keep_alive
            recorder().request(self.router.direction, target.labels or plan.labels)
            try:
                if deadline is None:
                    up, exch, resp = await self._send(target, head, replay)
                else:
                    async with asyncio.timeout_at(deadline):
                        up, exch, resp = await self._send(target, head, replay)
            except TimeoutError:
                self._abandon(target)
                return await self._fail(head, target, 504, "request timed out", t0)
            except UpstreamError as err:
                self._abandon(target)
                if self._may_retry(plan, replay, err.status, attempt):
                    continue
                return await self._fail(head, target, err.status, str(err), t0)
            failure = classify(route, resp.status)
            if failure and self._may_retry(plan, replay, resp.status, attempt):
                self._abandon(target)
                continue
            return await self._respond(head, target, up, exch, resp, t0=t0, failure=failure)

    def _may_retry(self, plan: Plan, replay: bytes | None, status: int, attempt: int) -> bool:
        if replay is None or plan.budget is None:
            return False
        now = self._loop.time()
        return should_retry(
            plan.route, status, attempt, plan.budget, now, max_attempts=MAX_ATTEMPTS
        )

    def _abandon(self, target: Target) -> None:
        """The attempt failed or is dropped: report it, drop its upstream connection."""
        self._end_handle(target, ok=False)
        self._drop_current()

    async def _fail(
        self, head: RequestHead, target: Target, status: int, message: str, t0: float
    ) -> bool:
        """Answer a failed request; the connection closes if its body was not read whole.

        A request without a body has only its end left to read; a body is not
        waited for (the client may be slow, and we already failed it).
        """
        bodiless = head.framing is Framing.NONE or head.content_length == 0
        if not self.body_done and bodiless and not self.down.lost:
            self.body_done = await self._skip_body_safely()
        answer = reject(status, message, close=not self.body_done)
        return self._answer(answer, t0, target.labels) and head.keep_alive

    async def _send(
        self, target: Target, head: RequestHead, replay: bytes | None
    ) -> tuple[UpstreamConn, _Exchange, ResponseHead]:
        """Send the request (body streamed or replayed); the response head.

        A reused pooled connection that dies before answering is replaced by a
        fresh one once, when the body can be sent again (replay or no body).
        """
        resendable = replay is not None or head.framing is Framing.NONE
        self.body_done = replay is not None
        for _ in range(2):
            up, reused = await self._acquire(target)
            self.current = up
            exch = up.begin(head.method, self.transport if head.expect_continue else None)
            headers = http1.strip_hop_by_hop(
                head.headers, keep=_KEEP_TE if head.framing is Framing.CHUNKED else _NO_KEEP
            )
            if target.rewrite is not None:
                headers = target.rewrite(headers)
            tr = up.transport
            assert tr is not None  # noqa: S101 - connected by the opener
            out = http1.request_head_bytes(head.method, head.target, headers, head.version)
            if replay:
                if len(replay) <= COALESCE_LIMIT:
                    tr.write(out + replay)
                else:
                    tr.writelines((out, replay))
            else:
                tr.write(out)
            if not replay and not self.body_done:
                if not (head.framing is Framing.NONE and self.down.take_end()):
                    await self._stream_body(up)
                self.body_done = True
            try:
                resp = await exch.head
            except UpstreamError:
                if reused and resendable and not exch.got_bytes:
                    up.abort()
                    self.current = None
                    continue
                raise
            return up, exch, resp
        raise UpstreamError("upstream", "pooled connections keep failing")

    async def _acquire(self, target: Target) -> tuple[UpstreamConn, bool]:
        idle = self.pool.take(target.key)
        if idle is not None:  # the common case: no coroutine, no closure
            return cast("UpstreamConn", idle), True

        async def opener() -> UpstreamConn:
            _, proto = await target.open(UpstreamConn)
            return cast("UpstreamConn", proto)

        conn, reused = await self.pool.acquire(target.key, opener)
        return cast("UpstreamConn", conn), reused

    async def _stream_body(self, up: UpstreamConn) -> None:
        tr = up.transport
        assert tr is not None  # noqa: S101
        while True:
            ev = await self.down.next_event()
            if isinstance(ev, BodyData):
                if not up.lost:
                    tr.write(ev.data)
                    if up.write_paused:
                        await up.drained()
            elif isinstance(ev, MessageEnd):
                return
            else:  # client gone or broken body
                if isinstance(ev, ProtocolError):
                    self._write(http1.error_response(ev.status, ev.reason, close=True))
                raise _ClientGoneError

    async def _read_body(self) -> bytes:
        parts: list[bytes | memoryview] = []
        while True:
            ev = await self.down.next_event()
            if isinstance(ev, BodyData):
                parts.append(ev.data)
            elif isinstance(ev, MessageEnd):
                return b"".join(parts)
            else:
                if isinstance(ev, ProtocolError):
                    self._write(http1.error_response(ev.status, ev.reason, close=True))
                raise _ClientGoneError

    async def _skip_body(self) -> None:
        while True:
            ev = await self.down.next_event()
            if isinstance(ev, MessageEnd):
                return
            if not isinstance(ev, BodyData):
                raise _ClientGoneError

    async def _skip_body_safely(self) -> bool:
        try:
            await self._skip_body()
        except _ClientGoneError:
            return False
        return True

    async def _respond(  # noqa: PLR0913 - the facts of one response
        self,
        head: RequestHead,
        target: Target,
        up: UpstreamConn,
        exch: _Exchange,
        resp: ResponseHead,
        *,
        t0: float,
        failure: bool,
    ) -> bool:
        keep = head.keep_alive and resp.framing is not Framing.UNTIL_CLOSE
        headers = http1.strip_hop_by_hop(
            resp.headers, keep=_KEEP_TE if resp.framing is Framing.CHUNKED else _NO_KEEP
        )
        if (
            headers is resp.headers
            and keep
            and head.version == b"1.1"
            and resp.version == b"1.1"
            and resp.reason
            and resp.raw
        ):
            # Nothing to change: forward the head as received (no rebuild).
            parts: list[bytes | memoryview] = [resp.raw, b"\r\n\r\n"]
        else:
            if not keep:
                headers = [*headers, (b"connection", b"close")]
            elif head.version == b"1.0":
                headers = [*headers, (b"connection", b"keep-alive")]
            parts = [http1.response_head_bytes(resp.status, headers, resp.reason or None)]
        pending = exch.pending
        if pending and sum(map(len, pending)) <= COALESCE_LIMIT:
            # Head and the body bytes already here leave in one write (one send, one record).
            parts += pending
            pending.clear()
        out = b"".join(parts)
        self._write(out)
        if self._write_paused and up.transport is not None:
            up.transport.pause_reading()
        exch.forward_to(self.transport)
        try:
            await exch.wait_end()
        except UpstreamError:
            self._end_handle(target, ok=False)
            self._drop_current()
            self.transport.abort()
            raise _ClientGoneError from None
        now = self._loop.time()
        self._end_handle(target, ok=not failure)
        up.finish()
        self.current = None
        if resp.keep_alive and up.reusable:
            self.pool.release(up)
        else:
            up.close()
        recorder().response(
            self.router.direction,
            target.labels,
            status=resp.status,
            latency_s=now - t0,
            failure=failure,
        )
        return keep

    def _end_handle(self, target: Target, *, ok: bool) -> None:
        if target.handle is not None:
            target.handle.done(self._loop.time(), ok)

    def _drop_current(self) -> None:
        up = self.current
        if up is not None:
            up.abort()
            self.current = None

    def _answer(self, reject: Reject, t0: float, labels: Labels) -> bool:
        self._write(reject.response)
        recorder().response(
            self.router.direction,
            labels,
            status=reject.status,
            latency_s=self._loop.time() - t0,
            failure=reject.status >= 500,
        )
        return not reject.close


def reject(status: int, message: str, *, close: bool = False, grpc: int | None = None) -> Reject:
    """A proxy answer: `l5d-proxy-error` response, or a gRPC trailers-only error."""
    if grpc is not None:
        return Reject(status=status, response=http1.grpc_error_response(grpc, message), close=close)
    return Reject(
        status=status, response=http1.error_response(status, message, close=close), close=close
    )


async def serve(
    transport: asyncio.Transport, router: Router, pool: ConnPool, prefix: bytes, *, eof: bool
) -> int:
    """Serve a client connection whose reading is paused; the number of requests seen."""
    conn = HttpConn(transport, router, pool)
    conn.attach(prefix, eof=eof)
    with contextlib.suppress(_ClientGoneError):
        await conn.serve()
    return conn.requests
