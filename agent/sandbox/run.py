"""`meshagent sandbox up|status|down`: the whole mesh on one machine (shell).

`up` builds, in this order, recording each thing in
`/run/meshagent/sandbox/state.json` *before* creating it: the PKI (if
missing), N nodes (isolated network namespaces from `agent.netlab`, linked in
pairs, each with a veth to the host), the cluster plan
(`agent.sandbox.cluster`) written as a generated manifests folder, the pods
(netns + veth + cgroup `.../pod<uid>` + `/etc/netns/<netns>/hosts`),
kube-proxy rules per node, the control plane, one `meshagent run` per node
(inside the node netns, admin reached at the node's host-link address) and one
app per pod. Then it waits for readiness. `--detach` returns; otherwise it drives
traffic and shows the live view (`agent.sandbox.view`) until the duration ends
or Ctrl-C, and then takes everything down.

Rules:
1. `down` works from the state file alone (also after a crash): it kills
   recorded processes only when their start time and command line still match
   what was recorded, releases the agents' netns bind mounts of our pods, then
   removes pod cgroups, /etc/netns entries, host links and finally the lab
   (`Lab.cleanup_recorded`): namespaces, veths, bridges, lab cgroups. Rules and
   BPF programs attached inside the namespaces go with them; the eBPF pin
   roots (one per node agent, `BPF_PIN_BASE-<node>`) are uninstalled first.
2. `up` on a running sandbox whose processes are all alive is a no-op that
   prints its status; a partial or dead one is taken down first.
3. The lab state lives under /run/meshagent/sandbox/lab, not netlab's default
   directory, so other labs' stale-cleanup never takes a detached sandbox.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from agent import config
from agent.errors import AgentError
from agent.netlab import Lab, LabNode, LabPod, _start_time, cgroup2_root
from agent.redirect import netns
from agent.sandbox import cluster, kubeproxy

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

SANDBOX_DIR = Path("/run/meshagent/sandbox")
STATE_FILE = SANDBOX_DIR / "state.json"
LAB_DIR = SANDBOX_DIR / "lab"
PREFIX = "sb"
HOST_LINK_BASE = "100.127"  # 100.127.<n>.0/30 host <-> node n
REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
CONTROLPLANE_PORTS = (config.DESTINATION_PORT, config.IDENTITY_PORT, config.POLICY_PORT)
AGENT_NETNS_DIR = Path("/run/meshagent/netns")
BPF_PIN_BASE = Path("/sys/fs/bpf/meshagent-sandbox")  # + "-<node>"


class SandboxError(AgentError):
    """The sandbox could not be built, inspected or removed; `hint` says how to fix it."""

    def __init__(self, what: str, reason: str, hint: str = "") -> None:
        self.what = what
        self.reason = reason
        self.hint = hint
        super().__init__(f"sandbox: {what}: {reason}" + (f"\n  hint: {hint}" if hint else ""))


@dataclass(frozen=True, slots=True, kw_only=True)
class UpOptions:
    manifests: Path = EXAMPLES
    nodes: int = 2
    redirect: str = "auto"
    duration: float | None = None
    detach: bool = False
    identity_dir: Path | None = None
    ready_timeout: float = 90.0
    agents: bool | None = None  # None: when `meshagent run` exists
    progress: Callable[[str], None] = field(default=lambda _msg: None)


# --- state -------------------------------------------------------------------------


def _load_state() -> dict[str, Any] | None:
    try:
        return dict(json.loads(STATE_FILE.read_text()))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise SandboxError(str(STATE_FILE), f"unreadable: {exc}", "remove it by hand") from exc


class _State:
    """The record `down` works from; saved after every change."""

    def __init__(self, data: dict[str, Any]) -> None:
        self.data = data

    def save(self) -> None:
        SANDBOX_DIR.mkdir(parents=True, exist_ok=True)
        tmp = STATE_FILE.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1))
        tmp.replace(STATE_FILE)

    def add(self, key: str, item: Any) -> None:
        self.data.setdefault(key, []).append(item)
        self.save()


def _cmdline(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    return raw.decode(errors="replace").split("\0")[:-1]


def _ours(rec: dict[str, Any]) -> bool:
    """The recorded process is still running, and is still the one we started."""
    pid = rec["pid"]
    if _start_time(pid) != rec.get("start"):
        return False
    return _cmdline(pid) == rec.get("argv")


# --- preflight -----------------------------------------------------------------------


def preflight(opts: UpOptions) -> str:
    """Check what `up` needs; returns the redirect mode to use.

    Raises:
        SandboxError: not root, a tool or the manifests are missing, a port is taken,
        eBPF asked for but unavailable.
    """
    _need_root()
    for tool in ("ip", "nsenter", "iptables-restore"):
        if shutil.which(tool) is None:
            raise SandboxError(
                "preflight", f"{tool} not found", "apt-get install iproute2 util-linux iptables"
            )
    if not opts.manifests.is_dir():
        raise SandboxError(
            "preflight", f"no manifests folder {opts.manifests}", "pass --manifests DIR"
        )
    if not 1 <= opts.nodes <= 16:
        raise SandboxError("preflight", f"--nodes {opts.nodes}", "use 1 to 16 nodes")
    if cgroup2_root() is None:
        raise SandboxError(
            "preflight", "no cgroup v2 mount", "mount -t cgroup2 none /sys/fs/cgroup/unified"
        )
    for port in CONTROLPLANE_PORTS:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                raise SandboxError(
                    "preflight",
                    f"port {port} is taken (the control plane needs {CONTROLPLANE_PORTS})",
                    f"see who holds it: ss -ltnp 'sport = :{port}'",
                ) from None
    return _redirect_mode(opts.redirect)


def _need_root(verb: str = "up") -> None:
    if os.geteuid() != 0:
        raise SandboxError(
            "preflight",
            "must run as root (it creates namespaces, links, cgroups and capture rules)",
            f"sudo .venv/bin/meshagent sandbox {verb}",
        )


def _redirect_mode(asked: str) -> str:
    if asked == "iptables":
        return asked
    from agent.redirect import check  # noqa: PLC0415 - bcc is slow to import

    ebpf = check.ebpf_checks()
    mode, _reason = check.auto_mode(ebpf)
    if asked == "ebpf" and mode != "ebpf":
        raise ebpf_unavailable(ebpf)
    return mode


def ebpf_unavailable(checks: Sequence[Any] | None) -> SandboxError:
    """The error for `--redirect ebpf` when eBPF checks fail: each failure and its fix."""
    if checks is None:
        return SandboxError(
            "preflight", "eBPF mode is not available in this build", "use --redirect iptables"
        )
    failed = [c for c in checks if not c.ok]
    reason = "; ".join(f"{c.name}: {c.detail}" for c in failed) or "no eBPF checks ran"
    fixes = [c.hint for c in failed if c.hint]
    hint = "; ".join(dict.fromkeys([*fixes, "or use --redirect iptables"]))
    return SandboxError("preflight", f"eBPF redirect unavailable: {reason}", hint)


def agent_available() -> bool:
    """Whether `meshagent run` exists in this checkout."""
    return importlib.util.find_spec("agent.supervisor.core") is not None


def _meshagent() -> list[str]:
    exe = Path(sys.executable).parent / "meshagent"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "agent"]


# --- processes ---------------------------------------------------------------------


def _spawn(  # noqa: PLR0913 - one process, fully described
    state: _State,
    argv: Sequence[str],
    *,
    role: str,
    name: str,
    log: Path,
    netns_argv: Sequence[str] = (),
    cgroup: Path | None = None,
    env: dict[str, str] | None = None,
) -> subprocess.Popen[bytes]:
    full = [*netns_argv, *argv]

    def enter_cgroup() -> None:  # in the child, before exec
        if cgroup is not None:
            (cgroup / "cgroup.procs").write_text(str(os.getpid()))

    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as out:
        proc = subprocess.Popen(
            full,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            preexec_fn=enter_cgroup,  # noqa: PLW1509 - how the child joins the pod's cgroup
            start_new_session=True,
            env={**os.environ, **(env or {})},
            cwd=REPO,
        )
    # nsenter / ip netns exec exec the command: same PID; record the final argv once visible.
    deadline = time.monotonic() + 5
    argv_now = _cmdline(proc.pid)
    while (
        time.monotonic() < deadline and argv_now is not None and argv_now[: len(argv)] != list(argv)
    ):
        time.sleep(0.01)
        argv_now = _cmdline(proc.pid)
    state.add(
        "procs",
        {
            "pid": proc.pid,
            "start": _start_time(proc.pid),
            "argv": argv_now,
            "role": role,
            "name": name,
            "log": str(log),
        },
    )
    return proc


def _kill_recorded(procs: list[dict[str, Any]]) -> list[str]:
    errors = []
    alive = [p for p in procs if _ours(p)]
    for rec in alive:
        with contextlib.suppress(ProcessLookupError):
            os.kill(rec["pid"], 15)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(_ours(p) for p in alive):
        time.sleep(0.05)
    for rec in alive:
        if _ours(rec):
            with contextlib.suppress(ProcessLookupError):
                os.kill(rec["pid"], 9)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(_ours(p) for p in alive):
        time.sleep(0.05)
    errors += [
        f"process {p['pid']} ({p['role']} {p['name']}) did not die" for p in alive if _ours(p)
    ]
    # Reap our own children, if we started them (foreground up).
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass
    return errors


# --- building ----------------------------------------------------------------------


def _ip(*args: str) -> None:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SandboxError(f"ip {' '.join(args)}", proc.stderr.strip())


def _host_link(state: _State, index: int, node: LabNode) -> dict[str, str]:
    base = f"{HOST_LINK_BASE}.{index}"
    link = {
        "host_if": f"{PREFIX}h{index}",
        "host_ip": f"{base}.1",
        "node_ip": f"{base}.2",
        "netns": str(node.netns_name),
    }
    state.add("host_links", link)
    _ip(
        "link",
        "add",
        link["host_if"],
        "type",
        "veth",
        "peer",
        "name",
        "host0",
        "netns",
        link["netns"],
    )
    _ip("addr", "add", f"{link['host_ip']}/30", "dev", link["host_if"])
    _ip("link", "set", link["host_if"], "up")
    _ip("-n", link["netns"], "addr", "add", f"{link['node_ip']}/30", "dev", "host0")
    _ip("-n", link["netns"], "link", "set", "host0", "up")
    _ip("route", "add", str(node.subnet), "via", link["node_ip"])
    return link


def _make_nodes(
    lab: Lab, state: _State, count: int, say: Callable[[str], None]
) -> list[dict[str, Any]]:
    taken = subprocess.run(
        ["ip", "-4", "route"], capture_output=True, text=True, check=False
    ).stdout
    if f"{HOST_LINK_BASE}." in taken:
        raise SandboxError(
            "nodes", f"host routes already use {HOST_LINK_BASE}.0.0/16", "meshagent sandbox down"
        )
    nodes = []
    labnodes = []
    for i in range(1, count + 1):
        node = lab.node(f"node-{i}", isolated=True)
        labnodes.append(node)
        link = _host_link(state, i, node)
        nodes.append(
            {
                "name": node.name,
                "netns": node.netns_name,
                "pod_cidr": str(node.subnet),
                "gateway": node.gateway,
                **link,
            }
        )
        say(
            f"node {node.name}: netns {node.netns_name}, pods {node.subnet}, "
            f"host link {link['node_ip']}"
        )
    for a in range(len(labnodes)):
        for b in range(a + 1, len(labnodes)):
            lab.link(labnodes[a], labnodes[b])
    state.data["nodes"] = nodes
    state.save()
    return nodes


def _write_manifests(source: Path, plan: cluster.ClusterPlan, nodes: dict[str, Any]) -> Path:
    from agent.controlplane import manifests  # noqa: PLC0415

    out = SANDBOX_DIR / "manifests"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    for path in manifests.manifest_files(source):
        try:
            docs = list(yaml.safe_load_all(path.read_text()))
        except (OSError, yaml.YAMLError):
            continue  # the loader already reported it
        target = out / "user" / path.relative_to(source)
        target = target.with_suffix(".yaml")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(yaml.safe_dump_all(cluster.patch_documents(docs, plan), sort_keys=False))
    pods = [cluster.pod_manifest(p, nodes[p.node]["node_ip"]) for p in plan.pods]
    (out / "pods.yaml").write_text(yaml.safe_dump_all(pods, sort_keys=False))
    return out


def _make_pod(lab: Lab, state: _State, plan: cluster.ClusterPlan, pod: cluster.PodPlan) -> LabPod:
    lp = lab.pod(lab.nodes[pod.node], f"{pod.namespace}-{pod.name}", pod.ip)
    if lp.cgroup is not None:
        cg = lp.cgroup / f"pod{pod.uid}"
        state.add("cgroups", str(cg))
        cg.mkdir()
        lp.cgroup = cg
    etc = Path("/etc/netns") / lp.netns_name
    if not etc.parent.exists():
        state.add("etc_netns_root", str(etc.parent))
    state.add("etc_netns", str(etc))
    etc.mkdir(parents=True, exist_ok=True)
    (etc / "hosts").write_text(cluster.hosts_file(plan, pod))
    state.add(
        "pods",
        {
            "namespace": pod.namespace,
            "name": pod.name,
            "uid": pod.uid,
            "node": pod.node,
            "ip": pod.ip,
            "netns": lp.netns_name,
            "cgroup": str(lp.cgroup) if lp.cgroup else "",
            "serviceaccount": pod.service_account,
            "meshed": pod.meshed,
            "ports": [{"port": a.port, "opaque": a.opaque} for a in pod.app_ports],
            "command": pod.command,
        },
    )
    return lp


def _app_argv(pod: cluster.PodPlan) -> list[str]:
    if pod.command:
        return ["sh", "-c", pod.command]
    argv = [
        sys.executable,
        "-m",
        "agent.sandbox.app",
        "--pod",
        pod.name,
        "--namespace",
        pod.namespace,
    ]
    for ap in pod.app_ports:
        argv += ["--tcp" if ap.opaque else "--http", str(ap.port)]
    return argv


def start_app(state: _State, pod: cluster.PodPlan, lp: LabPod) -> None:
    """The pod's application, in its netns (with its /etc/hosts) and cgroup."""
    _spawn(
        state,
        _app_argv(pod),
        role="app",
        name=pod.key,
        log=SANDBOX_DIR / "logs" / f"app-{pod.namespace}-{pod.name}.log",
        netns_argv=["ip", "netns", "exec", lp.netns_name],
        cgroup=lp.cgroup,
        env={
            "POD_NAME": pod.name,
            "POD_NAMESPACE": pod.namespace,
            "POD_IP": pod.ip,
            "NODE_NAME": pod.node,
        },
    )


