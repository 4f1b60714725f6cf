"""`meshagent run` end to end: lab pods, a manifests folder, the agent as a subprocess.

Pods are `agent.netlab` pods named `pod<UID>`, so their processes sit in a
cgroup whose path contains `pod<UID>` (the convention of agent.pods.discover).
The agent runs with its own registry and netns dir under tmp_path, an admin
port on 127.0.0.1, and `--cleanup-on-exit` unless a test says otherwise.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest

from agent.pods import discover

pytestmark = pytest.mark.privileged

MESHAGENT = Path(sys.executable).parent / "meshagent"
NODE = "n1"
APP_PORT = 8080
READY_S = 30.0

NAMESPACE = """\
apiVersion: v1
kind: Namespace
metadata: {name: shop, annotations: {linkerd.io/inject: enabled}}
"""


def pod_yaml(name: str, uid: str, ip: str, *, sa: str = "default", node: str = NODE) -> str:
    return f"""\
apiVersion: v1
kind: Pod
metadata: {{name: {name}, namespace: shop, uid: {uid}, labels: {{app: {name}}}}}
spec:
  nodeName: {node}
  serviceAccountName: {sa}
  containers: [{{name: c, ports: [{{name: http, containerPort: {APP_PORT}}}]}}]
status:
  phase: Running
  podIP: {ip}
  conditions: [{{type: Ready, status: "True"}}]
"""


def service_yaml(name: str) -> str:
    return f"""\
apiVersion: v1
kind: Service
metadata: {{name: {name}, namespace: shop}}
spec:
  clusterIP: 10.96.0.20
  selector: {{app: {name}}}
  ports: [{{name: http, port: 80, targetPort: http}}]
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http_get(url: str, timeout: float = 2.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def wait_for(what: str, fn, timeout: float = READY_S, interval: float = 0.1):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            last = fn()
            if last:
                return last
        time.sleep(interval)
    pytest.fail(f"timed out waiting for {what} (last: {last!r})")


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("pki")
    for argv in (
        ["certs", "create-root", str(base / "root")],
        ["certs", "create-issuer", str(base / "identity"), "--ca", str(base / "root")],
    ):
        subprocess.run([str(MESHAGENT), *argv], check=True, capture_output=True)
    return base / "identity"


class Mesh:
    """A lab node with pods, a manifests folder and a running agent."""

    def __init__(self, lab, tmp_path: Path, pki: Path) -> None:
        self.lab = lab
        self.tmp = tmp_path
        self.pki = pki
        self.node = lab.node("n")
        self.manifests = tmp_path / "manifests"
        self.manifests.mkdir()
        (self.manifests / "ns.yaml").write_text(NAMESPACE)
        self.netns_dir = tmp_path / "netns"
        self.registry = tmp_path / "enrolled.json"
        self.admin_port = free_port()
        self.agent: subprocess.Popen[bytes] | None = None
        self.pods: dict[str, tuple[str, object]] = {}  # name -> (uid, LabPod)
        self.servers: dict[str, Path] = {}

    def pod(self, name: str, *, manifest: bool = True, server: bool = True):
        uid = str(uuid.uuid4())
        lp = self.lab.pod(self.node, f"pod{uid}")
        self.pods[name] = (uid, lp)
        if server:
            log = self.tmp / f"{name}-http.log"
            with log.open("wb") as out:
                lp.spawn(
                    [sys.executable, "-m", "http.server", str(APP_PORT), "--bind", "0.0.0.0"],
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    cwd=self.tmp,
                )
            self.servers[name] = log
        else:  # a process so the pod's cgroup and netns are found
            lp.spawn(["sleep", "600"])
        if manifest:
            self.write_pod(name)
        return lp

    def write_pod(self, name: str) -> None:
        uid, lp = self.pods[name]
        (self.manifests / f"pod-{name}.yaml").write_text(pod_yaml(name, uid, lp.ip))

    def start(self, *extra: str, control_plane: str = "embedded", cleanup: bool = True) -> None:
        argv = [
            str(MESHAGENT),
            "run",
            "--control-plane",
            control_plane,
            "--pods-from",
            f"manifests:{self.manifests}",
            "--node",
            NODE,
            "--workers",
            "2",
            "--admin-addr",
            f"127.0.0.1:{self.admin_port}",
            "--grace",
            "2s",
            "--identity-dir",
            str(self.pki),
            "--netns-dir",
            str(self.netns_dir),
            "--registry",
            str(self.registry),
            *(["--cleanup-on-exit"] if cleanup else []),
            *extra,
        ]
        self.log = (self.tmp / "agent.log").open("wb")
        self.agent = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT)

    def admin(self, path: str) -> tuple[int, bytes]:
        return http_get(f"http://127.0.0.1:{self.admin_port}{path}")

    def dump(self) -> dict:
        return json.loads(self.admin("/config_dump")[1])

    def wait_ready(self) -> None:
        wait_for("/ready", lambda: self.admin("/ready")[0] == 200)

    def enrolled(self) -> set[str]:
        return {p["pod"] for p in self.dump()["pods"]}

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> int | None:
        if self.agent is None:
            return None
        if self.agent.poll() is None:
            self.agent.send_signal(sig)
            try:
                self.agent.wait(timeout)
            except subprocess.TimeoutExpired:
                self.agent.kill()
                self.agent.wait()
        self.log.close()
        rc = self.agent.returncode
        self.agent = None
        return rc

    def agent_log(self) -> str:
        return (self.tmp / "agent.log").read_text(errors="replace")


