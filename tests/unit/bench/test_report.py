"""The bench report: added latency over the right baseline, ratios, memory summary."""

from __future__ import annotations

from agent.bench import report


def _rows():
    return [
        {"setup": "direct", "load": "http1-rate-1000", "p99_ms": 0.5, "rps": 1000.0},
        {"setup": "direct-xnode", "load": "http1-rate-1000", "p99_ms": 0.6},
        {"setup": "haproxy-http", "load": "http1-rate-1000", "p99_ms": 1.5},
        {"setup": "haproxy-tls", "load": "http1-rate-1000", "p99_ms": 2.6},
        {"setup": "meshagent-iptables", "load": "http1-rate-1000", "p99_ms": 2.5},
        {"setup": "meshagent-iptables-xnode", "load": "http1-rate-1000", "p99_ms": 1.6},
        {"setup": "haproxy-http", "load": "http1-saturate", "rps": 40000.0},
        {"setup": "meshagent-iptables", "load": "http1-saturate", "rps": 20000.0},
        {"setup": "meshagent-iptables", "load": "memory-100", "rss_mb": 80.0, "pss_mb": 50.0},
    ]


def test_added_p99_is_over_direct_same_node_and_direct_xnode_cross_node():
    doc = report.document({}, _rows(), [])
    added = {(r["setup"], r["load"]): r["added_p99_ms"] for r in doc["results"]}
    assert added["haproxy-http", "http1-rate-1000"] == 1.0
    assert added["meshagent-iptables", "http1-rate-1000"] == 2.0
    assert added["haproxy-tls", "http1-rate-1000"] == 2.0
    assert added["meshagent-iptables-xnode", "http1-rate-1000"] == 1.0
    assert added["haproxy-http", "http1-saturate"] is None  # no direct row for that load


def test_ratios_pair_same_node_with_haproxy_http_and_cross_node_with_haproxy_tls():
    doc = report.document({}, _rows(), [])
    r = doc["ratios"]
    assert r["added_p99:meshagent-iptables/haproxy-http@http1-rate-1000"] == 2.0
    assert r["added_p99:meshagent-iptables-xnode/haproxy-tls@http1-rate-1000"] == 0.5
    assert r["http1_saturate_rps:meshagent-iptables/haproxy-http@http1-saturate"] == 0.5
    assert not any("haproxy-tcp" in k for k in r)  # never measured: left out


def test_ratio_with_a_zero_peer_is_left_out():
    rows = [
        {"setup": "haproxy-http", "load": "http1-saturate", "rps": 0.0},
        {"setup": "meshagent-ebpf", "load": "http1-saturate", "rps": 10.0},
    ]
    assert report.ratios(rows) == {}


def test_memory_summary_sets_linkerd_sidecars_times_pods_and_the_goal_at_100():
    doc = report.document({}, _rows(), [])
    mem = doc["memory"]["meshagent-iptables@100"]
    assert mem["rss_mb"] == 80.0
    assert mem["linkerd_sidecars_mb"] == [1700.0, 2600.0]
    assert mem["goal_mb"] == report.NODE_MEMORY_GOAL_MB


def test_table_rows_blank_missing_values_and_show_errors():
    doc = report.document({}, [*_rows(), {"setup": "x", "load": "*", "error": "boom"}], [])
    rows = report.table_rows(doc)
    assert rows[-1]["errors"] == "boom"
    assert rows[0]["gbps"] == ""
