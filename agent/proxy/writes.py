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
"""

from __future__ import annotations

import contextvars
import logging
import weakref
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    import asyncio

logger = logging.getLogger(__name__)

# Flushes run outside any connection's context: they write for many connections.
_CONTEXT: Final = contextvars.Context()


class WriteBatch:
    """The writes one event loop holds until its current batch of callbacks ends."""

    __slots__ = ("_loop", "items")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = weakref.ref(loop)  # the registry's value: a strong one would keep it
        self.items: list[tuple[asyncio.WriteTransport, bytes | memoryview]] = []

    def hold(self, transport: asyncio.WriteTransport, data: bytes | memoryview) -> None:
        """Write `data` to `transport` when the loop's current batch of callbacks ends."""
        items = self.items
        if not items:
            loop = self._loop()
            if loop is None:
                raise RuntimeError("BUG: a write held for a loop that is gone")
            loop.call_soon(self.flush, context=_CONTEXT)
        items.append((transport, data))

    def flush(self) -> None:
        """Write everything held, in order (rule 2; a no-op when nothing is)."""
        items = self.items
        if not items:
            return
        self.items = []
        for transport, data in items:
            if transport.is_closing():
                continue
            try:
                transport.write(data)
            except Exception:  # rule 4: one transport's failure stays its own
                logger.warning("held write failed, aborting its connection", exc_info=True)
                transport.abort()


_BATCHES: Final[weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, WriteBatch]] = (
    weakref.WeakKeyDictionary()
)


def batch_for(loop: asyncio.AbstractEventLoop) -> WriteBatch:
    """`loop`'s write batch (made on first use; it goes with the loop)."""
    batch = _BATCHES.get(loop)
    if batch is None:
        batch = _BATCHES[loop] = WriteBatch(loop)
    return batch
