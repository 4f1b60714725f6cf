from __future__ import annotations

from agent.bench import goals, report

JUDGED = ("meshagent-iptables", "meshagent-ebpf", "meshagent-ebpf-accel", "meshagent-ebpf-xnode")


def _doc(ratios: dict[str, float], **more) -> dict:
    return {"ratios": ratios, "ratios_paired": {}, "accel": None, "memory": {}, **more}


def _by_name(doc: dict) -> dict[str, dict]:
    return {g["goal"]: g for g in goals.judge(doc, JUDGED)}


def test_every_goal_is_listed_in_order_and_one_nothing_measured_is_not_met_or_missed():
    got = goals.judge(_doc({}), JUDGED)
    assert [g["goal"] for g in got] == [
        "saturate",
        "saturate-xnode",
        "added-p99",
        "tcp-throughput",
        "sockmap",
        "sockmap-tcp",
        "cpu",
        "memory",
    ]
    assert all(g["met"] is None and g["values"] == {} for g in got)
    assert all(line.endswith(": not measured") for line in goals.lines(got))


def test_a_ratio_goal_is_met_only_when_every_judged_setup_meets_it_on_its_topology():
    ratios = {
        "http1_saturate_rps:meshagent-ebpf/haproxy-http@http1-saturate": 1.2,
        "http1_saturate_rps:meshagent-iptables/haproxy-http@http1-saturate": 1.0,
        # across nodes: judged by the cross-node goal against haproxy-tls, not here
        "http1_saturate_rps:meshagent-ebpf-xnode/haproxy-tls@http1-saturate": 0.95,
        # an explaining setup (not judged) and an L7 peer: left out
        "http1_saturate_rps:meshagent-ebpf-h1-xnode/haproxy-tls@http1-saturate": 0.5,
        "http1_saturate_rps:meshagent-ebpf-xnode/haproxy-tls-h2@http1-saturate": 0.5,
    }
    got = _by_name(_doc(ratios))
    assert got["saturate"]["met"] is True  # 1.0 meets ">= 1.0x"
    assert set(got["saturate"]["values"]) == {
        "http1_saturate_rps:meshagent-ebpf/haproxy-http@http1-saturate",
        "http1_saturate_rps:meshagent-iptables/haproxy-http@http1-saturate",
    }
    assert got["saturate-xnode"]["met"] is False
    assert got["saturate-xnode"]["values"] == {
        "http1_saturate_rps:meshagent-ebpf-xnode/haproxy-tls@http1-saturate": 0.95
    }
    assert got["saturate"]["source"] == "run"


def test_added_p99_prefers_side_by_side_falls_back_to_the_rate_load_and_leaves_sockmap_out():
    ratios = {
        "added_p99:meshagent-ebpf/haproxy-http@http1-side-1000": 1.1,
        "added_p99:meshagent-ebpf/haproxy-http@http1-rate-1000": 3.0,  # side-by-side wins
        "added_p99:meshagent-ebpf/haproxy-http@http1-rate-2000": 1.3,  # no side load at 2,000
        "added_p99:meshagent-ebpf-accel/haproxy-http@http1-rate-1000": 9.0,  # own goal
    }
    got = _by_name(_doc(ratios))["added-p99"]
    assert got["values"] == {
        "added_p99:meshagent-ebpf/haproxy-http@http1-side-1000": 1.1,
        "added_p99:meshagent-ebpf/haproxy-http@http1-rate-2000": 1.3,
    }
    assert got["met"] is False  # 1.3 > 1.2
    (line,) = [x for x in goals.lines([got]) if x]
    assert line == (
        "added p99 at 1,000 and 2,000 requests/s <= 1.2x haproxy-http's: NOT MET: "
        "meshagent-ebpf@http1-side-1000 1.1, meshagent-ebpf@http1-rate-2000 1.3"
    )


