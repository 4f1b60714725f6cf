"""Inbound policy types: what a pod's server port accepts and from whom.

Pure data, no I/O. Shapes follow `io.linkerd.proxy.inbound` (`Server`,
`Authz`, `Network`, `Authn`, `HttpRoute`); the control-plane client converts
protobuf into these. Default policies carry Linkerd's names
(`all-unauthenticated`, `all-authenticated`, `cluster-unauthenticated`,
`cluster-authenticated`, `deny`) so metrics read the same as Linkerd's.

Rules:
1. A policy that cannot be built is replaced by `ServerPolicy.invalid()`,
   which has no authorizations: it fails closed.
2. An authorization with no networks matches no client (as the proxy does;
   the control plane fills in all networks when a resource names none).
3. A MeshTLS suffix `""` is the root: it matches every identity. A suffix
   `ns.serviceaccount.identity.linkerd.cluster.local` matches identities that
   end in `.` plus the suffix.
"""

from __future__ import annotations

import enum
import ipaddress
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

# Linkerd's default detect timeout for inbound connections.
DEFAULT_DETECT_TIMEOUT_S = 10.0

# Linkerd's default `clusterNetworks` value.
DEFAULT_CLUSTER_NETWORKS = (
    "10.0.0.0/8",
    "100.64.0.0/10",
    "172.16.0.0/12",
    "192.168.0.0/16",
    "fd00::/8",
)
ALL_NETWORKS = ("0.0.0.0/0", "::/0")

DEFAULT_POLICY_NAMES = (
    "all-unauthenticated",
    "all-authenticated",
    "cluster-unauthenticated",
    "cluster-authenticated",
    "deny",
)


class ProxyProtocol(enum.Enum):
    """How the inbound proxy treats a server port's traffic."""

    DETECT = "detect"
    HTTP1 = "http1"
    HTTP2 = "http2"
    GRPC = "grpc"
    OPAQUE = "opaque"


