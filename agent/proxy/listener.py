"""Sockets the proxy opens inside a pod's network namespace.

Rules:
1. A socket belongs to the namespace it was *created* in; bind, listen,
   connect and accept then work there whichever process or thread uses it
   (agent.redirect.netns rule 3). So only `socket()` runs inside the pod's
   namespace, through `agent.redirect.netns`; everything else runs here.
2. Listeners are opened by the supervisor (non-blocking, SO_REUSEADDR,
   backlog 1024) and handed to the workers by fd passing. A pod's listener is
   one socket per worker, bound together with SO_REUSEPORT, so the kernel
   spreads new connections over the workers by their addresses; one socket
   shared by every worker would let whichever worker wakes first accept
   nearly all of them (measured: one of two workers took every client
   connection of a bench run, and capped it at one core). A group is only
   opened on a port nothing listens on (a plain bind probes it first), so it
   never joins another process's SO_REUSEPORT listener: the port in use is a
   `ListenerError`, as for one socket. With `steering` (agent.proxy.placement), the
   group carries a program that gives each new connection to the worker of the CPU
   it came in on; a kernel that refuses the program leaves the group
   spreading by hash, with a warning, and the pod is served all the same.
3. Upstream sockets (to an endpoint, or to the app on the pod's loopback) are
   created in the pod's namespace and carry `SO_MARK`, which the capture
   rules skip; without the mark the proxy would capture its own connections.

Cost of an upstream socket (measured here, 2000 sockets, 2-core VM): a plain
`socket()`+`close()` takes about 7 us; `upstream_socket`, which goes to the
netns thread, opens the nsfs file and calls `setns(2)` twice per socket,
about 56 us; `UpstreamSockets.get`, which takes a pre-made socket from a
per-namespace reserve refilled `BATCH` at a time off the hot path, about
20 us amortised (that includes creating the sockets and setting their options). So "no
netns work per request" holds like this: HTTP requests reuse pooled
upstream connections (no new socket at all), and a new upstream connection
costs one reserve pop; the namespace is entered once per `BATCH` sockets.
"""

from __future__ import annotations

import asyncio
import ctypes
import enum
import logging
import socket
import struct
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from agent import aio
from agent.config import INBOUND_PORT, OUTBOUND_PORT
from agent.errors import AgentError
from agent.proxy import placement
from agent.redirect import netns

if TYPE_CHECKING:
    from pathlib import Path

logger = logging.getLogger(__name__)

LISTEN_BACKLOG = 1024
OUTBOUND_HOST = "127.0.0.1"
INBOUND_HOST = "0.0.0.0"
SO_ATTACH_REUSEPORT_CBPF = 51  # asm-generic/socket.h; the socket module does not name it
_SOCK_FPROG = struct.Struct("@HP")  # struct sock_fprog: length, pointer to the instructions


class ListenerKind(enum.Enum):
    """Which side of a pod a listener serves; chooses the worker's handler."""

    OUTBOUND = "outbound"
    INBOUND = "inbound"

    # Members are singletons compared by identity: object's hash fits, and is C, where
    # Enum's hashes the name in Python, once per connection (`HANDLERS[kind]`).
    __hash__ = object.__hash__


class ListenerError(AgentError):
    """A listener or upstream socket could not be opened in a namespace."""

    def __init__(self, netns_path: str, what: str, reason: str) -> None:
        self.netns = netns_path
        self.what = what
        self.reason = reason
        super().__init__(f"netns {netns_path}: {what}: {reason}")


@dataclass(frozen=True, slots=True, kw_only=True)
class PodListeners:
    """One pod's outbound and inbound listeners, each one socket per worker (or one
    socket for all); the caller owns (and closes) them."""

    outbound: tuple[socket.socket, ...]
    inbound: tuple[socket.socket, ...]

    def close(self) -> None:
        for sock in (*self.outbound, *self.inbound):
            sock.close()


def open_listener(
    netns_path: str | Path,
    host: str,
    port: int,
    *,
    backlog: int = LISTEN_BACKLOG,
    reuseport: bool = False,
) -> socket.socket:
    """A non-blocking TCP listener on `host:port` inside the namespace at `netns_path`;
    with `reuseport`, one of a group of such listeners (SO_REUSEPORT, rule 2).

    Raises:
        NetnsError: the namespace cannot be entered.
        ListenerError: bind or listen failed (port in use, no such address).
    """
    sock = netns.socket_in(netns_path)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuseport:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        sock.listen(backlog)
        sock.setblocking(False)  # noqa: FBT003 - the socket API's own signature
    except OSError as exc:
        sock.close()
        reason = exc.strerror or str(exc)
        raise ListenerError(str(netns_path), f"listen {host}:{port}", reason) from exc
    return sock


def open_pod_listeners(
    netns_path: str | Path,
    *,
    outbound_port: int = OUTBOUND_PORT,
    inbound_port: int = INBOUND_PORT,
    copies: int = 1,
    steering: bytes | None = None,
) -> PodListeners:
    """The outbound (`127.0.0.1:outbound_port`) and inbound (`0.0.0.0:inbound_port`)
    listeners of the pod whose namespace is at `netns_path`: `copies` sockets of each,
    a SO_REUSEPORT group when more than one, steered by `steering` if given (rule 2).

    Raises:
        ValueError: `copies` is below 1.
        NetnsError, ListenerError: as `open_listener`; nothing is left open.
    """
    if copies < 1:
        raise ValueError(f"a listener needs at least one socket, got {copies}")
    opened: list[socket.socket] = []
    try:
        for host, port in ((OUTBOUND_HOST, outbound_port), (INBOUND_HOST, inbound_port)):
            if copies > 1:
                _probe_free(netns_path, host, port)
            for _ in range(copies):
                sock = open_listener(netns_path, host, port, reuseport=copies > 1)
                opened.append(sock)  # kept at once, for the cleanup below
            if copies > 1 and steering is not None:
                _steer(opened[-1], steering, netns_path, f"{host}:{port}")
    except BaseException:
        for sock in opened:
            sock.close()
        raise
    return PodListeners(outbound=tuple(opened[:copies]), inbound=tuple(opened[copies:]))


