"""Failure accrual: eject an endpoint after consecutive failures, probe it back in.

Pure state machine per endpoint; time (`now`, seconds) and randomness (`rng`)
are parameters. Semantics follow Linkerd's consecutive-failures accrual:

    HEALTHY --(max_failures consecutive failures)--> EJECTED(until = now + backoff)
    EJECTED --(a request dispatched at/after `until`)--> PROBING (that one request is the probe)
    PROBING --(probe succeeds)--> HEALTHY, backoff reset
    PROBING --(probe fails)--> EJECTED(until = now + next backoff), backoff doubles

Rules:
1. A success while HEALTHY resets the consecutive-failure count.
2. While EJECTED or PROBING, results of requests other than the probe are
   ignored (they were dispatched before the ejection).
3. Backoff n (n = 0, 1, ...) is `base = min(min_s * 2**n, max_s)` plus a jitter
   `min(base * jitter * rng.random(), max_s - base)`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Protocol


class Rng(Protocol):
    """The slice of `random.Random` the cores use, so tests can inject one."""

    def random(self) -> float:
        """A float in [0, 1)."""
        ...


@dataclass(frozen=True, slots=True, kw_only=True)
class AccrualPolicy:
    """Linkerd's defaults: 7 consecutive failures; backoff 1 s .. 60 s, jitter 0.5."""

    max_failures: int = 7
    min_backoff_s: float = 1.0
    max_backoff_s: float = 60.0
    jitter: float = 0.5

    def __post_init__(self) -> None:
        if self.max_failures < 1:
            raise ValueError("max_failures must be at least 1")
        if not 0 < self.min_backoff_s <= self.max_backoff_s:
            raise ValueError("backoff needs 0 < min <= max")
        if not 0.0 <= self.jitter <= 100.0:
            raise ValueError("jitter must be in 0..100")

    def backoff(self, iteration: int, rng: Rng) -> float:
        """The delay before probe number `iteration` (0-based)."""
        base = self.min_backoff_s * 2.0 ** min(iteration, 64)
        base = min(base, self.max_backoff_s)
        if self.jitter == 0.0:
            return base
        return base + min(base * self.jitter * rng.random(), self.max_backoff_s - base)


class State(enum.Enum):
    """Where an endpoint is in the accrual cycle."""

    HEALTHY = "healthy"
    EJECTED = "ejected"
    PROBING = "probing"


class FailureAccrual:
    """Consecutive-failure accrual for one endpoint."""

    __slots__ = ("_backoffs", "_failures", "policy", "state", "until")

    def __init__(self, policy: AccrualPolicy | None = None) -> None:
        self.policy = policy or AccrualPolicy()
        self.state = State.HEALTHY
        self.until = 0.0  # when EJECTED: the time a probe may go
        self._failures = 0
        self._backoffs = 0

    def available(self, now: float) -> bool:
        """True when a request may be sent now (healthy, or a probe is due)."""
        state = self.state
        if state is State.HEALTHY:
            return True
        return state is State.EJECTED and now >= self.until

    def dispatch(self, now: float) -> bool:
        """Note a request sent now; returns True when it is the probe."""
        if self.state is State.EJECTED and now >= self.until:
            self.state = State.PROBING
            return True
        return False

    def record(self, now: float, ok: bool, rng: Rng, *, probe: bool = False) -> None:
        """Feed a request's outcome; `probe` says whether it was the probe."""
        state = self.state
        if state is State.HEALTHY:
            if ok:
                self._failures = 0
                return
            self._failures += 1
            if self._failures >= self.policy.max_failures:
                self._eject(now, rng)
        elif state is State.PROBING and probe:
            if ok:
                self.state = State.HEALTHY
                self._failures = 0
                self._backoffs = 0
            else:
                self._eject(now, rng)

    def abandon_probe(self) -> None:
        """The probe ended without an outcome (cancelled): let the next request probe."""
        if self.state is State.PROBING:
            self.state = State.EJECTED

    def _eject(self, now: float, rng: Rng) -> None:
        self.until = now + self.policy.backoff(self._backoffs, rng)
        self._backoffs += 1
        self.state = State.EJECTED
