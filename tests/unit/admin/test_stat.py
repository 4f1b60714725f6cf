"""agent.admin.stat: golden metrics from two scrapes of real exposition text."""

from __future__ import annotations

import pytest

from agent.admin import stat
from agent.admin.aggregate import render
from agent.admin.families import FAMILIES
from agent.admin.metrics import PodMeta, Tls, WorkerMetrics

WEB = PodMeta(namespace="shop", pod="web-1", owner_kind="deployment", owner_name="web")
CLIENT = PodMeta(namespace="shop", pod="client-1")
OTHER = PodMeta(namespace="other", pod="db-0")
AUTH = "web.shop.svc.cluster.local:80"


def text(m: WorkerMetrics) -> str:
    snap = m.snapshot()
    return render((FAMILIES[name], samples) for name, samples in snap.families.items())


def traffic(m: WorkerMetrics, *, ok: int, failed: int, latency_ms: float) -> None:
    inbound = m.http(
        WEB, direction="inbound", authority="", target=("10.0.0.2", 8080), tls=Tls(state="true")
    )
    outbound = m.http(
        CLIENT, direction="outbound", authority=AUTH, target=("10.0.0.2", 8080), tls=None
    )
    route = m.route(CLIENT, direction="outbound", dst=AUTH, rt_route="GET /books")
    for series in (inbound, outbound, route):
        for _ in range(ok):
            series.request()
            series.response(200, latency_ms, success=True)
        for _ in range(failed):
            series.request()
            series.response(500, latency_ms, success=False)


def test_histogram_quantile_interpolates_like_prometheus() -> None:
    # 10 observations in (0, 10], 10 in (10, 20]: the median is the top of the first bucket.
    buckets = {10.0: 10.0, 20.0: 20.0, float("inf"): 20.0}
    assert stat.histogram_quantile(0.5, buckets) == 10.0
    assert stat.histogram_quantile(0.75, buckets) == 15.0
    assert stat.histogram_quantile(0.25, buckets) == 5.0  # the first bucket starts at 0
    assert stat.histogram_quantile(0.99, {10.0: 0.0, float("inf"): 5.0}) == 10.0  # +Inf bucket
    assert stat.histogram_quantile(0.5, {10.0: 0.0, float("inf"): 0.0}) is None


def test_pods_rows_come_from_the_increase_between_scrapes() -> None:
    m = WorkerMetrics(0)
    traffic(m, ok=5, failed=5, latency_ms=3)  # before the window: ignored
    before = stat.parse(text(m), t=100.0)
    traffic(m, ok=9, failed=1, latency_ms=30)
    after = stat.parse(text(m), t=110.0)
    rows = {r["name"]: r for r in stat.rows(before, after, "pods")}
    assert set(rows) == {"web-1", "client-1"}
    web = rows["web-1"]
    assert web["success_rate"] == pytest.approx(0.9)
    assert web["rps"] == pytest.approx(1.0)
    assert web["latency_p50_ms"] == pytest.approx(25.0)  # all 10 in (20, 30]
    assert web["meshed"] == "1/1"
    assert rows["client-1"]["success_rate"] is None  # no inbound traffic: "-"


def test_a_counter_that_went_down_was_reset_and_counts_from_zero() -> None:
    old = WorkerMetrics(0)
    traffic(old, ok=50, failed=0, latency_ms=1)
    before = stat.parse(text(old), t=0.0)
    new = WorkerMetrics(0)  # a restarted agent
    traffic(new, ok=3, failed=1, latency_ms=1)
    after = stat.parse(text(new), t=2.0)
    [web] = [r for r in stat.rows(before, after, "pods") if r["name"] == "web-1"]
    assert web["rps"] == pytest.approx(2.0)
    assert web["success_rate"] == pytest.approx(0.75)


def test_services_and_routes_group_outbound_traffic_and_filter_by_namespace() -> None:
    m = WorkerMetrics(0)
    before = stat.parse(text(m), t=0.0)
    traffic(m, ok=3, failed=1, latency_ms=4)
    m.http(OTHER, direction="inbound", authority="", target=("10.0.0.9", 5432), tls=None)
    after = stat.parse(text(m), t=4.0)
    [svc] = stat.rows(before, after, "services")
    assert (svc["namespace"], svc["name"], svc["authority"]) == ("shop", "web", AUTH)
    assert svc["success_rate"] == pytest.approx(0.75)
    [route] = stat.rows(before, after, "routes", namespace="shop")
    assert (route["route"], route["dst"], route["rps"]) == ("GET /books", AUTH, 1.0)
    assert [r["name"] for r in stat.rows(before, after, "pods", namespace="other")] == ["db-0"]
    assert stat.rows(before, after, "services", namespace="other") == []


def test_scrapes_of_several_agents_are_summed() -> None:
    a, b = WorkerMetrics(0), WorkerMetrics(1)
    traffic(a, ok=1, failed=0, latency_ms=1)
    traffic(b, ok=0, failed=1, latency_ms=1)
    merged = stat.merge([stat.parse(text(a), t=1.0), stat.parse(text(b), t=3.0)])
    assert merged.t == 2.0
    empty = stat.Scrape(t=0.0, samples={})
    [web] = [r for r in stat.rows(empty, merged, "pods") if r["name"] == "web-1"]
    assert web["success_rate"] == pytest.approx(0.5)


def test_an_unknown_kind_is_refused() -> None:
    empty = stat.Scrape(t=0.0, samples={})
    with pytest.raises(ValueError, match="deployments"):
        stat.rows(empty, empty, "deployments")
