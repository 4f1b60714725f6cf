"""The bench report: added latency over the right baseline, ratios, memory summary."""

from __future__ import annotations

import pytest

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


def test_cross_node_setups_are_also_set_against_haproxy_doing_their_l7_work():
    sat, rate = "http1-saturate", "http1-rate-1000"
    rows = [
        {"setup": "direct-xnode", "load": rate, "p99_ms": 0.6},
        {"setup": "haproxy-tls", "load": sat, "rps": 40000.0, "cpu_s_per_req": 2e-5},
        {"setup": "haproxy-tls-h1", "load": sat, "rps": 32000.0, "cpu_s_per_req": 3e-5},
        {"setup": "haproxy-tls-h1", "load": rate, "p99_ms": 1.1},
        {"setup": "haproxy-tls-h2", "load": sat, "rps": 56000.0, "cpu_s_per_req": 1.5e-5},
        {"setup": "python-floor-tls", "load": sat, "rps": 24000.0, "cpu_s_per_req": 4e-5},
        {"setup": "meshagent-ebpf-h1-xnode", "load": sat, "rps": 28000.0, "cpu_s_per_req": 3.6e-5},
        {"setup": "meshagent-ebpf-h1-xnode", "load": rate, "p99_ms": 1.6},
        {"setup": "meshagent-ebpf-xnode", "load": sat, "rps": 28000.0, "cpu_s_per_req": 3e-5},
        {"setup": "meshagent-ebpf", "load": sat, "rps": 50000.0},
    ]
    doc = report.document({}, rows, [])
    added = {(r["setup"], r["load"]): r["added_p99_ms"] for r in doc["results"]}
    assert added["haproxy-tls-h1", rate] == 0.5  # over direct-xnode, not direct
    r = doc["ratios"]
    h1, auto = "meshagent-ebpf-h1-xnode", "meshagent-ebpf-xnode"
    assert r[f"http1_saturate_rps:{h1}/haproxy-tls@{sat}"] == 0.7
    assert r[f"http1_saturate_rps:{h1}/haproxy-tls-h1@{sat}"] == 0.875
    assert r[f"cpu_s_per_request:{h1}/haproxy-tls-h1@{sat}"] == 1.2
    assert r[f"added_p99:{h1}/haproxy-tls-h1@{rate}"] == 2.0
    assert r[f"http1_saturate_rps:{auto}/haproxy-tls-h2@{sat}"] == 0.5  # h2 between: h2 peer
    assert r[f"cpu_s_per_request:{auto}/haproxy-tls-h2@{sat}"] == 2.0
    assert not any(f"{h1}/haproxy-tls-h2" in k or f"{auto}/haproxy-tls-h1" in k for k in r)
    assert r[f"http1_saturate_rps:python-floor-tls/haproxy-tls-h1@{sat}"] == 0.75
    assert r[f"http1_saturate_rps:python-floor-tls/haproxy-tls-h2@{sat}"] == 0.429
    assert not any(":meshagent-ebpf/haproxy-tls" in k for k in r)  # same node: haproxy-http


def test_ratio_with_a_zero_peer_is_left_out():
    rows = [
        {"setup": "haproxy-http", "load": "http1-saturate", "rps": 0.0},
        {"setup": "meshagent-ebpf", "load": "http1-saturate", "rps": 10.0},
    ]
    assert report.ratios(rows) == {}


def test_added_p99_ratio_is_left_out_when_the_peer_added_nothing_measurable():
    rows = [
        {"setup": "direct", "load": "http1-rate-2000", "p99_ms": 0.43},
        {"setup": "haproxy-http", "load": "http1-rate-2000", "p99_ms": 0.35},  # below direct
        {"setup": "meshagent-ebpf", "load": "http1-rate-2000", "p99_ms": 0.83},
        {"setup": "haproxy-http", "load": "http1-saturate", "rps": 40000.0},
        {"setup": "meshagent-ebpf", "load": "http1-saturate", "rps": 30000.0},
    ]
    r = report.document({}, rows, [])["ratios"]
    assert not any(k.startswith("added_p99:") for k in r)
    assert r["http1_saturate_rps:meshagent-ebpf/haproxy-http@http1-saturate"] == 0.75


