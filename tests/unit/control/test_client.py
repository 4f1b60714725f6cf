"""The client's pure parts: backoff schedule and the context token's wire form."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent.control.client import Backoff, ContextToken


def test_backoff_doubles_from_100ms_to_a_10s_cap_without_jitter():
    b = Backoff()
    assert [round(b.delay(n, 0.0), 3) for n in range(9)] == [
        0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 6.4, 10.0, 10.0,
    ]  # fmt: skip


@given(st.integers(0, 10_000), st.floats(0.0, 1.0, exclude_max=True))
def test_backoff_jitter_takes_off_at_most_half_and_never_exceeds_the_cap(attempt, rand):
    b = Backoff()
    ceiling = b.delay(attempt, 0.0)
    delay = b.delay(attempt, rand)
    assert ceiling / 2 <= delay <= ceiling <= b.cap_s


def test_context_token_is_what_linkerd2_proxy_sends():
    token = ContextToken(ns="shop", node_name="node-a", pod="web-1").to_json()
    assert json.loads(token) == {"ns": "shop", "nodeName": "node-a", "pod": "web-1"}
    assert " " not in token


@pytest.mark.parametrize("attempt", [0, 3])
def test_backoff_base_and_factor_are_settings(attempt):
    b = Backoff(base_s=1.0, cap_s=60.0, factor=3.0, jitter=0.0)
    assert b.delay(attempt, 0.9) == 3.0**attempt
