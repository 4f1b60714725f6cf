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
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from agent import native, netlab
from agent.bench.mesh import free_port
from agent.control.cache import PolicyKey
from agent.pods import discover
from agent.proxy.inbound import POLICY_WAIT_S
from agent.redirect.registry import Registry
from agent.supervisor import enroll

if TYPE_CHECKING:
    import socket

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


def pod_yaml(  # noqa: PLR0913 - a pod's fields
    name: str, uid: str, ip: str, *, sa: str = "default", node: str = NODE, app: str = ""
) -> str:
    return f"""\
apiVersion: v1
kind: Pod
metadata: {{name: {name}, namespace: shop, uid: {uid}, labels: {{app: {app or name}}}}}
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

    def write_pod(self, name: str, *, app: str = "") -> None:
        uid, lp = self.pods[name]
        (self.manifests / f"pod-{name}.yaml").write_text(pod_yaml(name, uid, lp.ip, app=app))

    def start(
        self,
        *extra: str,
        control_plane: str = "embedded",
        cleanup: bool = True,
        env: dict[str, str] | None = None,
    ) -> None:
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
        self.agent = subprocess.Popen(
            argv, stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
        )

    def start_without_control_plane(self) -> None:
        """`start` with every control-plane address a port nothing listens on."""
        dead = free_port()
        self.start(
            "--identity-addr",
            f"127.0.0.1:{dead}",
            "--policy-addr",
            f"127.0.0.1:{dead}",
            control_plane=f"127.0.0.1:{dead}",
        )

    def admin(self, path: str) -> tuple[int, bytes]:
        return http_get(f"http://127.0.0.1:{self.admin_port}{path}")

    def dump(self) -> dict:
        return json.loads(self.admin("/config_dump")[1])

    def wait_ready(self) -> None:
        try:
            wait_for("/ready", lambda: self.admin("/ready")[0] == 200)
        except pytest.fail.Exception as exc:
            exited = None if self.agent is None else self.agent.poll()
            pytest.fail(f"{exc}; agent exit status {exited}; its log:\n{self.agent_log()[-3000:]}")

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
    assert "native=active" in mesh.agent_log()  # the workers ran the compiled request path


def test_a_stale_native_build_is_named_and_the_sources_serve(mesh: Mesh) -> None:
    """A build whose stamp is not the sources' is left out (agent.native rule 1), loudly."""
    a = mesh.pod("client")
    b = mesh.pod("web")
    stale = mesh.tmp / "native"
    stale.mkdir()
    (stale / native.STAMP).write_text("an older build\n")
    mesh.start(env={native.DIR_ENV: str(stale)})
    mesh.wait_ready()
    assert curl(a, f"http://{b.ip}:{APP_PORT}/") == "200"
    assert mesh.stop() == 0
    log = mesh.agent_log()
    assert "compiled request path is older than its sources" in log
    assert "native=stale" in log
    assert "native=active" not in log


def test_a_registry_file_that_is_not_one_is_kept_and_no_pod_is_captured(mesh: Mesh) -> None:
    """agent.redirect.registry rule 4: the agent runs, not ready, says why, and captures no
    pod it could not record (rules nothing records would outlive it); the file is kept."""
    a = mesh.pod("client", server=False)
    text = "not a registry\n"
    mesh.registry.write_text(text)
    mesh.start("--redirect", "iptables")
    pending = wait_for("the pod pending", lambda: mesh.dump()["pending"])
    assert "not a registry of enrolled pods" in pending["shop/client"]
    assert mesh.admin("/ready")[0] != 200
    assert "PROXY_INIT_REDIRECT" not in nat_rules(a)
    assert mesh.stop() == 0
    assert mesh.registry.read_text() == text
    assert "previous run's pods not read" in mesh.agent_log()


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

    policy_streams = lambda: [  # noqa: E731
        st
        for st in mesh.dump()["streams"]
        if st["kind"] == "policy" and "pod='later'" in st["target"]
    ]
    wait_for("later's policy stream", policy_streams, timeout=10)

    (mesh.manifests / "pod-later.yaml").unlink()
    wait_for("unenrolled", lambda: "shop/later" not in mesh.enrolled(), timeout=10)
    assert policy_streams() == []  # the pod is gone: so is its WatchPort stream
    wait_for("rules gone", lambda: "PROXY_INIT_REDIRECT" not in nat_rules(later), timeout=5)
    wait_for("listeners gone", lambda: not ({4140, 4143} & listening(later)), timeout=5)
    assert not (mesh.netns_dir / mesh.pods["later"][0]).exists()


