"""`meshagent sandbox up --detach --nodes 2` on the bundled examples, probed from inside pods.

One `up` per redirect mode (module-scoped fixture); `down` in the finalizer,
then the machine is compared with how it was before.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.privileged

REPO = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "agent"]


def _meshagent(*args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, *args], capture_output=True, text=True, timeout=timeout, check=False, cwd=REPO
    )


def _machine() -> dict[str, object]:
    """What the sandbox may touch, read from the kernel."""
    from agent.netlab import cgroup2_root  # noqa: PLC0415

    def out(*argv: str) -> str:
        return subprocess.run(argv, capture_output=True, text=True, check=False).stdout

    root = cgroup2_root()
    cg = (
        sorted(p.name for p in (root / "meshagent").iterdir())
        if root and (root / "meshagent").is_dir()
        else []
    )
    return {
        "netns": sorted(n for n in out("ip", "netns", "list").split() if n.startswith("sb-")),
        "links": sorted(
            line.split(":")[1].strip()
            for line in out("ip", "-o", "link").splitlines()
            if ": sb" in line
        ),
        "routes": out("ip", "-4", "route").count("100.127."),
        "cgroups": [c for c in cg if c.startswith("sb-")],
        "procs": sorted(
            p.name for p in Path("/proc").iterdir()
            if p.name.isdigit() and b"/run/meshagent/sandbox" in _read(p / "cmdline")
        ),
        "etc_netns": (
            sorted(p.name for p in Path("/etc/netns").glob("sb-*"))
            if Path("/etc/netns").is_dir()
            else []
        ),
        "bpf_pins": sorted(p.name for p in Path("/sys/fs/bpf").glob("meshagent-sandbox*")),
    }  # fmt: skip


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError:
        return b""


@pytest.fixture(scope="module", params=["iptables", "ebpf"])
def sandbox(request):
    if os.geteuid() != 0:
        pytest.skip("the sandbox needs root")
    before = _machine()
    proc = _meshagent("sandbox", "up", "--detach", "--nodes", "2", "--redirect", request.param)
    try:
        assert proc.returncode == 0, proc.stdout + proc.stderr
        status = json.loads(_meshagent("sandbox", "status", "-o", "json").stdout)
        status["up_output"] = proc.stdout
        assert len(status["agents"]) == 2, status  # one `meshagent run` per node, always
        status["asked"] = request.param
        yield status
    finally:
        down = _meshagent("sandbox", "down")
        after = _machine()
        assert down.returncode == 0, down.stdout + down.stderr
        assert after == before


def _pod(status, workload: str, index: int = 0):
    pods = sorted(
        (p for p in status["pods"] if p["name"].rsplit("-", 2)[0] == workload),
        key=lambda p: p["name"],
    )
    return pods[index]


def _in_pod(pod, *argv: str, input_: bytes | None = None) -> subprocess.CompletedProcess[bytes]:
    """Run argv in the pod's netns (`ip netns exec`, so its /etc/hosts applies) and cgroup."""
    state = json.loads(Path("/run/meshagent/sandbox/state.json").read_text())
    cgroup = next(p["cgroup"] for p in state["pods"] if p["netns"] == pod["netns"])

    def enter() -> None:
        Path(cgroup, "cgroup.procs").write_text(str(os.getpid()))

    return subprocess.run(
        ["ip", "netns", "exec", pod["netns"], *argv],
        input=input_, capture_output=True, timeout=30, check=False, preexec_fn=enter,
    )  # fmt: skip


def _curl(pod, url: str) -> tuple[int, dict]:
    out = _in_pod(pod, "curl", "-s", "-m", "5", "-w", "\n%{http_code}", url).stdout.decode()
    body, _, code = out.rpartition("\n")
    try:
        return int(code), json.loads(body) if body.strip().startswith("{") else {}
    except ValueError:
        return 0, {}


def test_every_pod_is_ready_with_an_ip_on_its_node(sandbox):
    assert sandbox["up"]
    assert len(sandbox["pods"]) == 7
    assert all(p["ready"] for p in sandbox["pods"])
    assert {p["node"] for p in sandbox["pods"]} == {"node-1", "node-2"}


