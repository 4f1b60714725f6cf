"""Per-worker data-path context shared by the outbound and inbound handlers.

Rules:
1. One `Plane` per `Worker` (`plane_of(worker)`), living on the worker's loop:
   the upstream connection pool, SSL contexts, one `Balancer` and retry budget
   per destination, and the guards of live TCP connections whose inbound
   authorization must be re-checked when policy changes.
2. Balancers follow the state: `balancer(key, dst)` updates the endpoint set
   when the `Destination` value changed (object identity), so in-flight
   requests keep their handles and new ones see the new set.
3. Revocation: every `POLICY_RECHECK_S` the guards whose policy value changed
   are re-authorized; a connection no longer allowed is closed (well within
   the 2 s the design asks for). Requests (HTTP) are authorized one by one, so
   they need no guard.
4. `read_prefix` reads a connection's first bytes until a decision function
   decides (or EOF, or a timeout), on any transport, and gives back every
   byte read, so the next protocol can be fed them.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Hashable  # noqa: TC003 - a field type, see below
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, TypeVar

from agent import aio
from agent.policy.authorize import Facts, authorize
from agent.policy.model import ServerPolicy  # noqa: TC001 - a field type, see below
from agent.proxy.balance import Balancer
from agent.proxy.detect import NEED_MORE, NeedMore
from agent.proxy.profile import RetryBudgetState
from agent.proxy.record import recorder
from agent.proxy.state import Destination  # noqa: TC001 - a field type, see below
from agent.proxy.tcp import Relay  # noqa: TC001 - a field type, see below
from agent.proxy.upstream import ConnPool, TlsContexts

# The dataclasses' field types are imported at run time: compiled (agent.native), a
# dataclass resolves them when it is made.

if TYPE_CHECKING:
    from collections.abc import Callable

    from agent.proxy.inbound import SharedDecisions
    from agent.proxy.worker import Worker

logger = logging.getLogger(__name__)

POLICY_RECHECK_S: Final = 0.5
T = TypeVar("T")


@dataclass(slots=True)
class DstEntry:
    """A destination's balancer and retry budget, and the state value they follow."""

    dst: Destination
    balancer: Balancer
    budget: RetryBudgetState


@dataclass(slots=True, kw_only=True, eq=False)
class Guard:
    """A live TCP connection allowed by an inbound policy; closed when no longer allowed."""

    policy_key: Hashable
    policy: ServerPolicy
    facts: Facts
    relay: Relay
    default: ServerPolicy  # what applies while the key is absent
    labels: dict[str, str]


