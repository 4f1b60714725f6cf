"""The real mesh for the bench: PKI, manifests, a control plane, `meshagent run` per node.

`MeshPlane` owns what every meshagent setup of one run shares: a PKI (trust
anchor + issuer, `agent.identity.ca`), the control plane's manifests folder
(Namespace `bench`, one Pod manifest per bench pod with `status.podIP`,
`spec.nodeName` and `linkerd.io/inject: enabled`, a Service per server pod)
and one `meshagent controlplane` process on 127.0.0.1. `start_agent` runs
`meshagent run` for one lab node with only the chosen pods in its own
manifests folder, waits for its `/ready`, and returns a `NodeAgent`.

Rules:
1. Bench pods are lab pods named `pod<UID>` (UID: UUIDv5 of `bench/<role>`),
   so their processes sit in a cgroup naming the UID: `meshagent run` finds
   them the way it finds Kubernetes pods (`agent.pods.discover`).
2. Every agent has its own registry, netns hold dir, admin port and (eBPF)
   pin root, so two agents on this one kernel stand for two nodes. They share
   the run's cache of compiled eBPF programs (`agent.redirect.ebpf_cache`,
   in the work directory, unless MESHAGENT_BPF_CACHE names one): the first
   eBPF agent of a run compiles, the others load.
3. Manifest rendering (`pod_manifest`, `service_manifest`, `namespace_manifest`)
   is pure; processes are stopped by their Popen only; what an agent may have
   left (netns holds, eBPF pins) is removed after it stops.
4. A port chosen here for a process to bind later (`free_port`) lies outside
   the kernel's ephemeral range (below it, or above where more room is left):
   between the probe and that bind, a bind to port 0 elsewhere (the embedded
   control plane's servers, every outgoing connection) cannot be handed the
   same port. Drawn at random, it is never one handed out before in this
   process (several are asked for before any is bound).
"""

from __future__ import annotations

import contextlib
import functools
import os
import random
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, field
from http import HTTPStatus
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from agent.errors import AgentError
from agent.netlab import port_open
from agent.redirect.ebpf_cache import ENV_CACHE as ENV_BPF_CACHE

if TYPE_CHECKING:
    from agent.admin.stat import Key
    from agent.netlab import Lab, LabNode, LabPod

NAMESPACE = "bench"
INJECT = {"linkerd.io/inject": "enabled"}
_UID_NS = uuid.UUID("0b7c1f52-8f0e-4c4e-9d0b-6a3e5b1c2d47")
READY_S = 60.0
REPORT_S = 1.0  # agent.admin.observe.REPORT_S: how often a worker reports its metrics
SETTLE_REPORTS = 5  # `requests_settled` gives up after this many report periods
SETTLE_POLL_S = 0.05
STAMP = "meshagent_worker_last_report_timestamp_seconds"  # agent.admin.observe rule 5
WRAPPED_READY_S = 900.0  # wrapped workers (agent.bench.callgrind) start far slower


def ready_s() -> float:
    """How long a node agent may take to become ready: longer with wrapped workers."""
    from agent.bench.callgrind import ENV  # noqa: PLC0415 - the wrap's one name

    return WRAPPED_READY_S if os.environ.get(ENV) else READY_S


class MeshError(AgentError):
    """The bench's control plane or a node agent did not start."""

    def __init__(self, what: str, reason: str) -> None:
        self.what = what
        self.reason = reason
        super().__init__(f"bench {what}: {reason}")


def meshagent_argv() -> list[str]:
    return [sys.executable, "-m", "agent"]


def pod_uid(role: str) -> str:
    return str(uuid.uuid5(_UID_NS, f"{NAMESPACE}/{role}"))


def lab_name(role: str) -> str:
    """The lab pod name for `role`: `pod<UID>` (rule 1)."""
    return f"pod{pod_uid(role)}"


@dataclass(frozen=True, slots=True, kw_only=True)
class BenchPod:
    """A bench pod as the mesh sees it."""

    role: str  # cli, srv, srv2, idle3...
    node: str  # lab node name
    ip: str
    ports: tuple[int, ...] = ()
    annotations: tuple[tuple[str, str], ...] = ()  # beside INJECT, e.g. skip ports

    @property
    def uid(self) -> str:
        return pod_uid(self.role)


# --- manifests (pure) -------------------------------------------------------------------


def namespace_manifest() -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Namespace",
        "metadata": {"name": NAMESPACE, "annotations": dict(INJECT)},
    }


