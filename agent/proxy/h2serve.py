"""Serving an h2 client connection (agent.proxy.http2): each request stream in the
connections' callbacks when nothing in it waits, else in a task.

Rules:
1. A stream is served in callbacks (a `Relay`) when its router decides at once
   (`StreamRouter.route_now`), it goes on over h2, its route has no timeout, and an
   established upstream connection takes it (`H2Pool.stream_now`). (A stream an
   inbound gives its app as HTTP/1 is served in callbacks by agent.proxy.h2toh1's
   `serve_now` when it arrived whole and an app connection is idle.)
   Its request goes upstream from the client connection's `data_received`, its
   response back from the upstream's; a DATA frame is passed on when the window and the
   connection take it at once (`send_data_now`), then acknowledged to its sender.
2. Whatever would wait hands over to the coroutines, which keep all of http2's rules:
   a router that waits, a route timeout or no established connection
   (`http2.proxy_stream`); request DATA the window does not take (that direction goes to
   `http2.pump_request`); response DATA the window does not take, a reset, or anything
   else unusual on either side (the rest of the stream goes to `http2.resume`, the item
   put back at the head of its queue). A handed-over stream never comes back.
3. Both paths send the same frames to both peers and keep http2's rules 1-7: the
   same acknowledgements, resets both ways (the streams stay linked by `on_reset`),
   the same balancer outcome and metrics. Callbacks run in the client connection's
   context (`in_ctx`, as httpproxy rule 7) with `record.REQUEST` set to the stream's
   request before every recorder call and every task started for it.
4. A stream served whole in callbacks makes no task, future or coroutine.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from typing import TYPE_CHECKING, Any, Final

from agent import aio
from agent.proxy import h2msg, http2
from agent.proxy.h2conn import H2Conn
from agent.proxy.h2frame import ErrorCode
from agent.proxy.h2stream import (
    CANCEL,
    Data,
    End,
    H2Stream,
    Head,
    StreamGoneError,
    Trailers,
)
from agent.proxy.record import REQUEST, recorder

if TYPE_CHECKING:
    from collections.abc import Callable, Coroutine

    from agent.proxy.h2pool import H2Pool
    from agent.proxy.h2stream import Item
    from agent.proxy.record import BoundHttp, Labels

logger = logging.getLogger(__name__)

# Where one direction of a relayed stream is.
CALLBACKS: Final = 0
DONE: Final = 1
TASK: Final = 2
INTERNAL_ERROR: Final = ErrorCode.INTERNAL_ERROR


async def serve(
    transport: asyncio.Transport,
    router: http2.StreamRouter,
    pool: H2Pool,
    prefix: bytes,
    *,
    eof: bool,
) -> int:
    """Serve an h2 client connection whose reading is paused; the number of streams seen."""
    conn = H2Conn(client_side=False)
    tasks = aio.TaskSet(conn.loop)  # the streams handed to coroutines
    starter = Starter(router, pool, tasks)
    conn.on_incoming = starter.start
    transport.set_protocol(conn)
    conn.connection_made(transport)
    if prefix:
        conn.data_received(prefix)
    if eof:
        conn.close()
    elif not conn.closed:
        transport.resume_reading()
    try:
        while await conn.next_incoming() is not None:  # None once closed: on_incoming has them
            pass
        await asyncio.sleep(0)  # the resets of the connection's end reach the relays
        while tasks.tasks:
            await asyncio.wait(list(tasks.tasks))
    finally:
        for task in list(tasks.tasks):
            task.cancel()
        conn.close()
    return starter.count


class Starter:
    """Starts each new request stream of one client connection: a `Relay`, or a task."""

    __slots__ = ("count", "direction", "in_ctx", "pool", "relayed", "router", "tally", "tasks")

    def __init__(self, router: http2.StreamRouter, pool: H2Pool, tasks: aio.TaskSet) -> None:
        self.router = router
        self.direction = router.direction
        self.pool = pool
        self.tasks = tasks
        # `run` of the connection's task context (record.CONN), bound once: called per
        # stream, not looked up by name each time (and passed on to h2toh1's exchanges)
        self.in_ctx: Callable[..., Any] = contextvars.copy_context().run
        self.count = 0
        self.relayed = 0  # streams begun in callbacks
        self.tally: BoundHttp | None = None  # `exchanged`'s, bound in the connection's context

    def start(self, down: H2Stream) -> None:
        self.count += 1
        try:
            self.in_ctx(self._start, down)
        except Exception:  # a bug: this stream fails, not the connection's others
            logger.exception("h2 stream start failed", extra={"stream": down.sid})
            down.reset(INTERNAL_ERROR)
            down.close()

    def _start(self, down: H2Stream) -> None:
        t0 = down.conn.loop.time()
        head = h2msg.RequestHead(down.request)
        REQUEST.set(head)
        router = self.router
        got = router.route_now(down.request)
        if got is None:
            self.spawn(http2.proxy_stream(down, router, self.pool, t0=t0))
            return
        if isinstance(got, h2msg.Answer):
            try:
                rest = http2.answer_now(down, got, self.direction, {}, t0)
            except StreamGoneError:
                down.reset(CANCEL)
                rest = False
            if rest:
                self.spawn(http2.drain(down))
            else:
                down.close()
            return
        up = None
        if got.timeout_s is None:
            if got.h1 is not None:
                way, request = got.h1
                if way.serve_now(down, request, t0, self):
                    self.relayed += 1  # its request is counted with its response (h2toh1)
                    return
            else:
                up = self.pool.stream_now(got.key, got.headers, end=down.bodiless)
        if up is None:
            self.spawn(http2.proxy_stream(down, router, self.pool, routed=got, t0=t0))
            return
        recorder().request(self.direction, got.labels)
        self.relayed += 1
        Relay(self, down, up, got, head, t0).begin()

    def exchanged(self, labels: Labels, status: int, latency_s: float, failure: bool) -> None:
        """A stream served in callbacks was answered: its request and response counted at
        once through the connection's bound handle (record rule 5), in its context."""
        tally = self.tally
        if tally is None or tally.labels is not labels:
            tally = self.tally = recorder().bind_http(self.direction, labels)
        tally.exchange(status, latency_s, failure)

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        """A task for (the rest of) a stream, in the connection's context as it is now."""
        self.tasks.spawn(coro, name="h2-stream")


