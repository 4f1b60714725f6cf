"""The supervisor <-> worker channel: typed messages and fds over a SOCK_SEQPACKET socketpair.

Rules:
1. One channel per worker, made by `pair()` in the supervisor; the worker's
   end is inherited through `pass_fds` and never reachable from anywhere else.
2. Trust boundary: messages are pickled. That is safe only because both ends
   are our own processes and the socketpair is unnamed; never read this format
   from a socket anything else can connect to.
3. Framing: each message is one or more datagrams. The first starts with an
   8-byte big-endian payload length; the rest are continuation chunks of at
   most `CHUNK` bytes. A sender never interleaves messages (one loop thread).
4. fds (SCM_RIGHTS) ride on a message's first datagram. `send` dups them, so
   the caller keeps ownership of its own fd; the receiver owns the fd it gets.
5. Sending never blocks: datagrams the peer cannot take yet wait in order and
   go out when the socket is writable (`loop.add_writer`).
6. Reading is callback-driven (`loop.add_reader`): `on_message(msg)` per
   message, `on_closed()` once when the peer is gone or the stream is corrupt.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import pickle
import socket
import struct
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable, Hashable

    from agent.proxy.listener import ListenerKind

logger = logging.getLogger(__name__)

HEADER = struct.Struct("!Q")
CHUNK = 64 * 1024
MAX_FDS = 4


# --- messages: supervisor -> worker ---------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class AddListener:
    """Accept on this listener; `fd` is the sender's (or, received, the receiver's) fd."""

    listener_id: str
    pod: str
    kind: ListenerKind
    netns: str  # path of the pod's network namespace, for upstream sockets
    fd: int


@dataclass(frozen=True, slots=True, kw_only=True)
class RemoveListener:
    """Stop accepting on a listener; its connections get `drain_s` to finish."""

    listener_id: str
    drain_s: float


@dataclass(frozen=True, slots=True, kw_only=True)
class StateUpdate:
    """Set `key` in the worker's state to an opaque domain object."""

    key: Hashable
    value: Any


@dataclass(frozen=True, slots=True, kw_only=True)
class StateDelete:
    """Remove `key` from the worker's state."""

    key: Hashable


@dataclass(frozen=True, slots=True, kw_only=True)
class Drain:
    """Stop accepting, let connections finish for up to `deadline_s`, then exit 0."""

    deadline_s: float


# --- messages: worker -> supervisor ---------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Ready:
    """The worker is running and reading its channel."""

    worker_id: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Need:
    """The worker wants state it does not have (e.g. a destination stream opened)."""

    kind: str
    key: Hashable


@dataclass(frozen=True, slots=True, kw_only=True)
class Stats:
    """Counters of one worker (placeholder until the metrics work defines more)."""

    worker_id: int
    pid: int
    listeners: int
    open_connections: int
    accepted_total: int
    failed_total: int
    bytes_up: int
    bytes_down: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Metrics:
    """A worker's cumulative metrics (`agent.admin.metrics.MetricsSnapshot`, opaque here)."""

    worker_id: int
    snapshot: Any


@dataclass(frozen=True, slots=True, kw_only=True)
class TapEvents:
    """Tap events a worker recorded while someone taps (`dropped`: lost to its full ring)."""

    worker_id: int
    events: tuple[dict[str, Any], ...]
    dropped: int = 0


Message = (
    AddListener
    | RemoveListener
    | StateUpdate
    | StateDelete
    | Drain
    | Ready
    | Need
    | Stats
    | Metrics
    | TapEvents
)
_TYPES = (
    AddListener,
    RemoveListener,
    StateUpdate,
    StateDelete,
    Drain,
    Ready,
    Need,
    Stats,
    Metrics,
    TapEvents,
)


class ChannelError(Exception):
    """BUG-level: the channel carried something that is not one of our messages."""


def encode(msg: Message) -> tuple[list[bytes], list[int]]:
    """The datagrams of `msg` and the fds that go with the first one (not dup'd)."""
    fds: list[int] = []
    if isinstance(msg, AddListener):
        fds.append(msg.fd)
        msg = dataclasses.replace(msg, fd=-1)
    payload = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
    view = memoryview(payload)
    grams = [HEADER.pack(len(payload)) + bytes(view[:CHUNK])]
    grams.extend(bytes(view[i : i + CHUNK]) for i in range(CHUNK, len(payload), CHUNK))
    return grams, fds


def decode(payload: bytes, fds: list[int]) -> Message:
    """The message in `payload` with received `fds` put back in place.

    Raises:
        ChannelError: not one of our messages, or fds missing/extra.
    """
    try:
        obj: object = pickle.loads(payload)  # noqa: S301 - our own processes only (rule 2)
    except Exception as exc:
        raise ChannelError(f"BUG: undecodable message: {exc!r}") from exc
    if not isinstance(obj, _TYPES):
        raise ChannelError(f"BUG: unexpected object on channel: {type(obj).__name__}")
    msg: Message = obj
    wants = 1 if isinstance(msg, AddListener) else 0
    if len(fds) != wants:
        raise ChannelError(f"BUG: {type(msg).__name__} came with {len(fds)} fds")
    if isinstance(msg, AddListener):
        msg = dataclasses.replace(msg, fd=fds[0])
    return msg


def pair() -> tuple[socket.socket, socket.socket]:
    """(supervisor end, worker end): a non-blocking SEQPACKET socketpair.

    The worker end is inheritable, for `pass_fds`.
    """
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    mine.setblocking(False)  # noqa: FBT003 - the socket API's own signature
    theirs.set_inheritable(True)
    return mine, theirs