def test_a_dozen_pods_enrolled_side_by_side_are_all_captured_and_all_released_at_exit(
    mesh: Mesh,
) -> None:
    """iptables mode enrolls and unenrolls up to `STEP_WIDTH` pods at once
    (agent.supervisor.enroll rule 6): each pod's rules, listeners, registry entry and
    netns mount are all there after the start, and all gone after the exit."""
    assert enroll.STEP_WIDTH > 1
    names = [f"p{i:02}" for i in range(12)]
    pods = [mesh.pod(name, server=False) for name in names]
    mesh.start()
    mesh.wait_ready()
    assert mesh.enrolled() == {f"shop/{n}" for n in names}
    for lp in pods:
        assert "PROXY_INIT_REDIRECT" in nat_rules(lp), lp.name
        assert {4140, 4143} <= listening(lp), lp.name
    assert set(Registry(mesh.registry).load()) == {f"shop/{n}" for n in names}
    assert len(list(mesh.netns_dir.iterdir())) == len(names)
    assert mesh.stop() == 0
    for lp in pods:
        assert "PROXY_INIT_REDIRECT" not in nat_rules(lp), lp.name
    assert Registry(mesh.registry).load() == {}
    assert list(mesh.netns_dir.iterdir()) == []
    assert "pod step failed" not in mesh.agent_log()


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
    """Issue 4: a 30 s control-plane outage; known destinations keep working throughout,
    and the client reconnects afterwards (an endpoint added meanwhile shows up)."""
    a = mesh.pod("client")
    b = mesh.pod("web")
    late = mesh.pod("web-late", manifest=False)  # a second replica of web, added while down
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

    def endpoints() -> list[str]:
        return mesh.dump()["destinations"]["10.96.0.20:80"]["endpoints"]

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
        assert endpoints() == [f"{b.ip}:{APP_PORT}"]
        cp.terminate()
        cp.wait(10)
        mesh.write_pod("web-late", app="web")  # the agent enrolls it; nobody tells the client
        outage_s = 30.0  # issue 4: "control plane killed for 30 s"; beyond the 10 s backoff cap
        t0 = time.monotonic()
        while time.monotonic() - t0 < outage_s:  # the last state keeps serving
            assert curl(a, "http://10.96.0.20:80/") == "200"
            assert curl(a, f"http://{b.ip}:{APP_PORT}/") == "200"
            time.sleep(0.5)
        assert mesh.admin("/live")[0] == 200
        assert endpoints() == [f"{b.ip}:{APP_PORT}"]
        cp = start_cp()
        # The channel's reconnect backoff (capped at 10 s, gRPC adds up to 20%) may run out
        # just before the stream's own (capped at 10 s), then the control plane starts: about
        # 24 s at worst (a clean-clone CI at a768412 waited past 20 s once).
        wait_for("the new endpoint", lambda: f"{late.ip}:{APP_PORT}" in endpoints(), timeout=35)
        assert sorted(endpoints()) == sorted([f"{b.ip}:{APP_PORT}", f"{late.ip}:{APP_PORT}"])
        for _ in range(3):
            assert curl(a, "http://10.96.0.20:80/") == "200"
        assert mesh.stop() == 0
    finally:
        if cp.poll() is None:
            cp.terminate()
            cp.wait(10)
        cp_log.close()


def test_unknown_ip_is_forwarded_at_once_when_its_profile_stream_fails(mesh: Mesh) -> None:
    """GetProfile failing (here: no control plane at all) answers `exists=False` at once:
    the worker forwards to the original destination without waiting out its 2 s."""
    a = mesh.pod("client", server=False)
    outsider = mesh.pod("outsider", manifest=False)  # not meshed, not a service
    mesh.start_without_control_plane()
    wait_for("enrolled", lambda: mesh.enrolled() == {"shop/client"})
    target = f"{outsider.ip}:{APP_PORT}"
    t0 = time.monotonic()
    assert curl(a, f"http://{target}/") == "200"
    took = time.monotonic() - t0
    assert took < 1.5, took  # the worker waits 2 s for an answer that never comes otherwise
    assert mesh.dump()["destinations"][target]["exists"] is False
    assert curl(a, f"http://{target}/") == "200"


def test_with_no_control_plane_each_worker_waits_once_for_a_ports_policy(mesh: Mesh) -> None:
    """inbound rule 5: a port whose policy never comes (no control plane at all) costs one
    wait of `POLICY_WAIT_S` per worker; the next connections get the node's default at
    once (before, every one waited the second)."""
    a = mesh.pod("client", server=False)
    b = mesh.pod("web")
    mesh.start_without_control_plane()
    wait_for("enrolled", lambda: mesh.enrolled() == {"shop/client", "shop/web"})
    took = []
    for _ in range(6):
        t0 = time.monotonic()
        assert curl(a, f"http://{b.ip}:{APP_PORT}/") == "200"  # the default: all-unauthenticated
        took.append(time.monotonic() - t0)
    waited = [t for t in took if t >= POLICY_WAIT_S]
    assert 1 <= len(waited) <= 2, took  # --workers 2: at most one wait each
    assert mesh.dump()["policies"].get(f"shop/web:{APP_PORT}") is None  # nothing ever came


