"""Writes held to the end of the event loop's batch of callbacks.

When the loop wakes with many ready sockets, the HTTP/1 callback path (httpproxy rule
7) turns each request it reads into a write upstream and each response into a write
to its client. Written at once, every write may wake its reader (the app, the client)
for that one message, while the worker goes on to the next socket: the readers wake
once per message, and the worker pays a wake-up (an IPI, a preemption) per write. Held
to the end of the batch, the writes leave back to back: a reader that is already
awake finds several messages at once, and a write to it wakes nobody. Measured in
bench/RESULTS.md (eleventh pass): the client's and the app's wake-ups per request fell
to HAProxy's level, which sends at the end of its polling loop too.

Rules:
1. One batch per event loop (`batch_for`). `hold` keeps `(transport, data)`; the first
   hold of a batch schedules `flush` with `call_soon`, which the loop runs once it has
   dispatched the I/O callbacks it woke for, before it polls again: no timer, and an
   idle loop writes within the same wake-up.
2. Order: held data leaves in the order it was held, and before anything else is
   written to or closes any transport: every other write of the HTTP/1 path calls
   `flush` first (a no-op when nothing is held).
3. Only whole messages are held (a bodiless or whole request, a whole response), so
   what a batch holds is bounded by what the loop read in one wake-up, and no flow
   control is needed between the hold and the write.
4. A transport that closed meanwhile is skipped; a write that fails aborts its own
   transport only (logged once); the other held writes still leave.
5. Responses that came over a lane (`hold(..., lane=True)`: h1toh2, a peer node's proxy
   answered) leave at most `LANE_PART` per callback, the loop polling in between. Each
   write wakes a client that sends its next request at once; polled, those requests go
   on to the lane, which writes them early (agent.proxy.h2conn), while the rest of the
   responses still leave. Held to one flush, the next requests waited for all of them
   and the peer node idled meanwhile (bench/RESULTS.md, thirtieth pass). Another write
   of the path still flushes everything held first (rule 2).
6. Many writes leave in one system call (agent.proxy.uring): in a flush (or part),
   each plain TCP or Unix transport's first write, when nothing is queued in it,
   goes to the loop's `SendRing` (opened at the first such flush) when there are
   `MIN_SENDS` (4) of them or more; the rest go to the transports after what the
   ring's sends did not take, so each connection's bytes keep their order. One send
   per socket per call (uring rule 3).
   Written one by one, each write woke its reader, which preempted the worker there
   and then: a batch of N cost N preemptions and N wake-ups; in one call the worker is
   preempted once and the readers find their messages together (bench/RESULTS.md,
   thirty-first pass). Where io_uring is unavailable or switched off, or the call
   fails (logged once; no send was made), the transports write as before.
7. A transport's socket number is asked for once (`get_extra_info("socket").fileno()`,
   two calls into uvloop that cost a third of a ring send's Python) and kept in the
   batch's `fds`, keyed by the transport itself: the entry keeps the transport alive, so
   no other transport can take its key, and a closed transport is never sent to (its
   `is_closing()` is asked before its number), so a number the kernel gave to a newer
   socket is never used for it. Once `FDS_MAX` transports are kept, those that are
   closing are dropped, and all of them if most are still open.
8. An idle loop writes at once: a hold into an empty batch is written there and then
   when the batch's last write (a flush, or such a write) left more than `IDLE_NS`
   ago and the last flush wrote fewer than `MIN_SENDS` writes. At moderate rates a
   worker's wake-ups hold one or two messages: held, the first waited for the second's
   Python and paid a `call_soon`; a saturated worker flushes often and in big batches,
   so it still holds everything (rule 6's one-call batches). Measured in
   bench/RESULTS.md (thirty-eighth pass): CPU per request -2 to -9% and p50 -1 to -10%
   at 1,000 and 2,000 requests/s, saturation rate +1.4 to +2.7% and its p99 -30%. The
   last-flush condition matters: on the time alone, saturated workers that waited for
   a CPU wrote at once and lost 4% of their rate.
"""

from __future__ import annotations

import contextvars
import logging
import time
import weakref
from typing import TYPE_CHECKING, Any, Final

from agent.proxy.tlsio import TlsTransport
from agent.proxy.uring import MIN_SENDS, PLAIN_TRANSPORTS, SendRing

if TYPE_CHECKING:
    import asyncio

logger = logging.getLogger(__name__)

# Flushes run outside any connection's context: they write for many connections.
_CONTEXT: Final = contextvars.Context()
LANE_PART: Final = 8  # held writes per callback after a lane's responses (rule 5)
FDS_MAX: Final = 512  # transports whose socket numbers a batch keeps (rule 7)
IDLE_NS: Final = 30_000  # a batch whose last write is older writes at once (rule 8)
# bound once: `time.perf_counter_ns` read per hold was a lookup by name (native rule 6)
_clock_ns: Final = time.perf_counter_ns