def test_agents_report_ready_at_admin_urls_reachable_from_the_host(sandbox):
    assert [a["ready"] for a in sandbox["agents"]] == [True, True]


def test_echo_answers_as_the_pod_it_runs_in(sandbox):
    curl = _pod(sandbox, "curl")
    for api in (_pod(sandbox, "api", 0), _pod(sandbox, "api", 1)):
        res = _in_pod(curl, "curl", "-s", "-m", "5", f"http://{api['ip']}:8080/hello")
        if res.stdout.startswith(b"{"):
            assert json.loads(res.stdout)["pod"] == api["name"]


def test_service_names_resolve_inside_pods(sandbox):
    res = _in_pod(_pod(sandbox, "web"), "getent", "hosts", "api.shop.svc.cluster.local")
    assert res.returncode == 0
    assert res.stdout.split()[0].decode().startswith("10.96.")


def test_unmeshed_pod_reaches_a_service_through_kube_proxy(sandbox):
    curl = _pod(sandbox, "curl")
    code, body = _curl(curl, "http://web.shop.svc.cluster.local:8080/x")
    if sandbox["agents"]:
        assert code in (200, 403)  # web has the default (all-unauthenticated) policy
    else:
        assert (code, body["pod"]) == (200, _pod(sandbox, "web")["name"])


def test_unmeshed_pod_is_refused_by_api(sandbox):
    code, _ = _curl(_pod(sandbox, "curl"), "http://api.shop.svc.cluster.local:8080/x")
    assert code == 403


def test_web_reaches_api_over_mtls_and_echo_sees_webs_identity(sandbox):
    seen = set()
    for _ in range(8):
        code, body = _curl(_pod(sandbox, "web"), "http://api.shop.svc.cluster.local:8080/x")
        assert code == 200
        assert body["client_id"] == "web.shop.serviceaccount.identity.linkerd.cluster.local"
        seen.add(body["pod"])
    assert len(seen) == 2  # same-node and cross-node replicas both served


def test_load_is_denied_by_api_policy(sandbox):
    code, _ = _curl(_pod(sandbox, "load"), "http://api.shop.svc.cluster.local:8080/x")
    assert code == 403


def test_timeout_route_answers_504_in_time(sandbox):
    out = _in_pod(
        _pod(sandbox, "web"),
        "curl", "-s", "-m", "5", "-o", "/dev/null", "-w", "%{http_code} %{time_total}",
        "http://api.shop.svc.cluster.local:8080/slow/1?delay=2000",
    )  # fmt: skip
    code, took = out.stdout.decode().split()
    assert code == "504"
    assert float(took) < 1.5


def test_opaque_port_echoes_one_mebibyte_byte_exact(sandbox):
    payload = os.urandom(1 << 20)
    db_ip = "db.shop.svc.cluster.local"
    # Send from a thread, half-close after the last byte, read the echo until EOF
    # (issue 4: the mesh keeps the client's read side open after its FIN).
    script = (
        "import socket,sys,threading;d=sys.stdin.buffer.read()\n"
        "s=socket.create_connection((sys.argv[1],5432),5)\n"
        "def send(): s.sendall(d); s.shutdown(socket.SHUT_WR)\n"
        "threading.Thread(target=send,daemon=True).start();b=bytearray()\n"
        "while c:=s.recv(65536): b+=c\n"
        "sys.stdout.buffer.write(b)"
    )
    db = _pod(sandbox, "db")
    clients = [p for p in sandbox["pods"] if p["meshed"] and p["name"] != db["name"]]
    # same node (no TLS, same-node path) and cross node (mTLS, inbound TLS termination)
    assert {p["node"] == db["node"] for p in clients} == {True, False}
    for client in clients:
        res = _in_pod(client, sys.executable, "-c", script, db_ip, input_=payload)
        assert res.stdout == payload, (client["name"], res.stderr)
    res = _in_pod(_pod(sandbox, "curl"), sys.executable, "-c", script, db_ip, input_=payload)
    if not sandbox["agents"]:  # unmeshed to a meshed opaque port: with agents, policy decides
        assert res.stdout == payload, res.stderr


