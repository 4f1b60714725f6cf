"""Observability end to end: `meshagent run` on lab pods, known traffic, real scrapes.

Two pods on one lab node (`client`, `web` behind Service `web` at
10.96.0.20:80), the agent with two workers and its admin port on 127.0.0.1.
The client calls the Service (the same-node path: outbound for `client`,
inbound for `web`); web answers `/status/NNN` with that status.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.parse
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from agent.admin import stat
from agent.bench import mesh as bench_mesh
from agent.pods import discover


def _harness():
    """The `meshagent run` harness of test_supervisor.py (importlib mode: load by path)."""
    spec = importlib.util.spec_from_file_location(
        "_supervisor_harness", Path(__file__).with_name("test_supervisor.py")
    )
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_h = _harness()
APP_PORT, MESHAGENT, Mesh = _h.APP_PORT, _h.MESHAGENT, _h.Mesh
free_port, http_get, service_yaml, wait_for = (
    _h.free_port,
    _h.http_get,
    _h.service_yaml,
    _h.wait_for,
)
pki = _h.pki  # the module-scoped PKI fixture

pytestmark = pytest.mark.privileged

PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"
SVC = "http://10.96.0.20:80"
AUTHORITY = "web.shop.svc.cluster.local:80"
IDENT = "default.shop.serviceaccount.identity.linkerd.cluster.local"
APP = """\
import http.server
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        status = self.path.split("/")[2].split("?")[0] if self.path.startswith("/status/") else 200
        code = int(status)
        body = b"ok\\n"
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a):
        pass
http.server.ThreadingHTTPServer(("0.0.0.0", APP_PORT), H).serve_forever()
""".replace("APP_PORT", str(APP_PORT))
DRIVE = """\
import sys, urllib.request, urllib.error
for path in sys.argv[1:]:
    try:
        code = urllib.request.urlopen(SVC + path, timeout=5).status
    except urllib.error.HTTPError as e:
        code = e.code
    print(code)
""".replace("SVC", repr(SVC))

KEEPALIVE = """\
import http.client, sys
conn = http.client.HTTPConnection(HOST, 80, timeout=5)
for path in sys.argv[1:]:
    conn.request("GET", path)
    resp = conn.getresponse()
    resp.read()
    print(resp.status)
