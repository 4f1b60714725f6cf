"""Endpoint balancing: Peak-EWMA load with power-of-two-choices, plus failure accrual.

Pure and single-threaded (one per worker per destination); time (`now`,
seconds) and randomness (`rng`) are parameters, so a seeded `random.Random`
makes picks reproducible.

Peak-EWMA (as tower's `PeakEwma`, which linkerd2-proxy uses):
- Each endpoint keeps an RTT estimate, starting at `default_rtt_s` (30 ms).
- A completed request with RTT `r`: if `r` exceeds the estimate, the estimate
  jumps to `r` (peak sensitive); otherwise it moves toward `r` with weight
  `1 - exp(-elapsed / decay_s)`, `elapsed` being the time since the last update.
- Reading the cost first decays the estimate toward 0 the same way (a sample
  of 0), so an idle endpoint's bad history fades within a few `decay_s` (10 s).
- cost = estimate * (pending + 1) / weight.

Picking: choose two distinct endpoints at random among those accrual deems
available, take the cheaper (the first on a tie). Ejected endpoints are
skipped unless every endpoint is ejected; then all are candidates.

Rules:
1. `update(endpoints)` keeps the stats of endpoints that stay (matched by
   address) and drops the rest from picking; handles already given out for
   removed endpoints still complete normally.
2. Every handle from `pick` must end with `done(now, ok)` or `cancel()`; a
   second call is ignored.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Final

from agent.proxy.accrual import AccrualPolicy, FailureAccrual, Rng, State

if TYPE_CHECKING:
    from collections.abc import Collection, Iterable

    from agent.proxy.model import Endpoint

DEFAULT_DECAY_S: Final = 10.0
DEFAULT_RTT_S: Final = 0.030


class EndpointStats:
    """Load and health of one endpoint; shared by its in-flight handles."""

    __slots__ = ("accrual", "endpoint", "member", "pending", "rtt", "updated_at")

    def __init__(self, endpoint: Endpoint, rtt: float, accrual: FailureAccrual) -> None:
        self.endpoint = endpoint
        self.rtt = rtt
        self.updated_at: float | None = None
        self.pending = 0
        self.accrual = accrual
        self.member = True  # still in the balancer's endpoint set

    def cost(self, now: float, decay_s: float) -> float:
        """Decay the estimate to `now` and return rtt * (pending + 1) / weight."""
        weight = self.endpoint.weight
        if weight <= 0:
            return math.inf
        return self._decayed(now, decay_s) * (self.pending + 1) / weight

    def observe(self, now: float, sample: float, decay_s: float) -> None:
        """Fold in one request's RTT `sample`, peak sensitive."""
        if sample >= self.rtt or self.updated_at is None:
            self.rtt = max(sample, self.rtt)
        else:
            decay = math.exp(-max(now - self.updated_at, 0.0) / decay_s)
            self.rtt = self.rtt * decay + sample * (1.0 - decay)
        self.updated_at = now

    def _decayed(self, now: float, decay_s: float) -> float:
        last = self.updated_at
        if last is None:
            self.updated_at = now
        elif now > last:
            self.rtt *= math.exp((last - now) / decay_s)
            self.updated_at = now
        return self.rtt


class Handle:
    """One dispatched request; report its end with `done` (or `cancel`)."""

    __slots__ = ("_balancer", "_open", "_rng", "probe", "sent_at", "stats")

    def __init__(
        self, balancer: Balancer, stats: EndpointStats, sent_at: float, rng: Rng, probe: bool
    ) -> None:
        self._balancer = balancer
        self.stats = stats
        self.sent_at = sent_at
        self._rng = rng
        self.probe = probe
        self._open = True

    @property
    def endpoint(self) -> Endpoint:
        """The endpoint this request goes to."""
        return self.stats.endpoint

    def done(self, now: float, ok: bool = True) -> None:
        """The response ended at `now`; `ok` is the classification (False: failure)."""
        if not self._open:
            return
        self._open = False
        stats = self.stats
        stats.pending -= 1
        stats.observe(now, max(now - self.sent_at, 0.0), self._balancer.decay_s)
        accrual = stats.accrual
        before = accrual.state
        accrual.record(now, ok, self._rng, probe=self.probe)
        if accrual.state is not before:
            self._balancer._health_changed(stats, before)  # noqa: SLF001 - same module

    def cancel(self) -> None:
        """The request ended without an outcome: release it, record nothing."""
        if not self._open:
            return
        self._open = False
        self.stats.pending -= 1
        if self.probe:
            self.stats.accrual.abandon_probe()