def test_the_python_floor_is_set_against_haproxy_and_same_node_meshagent_against_it():
    sat = "http1-saturate"
    rows = [
        {"setup": "haproxy-http", "load": sat, "rps": 40000.0, "cpu_s_per_req": 2e-5},
        {"setup": "python-floor", "load": sat, "rps": 36000.0, "cpu_s_per_req": 2.5e-5},
        {"setup": "meshagent-ebpf", "load": sat, "rps": 27000.0, "cpu_s_per_req": 4e-5},
        {"setup": "meshagent-ebpf-xnode", "load": sat, "rps": 9000.0},
    ]
    r = report.ratios(rows)
    assert r[f"http1_saturate_rps:python-floor/haproxy-http@{sat}"] == 0.9
    assert r[f"cpu_s_per_request:python-floor/haproxy-http@{sat}"] == 1.25
    assert r[f"http1_saturate_rps:meshagent-ebpf/python-floor@{sat}"] == 0.75
    assert r[f"cpu_s_per_request:meshagent-ebpf/python-floor@{sat}"] == 1.6
    assert not any("xnode/python-floor" in k for k in r)  # the floor is one hop, same node
    assert report.ratios(rows[:1] + rows[2:3]).keys() == {  # no floor row: no floor ratios
        f"http1_saturate_rps:meshagent-ebpf/haproxy-http@{sat}",
        f"cpu_s_per_request:meshagent-ebpf/haproxy-http@{sat}",
    }


def test_the_tls_floor_is_set_against_haproxy_tls_and_cross_node_meshagent_against_it():
    sat = "http1-saturate"
    rows = [
        {"setup": "haproxy-tls", "load": sat, "rps": 30000.0, "cpu_s_per_req": 4e-5},
        {"setup": "python-floor-tls", "load": sat, "rps": 24000.0, "cpu_s_per_req": 6e-5},
        {"setup": "meshagent-ebpf-xnode", "load": sat, "rps": 18000.0, "cpu_s_per_req": 9e-5},
        {"setup": "meshagent-ebpf", "load": sat, "rps": 40000.0},
    ]
    r = report.ratios(rows)
    assert r[f"http1_saturate_rps:python-floor-tls/haproxy-tls@{sat}"] == 0.8
    assert r[f"cpu_s_per_request:python-floor-tls/haproxy-tls@{sat}"] == 1.5
    assert r[f"http1_saturate_rps:meshagent-ebpf-xnode/python-floor-tls@{sat}"] == 0.75
    assert r[f"cpu_s_per_request:meshagent-ebpf-xnode/python-floor-tls@{sat}"] == 1.5
    assert not any("ebpf/python-floor-tls" in k for k in r)  # two hops: cross node only
    assert not any("/python-floor@" in k for k in r)  # no one-hop floor in these rows


def test_the_tls_floor_adds_latency_over_direct_xnode():
    rows = [
        {"setup": "direct", "load": "http1-rate-1000", "p99_ms": 0.2},
        {"setup": "direct-xnode", "load": "http1-rate-1000", "p99_ms": 0.5},
        {"setup": "python-floor-tls", "load": "http1-rate-1000", "p99_ms": 1.25},
    ]
    report.add_latency_over_baseline(rows)
    assert rows[2]["added_p99_ms"] == 0.75


def test_memory_summary_sets_linkerd_sidecars_times_pods_and_the_goal_at_100():
    doc = report.document({}, _rows(), [])
    mem = doc["memory"]["meshagent-iptables@100"]
    assert mem["rss_mb"] == 80.0
    assert mem["linkerd_sidecars_mb"] == [1700.0, 2600.0]
    assert mem["goal_mb"] == report.NODE_MEMORY_GOAL_MB


def _memory_row(pods, *, supervisor, workers, per_worker):
    return {
        "setup": "meshagent-ebpf", "load": f"memory-{pods}",
        "rss_mb": supervisor + workers * per_worker, "pss_mb": 60.0,
        "supervisor_rss_mb": supervisor, "supervisor_pss_mb": 50.0,
        "workers_rss_mb": workers * per_worker, "workers_pss_mb": workers * 20.0,
        "processes": 1 + workers,
    }  # fmt: skip


def test_memory_summary_gives_each_workers_mean_and_the_note_the_largest_pod_count():
    rows = [
        _memory_row(1, supervisor=70.0, workers=2, per_worker=30.0),
        _memory_row(100, supervisor=76.0, workers=2, per_worker=33.5),
    ]
    doc = report.document({}, rows, [])
    mem = doc["memory"]["meshagent-ebpf@100"]
    assert (mem["workers"], mem["per_worker_rss_mb"], mem["per_worker_pss_mb"]) == (2, 33.5, 20.0)
    (note,) = [n for n in doc["notes"] if n.startswith("memory at")]
    assert note.startswith("memory at 100 pods (meshagent-ebpf): supervisor 76.0 MB + 2 workers")
    assert note.endswith("4: 210, 8: 344")  # 76 + 4 x 33.5, 76 + 8 x 33.5


def test_memory_summary_without_process_counts_has_no_per_worker_figures_nor_note():
    row = _memory_row(100, supervisor=76.0, workers=2, per_worker=33.5)
    del row["processes"]
    doc = report.document({}, [row], [])
    assert "per_worker_rss_mb" not in doc["memory"]["meshagent-ebpf@100"]
    assert not [n for n in doc["notes"] if n.startswith("memory at")]