class WriteBatch:
    """The writes one event loop holds until its current batch of callbacks ends."""

    __slots__ = ("_due", "_loop", "_opened", "fds", "items", "lane", "last_n", "ring", "wrote_at")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = weakref.ref(loop)  # the registry's value: a strong one would keep it
        self.items: list[tuple[asyncio.WriteTransport, bytes | memoryview]] = []
        self.lane = False  # a lane's response is held (rule 5)
        self.ring: SendRing | None = None  # rule 6, opened at the first flush it may serve
        self.fds: dict[Any, int] = {}  # transport -> its socket's number (rule 7)
        self._due = self.due  # bound once: made at every schedule, it cost a tenth of one
        self._opened = False
        self.wrote_at = 0  # perf_counter_ns of the last small flush or at-once write (rule 8)
        self.last_n = 0  # writes of the last flush (rule 8)

    def hold(
        self, transport: asyncio.WriteTransport, data: bytes | memoryview, *, lane: bool = False
    ) -> None:
        """Write `data` to `transport` when the loop's current batch of callbacks ends
        (`lane`: a response that came over a lane, rule 5)."""
        items = self.items
        if not items:
            if not lane and self.last_n < MIN_SENDS:
                now = _clock_ns()
                if now - self.wrote_at > IDLE_NS:  # rule 8: the loop was idle
                    self.wrote_at = now
                    _write([(transport, data)])
                    return
            self._schedule()
        items.append((transport, data))
        if lane:
            self.lane = True

    def loop_is(self, loop: asyncio.AbstractEventLoop) -> bool:
        """Whether this is `loop`'s batch (and `loop` still lives)."""
        return self._loop() is loop

    def _schedule(self) -> None:
        loop = self._loop()
        if loop is None:
            raise RuntimeError("BUG: a write held for a loop that is gone")
        loop.call_soon(self._due, context=_CONTEXT)

    def due(self) -> None:
        """The batch's end (rule 1): write what is held, in parts after a lane's
        responses (rule 5)."""
        items = self.items
        if not self.lane or len(items) <= LANE_PART:
            self.flush()
            return
        self.items = items[LANE_PART:]
        self._schedule()  # after the loop polled again
        self._write(items[:LANE_PART])

    def flush(self) -> None:
        """Write everything held, in order (rule 2; a no-op when nothing is)."""
        items = self.items
        if not items:
            return
        self.items = []
        self.lane = False
        self._write(items)
        self.last_n = n = len(items)
        if n < MIN_SENDS:  # after a bigger flush `hold` does not read the time (rule 8)
            self.wrote_at = _clock_ns()

    def _write(self, items: list[tuple[asyncio.WriteTransport, bytes | memoryview]]) -> None:
        if len(items) >= MIN_SENDS:
            if not self._opened:
                self._opened = True
                self.ring = SendRing.open()
            ring = self.ring
            if ring is not None:
                try:
                    items = _through_ring(ring, items, self.fds)
                except OSError:  # rule 6: the call made no send
                    logger.warning("io_uring send failed; writing one by one", exc_info=True)
                    self.ring = None
        _write(items)


def _write(items: list[tuple[asyncio.WriteTransport, bytes | memoryview]]) -> None:
    """Rule 4: each held write, skipping closed transports; a failure stays its own."""
    for transport, data in items:
        try:
            if isinstance(transport, TlsTransport):  # compiled: called natively, not by name
                if not transport.is_closing():
                    transport.write(data)
            elif not transport.is_closing():
                transport.write(data)
        except Exception:  # rule 4: one transport's failure stays its own
            logger.warning("held write failed, aborting its connection", exc_info=True)
            transport.abort()


def _through_ring(
    ring: SendRing,
    items: list[tuple[asyncio.WriteTransport, bytes | memoryview]],
    fds: dict[Any, int],
) -> list[tuple[asyncio.WriteTransport, bytes | memoryview]]:
    """Rule 6: each plain transport's first held write in one call; what is left to write
    through the transports, in order. `fds`: the socket numbers kept (rule 7)."""
    seen: set[Any] = set()
    sends: list[tuple[int, bytes | memoryview]] = []
    sent_to: list[asyncio.WriteTransport] = []
    rest: list[tuple[asyncio.WriteTransport, bytes | memoryview]] = []
    for transport, data in items:
        if (
            transport in seen
            or type(transport) not in PLAIN_TRANSPORTS
            or transport.is_closing()
            or transport.get_write_buffer_size()
        ):
            seen.add(transport)
            rest.append((transport, data))
            continue
        seen.add(transport)
        fd = fds.get(transport)
        if fd is None:
            if len(fds) >= FDS_MAX:
                _prune(fds)
            fd = fds[transport] = transport.get_extra_info("socket").fileno()
        sends.append((fd, data))
        sent_to.append(transport)
    if len(sends) < MIN_SENDS:
        return items
    left: list[tuple[asyncio.WriteTransport, bytes | memoryview]] = []
    for transport, (_, data), res in zip(sent_to, sends, ring.send(sends), strict=True):
        if res < 0:
            left.append((transport, data))  # its transport meets the error (or full buffer)
        elif res < len(data):
            left.append((transport, memoryview(data)[res:]))
    return left + rest


def _prune(fds: dict[Any, int]) -> None:
    """Rule 7: drop the closing transports' numbers; all of them if most are open."""
    closing = [transport for transport in fds if transport.is_closing()]
    if len(closing) * 2 < len(fds):
        fds.clear()
        return
    for transport in closing:
        del fds[transport]


_BATCHES: Final[weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, WriteBatch]] = (
    weakref.WeakKeyDictionary()
)


class _Last:
    """The batch `batch_for` answered last: a worker has one loop, and every new
    connection asks (the weak dictionary's `get` was an interpreted call each time).
    Held strongly, the batch holds its loop weakly, so the loop still goes when its
    last user does (at most one idle batch waits here for the next loop's first ask)."""

    __slots__ = ("batch",)

    def __init__(self) -> None:
        self.batch: WriteBatch | None = None


_LAST: Final = _Last()


def batch_for(loop: asyncio.AbstractEventLoop) -> WriteBatch:
    """`loop`'s write batch (made on first use; it goes with the loop)."""
    batch = _LAST.batch
    if batch is not None and batch.loop_is(loop):
        return batch
    batch = _BATCHES.get(loop)
    if batch is None:
        batch = _BATCHES[loop] = WriteBatch(loop)
    _LAST.batch = batch
    return batch
