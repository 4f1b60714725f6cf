"""Opaque TCP relay: bytes both ways between two transports, as fast as the loop allows.

Rules:
1. Protocols and transports only (no StreamReader): a chunk read on one side
   is written to the other in the same callback.
2. Half-close: EOF from one side becomes `write_eof` on the other; the relay
   ends when both directions have ended (or either side is lost).
3. Backpressure: each side's write buffer has high/low water marks; above
   high the *other* side stops reading, below low it reads again. A peer that
   never reads therefore holds at most about `high_water` bytes here plus
   one read chunk, whatever the sender does.
4. Idle: no byte either way for `idle_timeout` seconds aborts both sides
   (checked by a coarse timer, never re-armed per read).
5. Nothing here raises into the loop: a dead side ends the other (rule 9).
6. Handover: an accepted connection sits in `Held` (paused, first chunk and
   EOF kept) until `Relay.attach` takes it, which pauses it again until the
   upstream side exists (uvloop resumes reading after `connection_made`).
7. Without an idle timeout, a relay whose one side never reads nor closes
   never ends; the worker always sets one.
8. Whoever keeps a paused transport across an `await` first hands it to a
   fresh `Held` (`hold`) and reads `prefix`/`eof` back afterwards: bytes or an
   EOF that still arrive (uvloop's first read) land there instead of in a
   protocol nobody reads any more.
9. A side that closed cleanly closes the other, flushing (rule 2). A side lost
   to an error (the peer reset it, a write met a broken pipe) resets the other,
   so that its peer learns the stream broke instead of reading a clean end: a
   plain side once what is buffered for it is written (SO_LINGER 0, then
   close), a TLS side at once and without close_notify (which would say the
   stream ended whole). `reason` is then "reset".
10. Paired (agent.proxy.pairing): the kernel may carry some of the bytes past the
    worker. `pairing` hears of each forwarded chunk, the idle check and the byte
    counts add what it moved, and it reads its counts before the relay ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import struct
from typing import TYPE_CHECKING, Final, cast

from agent.proxy.accept import Held

if TYPE_CHECKING:
    from collections.abc import Callable

    from agent.proxy.pairing import Pairing

logger = logging.getLogger(__name__)

HIGH_WATER = 256 * 1024
LOW_WATER = 64 * 1024
_LINGER_RESET: Final = struct.pack("ii", 1, 0)  # close() then sends RST (rule 9)


def hold(transport: asyncio.Transport, prefix: bytes = b"", *, eof: bool = False) -> Held:
    """Park a paused `transport` on a new `Held` that already carries `prefix` and `eof`.

    Read `held.prefix` and `held.eof` only when handing the transport on (rule 8).
    """
    held = Held()
    held.prefix += prefix
    held.eof = eof
    held.transport = transport
    transport.set_protocol(held)
    if not transport.is_closing():
        transport.pause_reading()
    return held


class _Side(asyncio.Protocol):
    """One transport of a relay; writes what it reads to its peer."""

    __slots__ = ("eof", "lost", "name", "nbytes", "peer", "relay", "transport")

    def __init__(self, relay: Relay, name: str) -> None:
        self.relay = relay
        self.name = name
        self.transport: asyncio.Transport | None = None
        self.peer: _Side = self
        self.nbytes = 0  # bytes read from this side
        self.eof = False
        self.lost = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not registered subclasses of asyncio.Transport.
        tr = cast("asyncio.Transport", transport)
        self.transport = tr
        tr.set_write_buffer_limits(self.relay.high_water, self.relay.low_water)

    def data_received(self, data: bytes) -> None:
        self.nbytes += len(data)
        out = self.peer.transport  # never None: downstream reads only after `start`
        if out is not None and not out.is_closing():
            out.write(data)
            pairing = self.relay.pairing
            if pairing is not None:  # rule 10
                pairing.forwarded(self.nbytes, out, from_upstream=self is self.relay.upstream)

    def eof_received(self) -> bool:
        self.eof = True
        out = self.peer.transport
        if out is None or out.is_closing():
            return False
        if not out.can_write_eof():  # e.g. TLS: no half-close, end both
            self.relay.close()
            return False
        out.write_eof()
        if self.peer.eof:  # both directions ended
            self.relay.close()
        return True

    def pause_writing(self) -> None:
        # My write buffer is above high water: stop reading what fills it.
        src = self.peer.transport
        if src is not None and not src.is_closing():
            src.pause_reading()

    def resume_writing(self) -> None:
        src = self.peer.transport
        if src is not None and not src.is_closing() and not self.peer.eof:
            src.resume_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.relay.side_lost(self, exc)


class Relay:
    """Two transports spliced together; see the module rules.

    Typical use: `relay = Relay(idle_timeout=...)`, `relay.attach(downstream)`,
    `await loop.create_connection(relay.upstream_protocol, sock=connected_sock)`,
    `relay.start()`, then `await relay.wait()`. `open_relay` does all of it.
    """

    __slots__ = (
        "_idle_handle",
        "_idle_timeout",
        "_last_change",
        "_last_total",
        "_loop",
        "_prefix",
        "_prefix_eof",
        "done",
        "downstream",
        "high_water",
        "low_water",
        "pairing",
        "reason",
        "upstream",
    )

    def __init__(
        self,
        *,
        idle_timeout: float | None = None,
        high_water: int = HIGH_WATER,
        low_water: int = LOW_WATER,
    ) -> None:
        if not 0 <= low_water <= high_water:
            raise ValueError(f"need 0 <= low_water ({low_water}) <= high_water ({high_water})")
        self._loop = asyncio.get_running_loop()
        self.high_water = high_water
        self.low_water = low_water
        self.downstream = _Side(self, "downstream")
        self.upstream = _Side(self, "upstream")
        self.downstream.peer, self.upstream.peer = self.upstream, self.downstream
        self.done: asyncio.Future[None] = self._loop.create_future()
        self.reason = ""  # why it ended: "eof", "lost", "reset", "idle", "aborted"
        self._idle_timeout = idle_timeout
        self._idle_handle: asyncio.TimerHandle | None = None
        self._last_total = -1
        self._last_change = 0.0
        self._prefix = b""
        self._prefix_eof = False
        self.pairing: Pairing | None = None  # rule 10

    @property
    def bytes_up(self) -> int:
        """Bytes read from downstream (and written upstream), or moved past us (rule 10)."""
        moved = self.pairing.moved_up if self.pairing is not None else 0
        return self.downstream.nbytes + moved

    @property
    def bytes_down(self) -> int:
        """Bytes read from upstream (and written downstream), or moved past us (rule 10)."""
        moved = self.pairing.moved_down if self.pairing is not None else 0
        return self.upstream.nbytes + moved

    def attach(
        self, downstream: asyncio.Transport, prefix: bytes = b"", *, eof: bool = False
    ) -> None:
        """Take over an accepted transport whose reading is paused.

        `prefix` (bytes already read from it) and `eof` (it already ended) come
        from `Held`; they are forwarded upstream by `start`.
        """
        downstream.set_protocol(self.downstream)
        self.downstream.connection_made(downstream)
        # uvloop starts reading right after `connection_made`, whatever the
        # protocol did there: pause here, or bytes would arrive before the
        # upstream side exists (and be lost).
        downstream.pause_reading()
        self._prefix, self._prefix_eof = bytes(prefix), eof

    def upstream_protocol(self) -> asyncio.Protocol:
        """Protocol factory for `loop.create_connection(..., sock=...)`."""
        return self.upstream

    def start(self) -> None:
        """Start reading downstream and arm the idle timer."""
        down = self.downstream.transport
        if down is None or self.upstream.transport is None:
            raise RuntimeError("BUG: relay started before both sides are attached")
        if down.is_closing():
            self.abort()
            return
        if self._prefix:
            self.downstream.data_received(self._prefix)
            self._prefix = b""
        if self._prefix_eof:
            self.downstream.eof_received()
        else:
            down.resume_reading()
        if self._idle_timeout:
            self._last_change = self._loop.time()
            self._idle_handle = self._loop.call_later(self._tick(), self._check_idle)

    def _tick(self) -> float:
        assert self._idle_timeout is not None  # noqa: S101 - only armed with a timeout
        return max(self._idle_timeout / 4, 0.05)

    def _check_idle(self) -> None:
        assert self._idle_timeout is not None  # noqa: S101 - only armed with a timeout
        now = self._loop.time()
        total = self.downstream.nbytes + self.upstream.nbytes
        if self.pairing is not None:
            total += self.pairing.moved()
        if total != self._last_total:
            self._last_total, self._last_change = total, now
        if now - self._last_change >= self._idle_timeout:
            self._idle_handle = None
            self._end("idle", _abort)
            return
        self._idle_handle = self._loop.call_later(self._tick(), self._check_idle)

    def close(self) -> None:
        """End normally: flush what is buffered, then close both sides."""
        self._end("eof", _close)

    def abort(self) -> None:
        """End now: drop buffers, reset both sides."""
        self._end("aborted", _abort)

    def _end(self, reason: str, end: Callable[[asyncio.Transport], None]) -> None:
        """End each side still there with `end`: `_close`, `_abort` or `_reset`."""
        if not self.reason:
            self.reason = reason
            if self.pairing is not None:
                self.pairing.finish()  # rule 10: before the app ends can close
        for side in (self.downstream, self.upstream):
            tr = side.transport
            if tr is not None and not side.lost:
                end(tr)
        self._maybe_done()

    def side_lost(self, side: _Side, exc: Exception | None) -> None:
        """A side's connection is gone: end the other as it ended (rule 9)."""
        if exc is None:
            self._end("lost", _close)
            return
        logger.debug("relay side lost", extra={"side": side.name, "error": exc})
        self._end("reset", _reset)

    def _maybe_done(self) -> None:
        if self.done.done():
            return
        finished = all(s.lost or s.transport is None for s in (self.downstream, self.upstream))
        if finished:
            if self._idle_handle is not None:
                self._idle_handle.cancel()
                self._idle_handle = None
            self.done.set_result(None)

    async def wait(self) -> None:
        """Until both sides are closed."""
        await asyncio.shield(self.done)

    def write_buffer_sizes(self) -> tuple[int, int]:
        """Bytes buffered in this process towards (downstream, upstream)."""
        return tuple(  # type: ignore[return-value]
            s.transport.get_write_buffer_size() if s.transport and not s.lost else 0
            for s in (self.downstream, self.upstream)
        )