def nat_rules(lp) -> str:
    out = ""
    for tool in ("iptables-save", "iptables-legacy-save"):
        out += lp.run([tool, "-t", "nat"], check=False).stdout
    return out


def listening(lp) -> set[int]:
    text = lp.run(["ss", "-Hltn"]).stdout
    return {int(line.split()[3].rpartition(":")[2]) for line in text.splitlines() if line.strip()}


def curl(lp, url: str) -> str:
    code = f"import urllib.request,sys;print(urllib.request.urlopen({url!r}, timeout=5).status)"
    return lp.run([sys.executable, "-c", code], check=False, timeout=20).stdout.strip()


@pytest.fixture
def mesh(lab, tmp_path: Path, pki: Path):
    m = Mesh(lab, tmp_path, pki)
    try:
        yield m
    finally:
        m.stop(signal.SIGKILL if m.agent and m.agent.poll() is None else signal.SIGTERM)
        if m.netns_dir.is_dir():
            for held in m.netns_dir.iterdir():
                discover.release(held.name, m.netns_dir)


def test_meshed_pods_are_enrolled_listened_on_and_carry_http(mesh: Mesh) -> None:
    a = mesh.pod("client")
    b = mesh.pod("web")
    (mesh.manifests / "svc.yaml").write_text(service_yaml("web"))
    mesh.start()
    mesh.wait_ready()

    assert mesh.enrolled() == {"shop/client", "shop/web"}
    for lp in (a, b):
        assert "PROXY_INIT_REDIRECT" in nat_rules(lp)
        assert {4140, 4143} <= listening(lp)
    assert curl(a, f"http://{b.ip}:{APP_PORT}/") == "200"
    # A ClusterIP routes nowhere in the lab (no kube-proxy): only the mesh,
    # resolving it through the control plane, can answer.
    assert curl(a, "http://10.96.0.20:80/") == "200"
    dump = mesh.dump()
    dst = dump["destinations"]["10.96.0.20:80"]
    assert dst["authority"] == "web.shop.svc.cluster.local:80"
    assert dst["endpoints"] == [f"{b.ip}:{APP_PORT}"]
    assert f"{b.ip}:{APP_PORT}" in dump["destinations"]
    status, metrics = mesh.admin("/metrics")
    assert status == 200
    assert b'meshagent_enrolled_pods{mode="iptables"} 2' in metrics
    assert all(i["ready"] for i in dump["identities"])
    assert {i["identity"] for i in dump["identities"]} == {
        "default.shop.serviceaccount.identity.linkerd.cluster.local"
    }
    assert mesh.stop() == 0


