"""Worker recording (with the families' label rules), cross-worker aggregation, exposition."""

from __future__ import annotations

import bisect
import pickle

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from agent.admin.aggregate import Exposition, MetricsAggregator, render
from agent.admin.families import FAMILIES, FORBIDDEN_LABELS, LATENCY_MS_BUCKETS
from agent.admin.metrics import (
    Histogram,
    PodMeta,
    Ref,
    Tls,
    WorkerMetrics,
    bucket,
    dst_labels,
    errno_label,
    is_success,
)

WEB = PodMeta(
    namespace="shop",
    pod="web-7d9f-abcde",
    serviceaccount="web",
    owner_kind="deployment",
    owner_name="web",
)
DB = PodMeta(namespace="shop", pod="db-0", owner_kind="statefulset", owner_name="db")
SRV = Ref(group="policy.linkerd.io", kind="server", name="web-http", port=8080)
AUTHZ = Ref(group="policy.linkerd.io", kind="authorizationpolicy", name="web-authn")
CLIENT_ID = "client.shop.serviceaccount.identity.linkerd.cluster.local"
SERVER_ID = "db.shop.serviceaccount.identity.linkerd.cluster.local"


def parse(text: str) -> dict[str, list]:
    """sample name -> [(labels dict, value)] from a real prometheus_client parse."""
    out: dict[str, list] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def only(samples: dict[str, list], name: str, **match: str) -> tuple[dict, float]:
    found = [(lb, v) for lb, v in samples[name] if all(lb.get(k) == v for k, v in match.items())]
    assert len(found) == 1, (name, match, found)
    return found[0]


def inbound_http(m: WorkerMetrics):
    return m.http(
        WEB,
        direction="inbound",
        authority="web.shop.svc.cluster.local:8080",
        target=("10.42.0.7", 8080),
        tls=Tls.established(CLIENT_ID),
        server=SRV,
        authz=AUTHZ,
    )


# --- families ----------------------------------------------------------------------


def test_no_family_accepts_a_per_connection_label():
    for fam in FAMILIES.values():
        for label in FORBIDDEN_LABELS:
            assert label not in fam.labels, (fam.name, label)
    m = WorkerMetrics(1, incarnation=1)
    with pytest.raises(ValueError, match="does not take labels"):
        m.cell("request_total", (("namespace", "a"), ("client_port", "51234")))
    with pytest.raises(ValueError, match="does not take labels"):
        m.cell("tcp_open_total", (("peer_addr", "10.0.0.1:5555"),))


def test_unknown_family_is_a_bug():
    with pytest.raises(ValueError, match="unknown metric family"):
        WorkerMetrics(1, incarnation=1).cell("nope_total", ())


# --- recording and exposition ---------------------------------------------------------


def test_inbound_http_series_render_with_full_label_sets_and_exact_values():
    m = WorkerMetrics(1, incarnation=100)
    series = inbound_http(m)
    for latency, status in ((0.5, 200), (7, 200), (7, 200), (120, 503), (60_000, 200)):
        series.request()
        series.response(status, latency, is_success(status))
    allow = m.http_authz(
        WEB,
        allowed=True,
        target=("10.42.0.7", 8080),
        tls=Tls.established(CLIENT_ID),
        server=SRV,
        authz=AUTHZ,
    )
    allow.inc(5)
    agg = MetricsAggregator()
    agg.update(m.snapshot())
    samples = parse(render(agg.families()))

    base = {
        "namespace": "shop",
        "pod": "web-7d9f-abcde",
        "deployment": "web",
        "serviceaccount": "web",
        "direction": "inbound",
        "authority": "web.shop.svc.cluster.local:8080",
        "target_addr": "10.42.0.7:8080",
        "target_ip": "10.42.0.7",
        "target_port": "8080",
        "tls": "true",
        "client_id": CLIENT_ID,
        "srv_group": "policy.linkerd.io",
        "srv_kind": "server",
        "srv_name": "web-http",
        "srv_port": "8080",
        "authz_group": "policy.linkerd.io",
        "authz_kind": "authorizationpolicy",
        "authz_name": "web-authn",
    }
    assert samples["request_total"] == [(base, 5.0)]
    ok = {**base, "classification": "success", "status_code": "200"}
    failed = {**base, "classification": "failure", "status_code": "503"}
    assert sorted(samples["response_total"], key=lambda s: s[1]) == [(failed, 1.0), (ok, 4.0)]

    lat200 = {
        lb["le"]: v
        for lb, v in samples["response_latency_ms_bucket"]
        if lb.get("status_code") == "200"
    }
    assert lat200["1"] == 1  # 0.5 ms
    assert lat200["5"] == 1
    assert lat200["10"] == 3  # + 7, 7
    assert lat200["50000"] == 3
    assert lat200["+Inf"] == 4  # 60 s lands only in +Inf
    assert len(lat200) == len(LATENCY_MS_BUCKETS) + 1
    labels, total = only(samples, "response_latency_ms_sum", status_code="200")
    assert labels == {**base, "status_code": "200"}
    assert total == pytest.approx(60_014.5)
    assert only(samples, "response_latency_ms_count", status_code="503")[1] == 1

    authz_labels = {k: v for k, v in base.items() if k not in ("direction", "authority")}
    assert samples["inbound_http_authz_allow_total"] == [(authz_labels, 5.0)]