def test_table_rows_blank_missing_values_and_show_errors():
    doc = report.document({}, [*_rows(), {"setup": "x", "load": "*", "error": "boom"}], [])
    rows = report.table_rows(doc)
    assert rows[-1]["errors"] == "boom"
    assert rows[0]["gbps"] == ""


def test_error_kinds_add_up_over_rounds_and_show_in_the_table():
    load = "http1-rate-2000"
    rows = [
        {"setup": "s", "load": load, "rps": 2000.0, "errors": 2, "error_kinds": {"unsent": 2}},
        {"setup": "s", "load": load, "rps": 2000.0, "errors": 0},
        {"setup": "s", "load": load, "rps": 1999.0, "errors": 4,
         "error_kinds": {"unsent": 1, "status 502": 3}},
    ]  # fmt: skip
    (row,) = report.combine(rows)
    assert row["errors"] == 6
    assert row["error_kinds"] == {"unsent": 3, "status 502": 3}
    (shown,) = report.table_rows(report.document({}, [row], []))
    assert shown["errors"] == "6 (unsent x3, status 502 x3)"


# --- sockmap acceleration (meshagent-ebpf-accel over meshagent-ebpf) --------------------


def _accel_rows(*, accel_gbps=8.0, accel_error=None):
    rows = [
        {"setup": "meshagent-ebpf", "load": "http1-rr", "p50_ms": 0.20, "p99_ms": 0.40},
        {"setup": "meshagent-ebpf-accel", "load": "http1-rr", "p50_ms": 0.16, "p99_ms": 0.30},
        {"setup": "meshagent-ebpf", "load": "http1-rate-1000", "p50_ms": 0.25, "p99_ms": 1.0},
        {"setup": "meshagent-ebpf-accel", "load": "http1-rate-1000", "p50_ms": 0.20, "p99_ms": 0.8},
        {"setup": "meshagent-ebpf", "load": "http1-saturate", "p50_ms": 2.0, "rps": 100.0},
        {"setup": "meshagent-ebpf-accel", "load": "http1-saturate", "p50_ms": 9.0, "rps": 90.0},
        {"setup": "meshagent-ebpf", "load": "tcp-throughput", "gbps": 16.0},
    ]
    accel_tcp = {"setup": "meshagent-ebpf-accel", "load": "tcp-throughput", "gbps": accel_gbps}
    if accel_error:
        accel_tcp = {
            "setup": "meshagent-ebpf-accel",
            "load": "tcp-throughput",
            "error": accel_error,
        }
    return [*rows, accel_tcp]


def test_accel_ratios_are_latency_of_small_rr_loads_and_gbps_against_plain_ebpf():
    r = report.ratios(_accel_rows())
    assert r["accel_p50:meshagent-ebpf-accel/meshagent-ebpf@http1-rr"] == 0.8
    assert r["accel_p99:meshagent-ebpf-accel/meshagent-ebpf@http1-rate-1000"] == 0.8
    assert r["accel_gbps:meshagent-ebpf-accel/meshagent-ebpf@tcp-throughput"] == 0.5
    assert not any(k.startswith("accel_") and "http1-saturate" in k for k in r)


def test_accel_summary_meets_the_goal_only_when_mean_p50_and_p99_are_15_percent_lower():
    s = report.accel_summary(_accel_rows())
    assert s["latency"]["http1-rr"] == {"p50": 0.8, "p99": 0.75}
    assert s["p50_mean"] == 0.8
    assert s["p99_mean"] == 0.775
    assert s["latency_goal_met"] is True
    rows = _accel_rows()
    rows[3]["p50_ms"] = 0.25  # http1-rate-1000 p50 not lower: mean p50 ratio 0.9
    assert report.accel_summary(rows)["latency_goal_met"] is False


def test_accel_bulk_is_sane_at_half_the_plain_rate_and_failed_on_error_or_collapse():
    assert report.accel_summary(_accel_rows(accel_gbps=8.0))["bulk"]["sane"] is True
    assert report.accel_summary(_accel_rows(accel_gbps=4.0))["bulk"]["sane"] is False
    bulk = report.accel_summary(_accel_rows(accel_error="load tcp-throughput: ENOMEM"))["bulk"]
    assert bulk["sane"] is False
    assert bulk["error"] == "load tcp-throughput: ENOMEM"


def test_accel_summary_needs_both_setups_and_says_so_in_the_notes():
    only_plain = [r for r in _accel_rows() if r["setup"] == "meshagent-ebpf"]
    assert report.accel_summary(only_plain) is None
    assert report.document({}, only_plain, [])["accel"] is None
    notes = report.document({}, _accel_rows(), ["n"])["notes"]
    assert notes[0] == "n"
    assert "goal <= 0.85x met" in notes[-1]
    assert "bulk sane (8.0 Gbit/s, 0.5x plain)" in notes[-1]


