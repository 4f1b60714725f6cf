"""agent.bench.sidenoise's arithmetic: HAProxy's added p99 on two copies of one path."""

from __future__ import annotations

from agent.bench import sidenoise
from agent.bench.loads import Measured


def _got(**p99: float) -> dict[str, Measured]:
    names = {"haproxy_http": "haproxy-http"}
    return {names.get(k, k): Measured(requests=10, p50_ms=0.05, p99_ms=v) for k, v in p99.items()}


def test_each_copy_adds_over_its_own_direct_and_the_quotient_is_first_over_second():
    got = sidenoise.quotients(_got(direct=0.2, haproxy_http=0.45, direct2=0.3, haproxy2=0.5))
    assert got["added_p99_ms"] == [0.25, 0.2]
    assert got["quotient"] == 1.25
    assert got["p99_ms"]["haproxy2"] == 0.5
    assert got["errors"] == 0


def test_no_quotient_when_the_second_copy_added_nothing():
    got = sidenoise.quotients(_got(direct=0.2, haproxy_http=0.45, direct2=0.5, haproxy2=0.5))
    assert got["added_p99_ms"] == [0.25, 0.0]
    assert got["quotient"] is None
