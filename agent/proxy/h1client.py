"""The client side of an HTTP/1.1 proxied connection: parse requests, queue their events.

`ClientSide` is the accepted connection's protocol. It parses what the client
sends into a queue of events (agent.proxy.http1) and tells its owner, the
connection (agent.proxy.httpproxy's `HttpConn`, typed as such so the compiled
build calls it directly), that input arrived, that the client left or that
writing to it paused. The owner takes events with `pop` (callbacks) or
`await next_event()` (its coroutine).

Rules:
1. Reading pauses when more than `HIGH_WATER` body bytes or
   `MAX_QUEUED_EVENTS` events wait, and resumes once `pop` drained the queue
   below `LOW_WATER` and half the event limit.
2. EOF is kept (`eof`) and answered: the owner may still write.
3. `push_front` puts a request's body and end back first, for a request the
   owner began in callbacks and hands to its coroutine.
4. A bodiless request that arrives alone in one read, with nothing queued, is
   offered to the owner at once (`take`) without queueing it; if the owner
   declines, its head and end are queued and reported as usual.
5. A request that arrives alone and whole with its Content-Length body (a POST's
   usual read), its head seen before, is queued from the parser's shortcut
   (`RequestParser.whole`): a repeat of the last head is one comparison, where the
   full parse searched for the end of the head three times, with a slice and a
   cache lookup each.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import TYPE_CHECKING, Final, cast

from agent.proxy import http1
from agent.proxy.h1upstream import HIGH_WATER, LOW_WATER
from agent.proxy.http1 import END, BodyData, Framing, MessageEnd

if TYPE_CHECKING:
    from agent.proxy.httpproxy import HttpConn

MAX_QUEUED_EVENTS: Final = 256


class ClientGoneError(Exception):
    """The client vanished or sent a broken request; the connection ends."""


class ClientSide(asyncio.Protocol):
    """The client connection's protocol: parse requests, queue events for the connection."""

    def __init__(self, conn: HttpConn) -> None:
        self.conn: HttpConn | None = conn  # None once detached
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
        evs = self._events_of(data)
        if evs is None:
            return
        for ev in evs:
            if type(ev) is BodyData:
                self.queued += len(ev.data)
        self.events.extend(evs)
        if (self.queued > HIGH_WATER or len(self.events) > MAX_QUEUED_EVENTS) and not self.paused:
            self.paused = True
            if self.transport is not None:
                self.transport.pause_reading()
        conn = self.conn
        if conn is not None:
            conn.arrived()

    def _events_of(self, data: bytes) -> list[http1.Event] | None:
        """The events `data` adds to the queue; None when it was dealt with (rule 4)."""
        events = self.events
        if not events:
            head = self.parser.whole(data)
            if head is not None:
                if head.framing is not Framing.NONE:  # rule 5: with its body
                    return http1.whole_request_events(head, data)
                # rule 4: one bodiless request alone goes straight to the owner
                conn = self.conn
                if conn is not None and not conn.take(head):
                    events.append(head)
                    events.append(END)
                    conn.arrived()
                return None
        return self.parser.feed(data)

    def eof_received(self) -> bool:
        self.events.extend(self.parser.feed_eof())
        self.eof = True
        conn = self.conn
        if conn is not None:
            conn.arrived()
        return True  # keep our side open to answer

    def connection_lost(self, exc: Exception | None) -> None:  # noqa: ARG002 - Protocol API
        self.lost = True
        conn = self.conn
        if conn is not None:
            conn.client_lost()

    def pause_writing(self) -> None:
        conn = self.conn
        if conn is not None:
            conn.client_write_paused(paused=True)

    def resume_writing(self) -> None:
        conn = self.conn
        if conn is not None:
            conn.client_write_paused(paused=False)

    def detach(self) -> None:
        """The connection is over: report nothing more to it (no reference cycle stays,
        agent.proxy.worker rule 7)."""
        self.conn = None

    def wake(self) -> None:
        """Wake the coroutine waiting in `next_event`, if any."""
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)
        self._waiter = None

    def pop(self) -> http1.Event:
        """The first queued event (there must be one); resumes reading once drained enough."""
        ev = self.events.popleft()
        if type(ev) is BodyData:
            self.queued -= len(ev.data)
        if self.paused and self.queued <= LOW_WATER and len(self.events) < MAX_QUEUED_EVENTS // 2:
            self.paused = False
            if self.transport is not None and not self.lost:
                self.transport.resume_reading()
        return ev

    def push_front(self, body: list[bytes | memoryview]) -> None:
        """Queue a request's body and end again, first (a callback send handed back)."""
        self.events.appendleft(MessageEnd())
        for data in reversed(body):
            self.events.appendleft(BodyData(data))
            self.queued += len(data)

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
            conn = self.conn  # its loop: asyncio.get_running_loop() is a getpid() in 3.11
            loop = conn.loop if conn is not None else asyncio.get_running_loop()
            self._waiter = loop.create_future()
            await self._waiter
        return self.pop()
