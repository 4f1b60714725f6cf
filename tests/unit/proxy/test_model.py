"""Proxy domain types: validation and defaults."""

from __future__ import annotations

import dataclasses

import pytest

from agent.proxy.model import (
    DEFAULT_WEIGHT,
    Endpoint,
    MatchAll,
    PathRegex,
    Profile,
    ProtocolHint,
    RetryBudget,
    Route,
    StatusRange,
    WeightedDst,
)


def test_endpoint_defaults_and_hashing_ignore_labels():
    a = Endpoint(addr=("10.0.0.1", 80), labels={"pod": "a"}, protocol_hint=ProtocolHint.H2)
    b = Endpoint(addr=("10.0.0.1", 80), labels={"pod": "a"}, protocol_hint=ProtocolHint.H2)
    assert a.weight == DEFAULT_WEIGHT
    assert Endpoint(addr=("10.0.0.1", 80), opaque_transport_port=4143).opaque_transport_port == 4143
    assert a == b
    assert hash(a) == hash(b)
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.weight = 1  # type: ignore[misc]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"addr": ("", 80)},
        {"addr": ("10.0.0.1", 0)},
        {"addr": ("10.0.0.1", 65536)},
        {"addr": ("10.0.0.1", 80), "weight": -1},
        {"addr": ("10.0.0.1", 80), "opaque_transport_port": 0},
    ],
)
def test_bad_endpoints_are_rejected(kwargs):
    with pytest.raises(ValueError):
        Endpoint(**kwargs)


@pytest.mark.parametrize(
    ("factory", "kwargs"),
    [
        (StatusRange, {"min": 500, "max": 400}),
        (StatusRange, {"min": 99, "max": 200}),
        (RetryBudget, {"retry_ratio": -0.1}),
        (RetryBudget, {"min_retries_per_second": -1}),
        (RetryBudget, {"ttl_s": 0.5}),
        (RetryBudget, {"ttl_s": 61}),
        (WeightedDst, {"authority": "a", "weight": -1}),
        (Route, {"name": "r", "condition": MatchAll(()), "timeout_s": 0}),
    ],
)
def test_bad_values_are_rejected(factory, kwargs):
    with pytest.raises(ValueError):
        factory(**kwargs)


def test_path_regex_equality_ignores_the_compiled_pattern():
    assert PathRegex("/a") == PathRegex("/a")
    assert hash(PathRegex("/a")) == hash(PathRegex("/a"))


def test_profile_defaults_describe_an_unknown_destination():
    profile = Profile()
    assert profile.routes == ()
    assert profile.retry_budget is None
    assert profile.opaque_protocol is False
    assert profile.endpoint is None


def test_traffic_split_target_keeps_its_weight():
    assert WeightedDst(authority="web-v2.shop.svc.cluster.local:80", weight=100).weight == 100