def test_outbound_tcp_series_carry_dst_labels_errno_and_byte_counts():
    m = WorkerMetrics(2, incarnation=200)
    dst = dst_labels({"pod": "db-0", "namespace": "shop", "statefulset": "db"})
    tcp = m.tcp(
        WEB,
        direction="outbound",
        peer="dst",
        target=("10.42.1.9", 5432),
        tls=Tls.established(SERVER_ID),
        dst=dst,
    )
    for _ in range(3):
        tcp.open()
    tcp.transferred(read=1000, written=250)
    tcp.transferred(read=24, written=6)
    tcp.close(15.0)
    tcp.close(3_000.0, errno_label(104))
    agg = MetricsAggregator()
    agg.update(m.snapshot())
    samples = parse(render(agg.families()))
    base = {
        "namespace": "shop",
        "pod": "web-7d9f-abcde",
        "deployment": "web",
        "serviceaccount": "web",
        "direction": "outbound",
        "peer": "dst",
        "target_addr": "10.42.1.9:5432",
        "target_ip": "10.42.1.9",
        "target_port": "5432",
        "tls": "true",
        "server_id": SERVER_ID,
        "dst_namespace": "shop",
        "dst_pod": "db-0",
        "dst_statefulset": "db",
    }
    assert samples["tcp_open_total"] == [(base, 3.0)]
    assert samples["tcp_open_connections"] == [(base, 1.0)]
    assert samples["tcp_read_bytes_total"] == [(base, 1024.0)]
    assert samples["tcp_write_bytes_total"] == [(base, 256.0)]
    closes = {lb["errno"]: v for lb, v in samples["tcp_close_total"]}
    assert closes == {"": 1.0, "ECONNRESET": 1.0}
    assert only(samples, "tcp_close_total", errno="ECONNRESET")[0] == {
        **base,
        "errno": "ECONNRESET",
    }
    assert only(samples, "tcp_connection_duration_ms_bucket", errno="", le="20")[1] == 1
    assert only(samples, "tcp_connection_duration_ms_bucket", errno="ECONNRESET", le="2000")[1] == 0
    assert only(samples, "tcp_connection_duration_ms_bucket", errno="ECONNRESET", le="3000")[1] == 1


def test_plaintext_route_authz_deny_and_balancer_series():
    m = WorkerMetrics(3, incarnation=300)
    route = m.route(
        DB, direction="inbound", dst="db.shop.svc.cluster.local:5432", rt_route="GET /x"
    )
    route.request()
    route.response(404, 2.5, True)
    deny = m.http_authz(
        DB,
        allowed=False,
        target=("10.42.1.9", 80),
        tls=Tls.no_identity("not_provided_by_remote"),
        server=SRV,
        authz=AUTHZ,
    )
    deny.inc()
    m.balancer_endpoints(namespace="shop", name="db", port=5432, ready=3, pending=1)
    agg = MetricsAggregator()
    agg.update(m.snapshot())
    samples = parse(render(agg.families()))
    pod = {"namespace": "shop", "pod": "db-0", "statefulset": "db"}
    assert samples["route_request_total"] == [
        (
            {
                **pod,
                "direction": "inbound",
                "dst": "db.shop.svc.cluster.local:5432",
                "rt_route": "GET /x",
            },
            1.0,
        )
    ]
    assert only(samples, "route_response_total")[0]["classification"] == "success"
    (labels, value) = only(samples, "inbound_http_authz_deny_total")
    assert value == 1
    assert labels == {
        **pod,
        "target_addr": "10.42.1.9:80",
        "target_ip": "10.42.1.9",
        "target_port": "80",
        "srv_group": "policy.linkerd.io",
        "srv_kind": "server",
        "srv_name": "web-http",
        "srv_port": "8080",
        "tls": "no_identity",
        "no_tls_reason": "not_provided_by_remote",
    }
    assert "authz_name" not in labels  # a denial names no authorization
    ready = only(samples, "outbound_http_balancer_endpoints", endpoint_state="ready")
    assert ready[1] == 3
    assert ready[0]["parent_name"] == "db"
    assert ready[0]["backend_port"] == "5432"
    assert only(samples, "outbound_http_balancer_endpoints", endpoint_state="pending")[1] == 1