def _start_controlplane(state: _State, manifests_dir: Path, identity: Path) -> None:
    argv = [
        *_meshagent(),
        "controlplane",
        "--manifests",
        str(manifests_dir),
        "--identity-dir",
        str(identity),
    ]
    _spawn(
        state,
        argv,
        role="controlplane",
        name="controlplane",
        log=SANDBOX_DIR / "logs" / "controlplane.log",
    )
    state.data["controlplane"] = {
        "ports": dict(zip(("destination", "identity", "policy"), CONTROLPLANE_PORTS, strict=True))
    }
    state.save()


def start_agent(
    state: _State, node: dict[str, Any], manifests_dir: Path, identity: Path, mode: str
) -> None:
    """One `meshagent run` for `node`, inside its netns; admin reached at its host-link
    address, bound on 0.0.0.0 there so that `meshagent tap` can also reach it on the
    node netns's loopback (agent.admin.client rule 2); from outside that netns only
    the node's addresses lead to it."""
    host = node["host_ip"]
    admin = f"{node['node_ip']}:{config.ADMIN_PORT}"
    env = {"MESHAGENT_CLEANUP_ON_EXIT": "true"}
    if mode == "ebpf":  # bpffs is one per machine: each node agent pins under its own root
        pins = str(BPF_PIN_BASE.with_name(f"{BPF_PIN_BASE.name}-{node['name']}"))
        state.add("bpf_pins", pins)  # recorded first: `down` uninstalls it even after a crash
        env["MESHAGENT_BPF_PIN_ROOT"] = pins
    argv = [
        *_meshagent(),
        "run",
        "--control-plane", f"{host}:{config.DESTINATION_PORT}",
        "--identity-addr", f"{host}:{config.IDENTITY_PORT}",
        "--policy-addr", f"{host}:{config.POLICY_PORT}",
        "--pods-from", f"manifests:{manifests_dir}",
        "--node", node["name"],
        "--redirect", mode,
        "--admin-addr", f"0.0.0.0:{config.ADMIN_PORT}",
        "--identity-dir", str(identity),
    ]  # fmt: skip
    _spawn(
        state,
        argv,
        role="agent",
        name=node["name"],
        log=SANDBOX_DIR / "logs" / f"agent-{node['name']}.log",
        netns_argv=netns.exec_argv(netns.named_path(node["netns"])),
        env=env,
    )
    node["admin_url"] = f"http://{admin}"
    state.save()


