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
or Ctrl-C, and then takes everything down. Each step is in `agent.sandbox.build`;
the state file, its processes and `down`'s removal helpers are in
`agent.sandbox.state`.

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
import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agent.netlab import Lab, cgroup2_root
from agent.redirect import netns
from agent.sandbox import build, cluster, kubeproxy
from agent.sandbox.build import CONTROLPLANE_PORTS, PREFIX
from agent.sandbox.state import (
    REPO,
    SANDBOX_DIR,
    STATE_FILE,
    SandboxError,
    State,
    forget,
    kill_recorded,
    load_state,
    logs_dir,
    ours,
    release_agent_netns,
    rm_cgroup,
    rotate_logs,
    spawn,
    uninstall_bpf,
)

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

LAB_DIR = SANDBOX_DIR / "lab"
EXAMPLES = REPO / "examples"

__all__ = [
    "EXAMPLES",
    "STATE_FILE",
    "SandboxError",
    "UpOptions",
    "agent_available",
    "down",
    "ebpf_unavailable",
    "example_call",
    "foreground",
    "hints",
    "preflight",
    "status",
    "up",
    "view",
]


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
    if opts.identity_dir is not None:
        _check_pki(opts.identity_dir)
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


def _check_pki(identity_dir: Path) -> None:
    """`--identity-dir` holds a trust anchor and an issuer that chains to it, in date.

    Raises:
        SandboxError: it does not, saying which file and why.
    """
    from agent.errors import PKIError  # noqa: PLC0415
    from agent.identity import ca  # noqa: PLC0415 - cryptography, only when given

    try:
        ca.load_issuer(identity_dir)
    except PKIError as exc:
        raise SandboxError(
            "preflight",
            f"--identity-dir {identity_dir}: {exc}",
            f"meshagent certs create-root {identity_dir} && "
            f"meshagent certs create-issuer --ca {identity_dir} {identity_dir}",
        ) from None


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


# --- up / status / down ------------------------------------------------------------------


def up(opts: UpOptions) -> dict[str, Any]:
    """Build the sandbox (see the module docstring); returns `status()`.

    Raises:
        SandboxError: preflight failed, or something did not come up (it is then taken down).
    """
    say = opts.progress
    _need_root()
    existing = load_state()
    if existing is not None:
        if existing.get("phase") == "ready" and all(ours(p) for p in existing.get("procs", [])):
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
    rotate_logs()
    state = State(
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
    opts: UpOptions, state: State, objects: list[Any], mode: str, say: Callable[[str], None]
) -> None:
    deadline = time.monotonic() + opts.ready_timeout
    identity = build.ensure_pki(opts.identity_dir, say)
    state.data["identity_dir"] = str(identity)
    lab = Lab(PREFIX, state_dir=LAB_DIR)
    nodes = build.make_nodes(lab, state, opts.nodes, say)
    specs = [cluster.NodeSpec(name=n["name"], pod_cidr=lab.nodes[n["name"]].subnet) for n in nodes]
    try:
        plan = cluster.plan(objects, specs)
    except cluster.PlanError as exc:
        raise SandboxError("plan", str(exc), "use more --nodes") from exc
    by_name = {n["name"]: n for n in nodes}
    gen = build.write_manifests(opts.manifests, plan, by_name)
    state.data["generated"] = str(gen)
    state.save()
    say(f"plan: {len(plan.pods)} pods, {len(plan.cluster_ips)} services; manifests in {gen}")
    labpods = {p.key: build.make_pod(lab, state, plan, p) for p in plan.pods}
    for p in plan.pods:
        say(f"pod {p.key}: node {p.node}, ip {p.ip}, netns {labpods[p.key].netns_name}")
    for spec in specs:
        kubeproxy.apply(
            str(netns.named_path(by_name[spec.name]["netns"])),
            spec.name,
            kubeproxy.rules(plan, spec),
        )
    say("kube-proxy: service rules loaded in every node")
    build.start_controlplane(state, gen, identity)
    say("control plane: starting")
    with_agents = agent_available() if opts.agents is None else opts.agents
    if with_agents:
        for node in nodes:
            build.start_agent(state, node, gen, identity, mode)
            say(f"agent {node['name']}: starting (redirect {mode}, admin {node['admin_url']})")
    else:
        say("agents: not started (`meshagent run` unavailable or --no-agents); pods run unmeshed")
    for p in plan.pods:
        build.start_app(state, p, labpods[p.key])
    say(f"apps: {len(plan.pods)} started; waiting for readiness")
    build.wait_ready(state, deadline, say)
    state.data["phase"] = "ready"
    state.save()