def test_label_values_are_escaped_and_parse_back():
    m = WorkerMetrics(1, incarnation=1)
    odd = 'we"ird\\host\nname:80'
    s = m.http(
        WEB,
        direction="outbound",
        authority=odd,
        target=("10.0.0.1", 80),
        tls=Tls.no_identity("loopback"),
    )
    s.request()
    agg = MetricsAggregator()
    agg.update(m.snapshot())
    samples = parse(render(agg.families()))
    assert samples["request_total"][0][0]["authority"] == odd


def test_snapshot_pickles_round_trip():
    m = WorkerMetrics(4, incarnation=44)
    inbound_http(m).response(200, 3, True)
    snap = m.snapshot()
    back = pickle.loads(pickle.dumps(snap))
    assert back == snap
    assert back.seq == 1
    assert m.snapshot().seq == 2


# --- cardinality ----------------------------------------------------------------------------


def test_thousand_clients_on_distinct_ports_make_one_series_each_family():
    m = WorkerMetrics(1, incarnation=1)
    for client_port in range(40_000, 41_000):
        # What a worker knows per connection: the client port is not an input at all;
        # the label set is the pod, direction, target and TLS identity.
        _ = client_port
        tcp = m.tcp(
            WEB,
            direction="inbound",
            peer="src",
            target=("10.42.0.7", 8080),
            tls=Tls.established(CLIENT_ID),
            server=SRV,
        )
        tcp.open()
        inbound_http(m).request()
        tcp.close(1.0)
    snap = m.snapshot()
    assert {name: len(samples) for name, samples in snap.families.items()} == {
        "tcp_open_total": 1,
        "tcp_open_connections": 1,
        "tcp_read_bytes_total": 1,
        "tcp_write_bytes_total": 1,
        "request_total": 1,
        "tcp_close_total": 1,
        "tcp_connection_duration_ms": 1,
    }
    assert snap.families["tcp_open_total"][next(iter(snap.families["tcp_open_total"]))] == 1000


def test_series_past_the_limit_are_dropped_and_counted():
    m = WorkerMetrics(7, incarnation=1, max_series=10)
    for i in range(30):
        pod = PodMeta(namespace="ns", pod=f"p{i}")
        s = m.http(
            pod,
            direction="inbound",
            authority="a:80",
            target=("10.0.0.1", 80),
            tls=Tls.no_identity("loopback"),
        )
        s.request()  # recording into a dropped series must still work
    snap = m.snapshot()
    assert m.series == 10
    assert len(snap.families["request_total"]) == 10
    dropped = snap.families["meshagent_metrics_series_dropped_total"]
    labels = (("process", "worker"), ("worker", "7"), ("family", "request_total"))
    assert dropped == {labels: 20}


def test_forget_pod_drops_its_series_from_worker_and_retired_base():
    m = WorkerMetrics(1, incarnation=1)
    inbound_http(m).request()
    other = m.http(
        DB,
        direction="inbound",
        authority="db:5432",
        target=("10.0.0.2", 5432),
        tls=Tls.no_identity("loopback"),
    )
    other.request()
    agg = MetricsAggregator()
    agg.update(m.snapshot())
    agg.retire(1)
    agg.forget_pod("shop", "web-7d9f-abcde")
    assert [dict(lb)["pod"] for lb in agg.merged()["request_total"]] == ["db-0"]
    assert m.forget_pod("shop", "web-7d9f-abcde") == 1
    assert [dict(lb)["pod"] for lb in m.snapshot().families["request_total"]] == ["db-0"]


# --- aggregation ---------------------------------------------------------------------------


def _req_total(agg: MetricsAggregator) -> float:
    return sum(agg.merged().get("request_total", {}).values())  # type: ignore[arg-type]


def test_counters_sum_and_histograms_merge_bucketwise_across_workers():
    a, b = WorkerMetrics(1, incarnation=11), WorkerMetrics(2, incarnation=22)
    for m, latency in ((a, 3), (a, 30), (b, 3), (b, 3000)):
        s = inbound_http(m)
        s.request()
        s.response(200, latency, True)
    agg = MetricsAggregator()
    agg.update(a.snapshot())
    agg.update(b.snapshot())
    merged = agg.merged()
    assert list(merged["request_total"].values()) == [4]
    (counts, total) = next(iter(merged["response_latency_ms"].values()))  # type: ignore[misc]
    assert total == 3036
    le = dict(zip([*LATENCY_MS_BUCKETS, "inf"], counts, strict=True))
    assert (le[3], le[30], le[3000], sum(counts)) == (2, 1, 1, 4)