class Balancer:
    """P2C over Peak-EWMA costs for one destination's endpoints."""

    __slots__ = ("_accrual", "_by_addr", "_items", "_unhealthy", "decay_s", "default_rtt_s")

    def __init__(
        self,
        endpoints: Iterable[Endpoint] = (),
        *,
        decay_s: float = DEFAULT_DECAY_S,
        default_rtt_s: float = DEFAULT_RTT_S,
        accrual: AccrualPolicy | None = None,
    ) -> None:
        if decay_s <= 0 or default_rtt_s < 0:
            raise ValueError("decay must be positive and default RTT not negative")
        self.decay_s = decay_s
        self.default_rtt_s = default_rtt_s
        self._accrual = accrual or AccrualPolicy()
        self._by_addr: dict[tuple[str, int], EndpointStats] = {}
        self._items: list[EndpointStats] = []
        self._unhealthy = 0  # members whose accrual state is not HEALTHY
        self.update(endpoints)

    def __len__(self) -> int:
        return len(self._items)

    @property
    def endpoints(self) -> tuple[Endpoint, ...]:
        """The endpoints currently picked from."""
        return tuple(s.endpoint for s in self._items)

    def stats(self, addr: tuple[str, int]) -> EndpointStats | None:
        """The live stats of the endpoint at `addr` (for metrics and config dumps)."""
        return self._by_addr.get(addr)

    def update(self, endpoints: Iterable[Endpoint]) -> None:
        """Replace the endpoint set; endpoints that stay keep their load and health."""
        old = self._by_addr
        by_addr: dict[tuple[str, int], EndpointStats] = {}
        for ep in endpoints:
            stats = old.get(ep.addr) or by_addr.get(ep.addr)
            if stats is None:
                stats = EndpointStats(ep, self.default_rtt_s, FailureAccrual(self._accrual))
            else:
                stats.endpoint = ep
            by_addr[ep.addr] = stats
        for addr, stats in old.items():
            if addr not in by_addr:
                stats.member = False
        self._by_addr = by_addr
        self._items = list(by_addr.values())
        self._unhealthy = sum(1 for s in self._items if s.accrual.state is not State.HEALTHY)

    def pick(self, now: float, rng: Rng, avoid: Collection[tuple[str, int]] = ()) -> Handle | None:
        """Choose an endpoint for one request; None when there are no endpoints.

        `avoid`: addresses already tried by this request (retries). They are
        skipped while any other candidate remains, so a retry does not go back
        to the endpoint that just failed (a fast-failing endpoint otherwise has
        the lowest latency cost and would win every pick).
        """
        candidates = self._items
        if self._unhealthy:
            available = [s for s in candidates if s.accrual.available(now)]
            if available:
                candidates = available
        if avoid:
            others = [s for s in candidates if s.endpoint.addr not in avoid]
            if others:
                candidates = others
        n = len(candidates)
        if n == 0:
            return None
        if n == 1:
            chosen = candidates[0]
        else:
            i = min(int(rng.random() * n), n - 1)
            j = min(int(rng.random() * (n - 1)), n - 2)
            if j >= i:
                j += 1
            a, b = candidates[i], candidates[j]
            decay = self.decay_s
            chosen = a if a.cost(now, decay) <= b.cost(now, decay) else b
        chosen.pending += 1
        if chosen.updated_at is None:
            chosen.updated_at = now  # the estimate's clock starts with its first request
        probe = chosen.accrual.dispatch(now) if self._unhealthy else False
        return Handle(self, chosen, now, rng, probe)

    def _health_changed(self, stats: EndpointStats, before: State) -> None:
        if not stats.member:
            return
        after = stats.accrual.state
        if (before is State.HEALTHY) != (after is State.HEALTHY):
            self._unhealthy += 1 if before is State.HEALTHY else -1
