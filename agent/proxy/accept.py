"""A new connection, from the listener's accept to its handler's end: compiled.

The worker (agent.proxy.worker) listens and talks to the supervisor; it stays Python (it
runs as `__main__` and loads plugins). What every accepted connection runs is here, in
the compiled group (agent.native): a new connection paid for each interpreted call of
the accept path, about half of those it still made (bench/RESULTS.md, fifty-fourth pass).

Rules:
1. `Accepted` is the protocol of a freshly accepted connection until its handler takes
   the transport over, a `Held` (defined here, compiled, for `agent.proxy.tcp` too):
   reading is paused in `connection_made`; uvloop resumes reading right after that
   callback, so a first chunk that arrives anyway is kept in `prefix` (and reading
   paused again), and an EOF in `eof`. A handler hands both to whatever protocol takes
   over.
2. Each accepted connection is wrapped in a `Conn` and given to `HANDLERS[kind]` in its
   own task, an `asyncio.Task` made with its name (the loop's `create_task` names each
   task "Task-N", a formatted string, before it sets the name given; no task factory
   applies). A handler's exception ends that connection only: it is counted, logged once
   with pod, listener and peer, and never escapes. The worker references the task
   (`Conn.task`, `Worker.conns`) until it ends, so it has no failure left to log.
3. A finished connection leaves no reference cycle (agent.proxy.worker rule 7): the
   task's context holds the `Conn` (`record.CONN`, for the recorder) and the accepting
   protocol holds it too; both let go when the handler ends.
4. Extension points, set by modules loaded with the worker's `--plugin`: `HANDLERS`
   (changed in place; agent.proxy.worker's `HANDLERS` is this dict) and
   `resolve_target` (this module's attribute, replaced). Both are read per connection;
   `target_of` asks `resolve_target` once per connection and keeps the answer.
5. A connection's addresses (`Conn.peer`, `Conn.local`) are asked of the transport when
   first read, not at accept: each is a system call and an address made into text, and
   an outbound HTTP connection from a meshed pod reads neither (`Conn.port`, the
   listener's, tells a connection that resolved to the listener itself without them).
6. The original destination is read here, compiled (`original_dst_of_fd`: the
   getsockopt agent.redirect.orig_dst rule 1 describes, on the accepted socket's fd),
   its address made into text once per address (`_ADDR_TEXT`, bounded): interpreted
   in agent.redirect it was 7,900 instructions of a new connection, the text
   2,400 of them (bench/RESULTS.md, fifty-eighth pass).
7. What the accept path reads of interpreted objects (the worker, its listener, the
   `_socket` module) it reads once into typed locals or `Final` module constants, so
   the calls on them are C calls: a set's `add`/`discard` through a name lookup, or a
   module attribute read by name, was a few hundred instructions each per connection.
"""

from __future__ import annotations

import _socket
import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Final

from agent.errors import AgentError
from agent.proxy import record
from agent.proxy.listener import ListenerKind

if TYPE_CHECKING:
    from agent.proxy.worker import ListenerInfo

# the worker's: its connections' failures are the worker's to report
logger = logging.getLogger("agent.proxy.worker")