def test_gauges_sum_over_live_workers_only():
    a, b = WorkerMetrics(1, incarnation=11), WorkerMetrics(2, incarnation=22)
    for m, n in ((a, 2), (b, 5)):
        tcp = m.tcp(
            WEB,
            direction="inbound",
            peer="src",
            target=("10.42.0.7", 80),
            tls=Tls.no_identity("loopback"),
        )
        for _ in range(n):
            tcp.open()
    agg = MetricsAggregator()
    agg.update(a.snapshot())
    agg.update(b.snapshot())
    assert list(agg.merged()["tcp_open_connections"].values()) == [7]
    agg.retire(2)
    assert list(agg.merged()["tcp_open_connections"].values()) == [2]
    assert list(agg.merged()["tcp_open_total"].values()) == [7]  # counters stay


def test_balancer_gauge_is_not_multiplied_by_worker_count():
    agg = MetricsAggregator()
    for wid in (1, 2, 3):
        m = WorkerMetrics(wid, incarnation=wid)
        m.balancer_endpoints(namespace="shop", name="db", port=5432, ready=4, pending=0)
        agg.update(m.snapshot())
    ready = {
        dict(lb)["endpoint_state"]: v
        for lb, v in agg.merged()["outbound_http_balancer_endpoints"].items()
    }
    assert ready == {"ready": 4, "pending": 0}


def test_worker_restart_never_goes_backwards_and_counts_nothing_twice():
    agg = MetricsAggregator()
    old = WorkerMetrics(1, incarnation=1000)
    s = inbound_http(old)
    for _ in range(10):
        s.request()
    agg.update(old.snapshot())
    assert _req_total(agg) == 10
    for _ in range(5):
        s.request()
    final = old.snapshot()  # the drain snapshot
    agg.update(final)
    agg.retire(1)
    assert _req_total(agg) == 15
    agg.update(final)  # a duplicate of the drain snapshot arriving late
    assert _req_total(agg) == 15

    new = WorkerMetrics(1, incarnation=1001)  # same slot, starts from zero
    agg.update(new.snapshot())
    assert _req_total(agg) == 15
    inbound_http(new).request()
    agg.update(new.snapshot())
    assert _req_total(agg) == 16


def test_new_incarnation_without_retire_retires_the_old_one():
    agg = MetricsAggregator()
    old = WorkerMetrics(1, incarnation=1)
    inbound_http(old).request()
    agg.update(old.snapshot())
    new = WorkerMetrics(1, incarnation=2)
    inbound_http(new).request()
    agg.update(new.snapshot())
    assert _req_total(agg) == 2
    assert agg.live_workers == {1: 2}


def test_late_snapshot_of_a_retired_worker_adds_only_its_increase():
    agg = MetricsAggregator()
    m = WorkerMetrics(1, incarnation=7)
    s = inbound_http(m)
    s.request()
    agg.update(m.snapshot())
    agg.retire(1)  # e.g. the channel closed before its last snapshot was read
    s.request()
    s.request()
    s.response(200, 4, True)
    agg.update(m.snapshot())
    assert _req_total(agg) == 3
    assert sum(v[1] for v in agg.merged()["response_latency_ms"].values()) == 4  # type: ignore[index]


def test_out_of_order_snapshot_is_ignored():
    agg = MetricsAggregator()
    m = WorkerMetrics(1, incarnation=7)
    s = inbound_http(m)
    s.request()
    first = m.snapshot()
    s.request()
    second = m.snapshot()
    agg.update(second)
    agg.update(first)
    assert _req_total(agg) == 2


# Operations: (kind, worker slot). "inc" records one request; "snap" sends a snapshot;
# "die" kills the worker after an optional drain snapshot; a dead slot restarts on next use.
ops = st.lists(
    st.tuples(
        st.sampled_from(["inc", "inc", "inc", "snap", "die", "die_drained"]),
        st.integers(min_value=0, max_value=2),
    ),
    max_size=80,
)