class Relay:
    """One stream served in callbacks (rule 1): the client's `down`, the upstream's `up`."""

    __slots__ = (
        "down",
        "head",
        "pump",
        "request",
        "response",
        "routed",
        "starter",
        "status",
        "t0",
        "up",
    )

    def __init__(  # noqa: PLR0913, PLR0917 - the facts of one stream
        self,
        starter: Starter,
        down: H2Stream,
        up: H2Stream,
        routed: http2.Routed,
        head: h2msg.RequestHead,
        t0: float,
    ) -> None:
        self.starter = starter
        self.down = down
        self.up = up
        self.routed = routed
        self.head = head  # record.REQUEST's value for this stream
        self.t0 = t0
        self.request = DONE if up.local_ended else CALLBACKS
        self.response = CALLBACKS
        self.status: int | None = None  # the response head's, once sent on
        self.pump: asyncio.Task[int | None] | None = None

    def begin(self) -> None:
        down, up = self.down, self.up
        http2.link_resets(down, up)  # rule 3
        up.sink = self.on_response
        if self.request == CALLBACKS:
            down.sink = self.on_request
            self.on_request(down)  # what came with the request's head

    # --- the request: client -> upstream --------------------------------------------

    def on_request(self, down: H2Stream) -> None:
        while self.request == CALLBACKS:
            try:
                item = down.next_now()
            except StreamGoneError:
                self._request_to_task()
                return
            if item is None:
                return
            if not self._request_item(item):
                down.unget(item)
                self._request_to_task()

    def _request_item(self, item: Item) -> bool:
        """Pass one request item on; False when it cannot be at once (nothing done)."""
        down, up = self.down, self.up
        try:
            if isinstance(item, Data):
                end = down.peek_end()
                if not up.send_data_now(item.data, end=end):
                    return False
                down.ack(item.flow)
                if not end:
                    return True
                down.drop_end()
            elif isinstance(item, Trailers):
                up.send_headers(item.headers, end=True)
            elif isinstance(item, End):
                if not up.dismissed:
                    up.end()
            else:
                return False
        except StreamGoneError:
            return False
        self.request = DONE
        down.sink = None
        return True

    def _request_to_task(self) -> None:
        self.request = TASK
        self.down.sink = None
        self.pump = http2.pump_request(self.down, self.up)

    # --- the response: upstream -> client -------------------------------------------

    def on_response(self, up: H2Stream) -> None:
        while self.response == CALLBACKS:
            try:
                item = up.next_now()
            except StreamGoneError:
                self._response_to_task()
                return
            if item is None:
                return
            if not self._response_item(item):
                up.unget(item)
                self._response_to_task()

    def _response_item(self, item: Item) -> bool:
        """Pass one response item on; False when it cannot be at once (nothing done)."""
        down = self.down
        try:
            if self.status is None:
                return self._response_head(item)
            if isinstance(item, Data):
                return self._response_data(item)
            if isinstance(item, Trailers):
                down.send_headers(item.headers, end=True)
                self._finish(h2msg.grpc_status(item.headers))
                return True
            if isinstance(item, End):
                if not down.dismissed:
                    down.end()
                self._finish(None)
                return True
        except StreamGoneError:
            return False
        return False

    def _response_head(self, item: Item) -> bool:
        if not isinstance(item, Head):
            return False
        status = h2msg.status_of(item.headers)
        self.down.send_headers(item.headers, end=item.end)
        self.status = status
        if item.end:
            self._finish(h2msg.grpc_status(item.headers))
        return True

    def _response_data(self, item: Data) -> bool:
        up = self.up
        end = up.peek_end()
        if not self.down.send_data_now(item.data, end=end):
            return False
        up.ack(item.flow)
        if end:
            up.drop_end()
            self._finish(None)
        return True

    def _response_to_task(self) -> None:
        self.response = TASK
        self.up.sink = None
        if self.request == CALLBACKS:
            self._request_to_task()
        s = self.starter
        task = http2.resume(
            self.down, self.up, self.routed, s.direction, self.t0, self.pump, self.status
        )
        s.in_ctx(self._spawn, task)

    def _finish(self, grpc_status: int | None) -> None:
        """The response ended: its outcome recorded, then both streams closed (once the
        request is through: else the rest of it goes on in a task, http2 rule 3)."""
        self.response = DONE
        self.up.sink = None
        self.starter.in_ctx(self._record, grpc_status)
        if self.request == CALLBACKS:
            self._request_to_task()
        pump = self.pump
        if pump is None:
            http2.close(self.down, self.up, self.routed, None)
        else:
            self.starter.in_ctx(self._spawn, http2.linger(self.down, self.up, self.routed, pump))

    def _record(self, grpc_status: int | None) -> None:
        REQUEST.set(self.head)
        status = self.status
        assert status is not None  # noqa: S101 - the head was sent
        http2.responded(
            self.down, self.routed, self.starter.direction, self.t0, status, grpc_status
        )

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        REQUEST.set(self.head)
        self.starter.spawn(coro)