def _ensure_pki(opts: UpOptions, say: Callable[[str], None]) -> Path:
    from agent.identity import ca  # noqa: PLC0415

    if opts.identity_dir is not None:
        return opts.identity_dir
    d = SANDBOX_DIR / "identity"
    if not (d / "issuer.key").exists():
        d.mkdir(parents=True, exist_ok=True)
        ca.create_root(d, force=True)
        ca.create_issuer(d, d, force=True)
        say(f"pki: created trust anchor and issuer in {d}")
    return d


# --- readiness -----------------------------------------------------------------------


def _port_open(ns_path: Path | None, host: str, port: int) -> bool:
    try:
        sock = netns.socket_in(ns_path) if ns_path else socket.socket()
    except OSError:
        return False
    with sock:
        sock.settimeout(0.5)
        try:
            sock.connect((host, port))
        except OSError:
            return False
    return True


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as resp:  # noqa: S310 - our own admin URL
            return bool(resp.status == 200)
    except (OSError, ValueError):
        return False


def app_ready(pod: dict[str, Any]) -> bool:
    """Every app port accepts on the pod's loopback."""
    path = netns.named_path(pod["netns"])
    return all(_port_open(path, "127.0.0.1", p["port"]) for p in pod["ports"])


def _wait(what: str, check: Callable[[], bool], deadline: float, hint: str) -> None:
    while not check():
        if time.monotonic() > deadline:
            raise SandboxError(what, "not ready in time", hint)
        time.sleep(0.2)


