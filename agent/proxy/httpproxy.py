"""HTTP/1.1 proxying of one client connection: a thin asyncio shell over agent.proxy.http1.

Each client connection has one coroutine (`HttpConn.serve`) that serves its
requests in order and, for each, asks a `Router` where it goes (outbound:
balanced endpoint; inbound: the app after authorization), sends it on a
pooled keep-alive upstream connection (agent.proxy.h1upstream) and streams
the response back. The common request is served without it (rule 7). The
client side's protocol is agent.proxy.h1client, the callback exchange
agent.proxy.h1fast, and what routers return (`Plan`, `Target`, `Reject`)
agent.proxy.h1plan (re-exported here).

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
7. The callback path. A request that arrived whole (head, any body, end),
   without upgrade, CONNECT or `Expect`, whose plan is ready at once
   (`Router.plan_now`), has no retries and no timeout, and finds an idle
   pooled connection is served in the protocol callbacks: written upstream
   from the client's `data_received`, answered from the upstream's, and the
   next queued request is taken from there. The coroutine sleeps meanwhile
   (`parked`) and gets the connection back, with any work already decided
   (`handoff`), for everything else. A request upgraded to h2 goes the same way
   when its lane's h2 connection is up and takes its body at once (agent.proxy.h1toh2
   rule 6).
   Both paths keep rules 1-6. A reused connection that fails before any
   response byte hands the request to the coroutine, which sends it again on a
   fresh one (as `_send` does).
   Callbacks run in the connection's context (`in_ctx`, its bound `run`), so the recorder sees
   `record.CONN` and `record.REQUEST` as it does in the coroutine.
8. The callback path holds its writes (the request upstream, a whole response
   to the client) to the end of the loop's batch of callbacks
   (agent.proxy.writes); every other write flushes what is held first.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from typing import TYPE_CHECKING, Any, Final, cast

from agent.proxy import h1msg, h1toh2, writes
from agent.proxy.h1client import ClientGoneError as _ClientGoneError
from agent.proxy.h1client import ClientSide
from agent.proxy.h1fast import (
    KEEP_TE,
    NO_KEEP,
    CallbackExchange,
    Handoff,
    HeadOut,
    response_head,
    whole_request,
)
from agent.proxy.h1plan import Opener, Plan, Reject, Router, Target, reject
from agent.proxy.h1upstream import Exchange, UpstreamConn
from agent.proxy.http1 import (
    BodyData,
    Framing,
    MessageEnd,
    ProtocolError,
    RequestHead,
    ResponseHead,
)
from agent.proxy.origproto import upgradable
from agent.proxy.profile import classify, should_retry
from agent.proxy.record import SET_REQUEST, BoundHttp, Labels, recorder
from agent.proxy.upstream import ConnPool, UpstreamError

if TYPE_CHECKING:
    from collections.abc import Callable, Hashable

logger = logging.getLogger(__name__)

REPLAY_LIMIT: Final = 64 * 1024
MAX_ATTEMPTS: Final = 5  # per request, original included; the retry budget bounds the total too
# body bytes copied to join a head in one write; more go separately
COALESCE_LIMIT: Final = 16 * 1024
# Heads as sent (rule 3), pure functions of what decides them: the request head as received
# and the target's rewrite; the response head as received and the request's method, version
# and keep-alive. Parsed heads are shared objects (agent.proxy.http1), so the worker's
# connections share these too: a new connection's first request is a lookup, not a strip
# and a render (bench/RESULTS.md, fifty-seventh pass). Bounded, cleared whole when full.
# A request head's entry holds its rewrite, whose id is in the key.
_HEAD_CACHE_MAX: Final = 256
_SENT_HEADS: Final[dict[tuple[bytes, int], tuple[object, bytes]]] = {}
_ANSWER_HEADS: Final[dict[tuple[bytes, bool, bytes, bool], HeadOut]] = {}

__all__ = ["HttpConn", "Opener", "Plan", "Reject", "Router", "Target", "reject", "serve"]


class HttpConn:
    """Serves one client connection; see the module rules."""

    def __init__(
        self,
        transport: asyncio.Transport,
        router: Router,
        pool: ConnPool,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        self.router = router
        self.pool = pool
        self.down = ClientSide(self)
        self.transport = transport
        self.current: UpstreamConn | None = None
        self.requests = 0
        self.callback_requests = 0  # of `requests`, answered by the callbacks alone (rule 7)
        self.tally: BoundHttp | None = None  # h1fast's metrics handle (record rule 5)
        self.body_done = False  # the current request's body was read from the client
        self.write_paused = False
        # the caller's loop where it has one: asyncio.get_running_loop() is a getpid() in 3.11
        self.loop = loop if loop is not None else asyncio.get_running_loop()
        self.batch = writes.batch_for(self.loop)  # the callback path's writes (rule 8)
        # the loop's clock, bound once: called per request, a method call by name on the
        # loop was a lookup each time (bench/RESULTS.md, fifty-fourth pass)
        self.now: Callable[[], float] = self.loop.time
        # Rule 7: the callback path's state.
        # `run` of the connection's task context (record.CONN), bound once: called per
        # request, not looked up by name each time
        self.in_ctx: Callable[..., Any] = contextvars.copy_context().run
        self.parked: asyncio.Future[None] | None = None  # the coroutine sleeps on it
        # The exchange the callbacks are serving (an upgraded one: agent.proxy.h1toh2 rule 6).
        self.fast: CallbackExchange | h1toh2.UpExchange | None = None
        self.handoff: Handoff | None = None
        self.stop = False  # no further request on this connection
        # The last answer of each head cache, by the identity of what decided it: parsed heads
        # are shared objects (agent.proxy.http1), so a repeat of the last request or
        # response is two identity checks instead of a hash and a dict lookup.
        self._sent_for: tuple[RequestHead, object, bytes] | None = None  # (head, rewrite, sent)
        self._answer_for: tuple[RequestHead, ResponseHead, HeadOut] | None = None
        self.h2_memo = h1toh2.Memo()  # upgraded requests' h2 headers (agent.proxy.h1toh2)
        self.h2_lane = -1  # and the h2 connection they go on: h1toh2.lane_of picks it
        # the pool key of that lane for the last h2 key (h1toh2.lane_key), as objects
        self.h2_key_of: Hashable = None
        self.h2_key: Hashable = None
        self._drain: asyncio.Future[None] | None = None  # `client_drained` waits on it

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

    # callbacks from ClientSide (agent.proxy.h1client)
    def arrived(self) -> None:
        """Client input (or its EOF) was queued."""
        if self.parked is None:
            self.down.wake()
        elif self.fast is None:
            self.in_ctx(self.pump)
        # else: the callback exchange takes the queue when it ends

    def client_lost(self) -> None:
        up = self.current
        if up is not None:
            up.abort()  # a callback exchange learns of it from the upstream's connection_lost
        fast = self.fast
        if isinstance(fast, h1toh2.UpExchange):
            fast.lost()  # its stream is cancelled
        self.down.wake()
        self._wake_drain()
        if self.fast is None:
            self._unpark()

    def _wake_drain(self) -> None:
        fut, self._drain = self._drain, None
        _wake(fut)

    async def client_drained(self) -> None:
        """Until the client's transport takes writes again (or the client is gone)."""
        while self.write_paused and not self.down.lost:
            self._drain = self.loop.create_future()
            await self._drain

    def client_write_paused(self, *, paused: bool) -> None:
        self.write_paused = paused
        if not paused:
            self._wake_drain()
        up = self.current
        if up is not None and up.transport is not None and not up.lost:
            if paused:
                up.transport.pause_reading()
            else:
                up.transport.resume_reading()

    def _unpark(self) -> None:
        fut, self.parked = self.parked, None
        _wake(fut)

    # the coroutine
    async def serve(self) -> None:
        """Serve requests until the client is done or the connection must close."""
        try:
            while (work := await self._next()) is not None:
                if not await self._request(work.head, work.t0, work.plan, work.target):
                    break
        except _ClientGoneError:
            pass
        finally:
            self.parked = None
            fast = self.fast
            if isinstance(fast, h1toh2.UpExchange):
                fast.lost()
            self.fast = None  # a late upstream callback finds itself stale
            if self.current is not None:
                self.current.abort()
                self.current = None
            if not self.transport.is_closing():
                self.batch.flush()
                self.transport.close()
            self.down.detach()  # no reference cycles left (agent.proxy.worker rule 7)
            self.router.close()

    async def _next(self) -> Handoff | None:
        """The next request for the coroutine, sleeping while the callbacks serve; None: done."""
        down = self.down
        while not self.stop:
            if self.handoff is None and down.events:
                self.in_ctx(self.pump)
            work = self.handoff
            if work is not None:
                self.handoff = None
                return work
            if self.stop:
                break
            if self.fast is not None or not (down.events or down.lost or down.eof):
                self.parked = self.loop.create_future()
                await self.parked  # the callbacks serve until they hand back
                continue
            if not down.events:
                break  # the client is gone or done sending
            ev = down.pop()
            if isinstance(ev, ProtocolError):
                self.write(h1msg.error_response(ev.status, ev.reason, close=True))
                break
            if not isinstance(ev, RequestHead):
                logger.error("BUG: request event out of place", extra={"event": repr(ev)})
                break
            self.requests += 1
            return Handoff(ev, self.now())
        return None

    def write(self, data: bytes | memoryview) -> None:
        if not self.transport.is_closing():
            self.batch.flush()  # agent.proxy.writes rule 2
            self.transport.write(data)

    # --- the callback path (rule 7) ---

    def pump(self) -> None:
        """Serve queued whole requests in callbacks; hand the rest to the coroutine."""
        down = self.down
        events = down.events
        while (
            self.fast is None
            and self.handoff is None
            and not self.stop
            and events
            and not down.lost
        ):
            head = events[0]
            if type(head) is not RequestHead:
                break
            n = whole_request(events)
            if (
                not n
                or head.upgrade is not None
                or head.method == b"CONNECT"
                or head.expect_continue
            ):
                break
            plan = self.router.plan_now(head)
            if plan is None:
                break
            down.pop()  # from here on the request is ours
            if not self._start(head, plan, n):
                break
        self._settle()

    def take(self, head: RequestHead) -> bool:
        """A bodiless request arrived alone, nothing queued: begin it now if the callbacks may.

        The client side's shortcut past the queue (rule 7); False leaves the request
        (head and end) to the caller to queue and report as `arrived`.
        """
        if (
            self.parked is None
            or self.fast is not None
            or self.handoff is not None
            or self.stop
            or self.down.lost
            or head.expect_continue
        ):
            return False
        return cast("bool", self.in_ctx(_TAKE, self, head))

    def _take(self, head: RequestHead) -> bool:
        plan = self.router.plan_now(head)
        if plan is None:
            return False
        self._start(head, plan, 0)
        if self.fast is None:
            self._settle()
        return True

    def _start(self, head: RequestHead, plan: Plan | Reject, n: int) -> bool:
        """Begin `head` in callbacks; False: handed off to the coroutine.

        `n`: the request's events still queued after the head (body pieces and end), as
        `whole_request` counts them; 0 for a request `take` got past the queue.
        """
        self.requests += 1
        t0 = self.now()
        SET_REQUEST(head)
        if type(plan) is Reject:
            self._drop(n)
            self.callback_requests += 1
            self.stop = not (self.answer(plan, t0, {}) and head.keep_alive)
            return True
        assert type(plan) is Plan  # noqa: S101 - narrowing for mypy
        if plan.budget is not None or plan.timeout_s is not None:
            self._hand_off(Handoff(head, t0, plan), n)
            return False
        target = plan.choose(1)
        if type(target) is Reject:
            self._drop(n)
            self.callback_requests += 1
            self.stop = not (self.answer(target, t0, plan.labels) and head.keep_alive)
            return True
        assert type(target) is Target  # noqa: S101 - narrowing for mypy
        h2 = target.h2
        # always upgraded, or its lane is busy already (agent.proxy.h1toh2 rule 7)
        if h2 is not None and (not target.h2_plain or h2.busy(h1toh2.lane_key(self, target, h2))):
            return self._start_upgraded(head, plan, target, t0, n)
        up = self.pool.take(target.key)
        if up is None:  # no idle connection
            return self._start_unpooled(head, plan, target, t0, n)
        up = cast("UpstreamConn", up)
        body = self._drop(n)
        fast = CallbackExchange(self, up, head=head, t0=t0, plan=plan, target=target, body=body)
        self._send_now(fast)
        return True

    def _start_unpooled(
        self, head: RequestHead, plan: Plan, target: Target, t0: float, n: int
    ) -> bool:
        """`_start` for a request that found no idle HTTP/1 connection: upgraded when its
        target's are all busy (agent.proxy.h1toh2 rule 7), else to the coroutine."""
        if target.h2 is not None and self.pool.live(target.key) >= target.h2_plain:
            return self._start_upgraded(head, plan, target, t0, n)
        self._hand_off(Handoff(head, t0, plan, target), n)
        return False

    def _upgrade(self, target: Target) -> bool:
        """Whether a request to `target` (whose inbound takes h2) goes upgraded now
        (agent.proxy.h1toh2 rule 7)."""
        plain = target.h2_plain
        if not plain or self.pool.crowded(target.key, plain):
            return True
        h2 = target.h2
        return h2 is not None and h2.busy(h1toh2.lane_key(self, target, h2))

    def _start_upgraded(
        self, head: RequestHead, plan: Plan, target: Target, t0: float, n: int
    ) -> bool:
        """`_start` for a target whose inbound takes HTTP/1 upgraded to h2."""
        body = self._drop(n)
        if h1toh2.start_now(self, head, plan, target, t0, body):
            return True
        if n:
            self.down.push_front(body)  # queued again, for the coroutine
        self._hand_off(Handoff(head, t0, plan, target), n)
        return False

    def _send_now(self, fast: CallbackExchange) -> None:
        """Write `fast`'s request on its idle pooled connection; the callbacks take it on."""
        up = fast.up
        self.fast = fast
        self.current = up
        up.begin_with(fast, fast.head.method)
        out = self._head_bytes(fast.head, fast.target)
        tr = up.transport
        assert tr is not None  # noqa: S101 - pooled connections are connected
        body = fast.body
        self.batch.hold(tr, b"".join((out, *body)) if body else out)

    def _hand_off(self, work: Handoff, n: int) -> None:
        """The coroutine serves `work`; it reads the body and end from the queue."""
        if not n:
            self.down.push_front([])  # the end `take` did not queue
        self.handoff = work

    def _settle(self) -> None:
        """Wake the coroutine if the callbacks stopped with work or news for it."""
        down = self.down
        if self.fast is None and (
            self.handoff is not None or self.stop or down.events or down.lost or down.eof
        ):
            self._unpark()

    def _drop(self, n: int) -> list[bytes | memoryview]:
        """Pop a whole request's `n` remaining events (body, end); the body pieces.

        0: nothing of it is queued (`take`).
        """
        body: list[bytes | memoryview] = []
        if not n:
            return body
        pop = self.down.pop
        for _ in range(n - 1):
            ev = pop()
            assert type(ev) is BodyData  # noqa: S101 - `whole_request` checked
            body.append(ev.data)
        pop()  # the end
        return body

    def _head_bytes(self, head: RequestHead, target: Target) -> bytes:
        """The request head as sent upstream (hop-by-hop dropped, rewritten), cached."""
        rewrite = target.rewrite
        last = self._sent_for
        if last is not None and last[0] is head and last[1] is rewrite:
            return last[2]
        raw = head.raw
        key = (raw, id(rewrite))
        if raw:
            hit = _SENT_HEADS.get(key)
            if hit is not None and hit[0] is rewrite:
                self._sent_for = (head, rewrite, hit[1])
                return hit[1]
        headers = h1msg.strip_hop_by_hop(
            head.headers, keep=KEEP_TE if head.framing is Framing.CHUNKED else NO_KEEP
        )
        if rewrite is not None:
            headers = rewrite(headers)
        out = h1msg.request_head_bytes(head.method, head.target, headers, head.version)
        if raw:
            if len(_SENT_HEADS) >= _HEAD_CACHE_MAX:
                _SENT_HEADS.clear()
            _SENT_HEADS[key] = (rewrite, out)
            self._sent_for = (head, rewrite, out)
        return out

    def response_head(
        self, head: RequestHead, resp: ResponseHead
    ) -> tuple[list[bytes | memoryview], bool]:
        """`response_head`, cached by what decides it (the response head as received)."""
        last = self._answer_for
        if last is not None and last[1] is resp and last[0] is head:
            return last[2]
        raw = resp.raw
        if not raw:
            return response_head(head, resp)
        key = (raw, head.method == b"HEAD", head.version, head.keep_alive)
        hit = _ANSWER_HEADS.get(key)
        if hit is None:
            hit = response_head(head, resp)
            if len(_ANSWER_HEADS) >= _HEAD_CACHE_MAX:
                _ANSWER_HEADS.clear()
            _ANSWER_HEADS[key] = hit
        self._answer_for = (head, resp, hit)
        return hit

    # --- the coroutine path ---

    async def _request(
        self,
        head: RequestHead,
        t0: float,
        plan: Plan | Reject | None = None,
        first: Target | None = None,
    ) -> bool:
        """Serve one request (maybe begun by the callbacks); whether another may follow."""
        SET_REQUEST(head)  # for the recorder (agent.proxy.record rule 4)
        if plan is None:
            if head.upgrade is not None or head.method == b"CONNECT":
                await self._skip_body()
                return self.answer(reject(501, "upgrade not supported", close=True), t0, {})
            plan = self.router.plan_now(head)
            if plan is None:
                plan = await self.router.plan(head)
        if isinstance(plan, Reject):
            await self._skip_body()
            return self.answer(plan, t0, {}) and head.keep_alive
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
        return await self._attempts(head, plan, replay, t0=t0, deadline=deadline, first=first)

    async def _attempts(  # noqa: C901, PLR0913 - the facts of one request, its attempts in order
        self,
        head: RequestHead,
        plan: Plan,
        replay: bytes | None,
        *,
        t0: float,
        deadline: float | None,
        first: Target | None,
    ) -> bool:
        route = plan.route
        self.body_done = replay is not None
        attempt = 0
        while True:
            attempt += 1
            target = first if first is not None and attempt == 1 else plan.choose(attempt)
            if isinstance(target, Reject):
                if not self.body_done:
                    await self._skip_body()
                return self.answer(target, t0, plan.labels) and head.keep_alive
            recorder().request(self.router.direction, target.labels or plan.labels)
            try:
                if deadline is None:
                    got = await self._send_either(target, head, replay)
                else:
                    async with asyncio.timeout_at(deadline):
                        got = await self._send_either(target, head, replay)
            except TimeoutError:
                self._abandon(target)
                return await self._fail(head, target, 504, "request timed out", t0)
            except UpstreamError as err:
                self._abandon(target)
                if self._may_retry(plan, replay, err.status, attempt):
                    continue
                return await self._fail(head, target, err.status, str(err), t0)
            if isinstance(got, h1toh2.Upgraded):
                failure = classify(route, got.status)
                if failure and self._may_retry(plan, replay, got.status, attempt):
                    h1toh2.cancel(got)
                    self._abandon(target)
                    continue
                keep = await h1toh2.respond(self, head, target, got, t0=t0, failure=failure)
                return keep and head.keep_alive
            up, exch, resp = got
            failure = classify(route, resp.status)
            if failure and self._may_retry(plan, replay, resp.status, attempt):
                self._abandon(target)
                continue
            return await self._respond(head, target, up, exch, resp, t0=t0, failure=failure)

    def _may_retry(self, plan: Plan, replay: bytes | None, status: int, attempt: int) -> bool:
        if replay is None or plan.budget is None:
            return False
        now = self.now()
        return should_retry(
            plan.route, status, attempt, plan.budget, now, max_attempts=MAX_ATTEMPTS
        )

    def _abandon(self, target: Target) -> None:
        """The attempt failed or is dropped: report it, drop its upstream connection."""
        self.end_handle(target, ok=False)
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
        return self.answer(answer, t0, target.labels) and head.keep_alive

    async def _send_either(
        self, target: Target, head: RequestHead, replay: bytes | None
    ) -> tuple[UpstreamConn, Exchange, ResponseHead] | h1toh2.Upgraded:
        """Send the attempt upgraded to h2 when its target and the request allow, else
        as HTTP/1 (`_send`)."""
        if target.h2 is not None and upgradable(head) and self._upgrade(target):
            got = await h1toh2.send(self, target, head, replay)
            if got is not None:
                return got
        return await self._send(target, head, replay)

    async def _send(
        self, target: Target, head: RequestHead, replay: bytes | None
    ) -> tuple[UpstreamConn, Exchange, ResponseHead]:
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
            tr = up.transport
            assert tr is not None  # noqa: S101 - connected by the opener
            out = self._head_bytes(head, target)
            self.batch.flush()  # agent.proxy.writes rule 2
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
                    self.write(h1msg.error_response(ev.status, ev.reason, close=True))
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
                    self.write(h1msg.error_response(ev.status, ev.reason, close=True))
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
        exch: Exchange,
        resp: ResponseHead,
        *,
        t0: float,
        failure: bool,
    ) -> bool:
        parts, keep = self.response_head(head, resp)
        parts = list(parts)
        pending = exch.pending
        if pending and sum(map(len, pending)) <= COALESCE_LIMIT:
            # Head and the body bytes already here leave in one write (one send, one record).
            parts += pending
            pending.clear()
        out = b"".join(parts)
        self.write(out)
        if self.write_paused and up.transport is not None:
            up.transport.pause_reading()
        exch.forward_to(self.transport)
        try:
            await exch.wait_end()
        except UpstreamError:
            self.end_handle(target, ok=False)
            self._drop_current()
            self.transport.abort()
            raise _ClientGoneError from None
        now = self.now()
        self.end_handle(target, ok=not failure)
        up.finish()
        self.current = None
        if resp.keep_alive:
            self.pool.release(up)  # which closes it when not reusable
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

    def end_handle(self, target: Target, *, ok: bool) -> None:
        if target.handle is not None:
            target.handle.done(self.now(), ok)

    def _drop_current(self) -> None:
        up = self.current
        if up is not None:
            up.abort()
            self.current = None

    # --- how a callback exchange ends (rule 7: h1fast's and h1toh2's) ---

    def exchanged(
        self, labels: Labels, status: int, latency_s: float, *, failure: bool, keep: bool
    ) -> None:
        """A callback exchange answered its request: counted through the connection's
        bound handle (record rule 5); the callbacks take the next queued request, or the
        coroutine hears the news."""
        tally = self.tally
        if tally is None or tally.labels is not labels:
            tally = self.tally = recorder().bind_http(self.router.direction, labels)
        tally.exchange(status, latency_s, failure)
        self.fast = None
        self.callback_requests += 1
        if not keep:
            self.stop = True
        down = self.down
        if down.events or self.stop or down.lost or down.eof:
            self.pump()

    def answer_failed(
        self, status: int, message: str, t0: float, labels: Labels, *, keep_alive: bool
    ) -> None:
        """A callback exchange failed before its response: the proxy answers (rule 5),
        counted as the request it was; the connection goes on if the client may."""
        recorder().request(self.router.direction, labels)
        self.callback_requests += 1
        self.stop = not (self.answer(reject(status, message), t0, labels) and keep_alive)

    def answer(self, reject: Reject, t0: float, labels: Labels) -> bool:
        self.write(reject.response)
        recorder().response(
            self.router.direction,
            labels,
            status=reject.status,
            latency_s=self.now() - t0,
            failure=reject.status >= 500,
        )
        return not reject.close


# `HttpConn._take`, unbound, once: `self._take` made a bound method by name per request
_TAKE: Final = HttpConn._take  # noqa: SLF001 - its own module


def _wake(fut: asyncio.Future[None] | None) -> None:
    """Resolve a waiter the coroutine sleeps on, if it is still waiting."""
    if fut is not None and not fut.done():
        fut.set_result(None)


async def serve(  # noqa: PLR0913 - the connection, where it goes, what was read, its loop
    transport: asyncio.Transport,
    router: Router,
    pool: ConnPool,
    prefix: bytes,
    *,
    eof: bool,
    loop: asyncio.AbstractEventLoop | None = None,
) -> int:
    """Serve a client connection whose reading is paused; the number of requests seen."""
    conn = HttpConn(transport, router, pool, loop)
    conn.attach(prefix, eof=eof)
    try:
        await conn.serve()
    except _ClientGoneError:  # not `contextlib.suppress`: three interpreted calls
        return conn.requests
    return conn.requests