""".replace("HOST", repr(urllib.parse.urlsplit(SVC).hostname))


def drive(lp, paths: list[str]) -> list[int]:
    out = lp.run([sys.executable, "-c", DRIVE, *paths], check=True, timeout=60).stdout
    return [int(x) for x in out.split()]


def scrape(mesh: Mesh) -> dict[str, list[tuple[dict[str, str], float]]]:
    status, body = mesh.admin("/metrics")
    assert status == 200
    (mesh.tmp / "metrics.txt").write_bytes(body)  # for a failing test's reader
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for fam in text_string_to_metric_families(body.decode()):
        for s in fam.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def value(samples, name: str, **want: str) -> float:
    return sum(
        v for labels, v in samples.get(name, []) if all(labels.get(k) == x for k, x in want.items())
    )


def exact(samples, name: str, labels: dict[str, str]) -> float | None:
    for got, v in samples.get(name, []):
        if got == labels:
            return v
    return None


@pytest.fixture
def mesh(lab, tmp_path: Path, pki: Path):
    m = Mesh(lab, tmp_path, pki)
    try:
        client = m.pod("client", server=False)
        web = m.pod("web", server=False)
        (tmp_path / "app.py").write_text(APP)
        web.spawn([sys.executable, str(tmp_path / "app.py")])
        (m.manifests / "svc.yaml").write_text(service_yaml("web"))
        m.start()
        m.wait_ready()
        m.client, m.web = client, web  # type: ignore[attr-defined]
        yield m
    finally:
        m.stop(signal.SIGKILL if m.agent and m.agent.poll() is None else signal.SIGTERM)
        if m.netns_dir.is_dir():
            for held in m.netns_dir.iterdir():
                discover.release(held.name, m.netns_dir)


@pytest.fixture
def prometheus(tmp_path: Path):
    if not Path(PROMETHEUS).exists():
        # CI (CI=true) has what scripts/setup installs: missing there is a failure, not a skip.
        (pytest.fail if os.environ.get("CI") == "true" else pytest.skip)(
            "no prometheus binary (Debian package `prometheus`)"
        )
    procs: list[subprocess.Popen[bytes]] = []

    def start(target_port: int) -> int:
        web_port = free_port()
        config = tmp_path / "prometheus.yml"
        config.write_text(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
            "scrape_configs:\n  - job_name: meshagent\n    scrape_timeout: 1s\n"
            f"    static_configs:\n      - targets: ['127.0.0.1:{target_port}']\n"
        )
        log = (tmp_path / "prometheus.log").open("wb")
        procs.append(
            subprocess.Popen(
                [
                    PROMETHEUS,
                    f"--config.file={config}",
                    f"--storage.tsdb.path={tmp_path / 'prom-data'}",
                    f"--web.listen-address=127.0.0.1:{web_port}",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        )
        log.close()
        return web_port

    try:
        yield start
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(timeout=10)


def promql(port: int, query: str) -> list:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": query})
    status, body = http_get(url)
    assert status == 200, body
    return json.loads(body)["data"]["result"]


def cli(mesh: Mesh, *argv: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(MESHAGENT), *argv, "--admin", f"127.0.0.1:{mesh.admin_port}"],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def test_known_traffic_gives_exact_counters_with_full_labels_and_a_promql_success_rate(
    mesh: Mesh, prometheus
) -> None:
    client, web = mesh.client, mesh.web  # type: ignore[attr-defined]
    assert drive(client, ["/status/200"] * 6 + ["/status/500"] * 3) == [200] * 6 + [500] * 3

    def counted():
        s = scrape(mesh)
        return s if value(s, "response_total", direction="outbound") == 9 else None

    s = wait_for("9 responses counted", counted, timeout=10)
    pod_client = {"namespace": "shop", "pod": "client", "serviceaccount": "default"}
    pod_web = {"namespace": "shop", "pod": "web", "serviceaccount": "default"}
    target = {
        "target_addr": f"{web.ip}:{APP_PORT}",
        "target_ip": web.ip,
        "target_port": str(APP_PORT),
    }
    outbound = {
        **pod_client,
        "direction": "outbound",
        "authority": AUTHORITY,
        **target,
        "tls": "true",
        "server_id": IDENT,
        "dst_namespace": "shop",
        "dst_service": "web",
        "dst_pod": "web",
        "dst_serviceaccount": "default",
        "dst_control_plane_ns": "linkerd",
        "dst_zone": "",
        "dst_zone_locality": "unknown",
    }
    inbound = {**pod_web, "direction": "inbound", **target, "tls": "true", "client_id": IDENT}
    ok = {"classification": "success", "status_code": "200"}
    bad = {"classification": "failure", "status_code": "500"}
    assert exact(s, "request_total", outbound) == 9, s["request_total"]
    assert exact(s, "response_total", {**outbound, **ok}) == 6, s["response_total"]
    assert exact(s, "response_total", {**outbound, **bad}) == 3
    assert exact(s, "request_total", inbound) == 9
    assert exact(s, "response_total", {**inbound, **ok}) == 6
    assert exact(s, "response_total", {**inbound, **bad}) == 3
    assert exact(s, "response_latency_ms_count", {**outbound, "status_code": "200"}) == 6
    assert value(s, "inbound_http_authz_allow_total", pod="web") == 9
    assert value(s, "tcp_open_total", direction="outbound", pod="client") == 9
    assert value(s, "tcp_close_total", direction="outbound", pod="client") == 9
    assert value(s, "tcp_open_connections", pod="client") == 0
    endpoints = {"parent_name": "web", "parent_namespace": "shop", "endpoint_state": "ready"}
    assert value(s, "outbound_http_balancer_endpoints", **endpoints) == 1
    assert value(s, "identity_cert_expiration_timestamp_seconds", identity=IDENT) > time.time()
    assert value(s, "process_cpu_seconds_total", process="worker") > 0
    assert value(s, "meshagent_event_loop_lag_seconds", process="supervisor") >= 0
    for labels, _ in s["request_total"]:
        assert not {"client_port", "peer_addr", "src_port"} & set(labels)

    # A real Prometheus computes Linkerd's success rate from the admin endpoint.
    port = prometheus(mesh.admin_port)
    # Linkerd's success rate over the counters (increase() would extrapolate per series).
    query = (
        'sum(response_total{direction="outbound",classification="success"})'
        ' / sum(response_total{direction="outbound"})'
    )
    wait_for("a first scrape", lambda: promql(port, 'response_total{direction="outbound"}'))
    drive(client, ["/status/200"] * 6 + ["/status/500"] * 3)  # increases while it scrapes

    def rate() -> float | None:
        res = promql(port, 'sum(response_total{direction="outbound"})')
        if not res or float(res[0]["value"][1]) < 18:
            return None
        got = promql(port, query)
        ratio = float(got[0]["value"][1]) if got else float("nan")
        return None if math.isnan(ratio) else ratio  # NaN: not two samples yet

    ratio = wait_for("prometheus answers", rate, timeout=30, interval=0.5)
    s = scrape(mesh)
    assert value(s, "response_total", direction="outbound") == 18
    assert ratio == pytest.approx(2 / 3), promql(port, 'response_total{direction="outbound"}')

    dump = mesh.admin("/config_dump")[1]
    assert b"PRIVATE KEY" not in dump
    assert b"BEGIN" not in dump or b"CERTIFICATE" in dump


def test_identical_requests_on_one_connection_are_each_counted(mesh: Mesh) -> None:
    """The outbound lane reuses one decision for a repeated head: every request still counts."""
    paths = ["/status/200"] * 12 + ["/status/500"] * 3
    argv = [sys.executable, "-c", KEEPALIVE, *paths]
    out = mesh.client.run(argv, check=True, timeout=60).stdout  # type: ignore[attr-defined]
    assert [int(x) for x in out.split()] == [200] * 12 + [500] * 3

    def counted():
        s = scrape(mesh)
        return s if value(s, "response_total", direction="outbound") == 15 else None

    s = wait_for("15 responses counted", counted, timeout=10)
    assert value(s, "tcp_open_total", direction="outbound", pod="client") == 1  # one connection
    assert value(s, "request_total", direction="outbound") == 15
    assert value(s, "response_total", direction="outbound", classification="failure") == 3
    assert value(s, "inbound_http_authz_allow_total", pod="web") == 15


def test_a_scrape_whose_workers_reported_after_the_traffic_counts_all_of_it(mesh: Mesh) -> None:
    """agent.admin.observe rule 5: every worker's stamp past a moment means every count
    made before that moment is in the scrape; the bench's settle (`agent.bench.mesh.settled`)
    relies on it."""
    assert drive(mesh.client, ["/status/200"] * 7) == [200] * 7  # type: ignore[attr-defined]
    answered = time.time()

    def reported():
        status, body = mesh.admin("/metrics")
        assert status == 200
        samples = stat.parse(body.decode(), 0.0).samples
        return samples if bench_mesh.settled(samples, answered) else None

    samples = wait_for("every worker reported after the traffic", reported, timeout=5)
    stamps = [v for (name, _), v in samples.items() if name == bench_mesh.STAMP]
    assert len(stamps) == samples[("meshagent_workers", (("state", "desired"),))] >= 1
    assert all(answered <= v <= time.time() for v in stamps), stamps
    assert bench_mesh.counted(samples, "outbound") == 7
    assert bench_mesh.counted(samples, "inbound") == 7


def test_counters_never_go_backwards_when_a_worker_is_killed(mesh: Mesh) -> None:
    client = mesh.client  # type: ignore[attr-defined]
    drive(client, ["/status/200"] * 8)
    total = lambda: value(scrape(mesh), "response_total", direction="outbound")  # noqa: E731
    wait_for("8 counted", lambda: total() == 8, timeout=10)
    workers = {w["id"]: w["pid"] for w in mesh.dump()["workers"]}
    os.kill(workers[0], signal.SIGKILL)
    seen = [total()]
    for _ in range(10):
        time.sleep(0.1)
        seen.append(total())
    assert seen == sorted(seen)
    assert seen[-1] >= 8
    wait_for("replacement", lambda: all(w["ready"] for w in mesh.dump()["workers"]), timeout=5)
    drive(client, ["/status/200"] * 4)
    wait_for("12 counted", lambda: total() == 12, timeout=10)
    assert value(scrape(mesh), "meshagent_worker_restarts_total") == 1


def test_stat_tap_and_diagnostics_show_what_the_agent_sees(mesh: Mesh) -> None:  # noqa: PLR0915 - one mesh, three commands
    client, web = mesh.client, mesh.web  # type: ignore[attr-defined]
    drive(client, ["/status/200"])
    total = lambda: value(scrape(mesh), "response_total", direction="inbound")  # noqa: E731
    wait_for("the first request counted", lambda: total() == 1, timeout=10)
    # stat: two scrapes 4 s apart, 4 good and 2 failing requests in between.
    stat = subprocess.Popen(
        [str(MESHAGENT), "stat", "pods", "-n", "shop", "--window", "4s", "-o", "json",
         "--admin", f"127.0.0.1:{mesh.admin_port}"],
        stdout=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        time.sleep(0.5)
        drive(client, ["/status/200"] * 4 + ["/status/503"] * 2)
        out, _ = stat.communicate(timeout=20)
    finally:
        if stat.poll() is None:
            stat.kill()
            stat.wait()
    rows = {r["name"]: r for r in json.loads(out)}
    assert set(rows) == {"client", "web"}
    assert rows["web"]["success_rate"] == pytest.approx(4 / 6)
    assert rows["web"]["rps"] == pytest.approx(6 / 4, rel=0.25)
    assert rows["web"]["latency_p50_ms"] is not None
    assert rows["web"]["meshed"] == "1/1"
    assert rows["client"]["success_rate"] is None  # no inbound traffic

    svc = cli(mesh, "stat", "services", "--window", "0", "-o", "json")
    assert svc.returncode == 0, svc.stderr

    # tap: live requests of web, filtered by path.
    tap = subprocess.Popen(
        [str(MESHAGENT), "tap", "shop/web", "--path", "/status/2", "--max", "2", "-o", "json",
         "--admin", f"127.0.0.1:{mesh.admin_port}"],
        stdout=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        time.sleep(1.0)  # subscribed, and the workers told
        drive(client, ["/status/404", "/status/201?q=1", "/status/202"])
        out, _ = tap.communicate(timeout=15)
    finally:
        if tap.poll() is None:
            tap.kill()
            tap.wait()
    # Two workers flush their own events: order is per worker, so sort by time.
    events = sorted((json.loads(line) for line in out.splitlines()), key=lambda e: e["ts"])
    assert [(e["method"], e["path"], e["status"]) for e in events] == [
        ("GET", "/status/201", 201),
        ("GET", "/status/202", 202),
    ]
    assert all(e["pod"] == "shop/web" and e["tls"] == "true" for e in events)
    assert all(e["client_id"] == IDENT and e["direction"] == "inbound" for e in events)

    # diagnostics: endpoints, certs and policy as the agent holds them.
    eps = cli(mesh, "diagnostics", "endpoints", AUTHORITY, "-o", "json")
    assert eps.returncode == 0, eps.stderr
    [ep] = json.loads(eps.stdout)
    assert ep["addr"] == f"{web.ip}:{APP_PORT}"
    assert ep["identity"] == IDENT
    certs = cli(mesh, "diagnostics", "certs", "shop/web", "-o", "json")
    [cert] = json.loads(certs.stdout)
    assert cert["identity"] == IDENT
    assert cert["ready"] is True
    assert cert["expiry"]
    assert "PRIVATE" not in certs.stdout
    pol = cli(mesh, "diagnostics", "policy", f"shop/web:{APP_PORT}", "-o", "json")
    assert pol.returncode == 0, pol.stderr
    assert json.loads(pol.stdout)[0]["port"] == str(APP_PORT)
    missing = cli(mesh, "diagnostics", "endpoints", "nope.shop.svc.cluster.local:80")
    assert missing.returncode == 1