def ss_owner_by_port(lp, port: int) -> dict[int, int]:
    """Client port -> pid of the process holding the accepted end, for `port` in the pod."""
    out = lp.run(["ss", "-Htnp", "state", "established", f"( sport = :{port} )"]).stdout
    owners = {}
    for line in out.splitlines():
        fields = line.split()
        peer_port = int(fields[3].rpartition(":")[2])
        pid = line.partition("pid=")[2].partition(",")[0]
        if pid.isdigit():
            owners[peer_port] = int(pid)
    return owners


ECHO_SERVER = """
import socket, threading
srv = socket.create_server(("0.0.0.0", 9000))
def serve(c):
    while data := c.recv(65536):
        c.sendall(data)
    c.close()
while True:
    c, _ = srv.accept()
    threading.Thread(target=serve, args=(c,), daemon=True).start()
"""


def test_a_killed_worker_loses_only_its_own_connections(mesh: Mesh) -> None:

    a = mesh.pod("client", server=False)
    b = mesh.pod("echo", server=False)
    b.spawn([sys.executable, "-c", ECHO_SERVER])
    mesh.start()
    mesh.wait_ready()
    workers = {w["pid"] for w in mesh.dump()["workers"]}
    assert len(workers) == 2
    conns: dict[int, socket.socket] = {}
    try:
        owners: dict[int, int] = {}
        # Until both workers hold some. Each accepts on its own socket of the listener's
        # SO_REUSEPORT group; the kernel picks one per connection, by the CPU it was made
        # on (agent.proxy.placement) or, on one CPU, by its addresses: so the connections
        # are made on each CPU in turn.
        cpus = sorted(os.sched_getaffinity(0))
        for i in range(200):
            sock = netlab.on_cpu(cpus[i % len(cpus)], _echo_hello, a, b.ip)
            conns[sock.getsockname()[1]] = sock
            owners = ss_owner_by_port(a, 4140)
            if len(set(owners.values())) == 2 and len(conns) >= 6:
                break
            time.sleep(0.02)
        assert set(owners.values()) == workers, owners
        victim = next(iter(workers))
        os.kill(victim, signal.SIGKILL)
        time.sleep(0.5)
        for port, sock in conns.items():
            try:
                sock.sendall(b"again")
                got = sock.recv(16)
            except OSError:
                got = b""
            if owners[port] == victim:
                assert got == b"", port  # reset or closed with its worker
            else:
                assert got == b"again", port  # the other worker's connections live on
        wait_for("a new connection", lambda: _echo_once(a, b.ip), timeout=5)  # replacement
    finally:
        for sock in conns.values():
            sock.close()


def _inbound_owners(client, pod, n: int) -> set[int]:
    """PIDs holding the accepted ends of `n` kept HTTP connections from `client` to `pod`."""
    from agent.redirect import netns  # noqa: PLC0415

    socks = []
    cpus = sorted(os.sched_getaffinity(0))
    try:
        for i in range(n):  # on each CPU in turn (the group is steered by CPU)
            sock = netlab.on_cpu(cpus[i % len(cpus)], netns.socket_in, client.netns)
            socks.append(sock)
            sock.settimeout(5)
            netlab.on_cpu(cpus[i % len(cpus)], sock.connect, (pod.ip, APP_PORT))
            sock.sendall(b"GET /?kept HTTP/1.1\r\nHost: web\r\n\r\n")
            assert sock.recv(4096).startswith(b"HTTP/1.1 200")
        out = pod.run(["ss", "-Htnp", "state", "established", f"( sport = :{APP_PORT} )"]).stdout
        return {
            int(line.partition("pid=")[2].partition(",")[0])
            for line in out.splitlines()
            if line.split()[3].startswith(f"{client.ip}:") and "pid=" in line
        }
    finally:
        for sock in socks:
            sock.close()


def _echo_hello(a, ip: str):
    """A connection from pod `a` to its echo server at `ip`, captured by a's outbound
    listener (a same-node hop), that has echoed once; the caller closes it."""
    from agent.redirect import netns  # noqa: PLC0415

    sock = netns.socket_in(a.netns)
    try:
        sock.settimeout(5)
        sock.connect((ip, 9000))
        sock.sendall(b"hello")
        assert sock.recv(16) == b"hello"
    except BaseException:
        sock.close()
        raise
    return sock


def _serve_by_cpu(mesh: Mesh, a, b, cpus: list[int]) -> dict[int, int]:
    """CPU -> the worker PID that took the connections made on it (each lot to one)."""
    by_cpu = {w["cpu"]: w["pid"] for w in mesh.dump()["workers"]}
    made: dict[int, int] = {}  # client port -> the CPU it connected on
    conns = []
    try:
        for i in range(12):  # by hash, 6 and 6 on the right workers has p ~ 2e-4
            cpu = cpus[i % 2]
            sock = netlab.on_cpu(cpu, _echo_hello, a, b.ip)
            conns.append(sock)
            made[sock.getsockname()[1]] = cpu
        owners = ss_owner_by_port(a, 4140)
        assert {port: owners.get(port) for port in made} == {
            port: by_cpu[cpu] for port, cpu in made.items()
        }
    finally:
        for sock in conns:
            sock.close()
    return by_cpu