def _close(tr: asyncio.Transport) -> None:
    """Close `tr` once its buffer is written (a TLS one with close_notify)."""
    if not tr.is_closing():
        tr.close()


def _abort(tr: asyncio.Transport) -> None:
    """Close `tr` now, its buffer dropped."""
    tr.abort()


def _reset(tr: asyncio.Transport) -> None:
    """Reset `tr`'s connection: a plain one after its buffer is written (rule 9)."""
    sock = tr.get_extra_info("socket")  # a TLS transport's: the raw one's
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RESET)
    if tr.get_extra_info("ssl_object") is not None:
        tr.abort()  # no close_notify: the peer must not take this for a whole stream
    elif not tr.is_closing():
        tr.close()


async def open_relay(  # noqa: PLR0913 - the relay's knobs, all keyword-only
    downstream: asyncio.Transport,
    upstream_sock: socket.socket,
    *,
    prefix: bytes = b"",
    eof: bool = False,
    idle_timeout: float | None = None,
    high_water: int = HIGH_WATER,
    low_water: int = LOW_WATER,
) -> Relay:
    """Splice a paused, accepted `downstream` to a *connected* `upstream_sock` and start.

    `prefix` and `eof`: what a `Held` protocol kept before the handover.

    The relay owns both from here (also when this raises).

    Raises:
        OSError: the upstream transport could not be set up.
    """
    relay = Relay(idle_timeout=idle_timeout, high_water=high_water, low_water=low_water)
    relay.attach(downstream, prefix, eof=eof)
    loop = asyncio.get_running_loop()
    try:
        await loop.create_connection(relay.upstream_protocol, sock=upstream_sock)
    except BaseException:
        upstream_sock.close()
        relay.abort()
        raise
    relay.start()
    return relay