def _procs_alive(state: dict[str, Any], role: str) -> list[dict[str, Any]]:
    return [p for p in state.get("procs", []) if p["role"] == role and _ours(p)]


def _wait_ready(state: _State, deadline: float, say: Callable[[str], None]) -> None:
    logs = SANDBOX_DIR / "logs"
    _wait(
        "control plane",
        lambda: all(_port_open(None, "127.0.0.1", p) for p in CONTROLPLANE_PORTS),
        deadline,
        f"see {logs / 'controlplane.log'}",
    )
    say("control plane: serving on :8086 (destination), :8080 (identity), :8090 (policy)")
    for node in state.data["nodes"]:
        if url := node.get("admin_url"):
            log = logs / f"agent-{node['name']}.log"
            _wait(
                f"agent {node['name']}", partial(_http_ok, f"{url}/ready"), deadline, f"see {log}"
            )
            say(f"agent {node['name']}: ready ({url})")
    for pod in state.data.get("pods", []):
        name = f"{pod['namespace']}/{pod['name']}"
        log = logs / f"app-{pod['namespace']}-{pod['name']}.log"
        _wait(f"pod {name}", partial(app_ready, pod), deadline, f"see {log}")
    say(f"pods: {len(state.data.get('pods', []))} ready")


# --- up / status / down ------------------------------------------------------------------