def pod_manifest(pod: BenchPod) -> dict[str, Any]:
    """A meshed Pod with status (podIP, Ready) and its node."""
    ports = [{"name": f"p{p}", "containerPort": p, "protocol": "TCP"} for p in pod.ports]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": pod.role,
            "namespace": NAMESPACE,
            "uid": pod.uid,
            "labels": {"app": pod.role},
            "annotations": {**INJECT, **dict(pod.annotations)},
        },
        "spec": {
            "nodeName": pod.node,
            "serviceAccountName": pod.role if pod.ports else "default",
            "containers": [{"name": "app", "image": "bench", "ports": ports}],
        },
        "status": {
            "phase": "Running",
            "podIP": pod.ip,
            "podIPs": [{"ip": pod.ip}],
            "conditions": [{"type": "Ready", "status": "True"}],
        },
    }


def service_manifest(pod: BenchPod) -> dict[str, Any]:
    """A Service selecting `pod` on each of its ports."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": pod.role, "namespace": NAMESPACE},
        "spec": {
            "selector": {"app": pod.role},
            "ports": [{"name": f"p{p}", "port": p, "targetPort": p} for p in pod.ports],
        },
    }


def dump(docs: list[dict[str, Any]]) -> str:
    return yaml.safe_dump_all(docs, sort_keys=False)


# --- processes ----------------------------------------------------------------------------


EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
FREE_PORT_SPAN = 12_000  # how many ports beside the ephemeral range `free_port` draws from
FREE_PORT_TRIES = 200


def listen_ports(ephemeral: tuple[int, int]) -> range:
    """Ports to hand a process to bind (rule 4): up to `FREE_PORT_SPAN` of the unprivileged
    ports below the ephemeral range or above it, whichever side has more; empty when the
    range leaves none."""
    low, high = ephemeral
    below = range(max(1024, low - FREE_PORT_SPAN), low)
    above = range(high + 1, min(65536, high + 1 + FREE_PORT_SPAN))
    return below if len(below) >= len(above) else above


def _ephemeral() -> tuple[int, int]:
    try:
        low, high = EPHEMERAL_RANGE.read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # the kernel's default


_HANDED_OUT: set[int] = set()  # this process's answers: not given twice (rule 4)


def free_port() -> int:
    """A port free on 127.0.0.1 now, for a process to bind later (rule 4); never one this
    process was given before (until half the range was), since none of them is bound yet
    when several are asked for at once."""
    ports = listen_ports(_ephemeral())
    if not ports:
        msg = f"no port outside the ephemeral range {EPHEMERAL_RANGE} names to hand out"
        raise RuntimeError(msg)
    if len(_HANDED_OUT) >= len(ports) // 2:
        _HANDED_OUT.clear()
    for _ in range(FREE_PORT_TRIES):
        port = random.choice(ports)  # noqa: S311 - spreads tries, no secret
        if port in _HANDED_OUT:
            continue
        _HANDED_OUT.add(port)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    msg = (
        f"no free port on 127.0.0.1 in {ports.start}-{ports.stop - 1} after {FREE_PORT_TRIES} tries"
    )
    raise RuntimeError(msg)


def _http_status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:  # noqa: S310 - our own admin URL
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        exc.close()
        return int(exc.code)
    except (OSError, ValueError):
        return 0


def _stop(proc: subprocess.Popen[Any], timeout: float = 15.0) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)


def _tail(path: Path, n: int = 2000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


@dataclass(slots=True, kw_only=True)
class NodeAgent:
    """A running `meshagent run` (its supervisor; workers are its children)."""

    name: str
    proc: subprocess.Popen[bytes]
    admin_port: int
    netns_dir: Path
    pin_root: Path | None
    log: Path

    @property
    def pid(self) -> int:
        return self.proc.pid

    def admin(self, path: str) -> tuple[int, bytes]:
        url = f"http://127.0.0.1:{self.admin_port}{path}"
        try:
            with urllib.request.urlopen(url, timeout=5) as resp:
                return int(resp.status), resp.read()
        except urllib.error.HTTPError as exc:
            with exc:
                return int(exc.code), exc.read()

    def _samples(self) -> dict[Key, float]:
        """Its metrics' samples, by (name, labels).

        Raises:
            MeshError: its admin server did not answer with metrics.
        """
        from agent.admin import stat  # noqa: PLC0415 - prometheus_client's parser

        try:
            status, body = self.admin("/metrics")
        except OSError as exc:
            raise MeshError(self.name, f"GET /metrics: {exc}") from exc
        if status != HTTPStatus.OK:
            raise MeshError(self.name, f"GET /metrics answered {status}")
        return stat.parse(body.decode(), 0.0).samples

    def target_ports(self, family: str = "tcp_open_total") -> set[int]:
        """The ports of the pods' servers it has proxied connections to so far (the
        `target_port` of `tcp_open_total`, which inbound series carry), or with `family`
        "request_total" those it counted HTTP requests to.

        Raises:
            MeshError: its admin server did not answer with metrics.
        """
        return {
            int(value)
            for (name, labels), _ in self._samples().items()
            if name == family
            for key, value in labels
            if key == "target_port" and value.isdigit()
        }

    def requests_settled(self, since: float) -> tuple[int, int]:
        """The HTTP requests it counted, outbound and inbound, once every worker has
        reported a snapshot taken at `since` (Unix time) or later (`settled`): each
        request answered before `since` is in them. Workers report every `REPORT_S`
        (agent.admin.observe rule 5), so this takes up to that long.

        Raises:
            MeshError: its admin server did not answer with metrics, or a worker's
                report did not come within `SETTLE_REPORTS` report periods.
        """
        deadline = time.monotonic() + SETTLE_REPORTS * REPORT_S
        while True:
            samples = self._samples()
            if settled(samples, since):
                return counted(samples, "outbound"), counted(samples, "inbound")
            if time.monotonic() > deadline:
                stamps = _stamps(samples)
                raise MeshError(
                    self.name,
                    f"workers' reports not past {since:.3f} after {SETTLE_REPORTS} report "
                    f"periods: {stamps}",
                )
            time.sleep(SETTLE_POLL_S)

    def worker_pids(self) -> list[int]:
        import psutil  # noqa: PLC0415

        with contextlib.suppress(psutil.Error):
            return [c.pid for c in psutil.Process(self.pid).children(recursive=True)]
        return []

    def stop(self) -> None:
        """SIGTERM (it drains for --grace and unenrolls), then what it may have left."""
        from agent.pods import discover  # noqa: PLC0415

        _stop(self.proc)
        if self.netns_dir.is_dir():
            for held in self.netns_dir.iterdir():
                with contextlib.suppress(Exception):
                    discover.release(held.name, self.netns_dir)
        if self.pin_root is not None and self.pin_root.exists():
            from agent.redirect.ebpf import EbpfRedirector  # noqa: PLC0415 - bcc is heavy

            with contextlib.suppress(Exception):
                EbpfRedirector(pin_root=self.pin_root, accelerate=False).uninstall()


@dataclass(slots=True, kw_only=True)
class MeshPlane:
    """PKI, control-plane manifests and process shared by a run's meshagent setups."""

    workdir: Path
    pods: dict[str, BenchPod] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None
    ports: dict[str, int] = field(default_factory=dict)
    _files: int = 0

    @property
    def identity(self) -> Path:
        return self.workdir / "identity"

    @property
    def manifests(self) -> Path:
        return self.workdir / "cp-manifests"

    def add(self, pods: list[BenchPod]) -> None:
        """Publish `pods` (and a Service for each that serves ports) to the control plane."""
        self.manifests.mkdir(parents=True, exist_ok=True)
        docs = [pod_manifest(p) for p in pods]
        docs += [service_manifest(p) for p in pods if p.ports]
        self._files += 1
        tmp = self.manifests / f".batch{self._files}.tmp"
        tmp.write_text(dump(docs))
        tmp.rename(self.manifests / f"batch{self._files}.yaml")
        self.pods.update({p.role: p for p in pods})

    def start(self) -> None:
        """PKI, Namespace and `meshagent controlplane` on 127.0.0.1 (idempotent).

        Raises:
            MeshError: it exited or did not listen within 30 s.
        """
        if self.proc is not None and self.proc.poll() is None:
            return
        from agent.identity import ca  # noqa: PLC0415

        if not (self.identity / "issuer.key").exists():
            self.identity.mkdir(parents=True, exist_ok=True)
            ca.create_root(self.identity, force=True)
            ca.create_issuer(self.identity, self.identity, force=True)
        self.manifests.mkdir(parents=True, exist_ok=True)
        (self.manifests / "namespace.yaml").write_text(dump([namespace_manifest()]))
        self.ports = {k: free_port() for k in ("destination", "identity", "policy")}
        log = self.workdir / "controlplane.log"
        argv = [
            *meshagent_argv(),
            "--log-level",
            "warning",
            "controlplane",
            "--manifests", str(self.manifests),
            "--identity-dir", str(self.identity),
            "--bind", "127.0.0.1",
            "--destination-port", str(self.ports["destination"]),
            "--identity-port", str(self.ports["identity"]),
            "--policy-port", str(self.ports["policy"]),
            "--shutdown-grace", "1s",
        ]  # fmt: skip
        with log.open("wb") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while not all(port_open("127.0.0.1", p) for p in self.ports.values()):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise MeshError("control plane", f"did not listen: {_tail(log)}")
            time.sleep(0.1)

    def stop(self) -> None:
        if self.proc is not None:
            _stop(self.proc)

    def start_agent(  # noqa: PLR0913 - keyword-only settings
        self,
        roles: list[str],
        mode: str,
        *,
        node: str,
        name: str,
        workers: int = 2,
        log_level: str = "warning",
        env: dict[str, str] | None = None,
        cpus: frozenset[int] | None = None,
    ) -> NodeAgent:
        """`meshagent run` for `node`, meshing the pods `roles`; returns once /ready is 200.
        `env` adds to the agent's environment (e.g. MESHAGENT_EBPF_ACCEL=1); `cpus`, the
        node's CPUs, confines the agent and the workers it starts (`agent.netlab` rule 6).

        Raises:
            MeshError: the control plane or the agent did not start, or no /ready in time.
        """
        self.start()
        folder = self.workdir / f"agent-{name}-manifests"
        folder.mkdir(parents=True, exist_ok=True)
        for old in folder.glob("*.yaml"):
            old.unlink()
        docs = [namespace_manifest(), *(pod_manifest(self.pods[r]) for r in roles)]
        (folder / "pods.yaml").write_text(dump(docs))
        admin_port = free_port()
        netns_dir = self.workdir / f"agent-{name}-netns"
        pin_root = Path(f"/sys/fs/bpf/mabench-{name}") if mode == "ebpf" else None
        env = {**os.environ, **(env or {})}
        env.setdefault(ENV_BPF_CACHE, str(self.workdir / "bpf-cache"))
        if pin_root is not None:
            env["MESHAGENT_BPF_PIN_ROOT"] = str(pin_root)
        d = self.ports
        argv = [
            *meshagent_argv(),
            "--log-level", log_level,
            "run",
            "--control-plane", f"127.0.0.1:{d['destination']}",
            "--identity-addr", f"127.0.0.1:{d['identity']}",
            "--policy-addr", f"127.0.0.1:{d['policy']}",
            "--pods-from", f"manifests:{folder}",
            "--node", node,
            "--redirect", mode,
            "--workers", str(workers),
            "--admin-addr", f"127.0.0.1:{admin_port}",
            "--grace", "1s",
            "--identity-dir", str(self.identity),
            "--netns-dir", str(netns_dir),
            "--registry", str(self.workdir / f"agent-{name}-registry.json"),
            "--cleanup-on-exit",
        ]  # fmt: skip
        log = self.workdir / f"agent-{name}.log"
        place = None if cpus is None else functools.partial(os.sched_setaffinity, 0, cpus)
        with log.open("wb") as out:
            proc = subprocess.Popen(
                argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                preexec_fn=place,  # noqa: PLW1509 - the node's CPUs, before exec
            )
        agent = NodeAgent(
            name=name,
            proc=proc,
            admin_port=admin_port,
            netns_dir=netns_dir,
            pin_root=pin_root,
            log=log,
        )
        try:
            _wait_ready(agent, name)
        except BaseException:  # also an interrupt while it starts: nobody else holds it yet
            agent.stop()
            raise
        return agent