def attach_steering(sock: socket.socket, program: bytes) -> None:
    """Put `program` (classic BPF instructions, `placement.steering_program`) on the
    SO_REUSEPORT group `sock` listens in.

    Raises:
        OSError: the kernel refused it.
    """
    insns = ctypes.create_string_buffer(program, len(program))
    fprog = _SOCK_FPROG.pack(len(program) // placement.INSN.size, ctypes.addressof(insns))
    sock.setsockopt(socket.SOL_SOCKET, SO_ATTACH_REUSEPORT_CBPF, fprog)  # copies insns


def _steer(sock: socket.socket, program: bytes, netns_path: str | Path, where: str) -> None:
    try:
        attach_steering(sock, program)
    except OSError as exc:
        logger.warning(
            "listener group not steered by CPU; the kernel spreads it by hash",
            extra={"netns": str(netns_path), "listener": where, "reason": exc.strerror},
        )


def _probe_free(netns_path: str | Path, host: str, port: int) -> None:
    """Raise ListenerError if something listens on `host:port` (rule 2): a plain bind
    fails on a port with a listener, even a SO_REUSEPORT one; it accepts nothing.
    """
    probe = netns.socket_in(netns_path)
    try:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind((host, port))
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise ListenerError(str(netns_path), f"listen {host}:{port}", reason) from exc
    finally:
        probe.close()


def _marked(family: int, mark: int, count: int) -> list[socket.socket]:
    # Runs inside the namespace (netns thread): create `count` sockets there.
    socks: list[socket.socket] = []
    try:
        for _ in range(count):
            sock = socket.socket(family, socket.SOCK_STREAM)
            socks.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_MARK, mark)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setblocking(False)  # noqa: FBT003 - the socket API's own signature
    except BaseException:
        for sock in socks:
            sock.close()
        raise
    return socks


def upstream_socket(
    netns_path: str | Path, mark: int, family: int = socket.AF_INET
) -> socket.socket:
    """One unconnected, non-blocking TCP socket inside `netns_path` carrying `SO_MARK=mark`.

    Blocks for one trip to the netns thread; on an event loop use
    `UpstreamSockets.get`, which amortises that trip.

    Raises:
        NetnsError: the namespace cannot be entered.
        ListenerError: the socket or its mark could not be set up.
    """
    try:
        return netns.run_in(netns_path, lambda: _marked(family, mark, 1))[0]
    except OSError as exc:
        raise ListenerError(str(netns_path), "upstream socket", str(exc)) from exc


class UpstreamSockets:
    """A small reserve of marked upstream sockets per namespace, for one event loop.

    `get` pops a ready socket (no namespace work); when a reserve runs below
    half of `BATCH`, one background trip to the netns thread makes another
    batch. The reserve holds a reference on the namespace: call `discard` when
    a pod's listeners go away so its namespace can be freed.
    """

    BATCH = 8

    def __init__(self, mark: int, *, family: int = socket.AF_INET) -> None:
        self._mark = mark
        self._family = family
        self._ready: dict[str, deque[socket.socket]] = {}
        self._filling: dict[str, asyncio.Future[None]] = {}
        self._epoch = 0  # bumped by `discard`; a refill that straddles it is dropped

    async def get(self, netns_path: str) -> socket.socket:
        """An unconnected marked socket in `netns_path`.

        Raises:
            NetnsError, ListenerError: the namespace or socket setup failed.
        """
        ready = self._ready.get(netns_path)
        while not ready:
            await self._fill(netns_path)
            ready = self._ready.get(netns_path)
        sock = ready.popleft()
        if len(ready) < self.BATCH // 2 and netns_path not in self._filling:
            self._fill_soon(netns_path)
        return sock

    def _fill_soon(self, netns_path: str) -> None:
        # A failed background refill is logged by spawn; the next `get` retries and raises.
        aio.spawn(self._fill(netns_path), name=f"upstream-refill {netns_path}")

    async def _fill(self, netns_path: str) -> None:
        pending = self._filling.get(netns_path)
        if pending is not None:
            await asyncio.shield(pending)
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._filling[netns_path] = fut
        epoch = self._epoch
        try:
            socks = await netns.run_in_async(
                netns_path, lambda: _marked(self._family, self._mark, self.BATCH)
            )
        except BaseException as exc:
            err = ListenerError(netns_path, "upstream sockets", str(exc))
            fut.set_exception(err if isinstance(exc, OSError) else exc)
            fut.exception()  # retrieved here; every waiter raises it itself
            if isinstance(exc, OSError):
                raise err from exc
            raise
        finally:
            del self._filling[netns_path]
        fut.set_result(None)
        if epoch != self._epoch:  # discarded meanwhile: do not pin the namespace
            for sock in socks:
                sock.close()
            return
        self._ready.setdefault(netns_path, deque()).extend(socks)

    def discard(self, netns_path: str) -> None:
        """Close the reserve of `netns_path` (its pod is gone)."""
        self._epoch += 1
        for sock in self._ready.pop(netns_path, ()):
            sock.close()

    def close(self) -> None:
        """Close every reserved socket."""
        for path in list(self._ready):
            self.discard(path)