class Channel:
    """One end of a channel on the running loop; see the module rules."""

    def __init__(
        self,
        sock: socket.socket,
        *,
        on_message: Callable[[Message], None],
        on_closed: Callable[[], None],
        name: str,
    ) -> None:
        sock.setblocking(False)  # noqa: FBT003 - the socket API's own signature
        self._sock = sock
        self._on_message = on_message
        self._on_closed = on_closed
        self.name = name
        self._loop = asyncio.get_running_loop()
        self._out: deque[tuple[bytes, list[int]]] = deque()
        self._writing = False
        self._reading = False
        self._closed = False
        self._flushed: asyncio.Future[None] | None = None
        self._partial: bytearray | None = None
        self._expect = 0
        self._partial_fds: list[int] = []

    @property
    def closed(self) -> bool:
        return self._closed

    def start(self) -> None:
        """Start delivering received messages to `on_message`."""
        if not self._closed and not self._reading:
            self._loop.add_reader(self._sock.fileno(), self._read)
            self._reading = True

    # --- sending ------------------------------------------------------------

    def send(self, msg: Message) -> bool:
        """Queue `msg` and send what the socket takes now; False if the channel is closed.

        fds in `msg` are dup'd here: the caller may close its own at once.

        Raises:
            pickle.PicklingError, TypeError: a state value cannot be pickled.
        """
        if self._closed:
            return False
        grams, fds = encode(msg)
        dups = [os.dup(fd) for fd in fds]
        self._out.append((grams[0], dups))
        self._out.extend((g, []) for g in grams[1:])
        if not self._writing:
            self._write()
        return not self._closed

    def _write(self) -> None:
        while self._out:
            data, fds = self._out[0]
            try:
                if fds:
                    socket.send_fds(self._sock, [data], fds)
                else:
                    self._sock.send(data)
            except (BlockingIOError, InterruptedError):
                if not self._writing:
                    self._loop.add_writer(self._sock.fileno(), self._write)
                    self._writing = True
                return
            except OSError as exc:
                logger.info("channel send failed", extra={"channel": self.name, "error": exc})
                self._close_and_report()
                return
            self._out.popleft()
            for fd in fds:
                os.close(fd)
        if self._writing:
            self._loop.remove_writer(self._sock.fileno())
            self._writing = False
        if self._flushed is not None and not self._flushed.done():
            self._flushed.set_result(None)

    async def flush(self) -> None:
        """Until everything queued so far has been handed to the kernel (or the channel closed)."""
        if not self._out or self._closed:
            return
        if self._flushed is None or self._flushed.done():
            self._flushed = self._loop.create_future()
        await self._flushed

    # --- receiving ----------------------------------------------------------

    def read_pending(self) -> None:
        """Deliver what the peer already sent (e.g. a dead worker's last metrics) now."""
        if self._reading:
            self._read()

    def _read(self) -> None:
        while not self._closed:
            try:
                data, fds, flags, _ = socket.recv_fds(self._sock, HEADER.size + CHUNK, MAX_FDS)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                logger.info("channel receive failed", extra={"channel": self.name, "error": exc})
                self._close_and_report()
                return
            if not data and not fds:  # orderly shutdown by the peer
                self._close_and_report()
                return
            if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
                self._corrupt(fds, f"truncated datagram (flags {flags:#x})")
                return
            self._datagram(data, fds)

    def _datagram(self, data: bytes, fds: list[int]) -> None:
        if self._partial is None:
            if len(data) < HEADER.size:
                self._corrupt(fds, "datagram shorter than the header")
                return
            (self._expect,) = HEADER.unpack_from(data)
            self._partial = bytearray(data[HEADER.size :])
            self._partial_fds = fds
        elif fds:
            self._corrupt(fds, "fds on a continuation datagram")
            return
        else:
            self._partial += data
        if len(self._partial) < self._expect:
            return
        payload, fds = bytes(self._partial), self._partial_fds
        self._partial, self._partial_fds = None, []
        if len(payload) != self._expect:
            self._corrupt(fds, f"message of {len(payload)} bytes, header said {self._expect}")
            return
        try:
            msg = decode(payload, fds)
        except ChannelError as exc:
            self._corrupt(fds, str(exc))
            return
        try:
            self._on_message(msg)
        except Exception:
            logger.exception(
                "BUG: message handler failed",
                extra={"channel": self.name, "kind": type(msg).__name__},
            )

    def _corrupt(self, fds: list[int], reason: str) -> None:
        for fd in fds:
            os.close(fd)
        logger.error(
            "BUG: corrupt channel stream, closing", extra={"channel": self.name, "reason": reason}
        )
        self._close_and_report()

    # --- closing ------------------------------------------------------------

    def _close_and_report(self) -> None:
        if self._closed:
            return
        self.close()
        self._on_closed()

    def close(self) -> None:
        """Close this end now; queued datagrams and their fds are dropped."""
        if self._closed:
            return
        self._closed = True
        fileno = self._sock.fileno()
        if self._reading:
            self._loop.remove_reader(fileno)
        if self._writing:
            self._loop.remove_writer(fileno)
        for _, fds in self._out:
            for fd in fds:
                os.close(fd)
        self._out.clear()
        for fd in self._partial_fds:
            os.close(fd)
        self._partial_fds = []
        if self._flushed is not None and not self._flushed.done():
            self._flushed.set_result(None)
        with contextlib.suppress(OSError):
            self._sock.close()