def _wait_ready(agent: NodeAgent, name: str) -> None:
    """Until the agent's /ready answers 200.

    Raises:
        MeshError: it exited, or was not ready within `ready_s()`.
    """
    within = ready_s()
    deadline = time.monotonic() + within
    url = f"http://127.0.0.1:{agent.admin_port}/ready"
    while _http_status(url) != 200:
        if agent.proc.poll() is not None or time.monotonic() > deadline:
            why = "exited" if agent.proc.poll() is not None else f"not ready after {within}s"
            raise MeshError(f"node agent {name}", f"{why}: {_tail(agent.log)}")
        time.sleep(0.1)


def counted(samples: dict[Key, float], direction: str) -> int:
    """The HTTP requests a scrape's `request_total` counts in `direction`."""
    return int(
        sum(
            value
            for (name, labels), value in samples.items()
            if name == "request_total" and ("direction", direction) in labels
        )
    )


def _stamps(samples: dict[Key, float]) -> dict[str, float]:
    """worker -> when the snapshot it last reported was taken."""
    return {
        dict(labels).get("worker", "?"): value
        for (name, labels), value in samples.items()
        if name == STAMP
    }


def settled(samples: dict[Key, float], since: float) -> bool:
    """Whether a scrape holds every count its workers made before `since`: as many
    workers stamped as the agent wants (`meshagent_workers{state="desired"}`), each
    stamp at `since` or later."""
    desired = samples.get(("meshagent_workers", (("state", "desired"),)))
    stamps = _stamps(samples)
    if desired is None or len(stamps) < desired:
        return False
    return all(stamp >= since for stamp in stamps.values())


def make_pod(lab: Lab, node: LabNode, role: str, *, ip: str | None = None) -> LabPod:
    """A lab pod for `role`, named so discovery finds it (rule 1)."""
    return lab.pod(node, lab_name(role), ip)
