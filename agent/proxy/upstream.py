"""Upstream connections of the data path: from a pod's namespace, plain or mTLS, pooled.

Rules:
1. Every upstream socket comes from `Worker.upstreams` (created inside the
   source pod's namespace, carrying the proxy mark): no netns work per request.
2. mTLS to a meshed endpoint uses the SOURCE pod's certificate (chosen by the
   caller from the listener that accepted, never from bytes the app sent),
   SNI = the endpoint's `tls_identity`, the server's chain verified against
   the trust bundle, and its identity (`peer_identity`) must equal
   `tls_identity` exactly. No material, or expired material: fail closed
   (`UpstreamError` with status 502) before any byte leaves.
3. SSL contexts are cached per identity and rebuilt when the `TlsMaterial`
   value changes (compared by identity of the object, then by content).
4. `ConnPool` keeps idle keep-alive HTTP/1 connections per key; a key names
   everything that makes connections non-interchangeable (source pod, TLS
   identity, destination address). Dead connections are skipped; idle ones are
   closed after `idle_timeout`.
5. `ConnPool` counts the connections it opens per key, from the moment it starts
   opening one until it is lost (`live`, through the connection's `on_gone`), idle
   or busy, so that a burst of requests does not open one each: `crowded` says a
   key has no idle connection and `limit` or more busy ones (agent.proxy.h1toh2
   rule 7 upgrades such requests instead of opening more).
6. One key object per upstream: whoever makes a pool key (a router, per client
   connection and endpoint) passes it through `ConnPool.canonical`, which hands
   back the first equal key it saw. `take` and `release` find the last key's
   list by identity, and consecutive requests on a worker come from different
   client connections: with a key tuple of their own each, every take and
   release hashed and compared a nested tuple (6 of 8 `tuplehash` calls per
   same-node request, counted with uprobes in bench/RESULTS.md's twentieth pass).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Hashable
from typing import TYPE_CHECKING, Final, Protocol

from agent.errors import AgentError, PKIError
from agent.identity import tls as idtls
from agent.proxy.accept import Held
from agent.proxy.h1upstream import UpstreamConn
from agent.proxy.tcp import Relay
from agent.proxy.tlsio import TlsHandshakeError, TlsTransport

if TYPE_CHECKING:
    import socket
    import ssl

    from agent.proxy.state import TlsMaterial
    from agent.proxy.worker import Worker

logger = logging.getLogger(__name__)

TLS_HANDSHAKE_TIMEOUT_S: Final = 5.0
POOL_IDLE_TIMEOUT_S: Final = 60.0
POOL_MAX_IDLE: Final = 256
KEYS_MAX: Final = 4096  # canonical keys kept (rule 6); cleared whole when full


class UpstreamError(AgentError):
    """An upstream could not be reached as required; `status` is the HTTP answer (502/503)."""

    def __init__(self, target: str, reason: str, status: int = 502) -> None:
        self.target = target
        self.reason = reason
        self.status = status
        super().__init__(f"upstream {target}: {reason}")


class TlsContexts:
    """Client and server SSL contexts per identity, rebuilt when the material changes."""

    def __init__(self) -> None:
        self._client: dict[str, tuple[TlsMaterial, ssl.SSLContext]] = {}
        self._server: dict[str, tuple[TlsMaterial, ssl.SSLContext]] = {}

    def client(self, material: TlsMaterial | None, identity: str, *, now: float) -> ssl.SSLContext:
        """The client context presenting `identity`'s certificate.

        Raises:
            UpstreamError: no material, expired, or unusable (fail closed).
        """
        return self._get(self._client, material, identity, now, idtls.client_context)

    def server(self, material: TlsMaterial | None, identity: str, *, now: float) -> ssl.SSLContext:
        """The server context presenting `identity`'s certificate, requiring client certs.

        Raises:
            UpstreamError: no material, expired, or unusable.
        """
        return self._get(self._server, material, identity, now, idtls.server_context)

    @staticmethod
    def _get(
        cache: dict[str, tuple[TlsMaterial, ssl.SSLContext]],
        material: TlsMaterial | None,
        identity: str,
        now: float,
        build: Callable[[bytes, idtls.SealedKey, bytes], ssl.SSLContext],
    ) -> ssl.SSLContext:
        if material is None:
            raise UpstreamError(identity, "no TLS material for this identity")
        if material.not_after <= now:
            raise UpstreamError(identity, "certificate expired")
        hit = cache.get(identity)
        if hit is not None and (hit[0] is material or hit[0] == material):
            return hit[1]
        try:
            key = idtls.SealedKey(pem=material.key_pem, password=material.key_password)
            ctx = build(material.cert_chain_pem, key, material.trust_pem)
        except (ValueError, PKIError) as exc:
            raise UpstreamError(identity, f"unusable TLS material: {exc}") from exc
        cache[identity] = (material, ctx)
        return ctx


async def connect_socket(worker: Worker, netns: str, addr: tuple[str, int]) -> socket.socket:
    """A socket made in `netns` (marked), connected to `addr`.

    Raises:
        UpstreamError: connect failed or timed out (status 502).
    """
    sock = await worker.upstreams.get(netns)
    try:
        async with asyncio.timeout(worker.connect_timeout):
            await asyncio.get_running_loop().sock_connect(sock, addr)
    except (OSError, TimeoutError) as exc:
        sock.close()
        reason = "connect timed out" if isinstance(exc, TimeoutError) else f"connect: {exc}"
        raise UpstreamError(f"{addr[0]}:{addr[1]}", reason) from exc
    except BaseException:
        sock.close()
        raise
    return sock


async def open_transport(  # noqa: PLR0913 - keyword-only connection facts
    worker: Worker,
    factory: Callable[[], asyncio.Protocol],
    *,
    netns: str,
    addr: tuple[str, int],
    ssl_ctx: ssl.SSLContext | None = None,
    expect_identity: str | None = None,
) -> tuple[asyncio.Transport, asyncio.Protocol]:
    """Connect from `netns` to `addr`, with mTLS when `ssl_ctx` is given (`open_tls`).

    With TLS, SNI is `expect_identity` and the server must present exactly it.

    Raises:
        UpstreamError: connect, handshake or identity check failed (status 502).
    """
    if ssl_ctx is not None:
        tlsx = await open_tls(
            worker, netns=netns, addr=addr, ssl_ctx=ssl_ctx, expect_identity=expect_identity
        )
        proto = factory()
        tlsx.set_protocol(proto)
        proto.connection_made(tlsx)
        tlsx.resume_reading()
        return tlsx, proto
    sock = await connect_socket(worker, netns, addr)
    try:
        return await asyncio.get_running_loop().create_connection(factory, sock=sock)
    except OSError as exc:
        sock.close()
        raise UpstreamError(f"{addr[0]}:{addr[1]}", f"connect: {exc!r}") from exc


TransportOpener = Callable[
    [Callable[[], asyncio.Protocol]], Awaitable[tuple[asyncio.Transport, asyncio.Protocol]]
]


def transport_opener(
    worker: Worker,
    *,
    netns: str,
    addr: tuple[str, int],
    ssl_ctx: ssl.SSLContext | None = None,
    identity: str | None = None,
) -> TransportOpener:
    """`open_transport` with these facts, for a pool to call with its protocol factory."""

    async def opener(
        factory: Callable[[], asyncio.Protocol],
    ) -> tuple[asyncio.Transport, asyncio.Protocol]:
        return await open_transport(
            worker, factory, netns=netns, addr=addr, ssl_ctx=ssl_ctx, expect_identity=identity
        )

    return opener


# --- keep-alive pool ----------------------------------------------------------


class Pooled(Protocol):
    """What the pool needs of a connection (agent.proxy.httpproxy's upstream protocol)."""

    pool_key: Hashable
    idle_since: float
    on_gone: Callable[[Pooled], None] | None  # called once when the connection is lost (rule 5)

    @property
    def reusable(self) -> bool:
        """Alive, between exchanges, nothing unread."""

    def close(self) -> None:
        """Close the connection."""


Opener = Callable[[], Awaitable[Pooled]]


def canonical(keys: dict[Hashable, Hashable], key: Hashable) -> Hashable:
    """The object in `keys` equal to `key`, `key` itself the first time (rule 6): one key
    object per value, kept in `keys` (`ConnPool.canonical`, `H2Pool.lane_key`)."""
    got = keys.get(key)
    if got is None:
        if len(keys) >= KEYS_MAX:
            keys.clear()  # later equal keys start a new set; lookups stay correct
        got = keys[key] = key
    return got


def _reusable(conn: UpstreamConn | Pooled) -> bool:
    """`conn.reusable`, read in place when `conn` is the compiled class the pool holds in
    the workers: read on the union (`Pooled` is a Protocol, for the unit tests' fakes), it
    was a lookup by name, per take and per release (agent.native rule 12)."""
    if isinstance(conn, UpstreamConn):
        return conn.reusable
    return conn.reusable


def _key_of(conn: UpstreamConn | Pooled) -> Hashable:
    """`conn.pool_key`, read in place as in `_reusable`."""
    if isinstance(conn, UpstreamConn):
        return conn.pool_key
    return conn.pool_key


# bound once: `time.monotonic` read per release was a lookup by name (agent.native rule 6)
_monotonic: Final = time.monotonic


class ConnPool:
    """Idle upstream connections per key, for one worker's loop."""

    def __init__(
        self, *, idle_timeout: float = POOL_IDLE_TIMEOUT_S, max_idle: int = POOL_MAX_IDLE
    ) -> None:
        self.idle_timeout = idle_timeout
        self.max_idle = max_idle
        # Typed with the one connection class it holds first, so the compiled build reads
        # its attributes directly; anything else `Pooled` (the unit tests' fakes) also works.
        self._idle: dict[Hashable, list[UpstreamConn | Pooled]] = {}
        # The last key's list, by the key's identity: a router hands out the same key
        # object for a destination, so most takes and releases skip hashing a tuple.
        self._last_key: Hashable | None = None
        self._last_idle: list[UpstreamConn | Pooled] | None = None
        self._sweeper: asyncio.TimerHandle | None = None
        self._live: dict[Hashable, int] = {}  # rule 5
        self._keys: dict[Hashable, Hashable] = {}  # rule 6
        self.opened = 0
        self.reused = 0

    def canonical(self, key: Hashable) -> Hashable:
        """The pool's key object equal to `key` (rule 6): `key` itself the first time.

        Not generic on purpose: compiled, a call typed as returning the argument's fixed
        tuple type would be unboxed and built again where it is stored (agent.native
        rule 7), a new object each time, and the identity would be lost.
        """
        return canonical(self._keys, key)

    def take(self, key: Hashable) -> UpstreamConn | Pooled | None:
        """A live idle connection for `key`, or None."""
        if key is self._last_key:
            idle = self._last_idle
        else:
            idle = self._idle.get(key)
            if idle is not None:
                self._last_key, self._last_idle = key, idle
        while idle:
            conn = idle.pop()
            if _reusable(conn):
                self.reused += 1
                return conn
            conn.close()
        return None

    async def acquire(self, key: Hashable, opener: Opener) -> tuple[Pooled, bool]:
        """A connection for `key` (idle one, else `opener()`), and whether it was reused.

        Raises:
            Whatever `opener` raises.
        """
        conn = self.take(key)
        if conn is not None:
            return conn, True
        self._live[key] = self._live.get(key, 0) + 1  # busy from the start (rule 5)
        try:
            conn = await opener()
        except BaseException:
            self._dec(key)
            raise
        conn.pool_key = key
        self.opened += 1
        if conn.reusable:
            conn.on_gone = self._gone
        else:  # lost already (a new connection is otherwise reusable)
            self._gone(conn)
        return conn, False

    def _gone(self, conn: UpstreamConn | Pooled) -> None:
        self._dec(conn.pool_key)

    def _dec(self, key: Hashable) -> None:
        n = self._live.get(key, 0) - 1
        if n > 0:
            self._live[key] = n
        else:
            self._live.pop(key, None)

    def live(self, key: Hashable) -> int:
        """Connections this pool is opening or opened for `key` and not yet lost (rule 5)."""
        return self._live.get(key, 0)

    def crowded(self, key: Hashable, limit: int) -> bool:
        """No idle connection for `key`, and `limit` or more of its connections busy."""
        idle = self._last_idle if key is self._last_key else self._idle.get(key)
        return not idle and self._live.get(key, 0) >= limit

    def release(self, conn: UpstreamConn | Pooled) -> None:
        """Give a connection back after a complete exchange (closed if not reusable)."""
        if not _reusable(conn):
            conn.close()
            return
        key = _key_of(conn)
        idle = self._last_idle
        if idle is None or key is not self._last_key:
            idle = self._idle.get(key)
            if idle is None:
                idle = self._idle[key] = []
            self._last_key, self._last_idle = key, idle
        if len(idle) >= self.max_idle:
            conn.close()
            return
        now = _monotonic()
        if isinstance(conn, UpstreamConn):
            conn.idle_since = now
        else:
            conn.idle_since = now
        idle.append(conn)
        if self._sweeper is None:
            loop = asyncio.get_running_loop()
            self._sweeper = loop.call_later(self.idle_timeout / 2, self._sweep)

    def _sweep(self) -> None:
        self._sweeper = None
        self._last_key = self._last_idle = None  # the lists are replaced below
        cutoff = time.monotonic() - self.idle_timeout
        for key in list(self._idle):
            keep = [c for c in self._idle[key] if c.reusable and c.idle_since > cutoff]
            for c in self._idle[key]:
                if c not in keep:
                    c.close()
            if keep:
                self._idle[key] = keep
            else:
                del self._idle[key]
        if self._idle:
            loop = asyncio.get_running_loop()
            self._sweeper = loop.call_later(self.idle_timeout / 2, self._sweep)

    def idle_count(self, key: Hashable | None = None) -> int:
        """Idle connections (for `key`, or all)."""
        if key is not None:
            return len(self._idle.get(key, ()))
        return sum(len(v) for v in self._idle.values())

    def close(self) -> None:
        """Close every idle connection."""
        for conns in self._idle.values():
            for c in conns:
                c.close()
        self._idle.clear()
        self._last_key = self._last_idle = None
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None


async def start_relay(  # noqa: PLR0913 - keyword-only connection facts
    worker: Worker,
    downstream: asyncio.Transport,
    *,
    netns: str,
    addr: tuple[str, int],
    prefix: bytes,
    eof: bool,
    ssl_ctx: ssl.SSLContext | None = None,
    expect_identity: str | None = None,
) -> Relay:
    """Splice a paused client transport to `addr` (from `netns`, mTLS with `ssl_ctx`).

    The relay owns `downstream` from here (aborted if this raises).

    Raises:
        UpstreamError: connect, handshake or identity check failed.
    """
    relay = Relay(idle_timeout=worker.idle_timeout)
    relay.attach(downstream, prefix, eof=eof)
    try:
        await open_transport(
            worker,
            relay.upstream_protocol,
            netns=netns,
            addr=addr,
            ssl_ctx=ssl_ctx,
            expect_identity=expect_identity,
        )
    except BaseException:
        relay.abort()
        raise
    relay.start()
    return relay


async def open_tls(
    worker: Worker,
    *,
    netns: str,
    addr: tuple[str, int],
    ssl_ctx: ssl.SSLContext,
    expect_identity: str | None,
) -> TlsTransport:
    """An mTLS client transport (reading paused, no protocol yet) that can half-close.

    Every mTLS upstream (HTTP pools, h2, the relay) uses this rather than the loop's
    TLS transport, which cannot send close_notify while still reading (issue 4:
    half-close over mTLS) and, in uvloop, maps and unmaps a read buffer per TLS
    read (three more syscalls per response; agent.proxy.tlsio's READ_CHUNK).

    Raises:
        UpstreamError: connect, handshake or identity check failed (status 502).
    """
    sock = await connect_socket(worker, netns, addr)
    where = f"{addr[0]}:{addr[1]}"
    try:
        raw, _ = await asyncio.get_running_loop().create_connection(Held, sock=sock)
    except OSError as exc:
        sock.close()
        raise UpstreamError(where, f"connect: {exc!r}") from exc
    tlsx = TlsTransport(raw, ssl_ctx, server_side=False, server_hostname=expect_identity)
    try:
        await tlsx.handshake(TLS_HANDSHAKE_TIMEOUT_S)
    except TlsHandshakeError as exc:
        tlsx.abort()
        raise UpstreamError(where, f"tls handshake: {exc.reason}") from exc
    got = idtls.peer_identity(tlsx.get_extra_info("ssl_object"))
    if got != expect_identity:
        tlsx.abort()
        raise UpstreamError(where, f"server identity {got!r} is not {expect_identity!r}")
    return tlsx