def test_pods_added_and_removed_while_running_are_enrolled_and_unenrolled(mesh: Mesh) -> None:
    mesh.pod("first", server=False)
    later = mesh.pod("later", manifest=False, server=False)
    mesh.start()
    mesh.wait_ready()
    assert "PROXY_INIT_REDIRECT" not in nat_rules(later)

    mesh.write_pod("later")
    wait_for("enrolled", lambda: "shop/later" in mesh.enrolled(), timeout=10)
    assert "PROXY_INIT_REDIRECT" in nat_rules(later)
    assert {4140, 4143} <= listening(later)

    (mesh.manifests / "pod-later.yaml").unlink()
    wait_for("unenrolled", lambda: "shop/later" not in mesh.enrolled(), timeout=10)
    wait_for("rules gone", lambda: "PROXY_INIT_REDIRECT" not in nat_rules(later), timeout=5)
    wait_for("listeners gone", lambda: not ({4140, 4143} & listening(later)), timeout=5)
    assert not (mesh.netns_dir / mesh.pods["later"][0]).exists()


def test_a_killed_worker_is_replaced_within_two_seconds(mesh: Mesh) -> None:
    mesh.pod("client", server=False)
    mesh.start()
    mesh.wait_ready()
    before = {w["id"]: w["pid"] for w in mesh.dump()["workers"]}
    victim = before[0]
    os.kill(victim, signal.SIGKILL)
    t0 = time.monotonic()

    def replaced() -> bool:
        ws = {w["id"]: (w["pid"], w["ready"]) for w in mesh.dump()["workers"]}
        return 0 in ws and ws[0][0] != victim and ws[0][1]

    wait_for("replacement", replaced, timeout=5, interval=0.05)
    assert time.monotonic() - t0 < 2.0


def test_sigterm_exits_zero_within_grace_and_keeps_redirects(mesh: Mesh) -> None:
    lp = mesh.pod("client", server=False)
    mesh.start(cleanup=False)
    mesh.wait_ready()
    t0 = time.monotonic()
    assert mesh.stop(timeout=10) == 0
    assert time.monotonic() - t0 < 2.0 + 3.0  # grace plus shutdown
    assert "PROXY_INIT_REDIRECT" in nat_rules(lp)  # rule 2: redirects stay
    assert (mesh.netns_dir / mesh.pods["client"][0]).exists()

    # A restarted agent finds the pod again (re-enrolling is idempotent).
    mesh.start()
    mesh.wait_ready()
    assert mesh.enrolled() == {"shop/client"}
    assert mesh.stop() == 0
    assert "PROXY_INIT_REDIRECT" not in nat_rules(lp)


def test_known_traffic_keeps_flowing_while_the_control_plane_is_down(
    mesh: Mesh, tmp_path: Path
) -> None:
    a = mesh.pod("client")
    b = mesh.pod("web")
    ports = {name: free_port() for name in ("destination", "identity", "policy")}
    cp_argv = [
        str(MESHAGENT),
        "controlplane",
        "--manifests",
        str(mesh.manifests),
        "--identity-dir",
        str(mesh.pki),
        "--bind",
        "127.0.0.1",
        *(x for name, port in ports.items() for x in (f"--{name}-port", str(port))),
    ]

    cp_log = (tmp_path / "cp.log").open("ab")

    def start_cp() -> subprocess.Popen[bytes]:
        return subprocess.Popen(cp_argv, stdout=subprocess.DEVNULL, stderr=cp_log)

    (mesh.manifests / "svc.yaml").write_text(service_yaml("web"))
    cp = start_cp()
    try:
        mesh.start(
            "--identity-addr",
            f"127.0.0.1:{ports['identity']}",
            "--policy-addr",
            f"127.0.0.1:{ports['policy']}",
            control_plane=f"127.0.0.1:{ports['destination']}",
        )
        mesh.wait_ready()
        assert curl(a, "http://10.96.0.20:80/") == "200"  # resolved through the control plane
        cp.terminate()
        cp.wait(10)
        time.sleep(1.0)
        for _ in range(3):  # the last state keeps serving
            assert curl(a, "http://10.96.0.20:80/") == "200"
        assert curl(a, f"http://{b.ip}:{APP_PORT}/") == "200"
        assert mesh.admin("/live")[0] == 200
        cp = start_cp()
        assert curl(a, "http://10.96.0.20:80/") == "200"
        assert mesh.stop() == 0
    finally:
        if cp.poll() is None:
            cp.terminate()
            cp.wait(10)
        cp_log.close()
