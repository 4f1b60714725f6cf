"""The declared metric families: Linkerd's names, types and latency buckets."""

from __future__ import annotations

from agent.admin.families import FAMILIES, LATENCY_MS_BUCKETS, Kind


def test_latency_buckets_are_linkerds():
    assert LATENCY_MS_BUCKETS == (
        1,
        2,
        3,
        4,
        5,
        10,
        20,
        30,
        40,
        50,
        100,
        200,
        300,
        400,
        500,
        1000,
        2000,
        3000,
        4000,
        5000,
        10000,
        20000,
        30000,
        40000,
        50000,
    )
    for name in ("response_latency_ms", "route_response_latency_ms", "tcp_connection_duration_ms"):
        assert FAMILIES[name].kind is Kind.HISTOGRAM
        assert FAMILIES[name].buckets == LATENCY_MS_BUCKETS


def test_linkerd_family_names_and_types_are_declared():
    want = {
        "request_total": Kind.COUNTER,
        "response_total": Kind.COUNTER,
        "route_request_total": Kind.COUNTER,
        "route_response_total": Kind.COUNTER,
        "tcp_open_total": Kind.COUNTER,
        "tcp_close_total": Kind.COUNTER,
        "tcp_open_connections": Kind.GAUGE,
        "tcp_read_bytes_total": Kind.COUNTER,
        "tcp_write_bytes_total": Kind.COUNTER,
        "inbound_http_authz_allow_total": Kind.COUNTER,
        "inbound_http_authz_deny_total": Kind.COUNTER,
        "inbound_tcp_authz_allow_total": Kind.COUNTER,
        "inbound_tcp_authz_deny_total": Kind.COUNTER,
        "outbound_http_balancer_endpoints": Kind.GAUGE,
    }
    assert {n: FAMILIES[n].kind for n in want} == want