def test_with_rounds_the_ratio_goals_take_the_medians_within_rounds():
    name = "added_p99:meshagent-ebpf/haproxy-http@http1-side-1000"
    doc = _doc({name: 1.5}, ratios_paired={name: 1.1})
    got = _by_name(doc)["added-p99"]
    assert got["values"] == {name: 1.1}
    assert (got["met"], got["source"]) == (True, "paired")
    assert "(medians within rounds)" in goals.lines([got])[0]


def test_cpu_is_judged_against_haproxy_http_on_one_node_and_haproxy_tls_across():
    ratios = {
        "cpu_s_per_request:meshagent-ebpf/haproxy-http@http1-rate-1000": 1.4,
        "cpu_s_per_request:meshagent-ebpf/haproxy-http@http1-saturate": 0.7,
        "cpu_s_per_request:meshagent-ebpf-xnode/haproxy-tls@http1-rate-1000": 2.1,
    }
    got = _by_name(_doc(ratios))["cpu"]
    assert len(got["values"]) == 3
    assert got["met"] is False


def test_sockmap_needs_its_latency_and_sane_bulk_and_memory_is_judged_at_100_pods():
    accel = {"p50_mean": 0.8, "p99_mean": 0.84, "latency_goal_met": True, "bulk": {"sane": False}}
    memory = {
        "meshagent-ebpf@100": {"rss_mb": 149.0},
        "meshagent-ebpf@10": {"rss_mb": 400.0},  # only 100 pods is the goal
        "meshagent-iptables@100": {"rss_mb": 151.0},
    }
    got = _by_name(_doc({}, accel=accel, memory=memory))
    assert got["sockmap"]["met"] is False  # a bulk transfer failed
    assert got["sockmap"]["values"] == {"p50": 0.8, "p99": 0.84, "bulk_sane": False}
    accel["bulk"] = None  # bulk not run: latency alone
    assert _by_name(_doc({}, accel=accel))["sockmap"]["met"] is True
    assert got["memory"]["values"] == {"meshagent-iptables@100": 151.0, "meshagent-ebpf@100": 149.0}
    assert got["memory"]["met"] is False
    assert got["memory"]["limit"] == report.NODE_MEMORY_GOAL_MB


def test_with_rounds_sockmap_latency_is_the_mean_of_its_ratios_within_rounds():
    accel = {"p50_mean": 0.95, "p99_mean": 0.95, "latency_goal_met": False, "bulk": {"sane": True}}
    pair = "meshagent-ebpf-accel/meshagent-ebpf"
    paired = {
        f"accel_p50:{pair}@http1-rr": 0.8,
        f"accel_p50:{pair}@http1-rate-1000": 0.84,
        f"accel_p99:{pair}@http1-rr": 0.86,
        f"accel_p99:{pair}@http1-rate-1000": 0.8,
        f"accel_gbps:{pair}@tcp-throughput": 1.0,  # bulk, not latency
    }
    got = _by_name(_doc({}, accel=accel, ratios_paired=paired))["sockmap"]
    assert got["values"] == {"p50": 0.82, "p99": 0.83, "bulk_sane": True}
    assert (got["met"], got["source"]) == (True, "paired")
    # with side-by-side rounds those alone are judged (agent.bench.report rule 4)
    paired[f"accel_p50:{pair}@http1-side-1000"] = 0.9
    paired[f"accel_p99:{pair}@http1-side-1000"] = 0.7
    got = _by_name(_doc({}, accel=accel, ratios_paired=paired))["sockmap"]
    assert got["values"] == {"p50": 0.9, "p99": 0.7, "bulk_sane": True}
    assert got["met"] is False


