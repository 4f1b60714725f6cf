"""Node and process metrics read from psutil and /proc; agent-state setters; loop lag."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from agent import aio
from agent.admin.aggregate import render
from agent.admin.node import NodeMetrics, measure_loop_lag


def scrape(node: NodeMetrics) -> dict[str, dict[tuple, float]]:
    out: dict[str, dict[tuple, float]] = {}
    for fam in text_string_to_metric_families(render(node.families())):
        for s in fam.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


@pytest.fixture
def child():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


def test_process_metrics_for_supervisor_and_each_worker(child):
    node = NodeMetrics()
    node.set_workers({3: child.pid})
    got = scrape(node)
    sup = (("process", "supervisor"),)
    wrk = (("process", "worker"), ("worker", "3"))
    assert set(got["process_cpu_seconds_total"]) == {sup, wrk}
    assert got["process_resident_memory_bytes"][sup] > 1_000_000
    assert got["process_open_fds"][sup] >= 3
    assert got["process_open_fds"][wrk] >= 3
    assert abs(got["process_start_time_seconds"][wrk] - time.time()) < 120


def test_vanished_worker_is_skipped(child):
    node = NodeMetrics()
    node.set_workers({1: child.pid})
    child.kill()
    child.wait()
    got = scrape(node)
    assert set(got["process_cpu_seconds_total"]) == {(("process", "supervisor"),)}


def test_node_cpu_memory_and_load():
    got = scrape(NodeMetrics())
    assert got["meshagent_node_cpus"][()] == os.cpu_count()
    assert (
        got["meshagent_node_memory_total_bytes"][()]
        >= got["meshagent_node_memory_available_bytes"][()]
    )
    assert got["meshagent_node_load1"][()] == pytest.approx(os.getloadavg()[0], abs=5)
    assert got["meshagent_node_cpu_seconds_total"][(("mode", "idle"),)] > 0


def test_agent_state_setters_render():
    node = NodeMetrics()
    node.set_enrolled_pods("ebpf", 4)
    node.set_listeners("inbound", 4)
    node.set_redirect_rules("iptables", 12)
    node.set_bpf_map_entries("orig_dst", 7)
    node.set_stream_state("destination", True)
    node.set_stream_state("policy", False)
    node.inc_reconnects("policy")
    node.inc_reconnects("policy")
    node.set_cert_expiry("web.shop.serviceaccount.identity.linkerd.cluster.local", 1.9e9)
    node.inc_cert_refresh("web.shop.serviceaccount.identity.linkerd.cluster.local")
    node.inc_cert_failure("db.shop.serviceaccount.identity.linkerd.cluster.local")
    node.set_worker_counts(desired=2, up=1)
    node.inc_worker_restarts()
    got = scrape(node)
    assert got["meshagent_enrolled_pods"] == {(("mode", "ebpf"),): 4}
    assert got["meshagent_redirect_rules"] == {(("mode", "iptables"),): 12}
    assert got["meshagent_bpf_map_entries"] == {(("map", "orig_dst"),): 7}
    assert got["meshagent_control_plane_stream_up"] == {
        (("service", "destination"),): 1,
        (("service", "policy"),): 0,
    }
    assert got["meshagent_control_plane_reconnects_total"] == {(("service", "policy"),): 2}
    web = (("identity", "web.shop.serviceaccount.identity.linkerd.cluster.local"),)
    assert got["identity_cert_expiration_timestamp_seconds"] == {web: 1.9e9}
    assert got["identity_cert_refresh_count_total"] == {web: 1}  # parser appends _total
    assert got["meshagent_workers"] == {(("state", "desired"),): 2, (("state", "up"),): 1}
    assert got["meshagent_worker_restarts_total"] == {(): 1}
    node.forget_identity("web.shop.serviceaccount.identity.linkerd.cluster.local")
    assert "identity_cert_expiration_timestamp_seconds" not in scrape(node)


async def test_loop_lag_reports_a_blocked_loop():
    seen: list[float] = []
    task = aio.spawn(measure_loop_lag(seen.append, interval_s=0.01, window_s=0.05), name="lag")
    try:
        await asyncio.sleep(0.02)
        time.sleep(0.2)  # noqa: ASYNC251 - block the loop on purpose
        for _ in range(100):
            if seen and max(seen) >= 0.15:
                break
            await asyncio.sleep(0.01)
    finally:
        await aio.cancel_and_wait([task])
    assert max(seen) >= 0.15


async def test_an_idle_loop_is_probed_once_per_window_a_busy_one_each_interval():
    """`busy()` is asked once per wake-up: 0.3 s with 0.01 s intervals and 0.1 s windows
    wake an idle loop about 3 times and a busy one about 30 times."""
    for is_busy, low, high in ((False, 2, 5), (True, 15, 31)):
        asked: list[bool] = []

        def busy(answer: bool = is_busy, asked: list[bool] = asked) -> bool:
            asked.append(answer)
            return answer

        seen: list[float] = []
        task = aio.spawn(
            measure_loop_lag(seen.append, interval_s=0.01, window_s=0.1, busy=busy), name="lag"
        )
        try:
            await asyncio.sleep(0.3)
        finally:
            await aio.cancel_and_wait([task])
        assert low <= len(asked) <= high, (is_busy, len(asked))
        assert 1 <= len(seen) <= 4  # a report per window either way