def test_repeated_rounds_become_one_row_of_medians_and_ratios_use_them():
    sat = "http1-saturate"
    rows = [
        {"setup": "haproxy-http", "load": sat, "rps": 40000.0, "requests": 400, "errors": 0},
        {"setup": "meshagent-ebpf", "load": sat, "rps": 20000.0, "cpu_s_per_req": 4e-5,
         "requests": 200, "errors": 1},
        {"setup": "haproxy-http", "load": sat, "rps": 50000.0, "requests": 500, "errors": 0},
        {"setup": "meshagent-ebpf", "load": sat, "rps": 33000.0, "cpu_s_per_req": 3e-5,
         "requests": 330, "errors": 0},
        {"setup": "haproxy-http", "load": sat, "rps": 44000.0, "requests": 440, "errors": 0},
        {"setup": "meshagent-ebpf", "load": sat, "error": "agent not ready"},
        {"setup": "meshagent-ebpf", "load": "memory-1", "rss_mb": 130.0},
    ]  # fmt: skip
    combined = report.combine(rows)
    by = {(r["setup"], r["load"]): r for r in combined}
    assert [(r["setup"], r["load"]) for r in combined] == [
        ("haproxy-http", sat),
        ("meshagent-ebpf", sat),
        ("meshagent-ebpf", "memory-1"),
    ]
    assert by["haproxy-http", sat]["rps"] == 44000.0
    assert by["haproxy-http", sat]["rps_rounds"] == [40000.0, 50000.0, 44000.0]
    ebpf = by["meshagent-ebpf", sat]
    assert ebpf["rounds"] == 2  # the failed round is left out of the medians
    assert ebpf["rps"] == 26500.0
    assert ebpf["cpu_s_per_req"] == pytest.approx(3.5e-5)
    assert (ebpf["requests"], ebpf["errors"]) == (530, 1)
    assert "error" not in ebpf
    assert by["meshagent-ebpf", "memory-1"] == rows[-1]  # measured once: as it was
    doc = report.document({}, combined, [])
    assert doc["ratios"][f"http1_saturate_rps:meshagent-ebpf/haproxy-http@{sat}"] == 0.602


def test_idle_shares_are_medians_over_rounds_per_cpu_and_the_machines_a_table_column():
    sat = "http1-saturate"
    rows = [
        {"setup": "meshagent-ebpf-xnode", "load": sat, "rps": 1.0, "idle_pct": 20.0,
         "idle_pct_cpus": [10.0, 30.0]},
        {"setup": "meshagent-ebpf-xnode", "load": sat, "rps": 1.0, "idle_pct": 30.0,
         "idle_pct_cpus": [40.0, 20.0]},
        {"setup": "meshagent-ebpf-xnode", "load": sat, "rps": 1.0, "idle_pct": 22.0,
         "idle_pct_cpus": [20.0, 24.0]},
    ]  # fmt: skip
    (row,) = report.combine(rows)
    assert row["idle_pct"] == 22.0
    assert row["idle_pct_cpus"] == [20.0, 24.0]  # each CPU's own median
    (shown,) = report.table_rows({"results": [row]})
    assert shown["idle_pct"] == 22.0


def test_counted_instructions_are_a_median_over_rounds_and_a_table_column_when_present():
    sat = "http1-saturate"
    rows = [
        {"setup": "meshagent-ebpf-xnode", "load": sat, "rps": 200.0, "ir_per_request": 132_000},
        {"setup": "meshagent-ebpf-xnode", "load": sat, "rps": 210.0, "ir_per_request": 133_000},
        {"setup": "meshagent-ebpf-xnode", "load": sat, "rps": 190.0, "ir_per_request": 131_900},
    ]
    (row,) = report.combine(rows)
    assert row["ir_per_request"] == 132_000
    assert row["ir_rounds"] == [132_000, 133_000, 131_900]
    doc = report.document({}, [row], [])
    assert report.table_rows(doc)[0]["ir_per_request"] == 132_000
    plain = report.document({}, [{"setup": "direct", "load": sat, "rps": 9.0}], [])
    assert "ir_per_request" not in report.table_rows(plain)[0]


def test_a_setup_that_failed_every_round_keeps_its_error():
    rows = [
        {"setup": "meshagent-ebpf", "load": "*", "error": "first"},
        {"setup": "meshagent-ebpf", "load": "*", "error": "second"},
    ]
    assert report.combine(rows) == [rows[0]]


