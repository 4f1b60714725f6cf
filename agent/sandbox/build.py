"""The parts of the sandbox `up` makes, one function each, and the readiness waits.

`agent.sandbox.run` calls these in the order its docstring gives: `ensure_pki`,
`make_nodes` (isolated `agent.netlab` nodes, linked in pairs, each with a veth
to the host), `write_manifests` (the cluster plan as a manifests folder),
`make_pod` per pod, then (after the kube-proxy rules, `agent.sandbox.kubeproxy`)
`start_controlplane`, `start_agent` per node, `start_app` per pod and
`wait_ready`.

Rules:
1. Each thing is recorded in the state (`agent.sandbox.state`) before it is
   created (cgroups, /etc/netns entries, host links, eBPF pin roots), or by the
   `Lab` in its own record (namespaces, veths, bridges); processes start only
   through `state.spawn`, which records them.
2. Host links are 100.127.<n>.0/30 (host .1, node n .2, with a route to the node's
   pod subnet); `make_nodes` refuses when host routes already use 100.127.0.0/16.
3. An app runs in its pod's netns through `ip netns exec` (so
   /etc/netns/<pod>/hosts resolves service names) and in its pod's cgroup; an
   agent runs in its node's netns, admin on 0.0.0.0 there, reached at the
   node's host-link address; in eBPF mode each agent pins under its own root
   `BPF_PIN_BASE-<node>`, because bpffs is one per machine.
4. `wait_ready` waits, all against one deadline, for the control-plane ports,
   then each agent's /ready, then each pod's app ports; a timeout is a
   `SandboxError` naming the log to read.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
import urllib.request
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from agent import config
from agent.netlab import port_open
from agent.redirect import netns
from agent.sandbox import cluster
from agent.sandbox.state import SANDBOX_DIR, SandboxError, State, logs_dir, spawn

if TYPE_CHECKING:
    from collections.abc import Callable

    from agent.netlab import Lab, LabNode, LabPod

PREFIX = "sb"
HOST_LINK_BASE = "100.127"  # 100.127.<n>.0/30 host <-> node n
CONTROLPLANE_PORTS = (config.DESTINATION_PORT, config.IDENTITY_PORT, config.POLICY_PORT)
BPF_PIN_BASE = Path("/sys/fs/bpf/meshagent-sandbox")  # + "-<node>"


# --- building ----------------------------------------------------------------------


def _ip(*args: str) -> None:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SandboxError(f"ip {' '.join(args)}", proc.stderr.strip())


def _host_link(state: State, index: int, node: LabNode) -> dict[str, str]:
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


def make_nodes(
    lab: Lab, state: State, count: int, say: Callable[[str], None]
) -> list[dict[str, Any]]:
    """`count` isolated nodes, each with a host link (rule 2), linked in pairs; records them.

    Raises:
        SandboxError: host routes already use the host-link range, or an `ip` command failed.
        LabError: the lab could not make a node or a link.
    """
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


def write_manifests(source: Path, plan: cluster.ClusterPlan, nodes: dict[str, Any]) -> Path:
    """The user's manifests patched to the plan, and one Pod per planned pod; returns the folder."""
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


def make_pod(lab: Lab, state: State, plan: cluster.ClusterPlan, pod: cluster.PodPlan) -> LabPod:
    """The pod's netns and veth, its cgroup `.../pod<uid>` and `/etc/netns/<netns>/hosts`.

    Raises:
        LabError: the lab could not make the pod.
    """
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


def start_app(state: State, pod: cluster.PodPlan, lp: LabPod) -> None:
    """The pod's application, in its netns (with its /etc/hosts) and cgroup."""
    spawn(
        state,
        _app_argv(pod),
        role="app",
        name=pod.key,
        log=logs_dir() / f"app-{pod.namespace}-{pod.name}.log",
        netns_argv=["ip", "netns", "exec", lp.netns_name],
        cgroup=lp.cgroup,
        env={
            "POD_NAME": pod.name,
            "POD_NAMESPACE": pod.namespace,
            "POD_IP": pod.ip,
            "NODE_NAME": pod.node,
        },
    )