def status() -> dict[str, Any]:
    """Nodes, agents, pods and the control plane, as recorded and as running now."""
    data = load_state()
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
                           "running": ours(rec),
                           "ready": build.http_ok(f"{url}/ready")})  # fmt: skip
    for p in data.get("pods", []):
        key = f"{p['namespace']}/{p['name']}"
        rec = apps.get(key)
        running = rec is not None and ours(rec)
        pods.append({
            "namespace": p["namespace"], "name": p["name"], "node": p["node"], "ip": p["ip"],
            "netns": p["netns"], "serviceaccount": p["serviceaccount"], "meshed": p["meshed"],
            "ready": running and build.app_ready(p),
        })  # fmt: skip
    cp = [p for p in data.get("procs", []) if p["role"] == "controlplane"]
    return {
        "up": data.get("phase") == "ready",
        "phase": data.get("phase"),
        "redirect": data.get("redirect"),
        "manifests": data.get("manifests"),
        "generated": data.get("generated"),
        "controlplane": {"pid": cp[0]["pid"] if cp else None, "running": bool(cp) and ours(cp[0])},
        "nodes": nodes,
        "agents": agents,
        "pods": pods,
    }


def down(say: Callable[[str], None] = lambda _m: None) -> list[str]:
    """Remove everything the recorded sandbox made (rule 1); returns the errors."""
    data = load_state()
    if data is None:
        return Lab.cleanup_recorded(PREFIX, state_dir=LAB_DIR)
    errors = kill_recorded(data.get("procs", []))
    say("processes stopped")
    errors += uninstall_bpf(data.get("bpf_pins", []))
    errors += release_agent_netns([p["uid"] for p in data.get("pods", [])])
    for cg in reversed(data.get("cgroups", [])):
        try:
            rm_cgroup(Path(cg))
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
        forget(data)
    return errors


def example_call(data: dict[str, Any]) -> tuple[dict[str, Any], str] | None:
    """A pod and a URL it can call through the mesh, from the manifests in use (for hints)."""
    from agent.sandbox import view  # noqa: PLC0415

    pods = data.get("pods", [])
    services = [s for s in view.services(data) if not s[3]]
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
    call = example_call(load_state() or {})
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
    lines.append(
        f"  logs: {logs_dir()}/ (the last sandbox's: logs.previous/)"
        f"   generated manifests: {info.get('generated')}"
    )
    lines.append("  meshagent sandbox down")
    return "\n".join(lines)


def view(duration: float | None = None) -> int:
    """The live view on a running sandbox (drives traffic while it runs); it stays up after.

    Raises:
        SandboxError: no sandbox is up.
    """
    from agent.sandbox import view as live  # noqa: PLC0415

    data = load_state()
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
    data = load_state()
    if data is None:
        return
    procs = data.get("procs", [])
    mine = [p for p in procs if p["role"] == "driver" and p["pid"] not in keep]
    kill_recorded(mine)
    data["procs"] = [p for p in procs if p not in mine]
    State(data).save()


def foreground(opts: UpOptions) -> int:
    """Drive traffic and show the live view until the duration ends or Ctrl-C; then down."""
    from agent.sandbox import view  # noqa: PLC0415

    data = load_state() or {}
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
    state = State(load_state() or data)
    spawn(
        state,
        argv,
        role="driver",
        name=f"{pod['namespace']}/{pod['name']}",
        log=logs_dir() / f"driver-{pod['namespace']}-{pod['name']}.log",
        netns_argv=["ip", "netns", "exec", pod["netns"]],
        cgroup=Path(pod["cgroup"]) if pod.get("cgroup") else None,
    )