def test_workers_serve_the_connections_made_on_their_cpus(mesh: Mesh) -> None:
    """`--cpu-placement steer`: worker i takes the connections made on the i-th CPU and
    runs anywhere; `pin`: and runs there only; `off` (the default): the kernel's hash
    (agent.proxy.placement)."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("placement by CPU needs two CPUs")
    a = mesh.pod("client", server=False)
    b = mesh.pod("echo", server=False)
    b.spawn([sys.executable, "-c", ECHO_SERVER])
    mesh.start("--cpu-placement", "steer")
    mesh.wait_ready()
    assert mesh.agent is not None
    anywhere = netlab.allowed_cpus(mesh.agent.pid)
    by_cpu = _serve_by_cpu(mesh, a, b, cpus)
    assert sorted(by_cpu) == cpus[:2]
    assert {netlab.allowed_cpus(pid) for pid in by_cpu.values()} == {anywhere}
    assert mesh.stop() == 0
    mesh.start("--cpu-placement", "pin")
    mesh.wait_ready()
    by_cpu = _serve_by_cpu(mesh, a, b, cpus)
    assert {cpu: netlab.allowed_cpus(pid) for cpu, pid in by_cpu.items()} == {
        cpu: str(cpu) for cpu in cpus[:2]
    }
    assert all(w["pinned"] for w in mesh.dump()["workers"])
    assert mesh.stop() == 0
    mesh.start()
    mesh.wait_ready()
    workers = mesh.dump()["workers"]
    assert [w["cpu"] for w in workers] == [None, None]
    assert mesh.agent is not None
    assert {netlab.allowed_cpus(w["pid"]) for w in workers} == {netlab.allowed_cpus(mesh.agent.pid)}
    _echo_hello(a, b.ip).close()  # still served (it checks the echo), by hash


ECHO_SERVER_DENY = """\
apiVersion: policy.linkerd.io/v1beta3
kind: Server
metadata: {name: echo-raw, namespace: shop}
spec:
  podSelector: {matchLabels: {app: echo}}
  port: 9000
  proxyProtocol: opaque
  accessPolicy: deny
"""


def _echoed(a, ip: str) -> bool:
    """Whether a connection from pod `a` to `ip`:9000 gets its bytes echoed (False: the
    proxy closed or reset it)."""
    try:
        return _echo_once(a, ip)
    except OSError:
        return False


def test_a_server_on_a_port_the_pod_does_not_declare_is_followed_and_enforced(
    mesh: Mesh,
) -> None:
    """enroll rule 5: the echo pod declares only APP_PORT; a Server selecting its port
    9000 by number denies, and when the Server goes the pod's default allows again."""
    a = mesh.pod("client", server=False)
    b = mesh.pod("echo", server=False)
    b.spawn([sys.executable, "-c", ECHO_SERVER])
    server = mesh.manifests / "server-echo.yaml"
    server.write_text(ECHO_SERVER_DENY)
    mesh.start()
    mesh.wait_ready()
    policy = "shop/echo:9000"

    def followed():
        return mesh.dump()["policies"].get(policy)

    assert not _echoed(a, b.ip)  # the first waits for the answer, and is denied by it
    held = wait_for("the policy of port 9000", followed, timeout=10)
    assert held["meta"] == {"group": "policy.linkerd.io", "kind": "server", "name": "echo-raw"}
    assert held["protocol"] == "opaque"
    # deny: only Linkerd's implicit localhost authorization, no client of another pod
    assert [z["meta"]["name"] for z in held["authorizations"]] == ["localhost"]
    assert not _echoed(a, b.ip)
    streams = {s["target"] for s in mesh.dump()["streams"] if s["kind"] == "policy"}
    assert str(PolicyKey("shop", "echo", 9000)) in streams, streams
    server.unlink()  # the control plane's folder watch sees it go: the default applies
    wait_for("port 9000 allowed again", lambda: _echoed(a, b.ip) or None, timeout=15)
    assert mesh.stop() == 0


def _echo_once(a, ip: str) -> bool:
    from agent.redirect import netns  # noqa: PLC0415

    with netns.socket_in(a.netns) as sock:
        sock.settimeout(2)
        sock.connect((ip, 9000))
        sock.sendall(b"new")
        return sock.recv(16) == b"new"


@contextlib.contextmanager
def ebpf_agent(mesh: Mesh, name: str, *, accel: bool = False, pair: bool = True):
    """The mesh's agent in eBPF mode on a pin root of its own (accelerated if `accel`,
    opaque relays paired unless not `pair`), yielding the pin root; whatever it leaves
    pinned is uninstalled, also on failure."""
    pin_root = Path(f"/sys/fs/bpf/meshagent-test-{name}-{os.getpid()}")
    env = {"MESHAGENT_BPF_PIN_ROOT": str(pin_root)}
    if accel:
        env["MESHAGENT_EBPF_ACCEL"] = "1"
    if not pair:
        env["MESHAGENT_EBPF_PAIR"] = "0"
    try:
        mesh.start("--redirect", "ebpf", env=env)
        mesh.wait_ready()
        yield pin_root
    finally:
        mesh.stop(signal.SIGKILL)
        if pin_root.exists():
            from agent.redirect.ebpf import EbpfRedirector  # noqa: PLC0415

            EbpfRedirector(pin_root=pin_root, accelerate=False).uninstall()