def up(opts: UpOptions) -> dict[str, Any]:
    """Build the sandbox (see the module docstring); returns `status()`.

    Raises:
        SandboxError: preflight failed, or something did not come up (it is then taken down).
    """
    say = opts.progress
    _need_root()
    existing = _load_state()
    if existing is not None:
        if existing.get("phase") == "ready" and all(_ours(p) for p in existing.get("procs", [])):
            say("sandbox already up")
            return status()
        say("a previous sandbox is recorded but not healthy: taking it down first")
        down(say)
    mode = preflight(opts)
    say(f"preflight: ok (redirect {mode}, {opts.nodes} node(s), manifests {opts.manifests})")
    from agent.controlplane import manifests  # noqa: PLC0415

    objects, errors = manifests.load_folder(opts.manifests)
    for err in errors:
        say(f"manifests: skipped {err}")
    state = _State(
        {
            "phase": "building",
            "created": time.time(),
            "manifests": str(opts.manifests.resolve()),
            "redirect": mode,
            "lab_prefix": PREFIX,
            "lab_dir": str(LAB_DIR),
        }
    )
    state.save()
    try:
        _build(opts, state, objects, mode, say)
    except BaseException:
        say("build failed: taking down what was made")
        down(lambda _m: None)
        raise
    return status()


