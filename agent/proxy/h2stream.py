"""One HTTP/2 stream of an `H2Conn` (agent.proxy.h2conn): a queue of what the peer sent,
and sends that respect flow control (agent.proxy.http2's rules 2 and 3).

The connection pushes what arrives (`Head`, `Data`, `Trailers`, `End`, or `Reset` when
the stream is reset or its connection is gone); the stream's task takes it with
`next`, sends with `send_headers`/`send_data`/`end`, and resets with `reset`. A stream
served in callbacks (agent.proxy.h2serve) has a `sink` instead: whenever something is
queued (a reset included) the connection calls it once, after the whole batch of frames
it was read with (`H2Conn.touch`), and it takes what is queued with `next_now`.

The queue is a list read from `_next` on, emptied whenever it is all read (so `items`
is empty exactly when nothing is queued, and `items[-1]` is the last queued item): a
list's append and index compile to inline code, a deque's methods to method calls.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from agent.proxy import h2msg
from agent.proxy.h2events import H2ConnectionError, H2StreamClosedError
from agent.proxy.h2frame import ErrorCode
from agent.proxy.h2msg import H2Headers  # noqa: TC001 - a field type: compiled, a dataclass resolves it

if TYPE_CHECKING:
    import asyncio
    from collections.abc import Callable

    from agent.proxy.h2conn import H2Conn

logger = logging.getLogger(__name__)

CANCEL: Final = ErrorCode.CANCEL
NO_ERROR: Final = ErrorCode.NO_ERROR
_GONE: Final = (H2StreamClosedError, H2ConnectionError)


class StreamGoneError(Exception):
    """The stream was reset (by the peer or by us) or its connection is gone."""

    def __init__(self, code: int) -> None:
        self.code = code
        super().__init__(f"stream reset ({code})")


# --- what a stream's queue holds ----------------------------------------------------


# Made per frame: each writes its `__init__` (agent.native rule 5).


@dataclass(slots=True, init=False)
class Head:
    headers: H2Headers
    end: bool

    def __init__(self, headers: H2Headers, end: bool) -> None:
        self.headers = headers
        self.end = end


@dataclass(slots=True, init=False)
class Data:
    data: bytes
    flow: int  # flow-controlled length (padding included), to acknowledge

    def __init__(self, data: bytes, flow: int) -> None:
        self.data = data
        self.flow = flow


@dataclass(slots=True, init=False)
class Trailers:
    headers: H2Headers

    def __init__(self, headers: H2Headers) -> None:
        self.headers = headers


@dataclass(slots=True)
class End:
    pass


@dataclass(slots=True)
class Reset:
    code: int


Item = Head | Data | Trailers | End | Reset
END: Final = End()  # the one shared plain end (items are never mutated)


class H2Stream:
    """One stream: what the peer sent (queued), and sends that respect flow control."""

    __slots__ = (
        "_next",
        "_waiter",
        "conn",
        "gone",
        "items",
        "local_ended",
        "on_reset",
        "remote_ended",
        "request",
        "sid",
        "sink",
        "touched",
    )

    def __init__(self, conn: H2Conn, sid: int) -> None:
        self.conn = conn
        self.sid = sid
        self.items: list[Item] = []  # queued from `_next` on (module docstring)
        self._next = 0
        self._waiter: asyncio.Future[None] | None = None
        self.request: H2Headers = []  # server side: the request headers
        self.remote_ended = False
        self.local_ended = False
        self.gone: int | None = None  # the reset code once reset or lost
        self.on_reset: Callable[[int], None] | None = None  # the peer reset this stream
        self.sink: Callable[[H2Stream], None] | None = None  # see the module docstring
        self.touched = False  # on the connection's list of streams whose sink is due

    # from the connection
    def push(self, item: Item) -> None:
        if isinstance(item, (End, Trailers)):
            self.remote_ended = True
        self.items.append(item)
        self._wake()
        if self.sink is not None:
            self.conn.touch(self)

    def peer_reset(self, code: int) -> None:
        """The peer reset the stream, or the connection is gone."""
        if self.gone is not None:
            return
        self.gone = code
        self.items.append(Reset(code))
        self._wake()
        self.conn.wake()
        if self.sink is not None:
            self.conn.touch(self)
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
            self._waiter = self.conn.loop.create_future()
            await self._waiter
        return self._take()

    def next_now(self) -> Item | None:
        """`next` without waiting: the next item when one is queued, else None.

        Raises:
            StreamGoneError: the stream was reset or its connection lost.
        """
        return self._take() if self.items else None

    def _take(self) -> Item:
        items = self.items
        item = items[self._next]
        if isinstance(item, Reset):
            raise StreamGoneError(item.code)  # stays queued: stays gone
        self._next += 1
        if self._next == len(items):
            items.clear()
            self._next = 0
        return item

    def unget(self, item: Item) -> None:
        """Queue `item`, just taken with `next_now`, first again."""
        if self._next:
            self._next -= 1
            self.items[self._next] = item
        else:
            self.items.insert(0, item)

    def queued_bytes(self) -> int:
        """DATA bytes queued and not taken yet."""
        items = self.items
        size = 0
        for i in range(self._next, len(items)):
            item = items[i]
            if isinstance(item, Data):
                size += len(item.data)
        return size

    def whole_within(self, limit: int) -> bool:
        """Whether the rest of what the peer sends is queued (its side ended, no reset),
        with at most `limit` DATA bytes: taken now, it is whole."""
        return self.remote_ended and self.gone is None and self.queued_bytes() <= limit

    def drop_end(self) -> None:
        """Drop the queued end (`peek_end` said it is next)."""
        self._take()

    def peek_end(self) -> bool:
        """Whether the next item is the plain end of the stream (not trailers)."""
        return bool(self.items) and isinstance(self.items[self._next], End)

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
            self.conn.h2.send_headers(self.sid, h2msg.protect(headers), end=end)
        except _GONE as exc:
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
            size = min(self._window(), conn.h2.max_outbound_frame_size, len(view))
            if size <= 0:
                await conn.wait_window()
                continue
            last = size == len(view)
            self._send(data if last and size == len(data) else view[:size].tobytes(), end and last)
            view = view[size:]
            if end and last:
                return
            await conn.drained()
        if end:
            self.end()

    def send_data_now(self, data: bytes, *, end: bool = False) -> bool:
        """`send_data` when it would not wait: all of `data` fits the window and one
        frame, and the connection takes it without a write (`H2Conn.takes_now`); else
        False, with nothing sent.

        Raises:
            StreamGoneError: the stream is gone.
        """
        conn = self.conn
        size = len(data)
        self._check()
        if not (
            size
            and size <= self._window()
            and size <= conn.h2.max_outbound_frame_size
            and conn.takes_now(size)
        ):
            return False
        self._send(data, end)
        return True

    def _window(self) -> int:
        """What the peer lets this stream send now."""
        try:
            return self.conn.h2.window(self.sid)
        except _GONE as exc:
            raise self._lost(exc) from exc

    def _send(self, chunk: bytes, end: bool) -> None:
        """One DATA frame's worth to the codec (the stream's last when `end`)."""
        try:
            self.conn.h2.send_data(self.sid, chunk, end=end)
        except _GONE as exc:
            raise self._lost(exc) from exc
        self.conn.queued(len(chunk))
        if end:
            self._ended()

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
        except _GONE as exc:
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
        with contextlib.suppress(*_GONE):
            self.conn.h2.reset_stream(self.sid, code)
            self.conn.flush()
        self.items.append(Reset(code))
        self._wake()
        self.conn.wake()
        if self.sink is not None:
            self.conn.touch(self)
        self.conn.forget(self)

    def cancel(self, _code: int = CANCEL) -> None:
        """Reset the stream with CANCEL, whatever `_code` (an `on_reset` callback that
        cancels this stream when its linked stream is reset)."""
        self.reset(CANCEL)

    def discard(self) -> None:
        """Hand back the window of DATA nobody will read (the stream is over).

        Also drops `on_reset`, the sink and the waiter: a linked pair's callbacks refer to each
        other's stream, a cycle only the collector would free otherwise.
        """
        self.on_reset = None
        self.sink = None
        self._waiter = None
        for item in self.items[self._next :]:
            if isinstance(item, Data):
                self.conn.ack(self.sid, item.flow)
        self.items.clear()
        self._next = 0
        if self.gone is not None:
            self.items.append(Reset(self.gone))

    def close(self) -> None:
        """The handler is done with the stream: reset it unless it ended both ways, hand
        back its window (`discard`), and take it off its connection."""
        if self.gone is None and not (self.local_ended and self.remote_ended):
            self.reset(CANCEL)
        self.discard()
        self.conn.forget(self)

    @property
    def dismissed(self) -> bool:
        """The peer sent its whole side, then reset with NO_ERROR: it reads no more of ours
        (RFC 9113 8.1), and what we were sending is simply over."""
        return self.gone == NO_ERROR and self.remote_ended

    @property
    def bodiless(self) -> bool:
        """The peer ended the stream and nothing but the end is left to read."""
        items = self.items
        return self.remote_ended and len(items) == self._next + 1 and isinstance(items[-1], End)

    def _check(self) -> None:
        if self.gone is not None:
            raise StreamGoneError(self.gone)

    def _lost(self, exc: Exception) -> StreamGoneError:
        logger.debug("stream gone", extra={"stream": self.sid, "error": str(exc)})
        self.gone = CANCEL if self.gone is None else self.gone
        return StreamGoneError(self.gone)
