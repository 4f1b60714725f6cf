"""Upstream h2 connections per pool key, for one worker (agent.proxy.http2's rule 6).

Rules:
1. One connection per key (source pod, endpoint, identity) with streams multiplexed on
   it; another is opened only when the peer's concurrent-stream limit is reached or
   the connection is going away. `pool_of(worker)` is the worker's pool.
2. Towards a meshed pod's inbound on another node (the mTLS hop), the key also
   holds a lane: a worker keeps up to `Worker.h2_lanes` connections per endpoint,
   and each client connection sends all its requests or streams on one lane
   (`next_lane`, round robin). The peer's kernel gives each connection to one of its
   workers (SO_REUSEPORT hashes the addresses) and that worker serves every stream
   on it: with one connection per worker, a two-worker node's connections often
   landed on one peer worker, which then served the whole run while the other idled
   (bench/RESULTS.md, fourteenth and fifteenth passes). So a node with several
   workers keeps `agent.proxy.pool.H2_LANES` (4) lanes per worker. A node with one
   worker keeps one (`pool.h2_lanes_for`): its one worker's load needs one peer
   worker's, and every further lane splits the frames one loop batch brings into
   more TLS records, writes and peer wake-ups (1 lane against 4: 40% more requests/s
   per CPU, bench/RESULTS.md, twenty-first pass).
3. A lane's key is one object per (key, lane) (`lane_key`), kept by each client
   connection (agent.proxy.h1toh2's `lane_key`), so the pool finds the last key's
   connections by identity: a tuple's hash is computed again at every lookup. `busy`
   remembers a key it found no connection for too (under `--h2-upgrade auto` a quiet
   endpoint's lane has none, and each request asked: 600 instructions a cross-node
   request); adding that key's first connection forgets it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, cast

from agent.proxy.h2conn import H2Conn
from agent.proxy.h2stream import H2Stream, StreamGoneError
from agent.proxy.pool import H2_LANES
from agent.proxy.upstream import UpstreamError, canonical

if TYPE_CHECKING:
    from collections.abc import Hashable

    from agent.proxy.h2msg import H2Headers


logger = logging.getLogger(__name__)

Opener = Callable[[Callable[[], asyncio.Protocol]], Awaitable[tuple[asyncio.Transport, Any]]]


# --- the upstream pool ------------------------------------------------------------------


class H2Pool:
    """One multiplexed upstream h2 connection per key (rule 6), for one worker's loop."""

    def __init__(self, lanes: int = H2_LANES) -> None:
        self.lanes = lanes  # lanes per meshed endpoint (rule 2): the worker's `h2_lanes`
        self._lane = 0  # the last lane handed out
        self._conns: dict[Hashable, list[H2Conn]] = {}
        self._opening: dict[Hashable, asyncio.Future[H2Conn]] = {}
        self.opened = 0
        self._keys: dict[Hashable, Hashable] = {}  # (key, lane) -> its one object (rule 3)
        # The last key `stream_now` looked up, and its list in `_conns` (rule 3).
        self._last_key: Hashable = None
        self._last_conns: list[H2Conn] | None = None

    def lane_key(self, key: Hashable, lane: int) -> Hashable:
        """The pool's one key object for `key`'s `lane` (rule 3)."""
        pair: Hashable = (key, lane)  # an object: a tuple-typed one is boxed anew at each use
        return canonical(self._keys, pair)

    def next_lane(self) -> int:
        """The lane of a new client connection, of this pool's `lanes` (rule 2)."""
        self._lane = (self._lane + 1) % self.lanes
        return self._lane

    async def stream(
        self, key: Hashable, opener: Opener, headers: H2Headers, *, end: bool
    ) -> H2Stream:
        """A new request stream to `key`'s upstream, opening a connection if needed.

        Raises:
            UpstreamError: connecting failed (or whatever `opener` raises).
        """
        for _ in range(3):
            conn = await self._conn(key, opener)
            try:
                return conn.open_stream(headers, end=end)
            except StreamGoneError:
                continue
        raise UpstreamError(str(key), "upstream h2 connections refuse new streams")

    def stream_now(
        self, key: Hashable, headers: H2Headers, *, end: bool, body: bytes = b""
    ) -> H2Stream | None:
        """`stream` without waiting: a new request stream on an established connection to
        `key` that can take one, with its whole `body` when given (`H2Conn.open_stream`);
        None when there is none, it refused, or the body does not go at once."""
        if key is self._last_key:
            conns = self._last_conns
        else:
            conns = self._conns.get(key)
            if conns is None:
                return None
            self._last_key, self._last_conns = key, conns
        for conn in conns or ():
            if conn.usable:
                if body and not conn.takes_body(len(body)):
                    return None
                try:
                    return conn.open_stream(headers, end=end, body=body)
                except StreamGoneError:
                    return None
        return None

    def busy(self, key: Hashable) -> bool:
        """Whether a connection to `key` has a stream open: a request joining it shares the
        lane's TLS records and wake-ups (agent.proxy.h1toh2 rule 7)."""
        if key is self._last_key:
            conns = self._last_conns
        else:  # remembered, found or not: `_conn` forgets it when it adds (rule 3)
            conns = self._conns.get(key)
            self._last_key, self._last_conns = key, conns
        for conn in conns or ():  # noqa: SIM110 - not `any` over a generator: asked per request
            if conn.streams:
                return True
        return False

    async def _conn(self, key: Hashable, opener: Opener) -> H2Conn:
        while True:
            for conn in self._conns.get(key, ()):
                if conn.usable:
                    return conn
            pending = self._opening.get(key)
            if pending is None:
                break
            try:
                await asyncio.shield(pending)
            except UpstreamError:
                break  # that opening failed: open another
        fut: asyncio.Future[H2Conn] = asyncio.get_running_loop().create_future()
        self._opening[key] = fut
        try:
            _, proto = await opener(lambda: H2Conn(client_side=True))
        except BaseException as exc:
            err = exc if isinstance(exc, UpstreamError) else UpstreamError(str(key), repr(exc))
            fut.set_exception(err)
            fut.exception()
            raise
        finally:
            if self._opening.get(key) is fut:
                del self._opening[key]
        conn = cast("H2Conn", proto)
        conn.pool_key = key
        conn.on_idle = self._drop
        self._conns.setdefault(key, []).append(conn)
        self._last_key, self._last_conns = None, None  # `busy` may remember it had none
        self.opened += 1
        if not fut.done():
            fut.set_result(conn)
        return conn

    def _drop(self, conn: H2Conn) -> None:
        conns = self._conns.get(conn.pool_key)
        if conns is not None and conn in conns:
            conns.remove(conn)
            if not conns:
                del self._conns[conn.pool_key]
                if conns is self._last_conns:
                    self._last_key, self._last_conns = None, None

    def count(self, key: Hashable | None = None) -> int:
        """Open upstream connections (for `key`, or all)."""
        if key is not None:
            return len(self._conns.get(key, ()))
        return sum(len(v) for v in self._conns.values())

    def close(self) -> None:
        for conns in list(self._conns.values()):
            for conn in list(conns):
                conn.close()
        self._conns.clear()
        self._last_key, self._last_conns = None, None


# --- per-worker pools ---------------------------------------------------------------------


def pool_of(worker: Any) -> H2Pool:
    """The h2 upstream pool of a worker, made on first use and kept on the worker
    (`Worker.h2pool`, as `agent.proxy.plane.plane_of` keeps its plane)."""
    pool: H2Pool | None = getattr(worker, "h2pool", None)
    if pool is None:
        pool = H2Pool(worker.h2_lanes)
        worker.h2pool = pool
    return pool