def _build(
    opts: UpOptions, state: _State, objects: list[Any], mode: str, say: Callable[[str], None]
) -> None:
    deadline = time.monotonic() + opts.ready_timeout
    identity = _ensure_pki(opts, say)
    state.data["identity_dir"] = str(identity)
    lab = Lab(PREFIX, state_dir=LAB_DIR)
    nodes = _make_nodes(lab, state, opts.nodes, say)
    specs = [cluster.NodeSpec(name=n["name"], pod_cidr=lab.nodes[n["name"]].subnet) for n in nodes]
    try:
        plan = cluster.plan(objects, specs)
    except cluster.PlanError as exc:
        raise SandboxError("plan", str(exc), "use more --nodes") from exc
    by_name = {n["name"]: n for n in nodes}
    gen = _write_manifests(opts.manifests, plan, by_name)
    state.data["generated"] = str(gen)
    state.save()
    say(f"plan: {len(plan.pods)} pods, {len(plan.cluster_ips)} services; manifests in {gen}")
    labpods = {p.key: _make_pod(lab, state, plan, p) for p in plan.pods}
    for p in plan.pods:
        say(f"pod {p.key}: node {p.node}, ip {p.ip}, netns {labpods[p.key].netns_name}")
    for spec in specs:
        kubeproxy.apply(
            str(netns.named_path(by_name[spec.name]["netns"])),
            spec.name,
            kubeproxy.rules(plan, spec),
        )
    say("kube-proxy: service rules loaded in every node")
    _start_controlplane(state, gen, identity)
    say("control plane: starting")
    with_agents = agent_available() if opts.agents is None else opts.agents
    if with_agents:
        for node in nodes:
            start_agent(state, node, gen, identity, mode)
            say(f"agent {node['name']}: starting (redirect {mode}, admin {node['admin_url']})")
    else:
        say("agents: not started (`meshagent run` unavailable or --no-agents); pods run unmeshed")
    for p in plan.pods:
        start_app(state, p, labpods[p.key])
    say(f"apps: {len(plan.pods)} started; waiting for readiness")
    _wait_ready(state, deadline, say)
    state.data["phase"] = "ready"
    state.save()


