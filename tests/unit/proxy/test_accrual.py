"""Consecutive-failure accrual: ejection, backoff, probing."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent.proxy.accrual import AccrualPolicy, FailureAccrual, State


class FixedRng:
    def __init__(self, value=0.0):
        self.value = value

    def random(self):
        return self.value


def fail_n(accrual, n, now=0.0, rng=None):
    for _ in range(n):
        accrual.record(now, False, rng or FixedRng())


def test_seven_consecutive_failures_eject_by_default():
    accrual = FailureAccrual()
    fail_n(accrual, 6)
    assert accrual.state is State.HEALTHY
    fail_n(accrual, 1, now=5.0)
    assert accrual.state is State.EJECTED
    assert accrual.until == 6.0  # 1 s minimum backoff, no jitter with rng 0
    assert not accrual.available(5.5)
    assert accrual.available(6.0)


def test_a_success_resets_the_failure_count():
    accrual = FailureAccrual()
    fail_n(accrual, 6)
    accrual.record(0.0, True, FixedRng())
    fail_n(accrual, 6)
    assert accrual.state is State.HEALTHY


def test_probe_success_readmits_and_resets_backoff():
    accrual = FailureAccrual(AccrualPolicy(max_failures=1, jitter=0.0))
    fail_n(accrual, 1, now=0.0)
    assert accrual.dispatch(0.5) is False  # too early: not a probe
    assert accrual.dispatch(1.0) is True
    assert accrual.state is State.PROBING
    assert not accrual.available(1.0)  # one probe at a time
    accrual.record(1.1, True, FixedRng(), probe=True)
    assert accrual.state is State.HEALTHY
    fail_n(accrual, 1, now=2.0)
    assert accrual.until == 3.0  # backoff back at the minimum


def test_probe_failure_doubles_the_backoff_up_to_the_maximum():
    accrual = FailureAccrual(AccrualPolicy(max_failures=1, jitter=0.0, max_backoff_s=5.0))
    fail_n(accrual, 1, now=0.0)
    now, delays = 0.0, []
    for _ in range(5):
        delays.append(accrual.until - now)
        now = accrual.until
        assert accrual.dispatch(now)
        accrual.record(now, False, FixedRng(), probe=True)
    assert delays == [1.0, 2.0, 4.0, 5.0, 5.0]


def test_results_of_other_requests_are_ignored_while_ejected_or_probing():
    accrual = FailureAccrual(AccrualPolicy(max_failures=1, jitter=0.0))
    fail_n(accrual, 1)
    accrual.record(0.2, True, FixedRng())  # an old in-flight request succeeds
    assert accrual.state is State.EJECTED
    accrual.dispatch(1.0)
    accrual.record(1.1, True, FixedRng())  # not the probe
    assert accrual.state is State.PROBING


def test_an_abandoned_probe_lets_the_next_request_probe():
    accrual = FailureAccrual(AccrualPolicy(max_failures=1))
    fail_n(accrual, 1)
    assert accrual.dispatch(10.0)
    accrual.abandon_probe()
    assert accrual.state is State.EJECTED
    assert accrual.dispatch(10.0)
    accrual.abandon_probe()
    accrual.abandon_probe()  # twice is harmless
    assert accrual.state is State.EJECTED


@given(st.integers(min_value=0, max_value=200), st.floats(min_value=0, max_value=0.999999))
def test_jittered_backoff_stays_within_base_and_maximum(iteration, r):
    policy = AccrualPolicy()
    base = min(policy.min_backoff_s * 2.0**iteration, policy.max_backoff_s)
    delay = policy.backoff(iteration, FixedRng(r))
    assert base <= delay <= policy.max_backoff_s
    assert delay <= base * 1.5


def test_backoff_is_deterministic_with_a_seeded_rng():
    policy = AccrualPolicy()
    a = [policy.backoff(i, random.Random(7)) for i in range(8)]
    b = [policy.backoff(i, random.Random(7)) for i in range(8)]
    assert a == b


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_failures": 0},
        {"min_backoff_s": 0},
        {"min_backoff_s": 2, "max_backoff_s": 1},
        {"jitter": -1},
    ],
)
def test_bad_policies_are_rejected(kwargs):
    with pytest.raises(ValueError):
        AccrualPolicy(**kwargs)