class Conn:
    """One accepted connection, as handlers see it.

    `transport` has reading paused. A handler takes it over with
    `transport.set_protocol(...)` and must first feed that protocol what was
    already read (`held.prefix`, `held.eof`), as `tcp.open_relay` does.
    """

    def __init__(  # noqa: PLR0913 - the facts of one connection
        self,
        *,
        worker: Any,  # agent.proxy.worker.Worker (interpreted)
        listener: ListenerInfo,
        held: Accepted,
        loop: asyncio.AbstractEventLoop,
        transport: asyncio.Transport,
        peer: Any = None,
        local: Any = None,
        port: int = 0,
    ) -> None:
        self.worker: Any = worker
        # its listener's loop, for handlers: asyncio.get_running_loop() is a getpid() in
        # CPython 3.11, two per connection (bench/RESULTS.md, forty-fifth pass)
        self.loop = loop
        self.listener = listener
        self.held = held
        self.transport = transport
        # (ip, port) each, asked of the transport when first read (`peer`, `local`: rule 5);
        # objects, not tuple types, to a compiled class (agent.native rule 7)
        self._peer: Any = peer
        self._local: Any = local
        self.port = port  # the listener's own port
        self.task: asyncio.Task[None] | None = None
        self.relay: Any = None  # agent.proxy.tcp.Relay, once a handler relays bytes
        self.obs: Any = None  # the recorder's per-connection record
        self.target: tuple[str, int] | None = None  # `target_of`'s answer, once asked

    @property
    def peer(self) -> Any:
        """The client's (ip, port); ("?", 0) when the transport does not know it."""
        peer = self._peer
        if peer is None:
            peer = self._peer = self.transport.get_extra_info("peername") or ("?", 0)
        return peer

    @property
    def local(self) -> Any:
        """The accepted socket's own (ip, port); ("?", 0) when the transport does not know it."""
        local = self._local
        if local is None:
            local = self._local = self.transport.get_extra_info("sockname") or ("?", 0)
        return local

    @property
    def socket(self) -> Any:
        """The accepted socket (a socket-like object: getsockopt, getsockname...)."""
        return self.transport.get_extra_info("socket")

    def log_extra(self) -> dict[str, object]:
        return {
            "pod": self.listener.pod,
            "listener": self.listener.listener_id,
            "peer": f"{self.peer[0]}:{self.peer[1]}",
        }


Handler = Callable[[Conn], Awaitable[None]]

# rule 4: agent.proxy.worker puts its relay in for both kinds; the data plane replaces it
HANDLERS: dict[ListenerKind, Handler] = {}


class Held(asyncio.Protocol):
    """A freshly accepted connection, held until a handler takes its transport over.

    Reading is paused in `connection_made`; uvloop restarts reading right after
    that callback, so the first chunk that arrives anyway is kept in `prefix`
    (and reading paused again), and an EOF is kept in `eof`. A handler hands
    both to whatever protocol takes over (`agent.proxy.tcp.Relay.attach` does;
    `agent.proxy.tcp` rules 6 and 8).
    """

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.prefix = bytearray()
        self.eof = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        tr: Any = transport  # accepted TCP: an asyncio.Transport
        self.transport = tr
        tr.pause_reading()

    def data_received(self, data: bytes) -> None:
        self.prefix += data
        transport = self.transport
        if transport is not None:
            transport.pause_reading()

    def eof_received(self) -> bool:
        self.eof = True
        return True  # keep our write side: the handler may still answer


class Accepted(Held):
    """Rule 1: the protocol a worker's listener gives each connection it accepts; it
    starts the connection's handler."""

    def __init__(self, listener: Any) -> None:  # agent.proxy.worker._Listener
        super().__init__()
        self.listener: Any = listener
        self.conn: Conn | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self.conn = accepted(self.listener, self)

    def connection_lost(self, exc: Exception | None) -> None:  # noqa: ARG002 - Protocol API
        # Only before a handler took the transport over.
        conn = self.conn
        if conn is not None and conn.task is not None:
            conn.task.cancel()


def accepted(lst: Any, held: Accepted) -> Conn:
    """A new connection on the worker's listener `lst`: its `Conn`, its handler started."""
    worker = lst.worker
    loop: asyncio.AbstractEventLoop = lst.loop
    transport = held.transport
    assert transport is not None  # noqa: S101 - called from connection_made
    conn = Conn(
        worker=worker,
        listener=lst.info,
        held=held,
        loop=loop,
        transport=transport,
        port=lst.port,
    )
    worker.accepted_total += 1
    # typed, the sets' `add` is a C call, not a method looked up by name (rule 7)
    conns: set[Conn] = worker.conns
    conns.add(conn)
    conns = lst.conns
    conns.add(conn)
    conn.task = asyncio.Task(serve(worker, conn, lst), loop=loop, name="conn")  # rule 2
    return conn