def status() -> dict[str, Any]:
    """Nodes, agents, pods and the control plane, as recorded and as running now."""
    data = _load_state()
    if data is None:
        return {"up": False, "nodes": [], "agents": [], "pods": []}
    agents_by_node = {p["name"]: p for p in data.get("procs", []) if p["role"] == "agent"}
    apps = {p["name"]: p for p in data.get("procs", []) if p["role"] == "app"}
    nodes, agents, pods = [], [], []
    for n in data.get("nodes", []):
        nodes.append(
            {
                "name": n["name"],
                "netns": n["netns"],
                "pod_cidr": n["pod_cidr"],
                "host_ip": n["node_ip"],
            }
        )
        rec = agents_by_node.get(n["name"])
        if rec is not None:
            url = n.get("admin_url", "")
            agents.append({"node": n["name"], "pid": rec["pid"], "admin_url": url,
                           "running": _ours(rec), "ready": _http_ok(f"{url}/ready")})  # fmt: skip
    for p in data.get("pods", []):
        key = f"{p['namespace']}/{p['name']}"
        rec = apps.get(key)
        running = rec is not None and _ours(rec)
        pods.append({
            "namespace": p["namespace"], "name": p["name"], "node": p["node"], "ip": p["ip"],
            "netns": p["netns"], "serviceaccount": p["serviceaccount"], "meshed": p["meshed"],
            "ready": running and app_ready(p),
        })  # fmt: skip
    cp = [p for p in data.get("procs", []) if p["role"] == "controlplane"]
    return {
        "up": data.get("phase") == "ready",
        "phase": data.get("phase"),
        "redirect": data.get("redirect"),
        "manifests": data.get("manifests"),
        "generated": data.get("generated"),
        "controlplane": {"pid": cp[0]["pid"] if cp else None, "running": bool(cp) and _ours(cp[0])},
        "nodes": nodes,
        "agents": agents,
        "pods": pods,
    }


def _release_agent_netns(uids: list[str]) -> list[str]:
    """Unmount the agents' netns bind mounts of our pods (they keep namespaces alive)."""
    errors = []
    for uid in uids:
        path = AGENT_NETNS_DIR / uid
        if not path.exists():
            continue
        proc = subprocess.run(
            ["umount", "-l", str(path)], capture_output=True, text=True, check=False
        )
        if proc.returncode != 0 and os.path.ismount(path):
            errors.append(f"umount {path}: {proc.stderr.strip()}")
        with contextlib.suppress(OSError):
            path.unlink()
    return errors


def _uninstall_bpf(pin_roots: list[str]) -> list[str]:
    """Remove the eBPF programs, maps, links and pins the agents left (a killed one leaves all)."""
    errors = []
    for raw in pin_roots:
        root = Path(raw)
        if not root.exists():
            continue
        from agent.redirect.ebpf import EbpfRedirector  # noqa: PLC0415 - eBPF mode only

        try:
            EbpfRedirector(pin_root=root, accelerate=False).uninstall()
        except (AgentError, OSError) as exc:
            errors.append(f"bpf pins {root}: {exc}")
    return errors


def _rm_cgroup(path: Path) -> None:
    if not path.exists():
        return
    with contextlib.suppress(OSError):
        (path / "cgroup.kill").write_text("1")
    deadline = time.monotonic() + 5
    while path.exists():
        try:
            path.rmdir()
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def down(say: Callable[[str], None] = lambda _m: None) -> list[str]:
    """Remove everything the recorded sandbox made (rule 1); returns the errors."""
    data = _load_state()
    if data is None:
        return Lab.cleanup_recorded(PREFIX, state_dir=LAB_DIR)
    errors = _kill_recorded(data.get("procs", []))
    say("processes stopped")
    errors += _uninstall_bpf(data.get("bpf_pins", []))
    errors += _release_agent_netns([p["uid"] for p in data.get("pods", [])])
    for cg in reversed(data.get("cgroups", [])):
        try:
            _rm_cgroup(Path(cg))
        except OSError as exc:
            errors.append(f"cgroup {cg}: {exc}")
    for etc in data.get("etc_netns", []):
        shutil.rmtree(etc, ignore_errors=True)
    for root in data.get("etc_netns_root", []):
        with contextlib.suppress(OSError):
            Path(root).rmdir()  # only when we made it and it is empty
    shutil.rmtree(SANDBOX_DIR / "stats", ignore_errors=True)
    for link in data.get("host_links", []):
        subprocess.run(["ip", "link", "del", link["host_if"]], capture_output=True, check=False)
    errors += Lab.cleanup_recorded(PREFIX, state_dir=LAB_DIR)
    say("namespaces, links and cgroups removed")
    if not errors:
        _forget(data)
    return errors


def _forget(data: dict[str, Any]) -> None:
    """Remove the state file, generated manifests and the PKI `up` made."""
    for path in (STATE_FILE, SANDBOX_DIR / "manifests", SANDBOX_DIR / "identity"):
        if path.is_dir():
            if data.get("identity_dir") == str(path) or path.name == "manifests":
                shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()


