"""ServiceProfile decisions: route matching, response classification, retry budgets.

Pure; time (`now`, seconds) is a parameter. Route timeouts are data
(`Route.timeout_s`) for the shell to arm.

Rules:
1. `match_route` returns the first route whose condition matches; regexes
   were compiled when the `PathRegex` was built and match the whole path,
   query string excluded.
2. `classify` returns whether a response is a failure: the first matching
   response class decides; with none, a non-zero `grpc-status` (when known)
   or an HTTP 5xx status is a failure (Linkerd's default).
3. A retry budget (tower's `TpsBudget`) is a sliding window of `ttl_s` in 10
   slots. Each original request deposits; each retry withdraws
   `1 / retry_ratio` deposits' worth. A reserve of
   `min_retries_per_second * ttl_s` retries is always available on top.
4. `should_retry` withdraws from the budget only when every other condition
   holds, so a refused retry costs nothing.
"""

from __future__ import annotations

from typing import Final

from agent.proxy.model import (
    MatchAll,
    MatchAny,
    MatchNot,
    MethodIs,
    PathRegex,
    Profile,
    RequestMatch,
    ResponseAll,
    ResponseAny,
    ResponseMatch,
    ResponseNot,
    RetryBudget,
    Route,
    StatusRange,
)

_SLOTS: Final = 10


def match_route(profile: Profile, method: str, path: str) -> Route | None:
    """The first route of `profile` matching the request, or None."""
    if "?" in path:
        path = path.partition("?")[0]
    for route in profile.routes:
        if request_matches(route.condition, method, path):
            return route
    return None


def request_matches(cond: RequestMatch, method: str, path: str) -> bool:
    """Evaluate a `RequestMatch` tree against a method and a query-less path."""
    if isinstance(cond, PathRegex):
        return cond.pattern.fullmatch(path) is not None
    if isinstance(cond, MethodIs):
        return cond.method == method
    if isinstance(cond, MatchAll):
        return all(request_matches(c, method, path) for c in cond.matches)
    if isinstance(cond, MatchAny):
        return any(request_matches(c, method, path) for c in cond.matches)
    if isinstance(cond, MatchNot):
        return not request_matches(cond.match, method, path)
    raise AssertionError(f"BUG: unknown request match {cond!r}")


def response_matches(cond: ResponseMatch, status: int) -> bool:
    """Evaluate a `ResponseMatch` tree against an HTTP status."""
    if isinstance(cond, StatusRange):
        return cond.min <= status <= cond.max
    if isinstance(cond, ResponseAll):
        return all(response_matches(c, status) for c in cond.matches)
    if isinstance(cond, ResponseAny):
        return any(response_matches(c, status) for c in cond.matches)
    if isinstance(cond, ResponseNot):
        return not response_matches(cond.match, status)
    raise AssertionError(f"BUG: unknown response match {cond!r}")


def classify(route: Route | None, status: int, grpc_status: int | None = None) -> bool:
    """True when the response is a failure for `route` (None: no route matched)."""
    if route is not None:
        for rc in route.response_classes:
            if response_matches(rc.condition, status):
                return rc.is_failure
    if grpc_status is not None and grpc_status != 0:
        return True
    return status >= 500


class RetryBudgetState:
    """A live retry budget: deposits per request, withdrawals per retry."""

    __slots__ = (
        "_epoch",
        "_slots",
        "_window_s",
        "budget",
        "deposit_amount",
        "reserve",
        "withdraw_amount",
    )

    def __init__(self, budget: RetryBudget | None = None, now: float = 0.0) -> None:
        self.budget = budget = budget or RetryBudget()
        ratio = budget.retry_ratio
        if ratio == 0.0:
            # Deposits earn nothing; only the reserve pays for retries.
            self.deposit_amount, self.withdraw_amount = 0, 1
        elif ratio <= 1.0:
            self.deposit_amount, self.withdraw_amount = 1, int(1.0 / ratio)
        else:
            # More than one retry per request: scale up to keep integers.
            self.deposit_amount, self.withdraw_amount = 1000, int(1000.0 / ratio)
        self.withdraw_amount = max(self.withdraw_amount, 1)
        self.reserve = int(budget.min_retries_per_second * budget.ttl_s) * self.withdraw_amount
        self._window_s = budget.ttl_s / _SLOTS
        self._slots = [0] * _SLOTS
        self._epoch = int(now // self._window_s)

    def deposit(self, now: float) -> None:
        """Count one original request."""
        self._slots[self._advance(now)] += self.deposit_amount

    def withdraw(self, now: float) -> bool:
        """Take one retry from the budget; False (and nothing taken) when overdrawn."""
        slot = self._advance(now)
        if sum(self._slots) + self.reserve < self.withdraw_amount:
            return False
        self._slots[slot] -= self.withdraw_amount
        return True

    def balance(self, now: float) -> int:
        """What is in the budget now, reserve included, in withdraw units x withdraw_amount."""
        self._advance(now)
        return sum(self._slots) + self.reserve

    def _advance(self, now: float) -> int:
        epoch = int(now // self._window_s)
        if epoch > self._epoch:
            for e in range(max(self._epoch + 1, epoch - _SLOTS + 1), epoch + 1):
                self._slots[e % _SLOTS] = 0
            self._epoch = epoch
        return self._epoch % _SLOTS


def should_retry(  # noqa: PLR0913 - the facts a retry decision needs
    route: Route | None,
    status: int,
    attempt: int,
    budget: RetryBudgetState,
    now: float,
    *,
    grpc_status: int | None = None,
    max_attempts: int | None = None,
) -> bool:
    """Whether to retry after attempt number `attempt` (1 = the original) got `status`.

    Withdraws from `budget` when (and only when) it answers True.
    """
    if route is None or not route.is_retryable:
        return False
    if max_attempts is not None and attempt >= max_attempts:
        return False
    if not classify(route, status, grpc_status):
        return False
    return budget.withdraw(now)