def test_paired_ratios_divide_within_each_round_then_take_the_median():
    sat = "http1-saturate"
    rows = [  # a machine that drifts: round 2 is slow for everyone
        {"setup": "haproxy-http", "load": sat, "rps": 40000.0},
        {"setup": "meshagent-ebpf", "load": sat, "rps": 36000.0},
        {"setup": "haproxy-http", "load": sat, "rps": 20000.0},
        {"setup": "meshagent-ebpf", "load": sat, "rps": 19000.0},
        {"setup": "haproxy-http", "load": sat, "rps": 42000.0},
        {"setup": "meshagent-ebpf", "load": sat, "rps": 21000.0},
        {"setup": "haproxy-http", "load": sat, "rps": 41000.0},
        {"setup": "meshagent-ebpf", "load": sat, "error": "agent not ready"},
    ]
    name = f"http1_saturate_rps:meshagent-ebpf/haproxy-http@{sat}"
    paired = report.paired_ratios(rows)
    # rounds 1-3: 0.9, 0.95, 0.5; round 4 has no meshagent row and pairs nothing
    assert paired == {name: 0.9}
    doc = report.document({}, report.combine(rows), [], measured=rows)
    assert doc["ratios_paired"] == paired
    assert doc["ratios"][name] == 0.519  # medians 21000 / 40500: rounds mixed


def test_paired_ratios_need_two_rounds():
    rows = [
        {"setup": "haproxy-http", "load": "http1-saturate", "rps": 40000.0},
        {"setup": "meshagent-ebpf", "load": "http1-saturate", "rps": 36000.0},
    ]
    assert report.paired_ratios(rows) == {}
    assert report.document({}, rows, [])["ratios_paired"] == {}


def test_a_variant_is_paired_with_base_round_by_round():
    sat, rate = "http1-saturate", "http1-rate-1000"
    base = [
        {"setup": "meshagent-ebpf", "load": sat, "rps": 100.0, "cpu_s_per_req": 4e-5},
        {"setup": "meshagent-ebpf", "load": sat, "rps": 50.0, "cpu_s_per_req": 5e-5},
        {"setup": "meshagent-ebpf", "load": sat, "error": "agent not ready"},
        {"setup": "meshagent-ebpf", "load": rate, "p50_ms": 0.2, "p99_ms": 1.0},
        {"setup": "haproxy-http", "load": sat, "rps": 90.0},
    ]  # fmt: skip
    ring = [  # a slow second round slows both sides: per round, the variant won both
        {"setup": "meshagent-ebpf", "load": sat, "rps": 110.0, "cpu_s_per_req": 3e-5},
        {"setup": "meshagent-ebpf", "load": sat, "rps": 60.0, "cpu_s_per_req": 6e-5},
        {"setup": "meshagent-ebpf", "load": sat, "rps": 70.0, "cpu_s_per_req": 6e-5},
        {"setup": "meshagent-ebpf", "load": rate, "p50_ms": 0.1, "p99_ms": None},
    ]  # fmt: skip
    got = report.variants(base, {"ring": ring}, {"ring": {"MESHAGENT_IO_URING": "on"}})
    assert set(got) == {"ring"}
    assert got["ring"]["env"] == {"MESHAGENT_IO_URING": "on"}
    paired = got["ring"]["paired"]
    rps = paired[f"rps:meshagent-ebpf@{sat}"]
    assert rps["rounds"] == [1.1, 1.2]  # round 3's base failed: no pair
    assert (rps["median"], rps["better"]) == (1.15, 2)
    cpu = paired[f"cpu_s_per_req:meshagent-ebpf@{sat}"]
    assert (cpu["rounds"], cpu["better"]) == ([0.75, 1.2], 1)  # lower is better
    assert paired[f"p50_ms:meshagent-ebpf@{rate}"]["rounds"] == [0.5]
    assert f"p99_ms:meshagent-ebpf@{rate}" not in paired  # a side had no number
    assert not any("haproxy" in k for k in paired)  # base-only setups pair with nothing
    (combined,) = [r for r in got["ring"]["results"] if r["load"] == sat]
    assert combined["rps"] == 70.0  # the variant's own rows, medians (rule 6)
    assert len(got["ring"]["measured"]) > len(got["ring"]["results"])  # every round's rows
    lines = report.variant_lines(got)
    assert (
        f"ring (MESHAGENT_IO_URING=on) / base: rps:meshagent-ebpf@{sat} = 1.15 "
        "(better in 2 of 2 rounds)" in lines
    )


def _accel_side_row(rate: int, p50: float, p99: float, plain: tuple[float, float]) -> dict:
    return {
        "setup": "meshagent-ebpf-accel",
        "load": f"http1-side-{rate}",
        "p50_ms": p50,
        "p99_ms": p99,
        "side": {
            "direct": {"p50_ms": 0.05, "p99_ms": 0.1},
            "meshagent-ebpf": {"p50_ms": plain[0], "p99_ms": plain[1]},
        },
    }