async def serve(worker: Any, conn: Conn, lst: Any) -> None:
    """Rule 2: run the connection's handler; whatever it raises ends this connection only."""
    record.CONN.set(conn)  # this task's context only (worker rule 5)
    error: BaseException | None = None
    try:
        await HANDLERS[conn.listener.kind](conn)
    except Exception as exc:  # rule 2: ends this connection only
        error = exc
        worker.failed_total += 1
        expected = isinstance(exc, (OSError, TimeoutError, AgentError))
        logger.warning(
            "connection failed",
            extra={**conn.log_extra(), "error": repr(exc)},
            exc_info=None if expected else exc,
        )
    finally:
        if not conn.transport.is_closing():
            conn.transport.abort()
        relay = conn.relay
        if relay is not None:
            worker.bytes_up += relay.bytes_up
            worker.bytes_down += relay.bytes_down
        conns: set[Conn] = worker.conns  # rule 7
        conns.discard(conn)
        conns = lst.conns
        conns.discard(conn)
        record.recorder().conn_end(conn, error)
        # No cycles left for the collector (rule 3).
        conn.task = None
        conn.held.conn = None


# <linux/netfilter_ipv4.h>: SO_ORIGINAL_DST 80 at level SOL_IP; the kernel fills a
# `struct sockaddr_in`: family (2 bytes), port (2, big-endian), IPv4 address (4), padding
SOL_IP: Final = 0
SO_ORIGINAL_DST: Final = 80
_SOCKADDR_IN_LEN: Final = 16
_ADDR_TEXT_MAX: Final = 4096
# rule 7: C statics, not three reads of `_socket`'s attributes by name per connection
_SOCKET: Final = _socket.socket
_AF_INET: Final = _socket.AF_INET
_SOCK_STREAM: Final = _socket.SOCK_STREAM
# an address's four bytes -> its text (rule 6): a worker's destinations are few
_ADDR_TEXT: dict[bytes, str] = {}


def original_dst_of_fd(fd: int) -> tuple[str, int] | None:
    """The (ip, port) the accepted TCP socket `fd` (not closed) was redirected from, or
    None where the kernel has none (not redirected by conntrack or the eBPF getsockopt
    program: sk_lookup, a direct connection). `_socket.socket`, not uvloop's
    pseudo-socket, whose calls each make one; SOL_IP's answer is the same on an
    AF_INET6 socket's fd."""
    sock = _SOCKET(_AF_INET, _SOCK_STREAM, 0, fd)
    try:
        raw: bytes = sock.getsockopt(SOL_IP, SO_ORIGINAL_DST, _SOCKADDR_IN_LEN)
    except OSError:
        return None
    finally:
        sock.detach()
    if len(raw) < 8:
        return None
    key = raw[4:8]
    host = _ADDR_TEXT.get(key)
    if host is None:
        if len(_ADDR_TEXT) >= _ADDR_TEXT_MAX:
            _ADDR_TEXT.clear()
        host = _ADDR_TEXT[key] = f"{raw[4]}.{raw[5]}.{raw[6]}.{raw[7]}"
    return host, (raw[2] << 8) | raw[3]


def default_resolve_target(conn: Conn) -> tuple[str, int]:
    """Where to relay `conn`: the original destination; inbound, on the pod's loopback.

    Asks `original_dst_of_fd` (SO_ORIGINAL_DST, rule 6) and, when it does not know
    (not redirected by conntrack: sk_lookup, or a direct connection), takes the
    accepted socket's local address, which is then the original destination. A
    direct connection to an outbound listener thus resolves to the listener itself,
    which the handlers refuse. The fd and the local address come from the transport,
    not from uvloop's pseudo-socket, whose calls each make a `socket.socket`
    (bench/RESULTS.md, forty-fifth pass).
    """
    target = original_dst_of_fd(conn.transport.get_extra_info("socket").fileno())
    if target is None:
        target = (conn.local[0], conn.local[1])
    if conn.listener.kind is ListenerKind.INBOUND:
        return ("127.0.0.1", target[1])  # DESIGN: forward to the app on the pod's loopback
    return target


# rule 4: a plugin replaces it (`accept.resolve_target = ...`)
resolve_target: Callable[[Conn], tuple[str, int]] = default_resolve_target


def target_of(conn: Conn) -> tuple[str, int]:
    """`resolve_target(conn)`, asked once per connection (the handler and the recorder
    both want it; it is a getsockopt and a parse).

    Raises:
        Whatever `resolve_target` raises (not remembered: the next call asks again).
    """
    target = conn.target
    if target is None:
        target = conn.target = resolve_target(conn)
    return target
