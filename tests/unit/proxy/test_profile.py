"""ServiceProfile route matching, classification and retry budgets."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent.proxy.model import (
    MatchAll,
    MatchAny,
    MatchNot,
    MethodIs,
    PathRegex,
    Profile,
    ResponseAll,
    ResponseAny,
    ResponseClass,
    ResponseNot,
    RetryBudget,
    Route,
    StatusRange,
)
from agent.proxy.profile import (
    RetryBudgetState,
    classify,
    match_route,
    request_matches,
    response_matches,
    should_retry,
)

GET_BOOKS = Route(
    name="GET /books/{id}",
    condition=MatchAll((MethodIs("GET"), PathRegex(r"/books/[^/]+"))),
    is_retryable=True,
    timeout_s=0.5,
)
POST_ANY = Route(name="POST", condition=MethodIs("POST"))
NOT_HEALTH = Route(name="not health", condition=MatchNot(PathRegex("/health")))
PROFILE = Profile(fqn="books.shop.svc.cluster.local", routes=(GET_BOOKS, POST_ANY, NOT_HEALTH))


@pytest.mark.parametrize(
    ("method", "path", "expected"),
    [
        ("GET", "/books/12", GET_BOOKS),
        ("GET", "/books/12?x=1", GET_BOOKS),
        ("GET", "/books/12/pages", NOT_HEALTH),  # regex must match the whole path
        ("POST", "/books/12", POST_ANY),  # first match wins in order
        ("PUT", "/health", None),
        ("PUT", "/other", NOT_HEALTH),
    ],
)
def test_first_matching_route_wins(method, path, expected):
    assert match_route(PROFILE, method, path) == expected


def test_any_and_empty_trees():
    assert request_matches(MatchAny((MethodIs("GET"), MethodIs("HEAD"))), "HEAD", "/")
    assert not request_matches(MatchAny(()), "GET", "/")
    assert request_matches(MatchAll(()), "GET", "/")
    assert match_route(Profile(), "GET", "/") is None


def test_regex_is_compiled_once_when_the_match_is_built():
    m = PathRegex(r"/a/\d+")
    assert m.pattern.fullmatch("/a/1")
    with pytest.raises(ValueError, match="bad path regex"):
        PathRegex("(")


FAIL_4XX = ResponseClass(condition=StatusRange(400, 499), is_failure=True)
OK_503 = ResponseClass(condition=StatusRange(503, 503), is_failure=False)


@pytest.mark.parametrize(
    ("classes", "status", "grpc", "failure"),
    [
        ((), 200, None, False),
        ((), 500, None, True),
        ((), 599, None, True),
        ((), 404, None, False),
        ((), 200, 0, False),
        ((), 200, 14, True),
        ((FAIL_4XX,), 404, None, True),
        ((OK_503,), 503, None, False),
        ((OK_503, FAIL_4XX), 502, None, True),  # no class matches: default
    ],
)
def test_classification(classes, status, grpc, failure):
    route = Route(name="r", condition=MatchAll(()), response_classes=classes)
    assert classify(route, status, grpc) is failure


def test_classification_without_route_uses_the_default():
    assert classify(None, 502) is True
    assert classify(None, 201) is False


def test_response_match_trees():
    in_4xx_not_404 = ResponseAll((StatusRange(400, 499), ResponseNot(StatusRange(404, 404))))
    assert response_matches(in_4xx_not_404, 403)
    assert not response_matches(in_4xx_not_404, 404)
    either = ResponseAny((StatusRange(200, 200), StatusRange(204, 204)))
    assert response_matches(either, 204)
    assert not response_matches(either, 201)


# --- retry budget ------------------------------------------------------------------


def test_budget_allows_the_reserve_without_any_requests():
    state = RetryBudgetState(RetryBudget(retry_ratio=0.2, min_retries_per_second=1, ttl_s=2.0))
    assert [state.withdraw(0.0) for _ in range(3)] == [True, True, False]


def test_budget_ratio_of_deposits_is_available_for_retries():
    state = RetryBudgetState(RetryBudget(retry_ratio=0.5, min_retries_per_second=0, ttl_s=10.0))
    for _ in range(10):
        state.deposit(0.0)
    allowed = sum(state.withdraw(0.5) for _ in range(20))
    assert allowed == 5


def test_deposits_expire_after_the_ttl():
    state = RetryBudgetState(RetryBudget(retry_ratio=1.0, min_retries_per_second=0, ttl_s=1.0))
    for _ in range(4):
        state.deposit(0.0)
    assert state.balance(0.95) == 4
    assert state.balance(1.05) == 0
    assert not state.withdraw(1.05)
    state.deposit(100.0)  # a long gap clears every slot once
    assert state.balance(100.0) == 1


def test_zero_ratio_budget_only_spends_the_reserve():
    state = RetryBudgetState(RetryBudget(retry_ratio=0.0, min_retries_per_second=1, ttl_s=1.0))
    for _ in range(100):
        state.deposit(0.0)
    assert [state.withdraw(0.0) for _ in range(2)] == [True, False]


def test_ratio_above_one_allows_several_retries_per_request():
    state = RetryBudgetState(RetryBudget(retry_ratio=2.0, min_retries_per_second=0, ttl_s=1.0))
    state.deposit(0.0)
    assert [state.withdraw(0.0) for _ in range(3)] == [True, True, False]


@given(
    st.lists(st.tuples(st.booleans(), st.floats(min_value=0, max_value=0.5)), max_size=80),
    st.floats(min_value=0.01, max_value=5.0),
)
def test_retries_never_exceed_deposits_plus_reserve_in_one_window(ops, ratio):
    budget = RetryBudget(retry_ratio=ratio, min_retries_per_second=1, ttl_s=10.0)
    state = RetryBudgetState(budget)
    now, deposits, retries = 0.0, 0, 0
    for is_request, dt in ops:
        now += dt * 0.1  # everything inside one ttl window
        if is_request:
            state.deposit(now)
            deposits += 1
        else:
            retries += state.withdraw(now)
    # What was withdrawn never exceeds what was deposited plus the reserve.
    assert retries * state.withdraw_amount <= deposits * state.deposit_amount + state.reserve
    # And whenever the budget refused, it really could not pay.
    assert state.withdraw(now) or state.balance(now) < state.withdraw_amount


def test_should_retry_needs_a_retryable_route_a_failure_and_budget():
    budget = RetryBudgetState(RetryBudget(retry_ratio=0.2, min_retries_per_second=1, ttl_s=1.0))
    assert not should_retry(None, 503, 1, budget, 0.0)
    assert not should_retry(POST_ANY, 503, 1, budget, 0.0)  # not retryable
    assert not should_retry(GET_BOOKS, 200, 1, budget, 0.0)  # not a failure
    assert not should_retry(GET_BOOKS, 503, 3, budget, 0.0, max_attempts=3)
    assert budget.balance(0.0) == budget.reserve  # refused retries withdrew nothing
    assert should_retry(GET_BOOKS, 503, 1, budget, 0.0)
    assert should_retry(GET_BOOKS, 200, 1, budget, 0.0, grpc_status=14) is False  # reserve spent


def test_default_budget_is_linkerds():
    state = RetryBudgetState()
    assert state.budget == RetryBudget(retry_ratio=0.2, min_retries_per_second=10, ttl_s=10.0)
    assert (state.deposit_amount, state.withdraw_amount, state.reserve) == (1, 5, 500)