def test_sockmap_side_by_side_is_set_against_its_own_plain_path_and_judged_before_the_rest():
    rows = [
        *_accel_rows(),  # sequential loads: p50 0.8, p99 0.775 on their own (met)
        # the plain ebpf setup's side row (beside HAProxy) must not be its peer here
        _side_row(0.45, 0.2, 0.4),
        _accel_side_row(1000, 0.18, 0.40, plain=(0.20, 0.50)),
        _accel_side_row(2000, 0.19, 0.45, plain=(0.20, 0.50)),
    ]
    doc = report.document({}, rows, [])
    r = doc["ratios"]
    assert r["accel_p50:meshagent-ebpf-accel/meshagent-ebpf@http1-side-1000"] == 0.9
    assert r["accel_p99:meshagent-ebpf-accel/meshagent-ebpf@http1-side-2000"] == 0.9
    accel = doc["accel"]
    assert accel["judged_on"] == "side"
    assert (accel["p50_mean"], accel["p99_mean"]) == (0.925, 0.85)
    assert accel["latency_goal_met"] is False  # p50 0.925: the sequential loads do not count
    assert accel["latency"]["http1-rr"] == {"p50": 0.8, "p99": 0.75}  # still reported
    accel_row = next(
        x for x in doc["results"] if x["load"] == "http1-side-1000" and "accel" in x["setup"]
    )
    assert accel_row["added_p99_ms"] == 0.3  # over the side's own direct
    lines = [n for n in doc["notes"] if n.startswith("side by side") and "plain path" in n]
    assert len(lines) == 2
    assert lines[0].endswith("p50 0.9x, p99 0.8x the plain path's (meshagent-ebpf)")
    assert "http1-side-1000, http1-side-2000; goal <= 0.85x not met" in doc["notes"][0]


def test_sockmap_side_by_side_alone_is_a_summary_without_the_plain_setups_rows():
    accel = report.accel_summary([_accel_side_row(1000, 0.17, 0.40, plain=(0.20, 0.50))])
    assert accel is not None
    assert (accel["p50_mean"], accel["p99_mean"], accel["latency_goal_met"]) == (0.85, 0.8, True)
    assert accel["bulk"] is None


def _accel_tcp_row(rate: int, p50: float, p99: float, plain: tuple[float, float]) -> dict:
    return {**_accel_side_row(rate, p50, p99, plain), "load": f"tcp-side-{rate}"}


def test_sockmap_opaque_tcp_is_reported_apart_and_leaves_the_http_verdict_alone():
    rows = [
        _accel_side_row(1000, 0.17, 0.40, plain=(0.20, 0.50)),  # HTTP: p50 0.85, p99 0.8
        _accel_tcp_row(1000, 0.10, 0.50, plain=(0.10, 0.50)),  # TCP: 1.0, 1.0
        _accel_tcp_row(2000, 0.08, 0.40, plain=(0.10, 0.50)),  # TCP: 0.8, 0.8
    ]
    doc = report.document({}, rows, [])
    accel = doc["accel"]
    # HTTP's numbers and verdict are HTTP's only
    assert list(accel["latency"]) == ["http1-side-1000"]
    assert (accel["judged_on"], accel["p50_mean"], accel["p99_mean"]) == ("side", 0.85, 0.8)
    assert accel["latency_goal_met"] is True
    # TCP's apart
    assert accel["latency_tcp"] == {
        "tcp-side-1000": {"p50": 1.0, "p99": 1.0},
        "tcp-side-2000": {"p50": 0.8, "p99": 0.8},
    }
    assert (accel["tcp_p50_mean"], accel["tcp_p99_mean"]) == (0.9, 0.9)
    assert accel["tcp_latency_goal_met"] is False
    pair = "meshagent-ebpf-accel/meshagent-ebpf"
    assert doc["ratios"][f"accel_p50:{pair}@tcp-side-2000"] == 0.8
    assert doc["ratios"][f"accel_p99:{pair}@tcp-side-1000"] == 1.0
    http_line, tcp_line = (n for n in doc["notes"] if n.startswith("sockmap acceleration"))
    assert "p50 0.85x, p99 0.8x over http1-side-1000; goal <= 0.85x met" in http_line
    assert tcp_line == (
        f"sockmap acceleration, opaque TCP ({pair.replace('/', ' / ')}, not in the goal above): "
        "p50 0.9x, p99 0.9x over tcp-side-1000, tcp-side-2000; <= 0.85x not met"
    )
    side_lines = [n for n in doc["notes"] if n.startswith("opaque TCP echo side by side")]
    assert len(side_lines) == 2
    assert side_lines[1].startswith("opaque TCP echo side by side at 2000 req/s (1 s turns): ")
    assert side_lines[1].endswith("p50 0.8x, p99 0.8x the plain path's (meshagent-ebpf)")


def test_sockmap_opaque_tcp_alone_never_becomes_the_http_judgement():
    accel = report.accel_summary([_accel_tcp_row(1000, 0.08, 0.40, plain=(0.10, 0.50))])
    assert accel is not None
    assert accel["latency"] == {}
    assert (accel["p50_mean"], accel["p99_mean"], accel["latency_goal_met"]) == (None, None, None)
    assert (accel["tcp_p50_mean"], accel["tcp_p99_mean"]) == (0.8, 0.8)
    assert accel["tcp_latency_goal_met"] is True
    assert report.accel_judged(["tcp-side-1000", "http1-rr"]) == (["http1-rr"], "sequential")
    assert report.accel_tcp_judged(["tcp-side-1000", "http1-side-1000"]) == ["tcp-side-1000"]