def test_an_opaque_upstream_that_resets_reaches_clients_as_a_reset(sandbox):
    """tcp relay rule 9 on both paths: same node, and cross node where the inbound's
    reset crosses the mTLS hop."""
    from agent.sandbox.app import RESET_MARK  # noqa: PLC0415

    script = (
        "import socket,sys\n"
        "s=socket.create_connection((sys.argv[1],5432),5);s.sendall(sys.stdin.buffer.read())\n"
        "b=b''\n"
        "try:\n"
        "    while c:=s.recv(65536): b+=c\n"
        "    print('eof',len(b))\n"
        "except ConnectionResetError: print('reset',len(b))"
    )
    sent = RESET_MARK + b"x" * 1000
    db = _pod(sandbox, "db")
    clients = [p for p in sandbox["pods"] if p["meshed"] and p["name"] != db["name"]]
    assert {p["node"] == db["node"] for p in clients} == {True, False}
    for client in clients:
        res = _in_pod(
            client, sys.executable, "-c", script, "db.shop.svc.cluster.local", input_=sent
        )
        how, _, got = res.stdout.decode().partition(" ")
        assert how == "reset", (client["name"], res.stdout, res.stderr)
        assert 0 <= int(got) <= len(sent)


def test_failing_replica_is_hidden_by_retries(sandbox):
    bad = _pod(sandbox, "api", 0)["name"]
    for i in range(10):
        code, body = _curl(
            _pod(sandbox, "web"), f"http://api.shop.svc.cluster.local:8080/retry/{i}?fail_pod={bad}"
        )
        assert code == 200
        assert body["pod"] != bad


def test_echo_status_path_returns_that_status(sandbox):
    code, _ = _curl(_pod(sandbox, "curl"), f"http://{_pod(sandbox, 'web')['ip']}:8080/status/418")
    assert code in (418, 403)  # 403 if the agent's policy refuses the unmeshed client


def test_agents_capture_in_the_requested_mode(sandbox):
    assert sandbox["redirect"] == sandbox["asked"]
    for agent in sandbox["agents"]:
        dump = json.loads(
            urllib.request.urlopen(f"{agent['admin_url']}/config_dump", timeout=5).read()
        )
        assert dump["mode"] == sandbox["asked"]
        assert dump["pods"]  # every node serves meshed pods
    pins = sorted(p.name for p in Path("/sys/fs/bpf").glob("meshagent-sandbox*"))
    assert pins == (
        ["meshagent-sandbox-node-1", "meshagent-sandbox-node-2"]
        if sandbox["asked"] == "ebpf"
        else []
    )