def test_ebpf_mode_carries_http_through_the_mesh_and_leaves_no_pin(mesh: Mesh) -> None:
    """`--redirect ebpf`: connect4 + getsockopt outbound, sk_lookup inbound, no iptables."""
    a = mesh.pod("client")
    b = mesh.pod("web")
    outsider = mesh.pod("outsider", manifest=False, server=False)  # not meshed
    (mesh.manifests / "svc.yaml").write_text(service_yaml("web"))
    with ebpf_agent(mesh, "sup") as pin_root:
        assert mesh.enrolled() == {"shop/client", "shop/web"}
        assert {p.name for p in (pin_root / "pods").iterdir()} == {"shop_client", "shop_web"}
        assert {p.name for p in (pin_root / "pods" / "shop_web").iterdir()} >= {
            "connect4",
            "sockops",
            "sk_lookup",
        }
        for lp in (a, b):
            assert "PROXY_INIT" not in nat_rules(lp)  # inbound is sk_lookup, not the fallback
        # The ClusterIP routes nowhere in the lab: only a worker that learnt the
        # original destination (eBPF map via getsockopt) can resolve and answer it.
        assert curl(a, "http://10.96.0.20:80/") == "200"
        assert curl(a, f"http://{b.ip}:{APP_PORT}/") == "200"
        # Inbound from an unmeshed pod: sk_lookup hands it to web's inbound
        # listener, whose worker forwards to web's pod IP from web's netns, as in
        # iptables mode; sk_lookup passes pod-to-itself, so it does not loop back.
        assert curl(outsider, f"http://{b.ip}:{APP_PORT}/?inbound") == "200"
        seen = [ln for ln in mesh.servers["web"].read_text().splitlines() if "GET /?inbound" in ln]
        assert [ln.split()[0] for ln in seen] == [b.ip]
        # sk_lookup picks web's inbound listener, the kernel one socket of its SO_REUSEPORT
        # group: kept connections land on both workers (all 16 on one: p ~ 3e-5).
        workers = {w["pid"] for w in mesh.dump()["workers"]}
        assert _inbound_owners(outsider, b, 16) == workers
        dump = mesh.dump()
        assert dump["mode"] == "ebpf"
        assert dump["destinations"]["10.96.0.20:80"]["endpoints"] == [f"{b.ip}:{APP_PORT}"]
        _, metrics = mesh.admin("/metrics")
        assert b'meshagent_enrolled_pods{mode="ebpf"} 2' in metrics
        assert mesh.stop() == 0
        assert not pin_root.exists()  # --cleanup-on-exit uninstalls programs, maps, links


SINK_PORT = 9300


# A server in the web pod for one connection. "sink": reads to the end, answers the sha256
# and length of what it read. "echo": sends back what it reads until EOF. "source
# SECONDS": reads one short request, then writes 64 KiB pieces of a pattern for SECONDS
# and closes; prints the sha256 and length of them.
SERVE = """
import hashlib, socket, sys, time
ls = socket.socket()
ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
ls.bind(("0.0.0.0", int(sys.argv[1])))
ls.listen(1)
print("ready", flush=True)
s, _ = ls.accept()
h, n = hashlib.sha256(), 0
if sys.argv[2] == "sink":
    while part := s.recv(1 << 16):
        h.update(part)
        n += len(part)
    s.sendall(f"{h.hexdigest()} {n}".encode())
elif sys.argv[2] == "echo":
    while part := s.recv(1 << 16):
        s.sendall(part)
else:
    assert s.recv(64) == b"GET\\n"
    piece = bytes(i % 251 for i in range(65536 + 7))
    end = time.monotonic() + float(sys.argv[3])
    while time.monotonic() < end:
        s.sendall(piece)
        h.update(piece)
        n += len(piece)
s.close()
print(h.hexdigest(), n, flush=True)
"""