def test_without_opaque_tcp_loads_the_summary_has_no_tcp_numbers_nor_line():
    doc = report.document({}, _accel_rows(), [])
    accel = doc["accel"]
    assert accel["latency_tcp"] == {}
    assert (accel["tcp_p50_mean"], accel["tcp_p99_mean"], accel["tcp_latency_goal_met"]) == (
        None,
        None,
        None,
    )
    assert not any("opaque TCP" in n for n in doc["notes"])


def test_accel_bulk_judges_the_download_too_when_it_ran():
    rows = [
        *_accel_rows(accel_gbps=15.0),
        {"setup": "meshagent-ebpf", "load": "tcp-reverse", "gbps": 16.0},
        {"setup": "meshagent-ebpf-accel", "load": "tcp-reverse", "gbps": 7.2},
    ]
    bulk = report.accel_summary(rows)["bulk"]
    assert bulk["gbps_ratio"] == 0.938
    assert bulk["reverse"]["gbps_ratio"] == 0.45
    assert bulk["sane"] is False  # the download under the floor fails the whole
    assert report.ratios(rows)["accel_gbps:meshagent-ebpf-accel/meshagent-ebpf@tcp-reverse"] == 0.45
    line = report.document({}, rows, [])["notes"][-1]
    assert "bulk FAILED (15.0 Gbit/s, 0.938x plain; reverse 7.2 Gbit/s, 0.45x plain)" in line
    rows[-1]["gbps"] = 12.0
    assert report.accel_summary(rows)["bulk"]["sane"] is True


def _side_row(mine: float, direct: float, haproxy: float, **more) -> dict:
    return {
        "setup": "meshagent-ebpf",
        "load": "http1-side-1000",
        "p50_ms": 0.15,
        "p99_ms": mine,
        "side": {
            "direct": {"p50_ms": 0.04, "p99_ms": direct, "requests": 10, "errors": 0},
            "haproxy-http": {"p50_ms": 0.14, "p99_ms": haproxy, "requests": 10, "errors": 1},
        },
        **more,
    }


def test_a_side_by_side_row_adds_latency_over_its_own_direct_and_is_set_against_its_haproxy():
    rows = [
        # rows of the sequential loads must not be used for the side-by-side one
        {"setup": "direct", "load": "http1-side-1000", "p99_ms": 9.0},
        {"setup": "haproxy-http", "load": "http1-side-1000", "p99_ms": 9.5},
        _side_row(0.45, 0.2, 0.4),
    ]
    doc = report.document({}, rows, [])
    row = doc["results"][-1]
    assert row["added_p99_ms"] == 0.25
    assert row["side"]["haproxy-http"]["added_p99_ms"] == 0.2
    assert row["side"]["direct"]["added_p99_ms"] == 0.0
    assert doc["ratios"]["added_p99:meshagent-ebpf/haproxy-http@http1-side-1000"] == 1.25
    assert "added_p99_ms" not in rows[-1]["side"]["haproxy-http"]  # copied, not written into
    (line,) = [n for n in doc["notes"] if n.startswith("side by side")]
    assert line == (
        "side by side at 1000 req/s (1 s turns): direct p99 0.2 ms; haproxy-http p99 0.4 ms "
        "(added 0.2); meshagent-ebpf p99 0.45 ms (added 0.25): 1.25x haproxy-http's added p99"
    )


def test_a_cross_node_side_by_side_row_is_over_its_direct_xnode_and_set_against_haproxy_tls():
    row = {
        "setup": "meshagent-ebpf-xnode",
        "load": "http1-side-1000",
        "p99_ms": 0.9,
        "side": {
            "direct-xnode": {"p99_ms": 0.3, "requests": 10, "errors": 0},
            "haproxy-tls": {"p99_ms": 0.7, "requests": 10, "errors": 0},
        },
    }
    rows = [{"setup": "direct-xnode", "load": "http1-side-1000", "p99_ms": 9.0}, row]
    doc = report.document({}, rows, [])
    mine = doc["results"][-1]
    assert mine["added_p99_ms"] == 0.6
    assert mine["side"]["haproxy-tls"]["added_p99_ms"] == 0.4
    assert mine["side"]["direct-xnode"]["added_p99_ms"] == 0.0
    side_ratios = {k: v for k, v in doc["ratios"].items() if "http1-side" in k}
    # the L7 peer (haproxy-tls-h2) was not beside it: no ratio against it
    assert side_ratios == {"added_p99:meshagent-ebpf-xnode/haproxy-tls@http1-side-1000": 1.5}
    (line,) = [n for n in doc["notes"] if n.startswith("side by side")]
    assert line == (
        "side by side at 1000 req/s (1 s turns): direct-xnode p99 0.3 ms; haproxy-tls p99 0.7 ms "
        "(added 0.4); meshagent-ebpf-xnode p99 0.9 ms (added 0.6): 1.5x haproxy-tls's added p99"
    )


