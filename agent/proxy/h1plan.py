"""What an HTTP/1 router decides per request: a plan, a target, or a proxy answer.

`Router.plan_now(head)` answers without waiting when it can (the callback
path of agent.proxy.httpproxy needs that); `plan(head)` may wait for state.
A `Plan` chooses a `Target` per attempt, without I/O; a `Reject` is answered
by the proxy itself (`reject` builds the `l5d-proxy-error` or gRPC form).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from agent.native import mypyc_attr
from agent.proxy import h1msg, http1

if TYPE_CHECKING:
    from agent.proxy.balance import Handle
    from agent.proxy.h2pool import H2Pool
    from agent.proxy.http1 import RequestHead
    from agent.proxy.model import Route
    from agent.proxy.profile import RetryBudgetState
    from agent.proxy.record import Labels

Opener = Callable[[Callable[[], asyncio.Protocol]], Awaitable[tuple[asyncio.Transport, Any]]]


@dataclass(slots=True, kw_only=True)
class Reject:
    """Answer the request with this proxy response instead of forwarding it."""

    status: int
    response: bytes
    close: bool = False


@dataclass(slots=True, init=False)
class Target:
    """Where one attempt goes: a pool key, how to open a connection, header rewrite."""

    key: Hashable
    open: Opener
    rewrite: Callable[[http1.Headers], http1.Headers] | None
    handle: Handle | None  # balancer handle: done(now, ok) when the attempt ends
    labels: Labels
    # Set: the endpoint's inbound takes HTTP/1 upgraded to h2 (agent.proxy.origproto):
    # the pool of multiplexed connections and the key there (`open` connects either).
    h2: H2Pool | None
    h2_key: Hashable
    # 0: every request goes upgraded; N: only when the HTTP/1 pool has no idle connection
    # for `key` and N busy ones (`--h2-upgrade auto`, agent.proxy.h1toh2 rule 7).
    h2_plain: int

    def __init__(  # noqa: PLR0913 - one per outbound request: written (agent.native rule 5)
        self,
        *,
        key: Hashable,
        open: Opener,  # noqa: A002 - the field's name
        rewrite: Callable[[http1.Headers], http1.Headers] | None = None,
        handle: Handle | None = None,
        labels: Labels | None = None,
        h2: H2Pool | None = None,
        h2_key: Hashable = None,
        h2_plain: int = 0,
    ) -> None:
        self.key = key
        self.open = open
        self.rewrite = rewrite
        self.handle = handle
        self.labels = {} if labels is None else labels
        self.h2 = h2
        self.h2_key = h2_key
        self.h2_plain = h2_plain


@dataclass(slots=True, init=False)
class Plan:
    """How to serve one request: its route (retries, timeout, classes) and target choice."""

    choose: Callable[[int], Target | Reject]  # attempt number -> target (no I/O, no waiting)
    route: Route | None
    budget: RetryBudgetState | None
    timeout_s: float | None
    labels: Labels

    def __init__(  # one per connection at least: written (agent.native rule 5)
        self,
        *,
        choose: Callable[[int], Target | Reject],
        route: Route | None = None,
        budget: RetryBudgetState | None = None,
        timeout_s: float | None = None,
        labels: Labels | None = None,
    ) -> None:
        self.choose = choose
        self.route = route
        self.budget = budget
        self.timeout_s = timeout_s
        self.labels = {} if labels is None else labels


@mypyc_attr(allow_interpreted_subclasses=True)
class Router:
    """Decides, per request, where it goes (outbound) or whether it may (inbound).

    A base class, not a Protocol: `plan_now` is called per request, and through a
    Protocol that was a lookup by name (agent.native rule 12). Subclasses (the outbound
    and inbound routers; tests' in Python) give `direction` to `__init__`."""

    def __init__(self, direction: str) -> None:
        self.direction = direction

    def plan_now(self, head: RequestHead) -> Plan | Reject | None:
        """The plan for `head` or a proxy answer, if known without waiting; else None."""
        raise NotImplementedError

    async def plan(self, head: RequestHead) -> Plan | Reject:
        """The plan for `head`, or a proxy answer (waits for state it needs)."""
        raise NotImplementedError

    def close(self) -> None:
        """The connection is over: drop what would keep the router in a reference cycle
        (a memo whose plan calls back into the router), agent.proxy.worker rule 7."""


def reject(status: int, message: str, *, close: bool = False, grpc: int | None = None) -> Reject:
    """A proxy answer: `l5d-proxy-error` response, or a gRPC trailers-only error."""
    if grpc is not None:
        return Reject(status=status, response=h1msg.grpc_error_response(grpc, message), close=close)
    return Reject(
        status=status, response=h1msg.error_response(status, message, close=close), close=close
    )