def _serve(pod, *how: str, port: int = SINK_PORT) -> subprocess.Popen[str]:
    """`SERVE` in `pod` on `port`, once it listens."""
    proc = pod.spawn(
        [sys.executable, "-c", SERVE, str(port), *how],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
    return proc


# The client: writes 64 KiB pieces of a pattern for SECONDS, then the sha256 it sent and
# what the sink answered.
UPLOAD = """
import hashlib, socket, sys, time
s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=20)
piece = bytes(i % 251 for i in range(65536 + 7))
h, n, end = hashlib.sha256(), 0, time.monotonic() + float(sys.argv[3])
while time.monotonic() < end:
    s.sendall(piece)
    h.update(piece)
    n += len(piece)
s.shutdown(socket.SHUT_WR)
answer = b""
while part := s.recv(256):
    answer += part
print(f"{h.hexdigest()} {n}", answer.decode(), sep="|")
"""


def _upload(a, b) -> None:
    """`UPLOAD` from pod `a` to a sink in pod `b` for 2 s: the sink read all of it, in
    order, and it was more than 8 MiB."""
    _serve(b, "sink")
    out = a.run([sys.executable, "-c", UPLOAD, b.ip, str(SINK_PORT), "2"], check=False, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    sent, answered = out.stdout.strip().split("|")
    assert answered == sent
    assert int(sent.split()[1]) > 8 << 20


def test_ebpf_acceleration_returns_bulk_senders_to_plain_tcp_mid_stream(mesh: Mesh) -> None:
    """MESHAGENT_EBPF_ACCEL=1, the paired relay off (as for HTTP, which is never paired):
    a 2 s upload through both proxies. Its two senders inside pods (the client app's end,
    the proxy's end towards the sink) switch off at their first big write; the agent's
    sweep takes both out of the sockhash while the stream runs, since neither peer had
    sent, and the sink still receives every byte in order."""
    from agent.redirect import maps, sockqueue  # noqa: PLC0415 - bcc-free, only here

    a = mesh.pod("client", server=False)
    b = mesh.pod("web")
    with ebpf_agent(mesh, "sweep-up", accel=True, pair=False) as pin_root:
        _upload(a, b)
        stats = maps.accel_stats(pin_root / "maps")
        assert stats["off_size"] >= 2
        # the senders, then (where FIONREAD counts the sockmap queue) the readers, whose
        # peers left the sockhash and whose queues were read empty
        want = 4 if sockqueue.supported() else 2
        assert stats["returned"] == want, (stats, mesh.agent_log()[-3000:])
        assert mesh.stop() == 0


# The client: a short request, then reads to the end; the sha256 and length of it.
DOWNLOAD = """
import hashlib, socket, sys
s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=20)
s.sendall(b"GET\\n")
h, n = hashlib.sha256(), 0
while part := s.recv(1 << 16):
    h.update(part)
    n += len(part)
print(h.hexdigest(), n)
"""


def test_ebpf_acceleration_returns_a_downloads_ends_once_their_queues_are_read(
    mesh: Mesh,
) -> None:
    """The paired relay off: a request, then a 2 s download: every end redirected its
    first bytes (the request both ways, the first piece of the answer), so the sweep
    takes an end out only when FIONREAD on a copy of its socket says its queue of
    redirected bytes is empty. The download's senders go back to plain TCP mid-stream,
    and every byte arrives in order."""
    from agent.redirect import maps, sockqueue  # noqa: PLC0415 - bcc-free, only here

    if not sockqueue.supported():
        pytest.skip("this kernel's FIONREAD counts TCP's queue only")
    a = mesh.pod("client", server=False)
    b = mesh.pod("web")
    with ebpf_agent(mesh, "sweep-down", accel=True, pair=False) as pin_root:
        source = _serve(b, "source", "2")
        out = a.run([sys.executable, "-c", DOWNLOAD, b.ip, str(SINK_PORT)], check=False, timeout=60)
        assert out.returncode == 0, out.stderr[-2000:]
        wrote, _ = source.communicate(timeout=20)
        assert out.stdout.strip() == wrote.strip()
        assert int(wrote.split()[1]) > 8 << 20
        stats = maps.accel_stats(pin_root / "maps")
        assert stats["redirected_msgs"] >= 2  # the request, on both accelerated hops
        assert stats["returned"] >= 2, (stats, mesh.agent_log()[-3000:])
        assert mesh.stop() == 0


# The client. "rr N": N exchanges of one 64-byte message each, every answer checked.
# "stream BYTES": writes BYTES of a seeded random pattern in chunks of 1-3000 bytes while
# reading the echo, without waiting for it; checks that the echo is the same stream.
ECHO_CLIENT = """
import random, selectors, socket, sys
s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=20)
if sys.argv[3] == "rr":
    for i in range(int(sys.argv[4])):
        msg = i.to_bytes(4, "big") * 16
        s.sendall(msg)
        got = b""
        while len(got) < len(msg):
            part = s.recv(64 - len(got))
            assert part, f"EOF after {i} exchanges"
            got += part
        assert got == msg, (i, got)
    s.shutdown(socket.SHUT_WR)
    assert s.recv(1) == b""
    print("ok")
    sys.exit(0)
rnd = random.Random(7)
total = int(sys.argv[4])
data = rnd.randbytes(total)
s.setblocking(False)
sel = selectors.DefaultSelector()
sel.register(s, selectors.EVENT_READ | selectors.EVENT_WRITE)
sent, back = 0, bytearray()
while True:
    for _, ev in sel.select(10):
        if ev & selectors.EVENT_WRITE:
            try:
                sent += s.send(data[sent : sent + rnd.randint(1, 3000)])
            except BlockingIOError:
                pass
            if sent == total:
                s.shutdown(socket.SHUT_WR)
                sel.modify(s, selectors.EVENT_READ)
        if ev & selectors.EVENT_READ:
            try:
                part = s.recv(1 << 16)
            except BlockingIOError:
                continue
            if not part:
                assert bytes(back) == data, f"echo differs: {len(back)} of {total} bytes"
                print("ok")
                sys.exit(0)
            back += part
"""
ECHO_PORT = 9400


def _tcp_bytes(metrics: bytes) -> int:
    """Sum of the agent's tcp_read_bytes_total and tcp_write_bytes_total samples."""
    total = 0
    for line in metrics.decode().splitlines():
        if line.startswith(("tcp_read_bytes_total{", "tcp_write_bytes_total{")):
            total += int(float(line.rsplit(" ", 1)[1]))
    return total


def test_ebpf_acceleration_pairs_an_opaque_relay_past_the_worker(mesh: Mesh) -> None:
    """MESHAGENT_EBPF_ACCEL=1, a same-node opaque connection of 300 exchanges: once the
    worker has forwarded the first message each way, sk_msg sends the app ends' messages
    straight out of the worker's socket on the other leg (agent.proxy.pairing). Every
    answer arrives intact, and the connection's byte metrics still count every byte."""
    from agent.redirect import maps  # noqa: PLC0415 - bcc-free, only here

    a = mesh.pod("client", server=False)
    b = mesh.pod("web")
    with ebpf_agent(mesh, "pair-rr", accel=True) as pin_root:
        server = _serve(b, "echo", port=ECHO_PORT)
        out = a.run(
            [sys.executable, "-c", ECHO_CLIENT, b.ip, str(ECHO_PORT), "rr", "300"],
            check=False,
            timeout=60,
        )
        assert out.stdout.strip() == "ok", out.stderr[-2000:]
        server.wait(timeout=10)
        stats = maps.accel_stats(pin_root / "maps")
        # 600 messages. The first each way went through the worker, and so does a reply
        # that comes before the worker, having written the last one, has said so: nearly
        # never, unless the machine is busy
        assert stats["paired_msgs"] >= 540, stats
        want = 2 * 300 * 64  # read from the client and written to it, the whole stream
        deadline = time.monotonic() + 10
        while _tcp_bytes(mesh.admin("/metrics")[1]) < want and time.monotonic() < deadline:
            time.sleep(0.2)  # the workers report every few seconds
        assert _tcp_bytes(mesh.admin("/metrics")[1]) == want
        assert mesh.stop() == 0


def test_ebpf_acceleration_pairs_an_upload_of_big_writes_and_loses_nothing(mesh: Mesh) -> None:
    """A 2 s upload in 64 KiB writes with the paired relay: the client's end goes direct
    once the worker has forwarded what came first, its writes leave through the worker's
    socket towards the sink at TCP's pace, and the sink reads every byte in order."""
    from agent.redirect import maps  # noqa: PLC0415 - bcc-free, only here

    a = mesh.pod("client", server=False)
    b = mesh.pod("web")
    with ebpf_agent(mesh, "pair-up", accel=True) as pin_root:
        _upload(a, b)
        assert maps.accel_stats(pin_root / "maps")["paired_msgs"] > 0
        assert mesh.stop() == 0


def test_ebpf_acceleration_pairs_a_stream_mid_way_and_keeps_its_order(mesh: Mesh) -> None:
    """A 4 MiB stream echoed back while it is written, in chunks of 1-3000 bytes: both app
    ends go direct once the worker catches up with them mid-stream (the bytes before went
    through the worker), and the echo is the same stream, byte for byte."""
    from agent.redirect import maps  # noqa: PLC0415 - bcc-free, only here

    a = mesh.pod("client", server=False)
    b = mesh.pod("web")
    with ebpf_agent(mesh, "pair-stream", accel=True) as pin_root:
        server = _serve(b, "echo", port=ECHO_PORT)
        out = a.run(
            [sys.executable, "-c", ECHO_CLIENT, b.ip, str(ECHO_PORT), "stream", str(4 << 20)],
            check=False,
            timeout=120,
        )
        assert out.stdout.strip() == "ok", out.stderr[-2000:]
        server.wait(timeout=10)
        stats = maps.accel_stats(pin_root / "maps")
        assert stats["paired_msgs"] > 0, stats  # direct from some point on ...
        assert stats["redirected_msgs"] + stats["passed_msgs"] > 2, stats  # ... not the first
        assert mesh.stop() == 0


# The client for a live connection: 20 exchanges, "paired", then one exchange per line
# read from stdin, answering "echoed" or "cut" (the proxy closed or reset the connection).
LIVE_CLIENT = """
import socket, sys
s = socket.create_connection((sys.argv[1], 9000), timeout=5)
def exchange():
    try:
        s.sendall(b"ping" * 16)
        got = b""
        while len(got) < 64:
            part = s.recv(64 - len(got))
            if not part:
                return "cut"
            got += part
        return "echoed"
    except OSError:
        return "cut"
for _ in range(20):
    assert exchange() == "echoed"
print("paired", flush=True)
for _ in sys.stdin:
    print(exchange(), flush=True)
"""


def test_a_paired_connection_is_still_cut_when_its_policy_stops_allowing_it(
    mesh: Mesh,
) -> None:
    """agent.proxy.plane rule 3 with the paired relay: the worker is out of the data path
    of a live opaque connection, yet when a Server starts denying its port the worker's
    re-check still closes it, and the app's next message finds it cut."""
    from agent.redirect import maps  # noqa: PLC0415 - bcc-free, only here

    a = mesh.pod("client", server=False)
    b = mesh.pod("echo", server=False)
    b.spawn([sys.executable, "-c", ECHO_SERVER])
    with ebpf_agent(mesh, "pair-deny", accel=True) as pin_root:
        wait_for("echo", lambda: _echoed_in_pod(a, b.ip) or None, timeout=10)
        with _client(a, "paired", LIVE_CLIENT, b.ip) as client:
            before = maps.accel_stats(pin_root / "maps")["paired_msgs"]
            assert _line(client) == "echoed"
            assert maps.accel_stats(pin_root / "maps")["paired_msgs"] == before + 2
            (mesh.manifests / "server-echo.yaml").write_text(ECHO_SERVER_DENY)
            wait_for(
                "the paired connection cut",
                lambda: _line(client) == "cut" or None,
                timeout=15,
                interval=0.2,
            )
        assert mesh.stop() == 0


@contextlib.contextmanager
def _client(pod, first: str, code: str, *args: str):
    """A Python client `code` in `pod`, yielded once it printed `first`; killed at the end
    unless it exited."""
    proc = pod.spawn(
        [sys.executable, "-c", code, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline().strip() == first, proc.stderr.read()
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _line(client) -> str:
    """Send `client` an empty line; its answer."""
    client.stdin.write("\n")
    client.stdin.flush()
    return client.stdout.readline().strip()


def _echoed_in_pod(a, ip: str) -> bool:
    """One exchange with the echo server from a process in pod `a` (captured in eBPF mode,
    whose programs are attached to the pod's cgroup)."""
    code = (
        "import socket,sys;s=socket.create_connection((sys.argv[1],9000),timeout=3);"
        "s.sendall(b'hi');print(s.recv(8)==b'hi')"
    )
    return a.run([sys.executable, "-c", code, ip], check=False, timeout=10).stdout.strip() == "True"


# The client for two live connections, to `ECHO_PORT` and the port after it: 5 exchanges
# on each, "open", then both stay open until a line comes on stdin.
TWO_CLIENT = """
import socket, sys
conns = [socket.create_connection((sys.argv[1], int(p)), timeout=5) for p in sys.argv[2:]]
for s in conns:
    for _ in range(5):
        s.sendall(b"x" * 64)
        got = b""
        while len(got) < 64:
            got += s.recv(64 - len(got))
print("open", flush=True)
sys.stdin.readline()
"""


def test_only_connections_whose_app_ends_are_accelerated_are_paired(mesh: Mesh) -> None:
    """pairing rule 6: the namespace keeps ECHO_PORT + 1 out of acceleration
    (skip-accel-ports), so sockops records neither app end of a connection to it and its
    worker writes no `ma_pair_ctl` entry for it; the connection to ECHO_PORT, open at
    the same time, has its two."""
    from agent.redirect import maps  # noqa: PLC0415 - bcc-free, only here

    skipped = ECHO_PORT + 1
    (mesh.manifests / "ns.yaml").write_text(
        NAMESPACE.replace(
            "{linkerd.io/inject: enabled}",
            f'{{linkerd.io/inject: enabled, config.meshagent.io/skip-accel-ports: "{skipped}"}}',
        )
    )
    a = mesh.pod("client", server=False)
    b = mesh.pod("web")
    with ebpf_agent(mesh, "pair-skip", accel=True) as pin_root:
        for port in (ECHO_PORT, skipped):
            _serve(b, "echo", port=port)
        with _client(a, "open", TWO_CLIENT, b.ip, str(ECHO_PORT), str(skipped)) as client:
            with maps.PinnedMap.open(pin_root / "maps", maps.PAIR_CTL) as ctl:
                keys = ctl.key_list()
            # A's end (to the outbound listener) and B's end (on the port it serves)
            assert len(keys) == 2, [(k.local_port, k.remote_port) for k in keys]
            assert ECHO_PORT in {k.local_port for k in keys}
            assert skipped not in {k.local_port for k in keys} | {k.remote_port for k in keys}
            assert _line(client) == ""  # it exits: both connections close
            assert client.wait(timeout=10) == 0
        assert mesh.stop() == 0