def test_a_cross_node_side_by_side_row_is_set_against_its_l7_peer_too_when_it_ran_beside():
    row = {
        "setup": "meshagent-ebpf-h1-xnode",
        "load": "http1-side-2000",
        "p99_ms": 0.9,
        "side": {
            "direct-xnode": {"p99_ms": 0.3, "requests": 10, "errors": 0},
            "haproxy-tls": {"p99_ms": 0.7, "requests": 10, "errors": 0},
            "haproxy-tls-h1": {"p99_ms": 0.8, "requests": 10, "errors": 0},
        },
    }
    doc = report.document({}, [row], [])
    side_ratios = {k: v for k, v in doc["ratios"].items() if "http1-side" in k}
    assert side_ratios == {
        "added_p99:meshagent-ebpf-h1-xnode/haproxy-tls@http1-side-2000": 1.5,
        "added_p99:meshagent-ebpf-h1-xnode/haproxy-tls-h1@http1-side-2000": 1.2,
    }
    (line,) = [n for n in doc["notes"] if n.startswith("side by side")]
    assert line.endswith(": 1.5x haproxy-tls's, 1.2x haproxy-tls-h1's added p99")


def test_side_by_side_rounds_take_each_peers_medians_and_pair_within_each_round():
    counts = {"sent": 13, "agent_requests": 13, "agent_inbound_requests": 13}
    rows = [_side_row(0.45, 0.2, 0.4, **counts), _side_row(0.9, 0.5, 0.6, **counts)]
    rows.append(_side_row(0.5, 0.3, 0.5, **counts))
    combined = report.combine(rows)
    (row,) = combined
    assert [row[k] for k in counts] == [39, 39, 39]  # summed over the rounds, as requests
    assert row["side"]["direct"]["p99_ms"] == 0.3
    assert row["side"]["haproxy-http"]["p99_ms"] == 0.5
    assert row["side"]["haproxy-http"]["requests"] == 30
    assert row["side"]["haproxy-http"]["errors"] == 3
    doc = report.document({}, combined, [], measured=rows)
    name = "added_p99:meshagent-ebpf/haproxy-http@http1-side-1000"
    assert doc["ratios"][name] == 1.0  # medians: (0.5 - 0.3) / (0.5 - 0.3)
    # within rounds: 0.25 / 0.2, 0.4 / 0.1, 0.2 / 0.2
    assert doc["ratios_paired"][name] == 1.25
    assert [r["p99_ms"] for r in doc["measured"]] == [0.45, 0.9, 0.5]  # every round's row
    assert "measured" not in report.document({}, rows[:1], [], measured=rows[:1])


def test_a_side_by_side_ratio_is_left_out_when_haproxy_added_nothing():
    doc = report.document({}, [_side_row(0.45, 0.4, 0.39)], [])
    assert not any("http1-side" in k for k in doc["ratios"])
    (line,) = [n for n in doc["notes"] if n.startswith("side by side")]
    assert line.endswith("(added 0.05)")


def test_saturation_in_turns_is_set_against_the_peer_beside_it_and_said_in_a_note():
    rows = [
        # the sequential rows must not be used for the load in turns
        {"setup": "haproxy-http", "load": "saturate-side", "rps": 99999.0},
        {"setup": "haproxy-tls", "load": "http1-saturate", "rps": 1.0},
        {
            "setup": "meshagent-iptables",
            "load": "saturate-side",
            "rps": 44000.0,
            "side": {"haproxy-http": {"rps": 40000.0, "requests": 320000, "errors": 0}},
        },
        {
            "setup": "meshagent-ebpf-xnode",
            "load": "saturate-side",
            "rps": 30000.0,
            "side": {"haproxy-tls": {"rps": 25000.0, "requests": 200000, "errors": 0}},
        },
    ]
    doc = report.document({}, rows, [])
    assert doc["ratios"]["http1_saturate_rps:meshagent-iptables/haproxy-http@saturate-side"] == 1.1
    assert doc["ratios"]["http1_saturate_rps:meshagent-ebpf-xnode/haproxy-tls@saturate-side"] == 1.2
    assert not any("added_p99" in name and "saturate-side" in name for name in doc["ratios"])
    lines = [n for n in doc["notes"] if n.startswith("http1-saturate side by side")]
    assert lines == [
        (
            "http1-saturate side by side (in turns): haproxy-http 40000 req/s; "
            "meshagent-iptables 44000 req/s: 1.1x haproxy-http's"
        ),
        (
            "http1-saturate side by side (in turns): haproxy-tls 25000 req/s; "
            "meshagent-ebpf-xnode 30000 req/s: 1.2x haproxy-tls's"
        ),
    ]
