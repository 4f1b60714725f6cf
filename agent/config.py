"""Typed settings from flags and `MESHAGENT_*` environment variables.

Rules:
1. Every flag has a mirror variable: `--admin-port` is `MESHAGENT_ADMIN_PORT`.
   A flag given on the command line wins over the variable, which wins over the
   default.
2. Every raw value goes through one parser; a parser raises `ValueError(reason)`
   and `resolve` turns it into a `SettingError` naming the flag or variable, the
   value and the reason.
3. Commands get frozen dataclasses, never the argparse namespace.
"""

from __future__ import annotations

import ipaddress
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, get_args

from agent.errors import SettingError

if TYPE_CHECKING:
    import argparse
    from collections.abc import Callable, Mapping, Sequence

# Linkerd's ports (DESIGN.md conventions).
OUTBOUND_PORT = 4140
INBOUND_PORT = 4143
ADMIN_PORT = 4191
CONTROL_PORT = 4190
DESTINATION_PORT = 8086
IDENTITY_PORT = 8080
POLICY_PORT = 8090

ENV_PREFIX = "MESHAGENT_"


def env_name(flag: str) -> str:
    """`--admin-port` -> `MESHAGENT_ADMIN_PORT`."""
    return ENV_PREFIX + flag.lstrip("-").replace("-", "_").upper()


# --- parsers: str -> value, raising ValueError(reason) ----------------------


def parse_port(raw: str) -> int:
    """A TCP port, 1-65535."""
    try:
        port = int(raw)
    except ValueError:
        raise ValueError("not an integer port") from None
    if not 0 < port < 65536:
        raise ValueError("port must be between 1 and 65535")
    return port


def parse_positive_int(raw: str) -> int:
    """An integer >= 1."""
    try:
        value = int(raw)
    except ValueError:
        raise ValueError("not an integer") from None
    if value < 1:
        raise ValueError("must be at least 1")
    return value


def parse_seconds(raw: str) -> float:
    """A duration: `30`, `1.5`, `30s`, `500ms`, `100us`, `2m`, `1h`."""
    text = raw.strip().lower()
    scale, per = 1, 1  # a unit is scale / per seconds: `100us` is 0.0001 exactly, as written
    units = (("us", 1, 1_000_000), ("ms", 1, 1000), ("s", 1, 1), ("m", 60, 1), ("h", 3600, 1))
    for suffix, unit_scale, unit_per in units:
        if text.endswith(suffix):
            text, scale, per = text[: -len(suffix)], unit_scale, unit_per
            break
    try:
        value = float(text) * scale / per
    except ValueError:
        raise ValueError("not a duration (examples: 30, 30s, 500ms, 2m)") from None
    if not math.isfinite(value):
        raise ValueError("not a finite duration")
    if value < 0:
        raise ValueError("duration must not be negative")
    return value


def parse_dir(raw: str) -> Path:
    """An existing directory."""
    path = Path(raw)
    if not path.is_dir():
        raise ValueError("no such directory")
    return path


def parse_path(raw: str) -> Path:
    """Any path (it may not exist yet)."""
    if not raw:
        raise ValueError("empty path")
    return Path(raw)


def parse_dir_path(raw: str) -> Path:
    """A directory, existing or to be made: not a file."""
    path = parse_path(raw)
    if path.exists() and not path.is_dir():
        raise ValueError("not a directory")
    return path


def parse_host_port(raw: str) -> tuple[str, int]:
    """`host:port` or `[v6]:port`."""
    host, sep, port = raw.rpartition(":")
    if not sep or not host:
        raise ValueError("expected HOST:PORT")
    host = host.strip("[]")
    return host, parse_port(port)


def parse_ip(raw: str) -> str:
    """An IPv4 or IPv6 address, normalised."""
    try:
        return str(ipaddress.ip_address(raw))
    except ValueError:
        raise ValueError("not an IP address") from None


def choice(*values: str) -> Callable[[str], str]:
    """A parser accepting exactly one of `values`."""

    def parse(raw: str) -> str:
        if raw not in values:
            raise ValueError(f"must be one of {', '.join(values)}")
        return raw

    return parse


# --- options ------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Option:
    """One flag and its mirror variable."""

    flag: str
    parse: Callable[[str], Any]
    default: str | None = None
    help: str = ""
    required: bool = False

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")

    @property
    def env(self) -> str:
        return env_name(self.flag)


def add_options(parser: argparse.ArgumentParser, options: Sequence[Option]) -> None:
    """Declare `options` on `parser`; values are parsed later by `resolve`."""
    for opt in options:
        default = f" (default {opt.default})" if opt.default is not None else ""
        parser.add_argument(
            opt.flag,
            dest=opt.dest,
            default=None,
            metavar=opt.dest.upper(),
            help=f"{opt.help}{default}; env {opt.env}",
        )


def resolve(
    args: argparse.Namespace, env: Mapping[str, str], options: Sequence[Option]
) -> dict[str, Any]:
    """Parse every option from flag, variable or default.

    Raises:
        SettingError: a value does not parse, or a required one is missing.
    """
    values: dict[str, Any] = {}
    for opt in options:
        raw = getattr(args, opt.dest, None)
        source = opt.flag
        if raw is None and opt.env in env:
            raw, source = env[opt.env], opt.env
        if raw is None:
            raw, source = opt.default, f"{opt.flag} (default)"
        if raw is None:
            if opt.required:
                raise SettingError(opt.flag, "", f"required (or set {opt.env})")
            values[opt.dest] = None
            continue
        try:
            values[opt.dest] = opt.parse(raw)
        except ValueError as exc:
            raise SettingError(source, raw, str(exc)) from None
    return values