@settings(max_examples=200, deadline=None)
@given(ops)
def test_totals_are_monotonic_and_equal_to_every_reported_increment(program):
    agg = MetricsAggregator()
    workers: dict[int, WorkerMetrics] = {}
    reported: dict[tuple[int, int], int] = {}  # incarnation -> requests it has reported
    made: dict[tuple[int, int], int] = {}
    next_pid = iter(range(1, 10_000))
    last_total = 0.0
    for op, slot in program:
        m = workers.get(slot)
        if m is None:
            m = workers[slot] = WorkerMetrics(slot, incarnation=next(next_pid))
        key = (slot, m.incarnation)
        if op == "inc":
            inbound_http(m).request()
            made[key] = made.get(key, 0) + 1
        elif op in {"snap", "die_drained"}:
            agg.update(m.snapshot())
            reported[key] = made.get(key, 0)
        if op in ("die", "die_drained"):
            agg.retire(slot)
            del workers[slot]
        total = _req_total(agg)
        assert total >= last_total
        assert total == sum(reported.values())
        last_total = total


# --- exposition with other sources ---------------------------------------------------------


def test_exposition_merges_sources_and_survives_a_failing_one():
    exp = Exposition()
    m = WorkerMetrics(1, incarnation=1)
    m.set_loop_lag(0.004)
    exp.aggregator.update(m.snapshot())

    def boom():
        raise RuntimeError("collector broke")

    sup = FAMILIES["meshagent_event_loop_lag_seconds"]
    exp.add_source(boom)
    exp.add_source(lambda: [(sup, {(("process", "supervisor"),): 0.002})])
    samples = parse(exp.render())
    lag = {lb.get("worker", "-"): v for lb, v in samples["meshagent_event_loop_lag_seconds"]}
    assert lag == {"1": 0.004, "-": 0.002}


@settings(max_examples=300)
@given(
    bounds=st.lists(st.floats(allow_nan=False), max_size=30).map(lambda xs: tuple(sorted(xs))),
    v=st.floats(),
)
def test_bucket_is_bisect_left(bounds: tuple[float, ...], v: float) -> None:
    assert bucket(bounds, v) == bisect.bisect_left(bounds, v)


_WHOLE_OR_NOT = st.one_of(
    st.integers(-5, 120).map(float), st.floats(-5.0, 120.0), st.floats(allow_nan=False)
)


@settings(max_examples=300)
@given(
    bounds=st.lists(_WHOLE_OR_NOT, max_size=30).map(lambda xs: tuple(sorted(xs))),
    values=st.lists(st.one_of(st.floats(-1.0, 102.0), st.floats()), min_size=1, max_size=20),
)
def test_a_histograms_index_is_bisect_left_through_its_table_too(
    bounds: tuple[float, ...], values: list[float]
) -> None:
    # rule 3: below `small_max` the index is a table read at v rounded up; a bound that
    # is not whole ends the table before it, so the answer is bisect's everywhere.
    hist = Histogram(bounds)
    for v in values:
        assert hist.index(v) == bisect.bisect_left(hist.bounds, v), (v, hist.small_max)


def test_linkerds_latency_buckets_get_a_table_to_a_hundred_ms() -> None:
    hist = Histogram(LATENCY_MS_BUCKETS)
    assert hist.small_max == 100.0
    assert Histogram((1, 2.5, 10)).small_max == 2.0  # (2, 2.5] and (2.5, 3] differ
    for v in (0.0, 0.001, 1.0, 1.0001, 4.5, 5.0, 5.5, 99.99, 100.0):
        assert hist.index(v) == bisect.bisect_left(LATENCY_MS_BUCKETS, v)


def test_a_histogram_keeps_its_bounds_as_floats_and_counts_as_with_the_given_ones() -> None:
    # agent.native rule 10: the families write their bounds as ints; a histogram keeps
    # floats, so the compiled `bucket` reads C doubles without calling `__float__`.
    hist = Histogram(LATENCY_MS_BUCKETS)
    assert all(type(b) is float for b in hist.bounds)
    assert hist.bounds == LATENCY_MS_BUCKETS
    for v in (0.2, 1, 1.5, 50, 50.01, 49999.0, 1e9):
        hist.observe(v)
    expected = [0] * (len(LATENCY_MS_BUCKETS) + 1)
    for v in (0.2, 1, 1.5, 50, 50.01, 49999.0, 1e9):
        expected[bisect.bisect_left(LATENCY_MS_BUCKETS, v)] += 1
    assert hist.counts == expected


def test_bucket_puts_a_latency_on_each_bound_in_that_bounds_bucket() -> None:
    bounds = tuple(float(b) for b in LATENCY_MS_BUCKETS)
    for i, b in enumerate(bounds):
        assert bucket(bounds, b) == i  # le="b" holds b itself
        assert bucket(bounds, b + 1e-9) == i + 1
    assert bucket(bounds, float("inf")) == len(bounds)  # the +Inf bucket
