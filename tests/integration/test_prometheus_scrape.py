"""A real Prometheus scrapes the admin server and computes Linkerd's success rate from it."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import time
import urllib.parse
import urllib.request

import pytest

from agent import aio
from agent.admin.aggregate import Exposition
from agent.admin.controls import ReadinessGate
from agent.admin.metrics import PodMeta, Tls, WorkerMetrics
from agent.admin.server import AdminServer
from agent.bench.mesh import free_port

PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"
WEB = PodMeta(namespace="shop", pod="web-1", owner_kind="deployment", owner_name="web")
SUCCESS_RATE = (
    'sum(rate(response_total{classification="success"}[30s])) / sum(rate(response_total[30s]))'
)
P50 = "histogram_quantile(0.5, sum(rate(response_latency_ms_bucket[30s])) by (le))"


@pytest.fixture
def prometheus(tmp_path):
    """Start Prometheus against a target port chosen by the test; killed by PID at the end."""
    if not shutil.which(PROMETHEUS):
        # CI (CI=true) has what scripts/setup installs: missing there is a failure, not a skip.
        (pytest.fail if os.environ.get("CI") == "true" else pytest.skip)(
            "no prometheus binary (Debian package `prometheus`)"
        )
    procs: list[subprocess.Popen] = []
    logs = []

    def start(target_port: int) -> int:
        web_port = free_port()
        config = tmp_path / "prometheus.yml"
        config.write_text(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
            "scrape_configs:\n  - job_name: meshagent\n    scrape_timeout: 1s\n"
            f"    static_configs:\n      - targets: ['127.0.0.1:{target_port}']\n"
        )
        log = (tmp_path / "prometheus.log").open("wb")
        logs.append(log)
        procs.append(
            subprocess.Popen(
                [
                    PROMETHEUS,
                    f"--config.file={config}",
                    f"--storage.tsdb.path={tmp_path / 'data'}",
                    f"--web.listen-address=127.0.0.1:{web_port}",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        )
        return web_port

    try:
        yield start
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(timeout=10)
        for log in logs:
            log.close()


def api(port: int, path: str, **params: str) -> dict:
    url = f"http://127.0.0.1:{port}{path}?{urllib.parse.urlencode(params)}"
    with urllib.request.urlopen(url, timeout=5) as resp:
        return json.loads(resp.read())


async def feed(worker: WorkerMetrics, exposition: Exposition, stop: asyncio.Event) -> None:
    """Traffic: 9 successes and 1 failure every 100 ms, all at 7 ms latency."""
    series = worker.http(
        WEB,
        direction="inbound",
        authority="web:80",
        target=("10.42.0.7", 80),
        tls=Tls.no_identity("not_provided_by_remote"),
    )
    while not stop.is_set():
        for status in (200,) * 9 + (503,):
            series.request()
            series.response(status, 7.0, status < 500)
        exposition.aggregator.update(worker.snapshot())
        await asyncio.sleep(0.1)


async def test_prometheus_scrapes_and_computes_success_rate(prometheus, tmp_path):
    exposition = Exposition()
    worker = WorkerMetrics(1, incarnation=1)
    server = AdminServer(
        host="127.0.0.1", port=0, metrics=exposition.render, ready=ReadinessGate().check
    )
    stop = asyncio.Event()
    async with server:
        feeder = aio.spawn(feed(worker, exposition, stop), name="test-feed")
        try:
            web = await asyncio.to_thread(prometheus, server.port)
            rate = p50 = None
            health = None
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                await asyncio.sleep(1)
                try:
                    targets = await asyncio.to_thread(api, web, "/api/v1/targets")
                    result = (
                        await asyncio.to_thread(api, web, "/api/v1/query", query=SUCCESS_RATE)
                    )["data"]["result"]
                    quant = (await asyncio.to_thread(api, web, "/api/v1/query", query=P50))["data"][
                        "result"
                    ]
                except OSError:
                    continue  # Prometheus still starting
                active = targets["data"]["activeTargets"]
                health = [(t["health"], t["lastError"]) for t in active]
                if result and quant and result[0]["value"][1] != "NaN":
                    rate, p50 = float(result[0]["value"][1]), float(quant[0]["value"][1])
                    break
        finally:
            stop.set()
            await feeder
    log = (tmp_path / "prometheus.log").read_text(errors="replace")[-2000:]
    assert health == [("up", "")], log
    assert rate == pytest.approx(0.9, abs=0.02), log
    assert p50 is not None
    assert 5 < p50 <= 10  # every request took 7 ms: the (5, 10] bucket
