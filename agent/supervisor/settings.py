"""`meshagent run` settings: flags, `MESHAGENT_*` variables, and the frozen `RunSettings`.

Rules: every flag goes through `agent.config.resolve` (flag > variable >
default); `RunSettings.from_values` checks what spans several flags.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent import config
from agent.config import DESTINATION_PORT, IDENTITY_PORT, POLICY_PORT, Option
from agent.errors import SettingError
from agent.pods.discover import NETNS_DIR
from agent.proxy import sched
from agent.proxy.pool import H2_UPGRADE_MODES
from agent.supervisor import cpulimit

REDIRECT_MODES = ("iptables", "ebpf", "auto")
EMBEDDED = "embedded"
CPU_PLACEMENTS = ("steer", "pin", "bind", "off")


def parse_pods_from(raw: str) -> Path:
    """`manifests:DIR` (Kubernetes comes later)."""
    kind, sep, rest = raw.partition(":")
    if not sep or kind != "manifests" or not rest:
        raise ValueError("expected manifests:DIR")
    path = Path(rest)
    if not path.is_dir():
        raise ValueError(f"no such directory: {rest}")
    return path


def parse_control_plane(raw: str) -> str:
    """`embedded`, `HOST` or `HOST:PORT` (the Destination address)."""
    if raw == EMBEDDED:
        return raw
    if not raw or raw.startswith(":"):
        raise ValueError("expected embedded, HOST or HOST:PORT")
    return raw


def parse_plugins(raw: str) -> tuple[str, ...]:
    """A comma-separated list of worker plugin modules (may be empty): module names this
    Python finds, or paths of `.py` files (`agent.proxy.worker.load_plugin`). Checked
    here, not imported: only the workers import them."""
    import importlib.util  # noqa: PLC0415

    plugins = tuple(p.strip() for p in raw.split(",") if p.strip())
    for plugin in plugins:
        if plugin.endswith(".py"):
            if not Path(plugin).is_file():
                raise ValueError(f"plugin file {plugin} does not exist")
            continue
        try:
            found = importlib.util.find_spec(plugin)
        except (ImportError, ValueError):  # a parent package is missing, or a bad name
            found = None
        if found is None:
            raise ValueError(f"no module named {plugin!r}")
    return plugins


RUN_OPTIONS: tuple[Option, ...] = (
    Option(
        flag="--control-plane",
        parse=parse_control_plane,
        required=True,
        help="control plane: `embedded` (in this process) or HOST[:DESTINATION_PORT]",
    ),
    Option(flag="--pods-from", parse=parse_pods_from, required=True, help="manifests:DIR"),
    Option(flag="--node", parse=config.parse_dns_name, help="this node's name (default hostname)"),
    Option(
        flag="--redirect",
        parse=config.choice(*REDIRECT_MODES),
        default="iptables",
        help="capture mode",
    ),
    Option(
        flag="--workers",
        parse=config.parse_positive_int,
        help="worker processes (default: one per CPU this process may run on, at most its "
        "cgroup's CPU limit rounded up)",
    ),
    Option(
        flag="--cpu-placement",
        parse=config.choice(*CPU_PLACEMENTS),
        default="off",
        help="give worker i the new connections made on the i-th CPU (steer), and run it "
        "there only (pin), or run worker i on the i-th CPU only and let the kernel spread "
        "connections by hash (bind), or neither (off)",
    ),
    Option(
        flag="--admin-addr",
        parse=config.parse_host_port,
        default=f"0.0.0.0:{config.ADMIN_PORT}",
        help="admin server address (port 0: any)",
    ),
    Option(flag="--grace", parse=config.parse_seconds, default="30s", help="drain time on SIGTERM"),
    Option(
        flag="--h2-upgrade",
        parse=config.choice(*H2_UPGRADE_MODES),
        default="auto",
        help="send HTTP/1 to endpoints hinted h2 as h2 streams (l5d-orig-proto): always (on, as "
        "Linkerd does), never (off), or when the endpoint's HTTP/1 connections are busy (auto)",
    ),
    Option(
        flag="--io-uring",
        parse=config.choice("on", "off"),
        default="on",
        help="send a batch of held writes in one io_uring call where the kernel allows (on), "
        "or one system call per write (off)",
    ),
    Option(
        flag="--worker-slice",
        parse=sched.parse_slice,
        default=sched.DEFAULT,
        help="the workers' scheduler slice (Linux 6.12+), 100us-100ms: a short one lets a "
        "woken worker run before a busy app's slice ends (agent.proxy.sched); off, the "
        "default, keeps the kernel's",
    ),
    Option(
        flag="--identity-dir",
        parse=config.parse_dir,
        help="ca.crt and token-signing key (embedded control plane, token minting)",
    ),
    Option(
        flag="--trust-anchors",
        parse=config.parse_path,
        help="trust bundle PEM (default IDENTITY_DIR/ca.crt)",
    ),
    Option(
        flag="--token-source",
        parse=config.choice("mint"),
        default="mint",
        help="where Certify tokens come from: mint (with IDENTITY_DIR's key)",
    ),
    Option(flag="--identity-addr", parse=config.parse_host_port, help="Identity HOST:PORT"),
    Option(flag="--policy-addr", parse=config.parse_host_port, help="policy HOST:PORT"),
    Option(
        flag="--netns-dir",
        parse=config.parse_dir_path,
        default=str(NETNS_DIR),
        help="where pods' network namespaces are held (bind mounts)",
    ),
    Option(
        flag="--worker-plugins",
        parse=parse_plugins,
        help="comma-separated worker plugin modules (default: agent.proxy.dataplane if present)",
    ),
    Option(flag="--cluster-domain", parse=config.parse_dns_name, default="cluster.local", help=""),
    Option(flag="--trust-domain", parse=config.parse_dns_name, default="cluster.local", help=""),
    Option(
        flag="--controlplane-namespace",
        parse=config.parse_dns_name,
        default="linkerd",
        help="namespace named in identities",
    ),
)


def _default_plugins() -> tuple[str, ...]:
    import importlib.util  # noqa: PLC0415

    return ("agent.proxy.dataplane",) if importlib.util.find_spec("agent.proxy.dataplane") else ()


@dataclass(frozen=True, slots=True, kw_only=True)
class RunSettings:
    """Everything `meshagent run` needs; see `RUN_OPTIONS` for meanings."""

    control_plane: str
    manifests: Path
    node: str
    redirect: str = "iptables"
    workers: int = 1
    cpu_placement: str = "off"  # one of CPU_PLACEMENTS (agent.proxy.placement)
    admin_addr: tuple[str, int] = ("0.0.0.0", config.ADMIN_PORT)
    grace: float = 30.0
    h2_upgrade: str = "auto"  # one of H2_UPGRADE_MODES (agent.proxy.h1toh2 rule 7)
    io_uring: bool = True  # agent.proxy.writes rule 6
    worker_slice: float | None = None  # seconds, None: the kernel's (agent.proxy.sched)
    identity_dir: Path | None = None
    trust_anchors: Path | None = None
    token_source: str = "mint"  # noqa: S105 - a source name, not a secret
    identity_addr: str = ""
    policy_addr: str = ""
    netns_dir: Path = NETNS_DIR
    worker_plugins: tuple[str, ...] = ()
    cleanup_on_exit: bool = False
    cluster_domain: str = "cluster.local"
    trust_domain: str = "cluster.local"
    controlplane_namespace: str = "linkerd"
    log_level: str = "info"

    @property
    def embedded(self) -> bool:
        return self.control_plane == EMBEDDED

    def addresses(self) -> dict[str, str]:
        """Destination, identity and policy addresses of a remote control plane."""
        host, sep, port = self.control_plane.rpartition(":")
        if not sep or not port.isdigit():
            host, port = self.control_plane, str(DESTINATION_PORT)
        return {
            "destination": f"{host}:{port}",
            "identity": self.identity_addr or f"{host}:{IDENTITY_PORT}",
            "policy": self.policy_addr or f"{host}:{POLICY_PORT}",
        }

    @classmethod
    def from_values(cls, values: dict[str, Any], *, log_level: str = "info") -> RunSettings:
        """Build from `resolve(args, env, RUN_OPTIONS)`.

        Raises:
            SettingError: a combination of flags that cannot work.
        """
        identity_dir = values["identity_dir"]
        trust = values["trust_anchors"] or (identity_dir / "ca.crt" if identity_dir else None)
        if identity_dir is None:
            raise SettingError(
                "--identity-dir", "", "required: the token-signing key (and ca.crt) live there"
            )
        if trust is None or not Path(trust).is_file():
            raise SettingError("--trust-anchors", str(trust), "no such file")
        plugins = values["worker_plugins"]
        return cls(
            control_plane=values["control_plane"],
            manifests=values["pods_from"],
            node=values["node"] or socket.gethostname(),
            redirect=values["redirect"],
            workers=values["workers"] or cpulimit.usable_cpus(),
            cpu_placement=values["cpu_placement"],
            admin_addr=values["admin_addr"],
            grace=values["grace"],
            h2_upgrade=values["h2_upgrade"],
            io_uring=values["io_uring"] == "on",
            worker_slice=values["worker_slice"],
            identity_dir=identity_dir,
            trust_anchors=Path(trust),
            token_source=values["token_source"],
            identity_addr=_addr(values["identity_addr"]),
            policy_addr=_addr(values["policy_addr"]),
            netns_dir=values["netns_dir"],
            worker_plugins=plugins if plugins is not None else _default_plugins(),
            cleanup_on_exit=bool(values.get("cleanup_on_exit")),
            cluster_domain=values["cluster_domain"],
            trust_domain=values["trust_domain"],
            controlplane_namespace=values["controlplane_namespace"],
            log_level=log_level,
        )


def _addr(value: tuple[str, int] | None) -> str:
    return f"{value[0]}:{value[1]}" if value else ""