def example_call(data: dict[str, Any]) -> tuple[dict[str, Any], str] | None:
    """A pod and a URL it can call through the mesh, from the manifests in use (for hints)."""
    from agent.sandbox import view  # noqa: PLC0415

    pods = data.get("pods", [])
    services = [s for s in view._services(data) if not s[3]]  # noqa: SLF001 - same package
    for want_meshed in (True, False):
        for ns, name, port, _ in services:
            callers = [
                p
                for p in pods
                if p["namespace"] == ns
                and p["meshed"] == want_meshed
                and p["name"].rsplit("-", 2)[0] != name
            ]
            if callers:
                return callers[0], f"http://{name}.{ns}.svc.cluster.local:{port}/"
    return None


def hints(info: dict[str, Any]) -> str:
    """How to look inside (printed after `up`), for the manifests and agents in use."""
    lines = ["", f"sandbox is up (redirect {info.get('redirect')}). Look inside:"]
    call = example_call(_load_state() or {})
    if call is not None:
        pod, url = call
        # `sandbox exec` joins the pod's cgroup too: eBPF capture applies per cgroup,
        # so a plain `ip netns exec` from the host would bypass the mesh.
        lines.append(f"  meshagent sandbox exec {pod['namespace']}/{pod['name']} -- curl -s {url}")
    lines += ["  meshagent sandbox status", "  meshagent sandbox view        # live traffic"]
    if info.get("agents"):
        lines += ["  meshagent redirects list", "  meshagent stat"]
        lines += [
            f"  curl {a['admin_url']}/metrics   # agent on {a['node']}" for a in info["agents"]
        ]
    lines.append(f"  logs: {SANDBOX_DIR / 'logs'}/   generated manifests: {info.get('generated')}")
    lines.append("  meshagent sandbox down")
    return "\n".join(lines)


def view(duration: float | None = None) -> int:
    """The live view on a running sandbox (drives traffic while it runs); it stays up after.

    Raises:
        SandboxError: no sandbox is up.
    """
    from agent.sandbox import view as live  # noqa: PLC0415

    data = _load_state()
    if data is None or data.get("phase") != "ready":
        raise SandboxError("view", "no sandbox is up", "meshagent sandbox up --detach")
    before = {p["pid"] for p in data.get("procs", [])}
    try:
        live.run(data, duration=duration, spawn=lambda argv, pod: _spawn_client(data, argv, pod))
    except KeyboardInterrupt:
        pass
    finally:
        _stop_drivers(before)
    return 0


def _stop_drivers(keep: set[int]) -> None:
    """Stop the traffic drivers started since (not in `keep`) and forget them."""
    data = _load_state()
    if data is None:
        return
    procs = data.get("procs", [])
    mine = [p for p in procs if p["role"] == "driver" and p["pid"] not in keep]
    _kill_recorded(mine)
    data["procs"] = [p for p in procs if p not in mine]
    _State(data).save()


def foreground(opts: UpOptions) -> int:
    """Drive traffic and show the live view until the duration ends or Ctrl-C; then down."""
    from agent.sandbox import view  # noqa: PLC0415

    data = _load_state() or {}
    try:
        view.run(
            data, duration=opts.duration, spawn=lambda argv, pod: _spawn_client(data, argv, pod)
        )
    except KeyboardInterrupt:
        pass
    finally:
        opts.progress("taking the sandbox down")
        errors = down(opts.progress)
        for err in errors:
            opts.progress(f"down: {err}")
    return 0


def _spawn_client(data: dict[str, Any], argv: list[str], pod: dict[str, Any]) -> None:
    state = _State(_load_state() or data)
    _spawn(
        state,
        argv,
        role="driver",
        name=f"{pod['namespace']}/{pod['name']}",
        log=SANDBOX_DIR / "logs" / f"driver-{pod['namespace']}-{pod['name']}.log",
        netns_argv=["ip", "netns", "exec", pod["netns"]],
        cgroup=Path(pod["cgroup"]) if pod.get("cgroup") else None,
    )