# --- meshagent controlplane -----------------------------------------------------

DEFAULT_CLUSTER_NETWORKS = "10.0.0.0/8,100.64.0.0/10,172.16.0.0/12,192.168.0.0/16"
InboundPolicy = Literal[
    "all-unauthenticated",
    "all-authenticated",
    "cluster-unauthenticated",
    "cluster-authenticated",
    "deny",
    "audit",
]  # Linkerd's default inbound policies (and a Server's accessPolicy)
INBOUND_POLICIES: tuple[str, ...] = get_args(InboundPolicy)


def parse_listen_port(raw: str) -> int:
    """A TCP port to listen on, 0-65535 (0: let the kernel pick one)."""
    if raw.strip() == "0":
        return 0
    return parse_port(raw)


def parse_networks(raw: str) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]:
    """A comma-separated list of CIDRs, at least one."""
    nets = []
    for item in (part.strip() for part in raw.split(",")):
        if not item:
            continue
        try:
            nets.append(ipaddress.ip_network(item, strict=False))
        except ValueError:
            raise ValueError(f"{item!r} is not a CIDR") from None
    if not nets:
        raise ValueError("expected at least one CIDR")
    return tuple(nets)


def parse_dns_name(raw: str) -> str:
    """A DNS name such as `cluster.local` (lowercase labels of letters, digits, '-')."""
    labels = raw.rstrip(".").split(".")
    ok = all(
        0 < len(label) < 64 and label.replace("-", "").isalnum() and label == label.lower()
        for label in labels
    )
    if not ok or len(raw) > 253:
        raise ValueError("not a DNS name")
    return raw.rstrip(".")


def parse_positive_seconds(raw: str) -> float:
    """A duration above zero."""
    value = parse_seconds(raw)
    if value <= 0:
        raise ValueError("must be positive")
    return value


@dataclass(frozen=True, slots=True, kw_only=True)
class ControlPlaneSettings:
    """`meshagent controlplane`: the embedded Destination, Identity and policy servers."""

    manifests: Path
    identity_dir: Path
    bind: str = "0.0.0.0"
    destination_port: int = DESTINATION_PORT
    identity_port: int = IDENTITY_PORT
    policy_port: int = POLICY_PORT
    cluster_domain: str = "cluster.local"
    trust_domain: str = "cluster.local"
    controlplane_namespace: str = "linkerd"
    default_inbound_policy: str = "all-unauthenticated"
    cluster_networks: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...] = tuple(
        ipaddress.ip_network(n) for n in DEFAULT_CLUSTER_NETWORKS.split(",")
    )
    issuance_lifetime: float = 24 * 3600.0
    clock_skew: float = 20.0
    shutdown_grace: float = 5.0
    poll_interval: float = 0.2

    @classmethod
    def from_values(cls, values: Mapping[str, Any]) -> ControlPlaneSettings:
        """Build from `resolve(args, env, CONTROLPLANE_OPTIONS)`."""
        return cls(**{k: v for k, v in values.items() if v is not None})


CONTROLPLANE_OPTIONS: tuple[Option, ...] = (
    Option(flag="--manifests", parse=parse_dir, required=True, help="folder of YAML manifests"),
    Option(
        flag="--identity-dir",
        parse=parse_dir,
        required=True,
        help="issuer.crt, issuer.key, ca.crt and the token-signing key",
    ),
    Option(flag="--bind", parse=parse_ip, default="0.0.0.0", help="address to listen on"),
    Option(
        flag="--destination-port",
        parse=parse_listen_port,
        default=str(DESTINATION_PORT),
        help="Destination gRPC port (0: any)",
    ),
    Option(
        flag="--identity-port",
        parse=parse_listen_port,
        default=str(IDENTITY_PORT),
        help="Identity gRPC port (0: any)",
    ),
    Option(
        flag="--policy-port",
        parse=parse_listen_port,
        default=str(POLICY_PORT),
        help="inbound policy gRPC port (0: any)",
    ),
    Option(
        flag="--cluster-domain", parse=parse_dns_name, default="cluster.local", help="DNS suffix"
    ),
    Option(
        flag="--trust-domain", parse=parse_dns_name, default="cluster.local", help="mesh identity"
    ),
    Option(
        flag="--controlplane-namespace",
        parse=parse_dns_name,
        default="linkerd",
        help="namespace named in identities",
    ),
    Option(
        flag="--default-inbound-policy",
        parse=choice(*INBOUND_POLICIES),
        default="all-unauthenticated",
        help="policy of ports no Server selects",
    ),
    Option(
        flag="--cluster-networks",
        parse=parse_networks,
        default=DEFAULT_CLUSTER_NETWORKS,
        help="pod and node networks, comma-separated CIDRs",
    ),
    Option(
        flag="--issuance-lifetime",
        parse=parse_positive_seconds,
        default="24h",
        help="validity of workload certificates",
    ),
    Option(
        flag="--clock-skew",
        parse=parse_seconds,
        default="20s",
        help="backdating of workload certificates",
    ),
    Option(
        flag="--shutdown-grace",
        parse=parse_seconds,
        default="5s",
        help="time open streams get to finish on SIGTERM",
    ),
)

CONTROLPLANE_TOKEN_OPTIONS: tuple[Option, ...] = (
    Option(
        flag="--identity-dir",
        parse=parse_dir,
        required=True,
        help="identity dir holding token-signing.key (created if missing)",
    ),
    Option(flag="--lifetime", parse=parse_positive_seconds, default="24h", help="token validity"),
)