def test_sockmap_opaque_tcp_is_a_line_of_its_own_and_never_in_sockmaps():
    accel = {
        "p50_mean": 0.8,
        "p99_mean": 0.84,
        "latency_goal_met": True,
        "bulk": None,
        "latency_tcp": {"tcp-side-1000": {"p50": 1.0, "p99": 0.9}},
        "tcp_p50_mean": 1.0,
        "tcp_p99_mean": 0.9,
    }
    got = _by_name(_doc({}, accel=accel))
    assert got["sockmap"]["values"] == {"p50": 0.8, "p99": 0.84}
    assert got["sockmap"]["met"] is True
    assert got["sockmap-tcp"]["values"] == {"p50": 1.0, "p99": 0.9}
    assert got["sockmap-tcp"]["met"] is False
    lines = goals.lines(goals.judge(_doc({}, accel=accel), JUDGED))
    sockmap = next(i for i, line in enumerate(lines) if line.startswith("sockmap: "))
    assert lines[sockmap + 1] == (
        "sockmap, opaque TCP (tcp-side-N, judged apart): latency <= 0.85x the plain path's: "
        "NOT MET: p50 1.0, p99 0.9"
    )
    del accel["latency_tcp"]  # a run without tcp-side loads
    assert _by_name(_doc({}, accel=accel))["sockmap-tcp"]["met"] is None


def test_with_rounds_opaque_tcp_and_http_each_take_the_means_of_their_own_ratios():
    pair = "meshagent-ebpf-accel/meshagent-ebpf"
    accel = {
        "p50_mean": 0.95,
        "p99_mean": 0.95,
        "bulk": None,
        "latency_tcp": {"tcp-side-1000": {}},
        "tcp_p50_mean": 0.95,
        "tcp_p99_mean": 0.95,
    }
    paired = {
        f"accel_p50:{pair}@http1-side-1000": 0.8,
        f"accel_p99:{pair}@http1-side-1000": 0.7,
        f"accel_p50:{pair}@tcp-side-1000": 1.1,
        f"accel_p99:{pair}@tcp-side-1000": 1.0,
        f"accel_p50:{pair}@tcp-side-2000": 0.9,
        f"accel_p99:{pair}@tcp-side-2000": 0.8,
    }
    got = _by_name(_doc({}, accel=accel, ratios_paired=paired))
    assert got["sockmap"]["values"] == {"p50": 0.8, "p99": 0.7}
    assert got["sockmap"]["met"] is True
    assert got["sockmap-tcp"]["values"] == {"p50": 1.0, "p99": 0.9}
    assert (got["sockmap-tcp"]["met"], got["sockmap-tcp"]["source"]) == (False, "paired")
    # TCP's rounds alone never stand in for HTTP's sequential loads either
    only_tcp = {k: v for k, v in paired.items() if "tcp-side" in k}
    got = _by_name(_doc({}, accel=accel, ratios_paired=only_tcp))
    assert got["sockmap"]["values"] == {"p50": None, "p99": None}
    assert got["sockmap"]["met"] is None


def test_short_loads_carry_a_caveat_and_verdict_length_loads_none():
    assert "smoke check" in goals.caveat(1.0)
    assert goals.caveat(goals.VERDICT_LOAD_S) is None
    assert goals.caveat(10.0) is None


def test_saturation_is_judged_in_turns_where_that_ran_else_on_the_sequential_load():
    seq = "http1_saturate_rps:{}/{}@http1-saturate"
    side = "http1_saturate_rps:{}/{}@saturate-side"
    ratios = {
        seq.format("meshagent-ebpf", "haproxy-http"): 0.95,  # the turns' number wins
        side.format("meshagent-ebpf", "haproxy-http"): 1.1,
        seq.format("meshagent-iptables", "haproxy-http"): 1.05,  # no turns: sequential
        seq.format("meshagent-ebpf-xnode", "haproxy-tls"): 1.2,
        side.format("meshagent-ebpf-xnode", "haproxy-tls"): 0.97,
    }
    got = _by_name(_doc(ratios))
    assert got["saturate"]["values"] == {
        side.format("meshagent-ebpf", "haproxy-http"): 1.1,
        seq.format("meshagent-iptables", "haproxy-http"): 1.05,
    }
    assert got["saturate"]["met"] is True
    assert got["saturate-xnode"]["values"] == {
        side.format("meshagent-ebpf-xnode", "haproxy-tls"): 0.97
    }
    assert got["saturate-xnode"]["met"] is False