class Plane:
    """See the module rules."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.pool = ConnPool()
        self.tls = TlsContexts()
        self.rng = random.Random()  # noqa: S311 - load balancing, not crypto
        self.dsts: dict[Hashable, DstEntry] = {}
        self.guards: set[Guard] = set()
        self._watcher: asyncio.Task[None] | None = None
        self.decisions: SharedDecisions | None = None  # made by inbound.authorize_http
        # agent.proxy.outbound rule 5: the routers' memos shared by a client's connections
        self.routes: dict[Hashable, Any] = {}

    def entry(self, key: Hashable, dst: Destination) -> DstEntry:
        """The balancer entry of destination `key`, updated to `dst` if it changed."""
        entry = self.dsts.get(key)
        if entry is None:
            budget = dst.profile.retry_budget if dst.profile is not None else None
            entry = DstEntry(dst, Balancer(dst.endpoints), RetryBudgetState(budget))
            self.dsts[key] = entry
        elif entry.dst is not dst:
            entry.balancer.update(dst.endpoints)
            new_budget = dst.profile.retry_budget if dst.profile is not None else None
            if new_budget != entry.budget.budget and new_budget is not None:
                entry.budget = RetryBudgetState(new_budget)
            entry.dst = dst
        return entry

    # --- revocation ---------------------------------------------------------

    def guard(self, guard: Guard) -> None:
        """Watch `guard` until its relay ends."""
        self.guards.add(guard)
        guard.relay.done.add_done_callback(lambda _: self.guards.discard(guard))
        if self._watcher is None or self._watcher.done():
            self._watcher = aio.spawn(self._watch(), name="policy-recheck")

    async def _watch(self) -> None:
        while self.guards:
            await asyncio.sleep(POLICY_RECHECK_S)
            self.recheck()

    def recheck(self) -> int:
        """Re-authorize guards whose policy changed; close the denied. How many closed."""
        state = self.worker.state
        closed = 0
        for g in list(self.guards):
            policy = state.get(g.policy_key, g.default)
            if policy is g.policy:
                continue
            g.policy = policy
            decision = authorize(policy, g.facts)
            if decision.allowed:
                continue
            closed += 1
            self.guards.discard(g)
            recorder().authz({**g.labels, **decision.labels()}, allowed=False, http=False)
            logger.info(
                "authorization revoked, closing connection",
                extra={"policy": str(g.policy_key), "client": str(g.facts.client_ip)},
            )
            g.relay.abort()
        return closed

    def close(self) -> None:
        self.pool.close()


def plane_of(worker: Worker) -> Plane:
    """The worker's `Plane`, made on first use and kept on the worker (`Worker.plane`):
    an attribute read, where a weak dictionary's `get` was an interpreted call, several
    per connection. A stand-in worker without the attribute gets one."""
    plane: Plane | None = getattr(worker, "plane", None)
    if plane is None:
        plane = Plane(worker)
        worker.plane = plane
    return plane


# --- reading a prefix ---------------------------------------------------------------


class _Sniff(asyncio.Protocol):
    __slots__ = ("buf", "eof", "lost", "wake")

    def __init__(self, prefix: bytes, *, eof: bool) -> None:
        self.buf = bytearray(prefix)
        self.eof = eof
        self.lost = False
        self.wake: asyncio.Future[None] | None = None

    def data_received(self, data: bytes) -> None:
        self.buf += data
        self._wake()

    def eof_received(self) -> bool:
        self.eof = True
        self._wake()
        return True

    def connection_lost(self, exc: Exception | None) -> None:  # noqa: ARG002 - Protocol API
        self.lost = True
        self._wake()

    def _wake(self) -> None:
        if self.wake is not None:
            _expire(self.wake)


def _expire(wake: asyncio.Future[None]) -> None:
    """Wake `read_prefix`'s wait (bytes came, or its deadline did: it looks again)."""
    if not wake.done():
        wake.set_result(None)


async def read_prefix(  # noqa: PLR0913 - the facts of one wait
    transport: asyncio.Transport,
    prefix: bytes,
    *,
    eof: bool,
    decide: Callable[[bytes, bool], T | NeedMore],
    timeout: float,  # noqa: ASYNC109 - a deadline parameter
    loop: asyncio.AbstractEventLoop | None = None,
) -> tuple[T | None, bytes, bool]:
    """Read until `decide(buf, eof)` is not NEED_MORE: (verdict or None on timeout, bytes, eof).

    Leaves `transport` with reading paused and a placeholder protocol. `loop`, the
    connection's (`Conn.loop`), spares asking for the running one (a getpid() in CPython
    3.11). The wait is one timer on the loop, not `asyncio.timeout`: a new connection
    whose first bytes come in a later read waits here, and the context manager was six
    interpreted calls (bench/RESULTS.md, fifty-fourth pass).

    Raises:
        ConnectionError: the connection was lost first.
    """
    verdict = decide(prefix, eof)
    if verdict is not NEED_MORE:
        return verdict, prefix, eof
    sniff = _Sniff(prefix, eof=eof)
    transport.set_protocol(sniff)
    transport.resume_reading()
    if loop is None:
        loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    result: Any = NEED_MORE
    try:
        while True:
            if sniff.lost:
                raise ConnectionError("connection lost while reading its first bytes")
            result = decide(bytes(sniff.buf), sniff.eof)
            if result is not NEED_MORE:
                break
            left = deadline - loop.time()
            if left <= 0:
                result = None
                break
            wake = sniff.wake = loop.create_future()
            timer = loop.call_later(left, _expire, wake)
            try:
                await wake
            finally:
                timer.cancel()
    finally:
        if not transport.is_closing():
            transport.pause_reading()
    return result, bytes(sniff.buf), sniff.eof