def _meshagent() -> list[str]:
    exe = Path(sys.executable).parent / "meshagent"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "agent"]


def start_controlplane(state: State, manifests_dir: Path, identity: Path) -> None:
    """`meshagent controlplane` on the host, serving the generated manifests."""
    argv = [
        *_meshagent(),
        "controlplane",
        "--manifests",
        str(manifests_dir),
        "--identity-dir",
        str(identity),
    ]
    spawn(
        state,
        argv,
        role="controlplane",
        name="controlplane",
        log=logs_dir() / "controlplane.log",
    )
    state.data["controlplane"] = {
        "ports": dict(zip(("destination", "identity", "policy"), CONTROLPLANE_PORTS, strict=True))
    }
    state.save()


def start_agent(
    state: State, node: dict[str, Any], manifests_dir: Path, identity: Path, mode: str
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
    spawn(
        state,
        argv,
        role="agent",
        name=node["name"],
        log=logs_dir() / f"agent-{node['name']}.log",
        netns_argv=netns.exec_argv(netns.named_path(node["netns"])),
        env=env,
    )
    node["admin_url"] = f"http://{admin}"
    state.save()


def ensure_pki(identity_dir: Path | None, say: Callable[[str], None]) -> Path:
    """The identity folder to use: `identity_dir`, or the sandbox's own (made if missing)."""
    from agent.identity import ca  # noqa: PLC0415

    if identity_dir is not None:
        return identity_dir
    d = SANDBOX_DIR / "identity"
    if not (d / "issuer.key").exists():
        d.mkdir(parents=True, exist_ok=True)
        ca.create_root(d, force=True)
        ca.create_issuer(d, d, force=True)
        say(f"pki: created trust anchor and issuer in {d}")
    return d


# --- readiness -----------------------------------------------------------------------


def http_ok(url: str) -> bool:
    """`url` answers 200 within a second."""
    try:
        with urllib.request.urlopen(url, timeout=1) as resp:  # noqa: S310 - our own admin URL
            return bool(resp.status == 200)
    except (OSError, ValueError):
        return False


def app_ready(pod: dict[str, Any]) -> bool:
    """Every app port accepts on the pod's loopback."""
    path = netns.named_path(pod["netns"])
    return all(port_open("127.0.0.1", p["port"], path) for p in pod["ports"])


def _wait(what: str, check: Callable[[], bool], deadline: float, hint: str) -> None:
    while not check():
        if time.monotonic() > deadline:
            raise SandboxError(what, "not ready in time", hint)
        time.sleep(0.2)


def wait_ready(state: State, deadline: float, say: Callable[[str], None]) -> None:
    """Wait for the control plane, the agents and the pods (rule 4).

    Raises:
        SandboxError: something was not ready by `deadline`; the hint names its log.
    """
    logs = logs_dir()
    _wait(
        "control plane",
        lambda: all(port_open("127.0.0.1", p) for p in CONTROLPLANE_PORTS),
        deadline,
        f"see {logs / 'controlplane.log'}",
    )
    say("control plane: serving on :8086 (destination), :8080 (identity), :8090 (policy)")
    for node in state.data["nodes"]:
        if url := node.get("admin_url"):
            log = logs / f"agent-{node['name']}.log"
            _wait(f"agent {node['name']}", partial(http_ok, f"{url}/ready"), deadline, f"see {log}")
            say(f"agent {node['name']}: ready ({url})")
    for pod in state.data.get("pods", []):
        name = f"{pod['namespace']}/{pod['name']}"
        log = logs / f"app-{pod['namespace']}-{pod['name']}.log"
        _wait(f"pod {name}", partial(app_ready, pod), deadline, f"see {log}")
    say(f"pods: {len(state.data.get('pods', []))} ready")