@dataclass(frozen=True, slots=True, kw_only=True)
class Meta:
    """Who defined a policy object; rendered as `*_group/*_kind/*_name` metric labels."""

    name: str
    kind: str = "default"
    group: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class Network:
    """A client network, minus exceptions."""

    net: IPNetwork
    excepts: tuple[IPNetwork, ...] = ()

    @classmethod
    def parse(cls, cidr: str, *excepts: str) -> Network:
        """`Network.parse("10.0.0.0/8", "10.1.0.0/16")`; raises ValueError on bad CIDRs."""
        return cls(
            net=ipaddress.ip_network(cidr, strict=False),
            excepts=tuple(ipaddress.ip_network(e, strict=False) for e in excepts),
        )

    def contains(self, ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
        """True when `ip` is in the network and in none of its exceptions.

        Asked per connection: the families are told apart with `isinstance`, not the
        `version` properties, and the exceptions walked by a loop, not a generator:
        each of those is an interpreted call (`in` checks no family of its own)."""
        v4 = isinstance(ip, ipaddress.IPv4Address)
        if v4 is not isinstance(self.net, ipaddress.IPv4Network) or ip not in self.net:
            return False
        for e in self.excepts:
            if v4 is isinstance(e, ipaddress.IPv4Network) and ip in e:
                return False
        return True


@dataclass(frozen=True, slots=True)
class Unauthenticated:
    """Any client, TLS or not."""


@dataclass(frozen=True, slots=True)
class TLSUnauthenticated:
    """Any client whose connection the proxy terminated TLS for, identity or not."""


@dataclass(frozen=True, slots=True, kw_only=True)
class MeshTLS:
    """Clients with a verified mesh identity in `identities` or under one of `suffixes`."""

    identities: frozenset[str] = frozenset()
    suffixes: tuple[str, ...] = ()

    def matches(self, identity: str) -> bool:
        """True when `identity` is listed or falls under a suffix (`""` matches all)."""
        if identity in self.identities or "*" in self.identities:
            return True
        for suffix in self.suffixes:
            if not suffix or suffix == "*":
                return True
            if identity.endswith(suffix) and identity[: -len(suffix)].endswith("."):
                return True
        return False


Authentication = Unauthenticated | TLSUnauthenticated | MeshTLS


@dataclass(frozen=True, slots=True, kw_only=True)
class Authorization:
    """Clients from `networks` that pass `authentication` are allowed."""

    networks: tuple[Network, ...]
    authentication: Authentication
    meta: Meta


class PathKind(enum.Enum):
    """How an HTTP route path match compares."""

    EXACT = "exact"
    PREFIX = "prefix"
    REGEX = "regex"


@dataclass(frozen=True, slots=True, kw_only=True)
class HttpRouteMatch:
    """One match of an HTTP route rule; `None` fields match anything."""

    path_kind: PathKind = PathKind.PREFIX
    path: str | None = None
    method: str | None = None
    pattern: re.Pattern[str] | None = field(
        default=None, init=False, repr=False, compare=False, hash=False
    )

    def __post_init__(self) -> None:
        if self.path_kind is PathKind.REGEX and self.path is not None:
            try:
                object.__setattr__(self, "pattern", re.compile(self.path))
            except re.error as exc:
                raise ValueError(f"bad route path regex {self.path!r}: {exc}") from None

    def matches(self, method: str, path: str) -> bool:
        """True when the request's method and path (query excluded) match."""
        if self.method is not None and self.method != method:
            return False
        if self.path is None:
            return True
        if self.path_kind is PathKind.EXACT:
            return path == self.path
        if self.path_kind is PathKind.PREFIX:
            return _prefix_matches(self.path, path)
        assert self.pattern is not None  # noqa: S101 - set in __post_init__ for REGEX
        return self.pattern.fullmatch(path) is not None


def _prefix_matches(prefix: str, path: str) -> bool:
    # Gateway API prefixes match whole path segments: /foo matches /foo and /foo/bar, not /foobar.
    stripped = prefix.rstrip("/")
    if not stripped:
        return True
    return path == stripped or path.startswith(stripped + "/")


@dataclass(frozen=True, slots=True, kw_only=True)
class HttpRoute:
    """A policy HTTP route: requests matching any of `matches` use its authorizations."""

    meta: Meta
    matches: tuple[HttpRouteMatch, ...] = ()  # empty: matches every request
    authorizations: tuple[Authorization, ...] = ()

    def matches_request(self, method: str, path: str) -> bool:
        """True when some match (or, with none, any request) fits."""
        if not self.matches:
            return True
        for m in self.matches:  # noqa: SIM110 - not `any` over a generator: asked per request
            if m.matches(method, path):
                return True
        return False


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerPolicy:
    """The policy for one pod port (InboundServerPolicies.WatchPort)."""

    protocol: ProxyProtocol = ProxyProtocol.DETECT
    detect_timeout_s: float = DEFAULT_DETECT_TIMEOUT_S
    authorizations: tuple[Authorization, ...] = ()
    meta: Meta
    labels: Mapping[str, str] = field(default_factory=dict, hash=False)
    http_routes: tuple[HttpRoute, ...] | None = None  # None: no routes configured
    valid: bool = True

    @classmethod
    def invalid(cls, detect_timeout_s: float = DEFAULT_DETECT_TIMEOUT_S) -> ServerPolicy:
        """A policy that denies everything; stands in for one we could not build."""
        return cls(
            protocol=ProxyProtocol.OPAQUE,
            detect_timeout_s=detect_timeout_s,
            meta=Meta(name="invalid"),
            valid=False,
        )

    @classmethod
    def default(
        cls,
        name: str,
        *,
        cluster_networks: Iterable[str] = DEFAULT_CLUSTER_NETWORKS,
        detect_timeout_s: float = DEFAULT_DETECT_TIMEOUT_S,
        protocol: ProxyProtocol = ProxyProtocol.DETECT,
    ) -> ServerPolicy:
        """One of Linkerd's default policies by name; raises ValueError for others."""
        if name not in DEFAULT_POLICY_NAMES:
            raise ValueError(f"unknown default policy {name!r}; known: {DEFAULT_POLICY_NAMES}")
        authorizations: tuple[Authorization, ...] = ()
        if name != "deny":
            scope, _, authn = name.partition("-")
            cidrs = ALL_NETWORKS if scope == "all" else tuple(cluster_networks)
            authentication: Authentication = (
                Unauthenticated() if authn == "unauthenticated" else MeshTLS(suffixes=("",))
            )
            authorizations = (
                Authorization(
                    networks=tuple(Network.parse(c) for c in cidrs),
                    authentication=authentication,
                    meta=Meta(name=name),
                ),
            )
        return cls(
            protocol=protocol,
            detect_timeout_s=detect_timeout_s,
            authorizations=authorizations,
            meta=Meta(name=name),
        )