def test_tap_from_the_host_streams_a_sandbox_pods_requests(sandbox):
    """`/tap` answers loopback callers only; the client dials a sandbox agent from
    inside its node netns, so `meshagent tap` on the host works (no 403)."""
    web = _pod(sandbox, "web")
    key = f"{web['namespace']}/{web['name']}"
    tap = subprocess.Popen(
        [*CLI, "tap", key, "--path", "/tapped", "--max", "3", "-o", "json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while tap.poll() is None and time.monotonic() < deadline:
            _curl(web, "http://api.shop.svc.cluster.local:8080/tapped")
            time.sleep(0.2)
        out, err = tap.communicate(timeout=5)
    finally:
        if tap.poll() is None:
            tap.kill()
            tap.communicate()
    assert tap.returncode == 0, err
    events = [json.loads(line) for line in out.splitlines()]
    assert len(events) == 3
    assert all(e["pod"] == key and e["direction"] == "outbound" for e in events)
    assert all(e["path"] == "/tapped" and e["status"] == 200 for e in events)


def test_log_level_put_reaches_sandbox_agents_only_through_their_netns(sandbox):
    from agent.admin import client  # noqa: PLC0415

    for agent in sandbox["agents"]:
        url = agent["admin_url"]
        put = urllib.request.Request(f"{url}/proxy-log-level", data=b"info", method="PUT")
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(put, timeout=5)  # from the host: not a loopback caller
        refused.value.close()
        assert refused.value.code == 403
        assert client.sandbox_netns(url) is not None
        before = urllib.request.urlopen(f"{url}/proxy-log-level", timeout=5).read().decode()
        try:
            client.put_log_level(url, "agent.proxy=debug,warning")  # raises unless accepted
            now = urllib.request.urlopen(f"{url}/proxy-log-level", timeout=5).read().decode()
            assert now.strip() == "agent.proxy=debug,warning"
        finally:
            client.put_log_level(url, before.strip())


def test_up_prints_progress_and_hints_that_work(sandbox):
    out = sandbox["up_output"]
    for line in ("preflight: ok", "control plane: starting", "apps: 7 started", "pods: 7 ready"):
        assert line in out
    assert "meshagent sandbox view" in out
    if sandbox["agents"]:
        assert "meshagent redirects list" in out
        assert "meshagent stat" in out
        for agent in sandbox["agents"]:
            assert f"curl {agent['admin_url']}/metrics" in out
    hinted = next(
        ln.split() for ln in out.splitlines() if ln.strip().startswith("meshagent sandbox exec")
    )
    assert hinted[4:7] == ["--", "curl", "-s"], hinted
    res = _meshagent(
        "sandbox",
        "exec",
        hinted[3],
        "--",
        "curl",
        "-s",
        "-o",
        "/dev/null",
        "-w",
        "%{http_code}",
        hinted[7],
        timeout=30,
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout in ("200", "403"), res  # an answer through the mesh (policy decides)


def test_sandbox_exec_runs_in_the_pods_cgroup_so_ebpf_capture_applies(sandbox):
    """web -> api through `sandbox exec`: the mesh answers with web's identity in every mode."""
    web = _pod(sandbox, "web")
    res = _meshagent(
        "sandbox",
        "exec",
        f"shop/{web['name']}",
        "--",
        "curl",
        "-s",
        "http://api.shop.svc.cluster.local:8080/exec",
        timeout=30,
    )
    assert res.returncode == 0, res.stderr
    body = json.loads(res.stdout)
    if sandbox["agents"]:
        assert body["client_id"] == "web.shop.serviceaccount.identity.linkerd.cluster.local"
    assert body["path"] == "/exec"


def test_view_runs_on_the_running_sandbox_and_leaves_it_up(sandbox):
    res = _meshagent("sandbox", "view", "--duration", "4.5", timeout=60)
    assert res.returncode == 0, res.stderr
    assert "meshagent sandbox" in res.stdout
    assert "rps" in res.stdout.lower()  # the client table has rows with rates
    status = json.loads(_meshagent("sandbox", "status", "-o", "json").stdout)
    assert status["up"]
    state = json.loads(Path("/run/meshagent/sandbox/state.json").read_text())
    assert not [p for p in state["procs"] if p["role"] == "driver"]  # drivers stopped


def test_up_refuses_a_taken_port_with_a_hint():
    """Preflight: 8086 held by another process (or by a running sandbox) is an error with a fix."""
    from agent.sandbox import run  # noqa: PLC0415

    holder = socket.socket()
    try:
        holder.bind(("127.0.0.1", 8086))
        holder.listen()
    except OSError:
        pass  # already held (a running sandbox's control plane): taken either way
    try:
        with pytest.raises(run.SandboxError) as err:
            run.preflight(run.UpOptions(redirect="iptables"))
    finally:
        holder.close()
    assert "port 8086 is taken" in err.value.reason
    assert "ss -ltnp" in err.value.hint


def test_up_as_non_root_says_so_with_a_fix():
    # Parse and import as root (the interpreter's files may be root-only), then drop to nobody.
    code = (
        "import os,sys; from agent import cli; from agent.errors import AgentError; "
        "from agent.sandbox import run; "
        "a = cli.build_parser().parse_args(['sandbox', 'up', '--detach']); "
        "os.setegid(65534); os.seteuid(65534)\n"
        "try: sys.exit(a.handler(a))\n"
        "except AgentError as exc: print(exc, file=sys.stderr); sys.exit(2)"
    )
    res = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
        check=False,
    )
    assert res.returncode != 0
    assert "must run as root" in res.stderr
    assert "sudo" in res.stderr
