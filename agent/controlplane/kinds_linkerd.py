"""Linkerd's kinds: linkerd.io ServiceProfile, the policy.linkerd.io kinds, HTTPRoute.

ServiceProfile (routes, response classes, retry budget, traffic split);
Server, ServerAuthorization, AuthorizationPolicy, MeshTLSAuthentication and
NetworkAuthentication; HTTPRoute of both policy.linkerd.io and
gateway.networking.k8s.io (its `group` tells them apart and is part of its
`key`). Pure data, built on `agent.controlplane.resources`.

Rules (those of `resources`, as they apply here):
1. Field names are Linkerd's/the Gateway API's in snake_case (with a trailing
   `_` where the name is a Python keyword: `not_`, `except_`); defaults are
   theirs (a Server's `access_policy` is "deny", a route match's path is
   PathPrefix "/", a backend is a Service).
2. Label selectors hold `FrozenMap`s; every object is immutable and hashable.
3. Durations (route timeouts, a retry budget's ttl) are float seconds; CIDRs
   are `ipaddress` networks; ports named or numbered are `int | str`.
4. `source` (from `Object`) does not take part in equality.
5. Imports only `resources` of the model, never `kinds_core` or `kinds`.
"""

from __future__ import annotations

import enum
import ipaddress
from dataclasses import dataclass, field

from agent.controlplane.resources import IPNetwork, LabelSelector, Object, ObjectRef, PortRange

# --- linkerd.io ServiceProfile ----------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestMatch:
    """A route condition; every field set must hold (Linkerd ANDs them)."""

    all: tuple[RequestMatch, ...] = ()
    any: tuple[RequestMatch, ...] = ()
    not_: RequestMatch | None = None
    method: str = ""
    path_regex: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class StatusRange:
    """An inclusive HTTP status range; None means unbounded on that side."""

    min: int | None = None
    max: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class ResponseMatch:
    """A response class condition; every field set must hold."""

    all: tuple[ResponseMatch, ...] = ()
    any: tuple[ResponseMatch, ...] = ()
    not_: ResponseMatch | None = None
    status: StatusRange | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class ResponseClass:
    """Responses matching `condition` are failures if `is_failure`."""

    condition: ResponseMatch
    is_failure: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class Route:
    """A ServiceProfile route; `timeout` in seconds (None: the proxy default)."""

    name: str
    condition: RequestMatch
    response_classes: tuple[ResponseClass, ...] = ()
    is_retryable: bool = False
    timeout: float | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class RetryBudget:
    """Retries allowed: a ratio of requests, at least a floor per second, over `ttl` seconds."""

    retry_ratio: float
    min_retries_per_second: int
    ttl: float


@dataclass(frozen=True, slots=True, kw_only=True)
class WeightedDst:
    """A traffic-split destination; `weight` is the quantity's value ("500m" is 0.5)."""

    authority: str
    weight: float


@dataclass(frozen=True, slots=True, kw_only=True)
class ServiceProfile(Object):
    """linkerd.io ServiceProfile; its name is the FQDN it describes."""

    routes: tuple[Route, ...] = ()
    retry_budget: RetryBudget | None = None
    opaque_ports: tuple[PortRange | str, ...] = ()
    dst_overrides: tuple[WeightedDst, ...] = ()


# --- policy.linkerd.io --------------------------------------------------------------


class ProxyProtocol(enum.Enum):
    """Server spec.proxyProtocol."""

    UNKNOWN = "unknown"
    HTTP1 = "HTTP/1"
    HTTP2 = "HTTP/2"
    GRPC = "gRPC"
    OPAQUE = "opaque"
    TLS = "TLS"


class AccessPolicy(enum.Enum):
    """Server spec.accessPolicy and the default-inbound-policy annotation values."""

    ALL_UNAUTHENTICATED = "all-unauthenticated"
    ALL_AUTHENTICATED = "all-authenticated"
    CLUSTER_UNAUTHENTICATED = "cluster-unauthenticated"
    CLUSTER_AUTHENTICATED = "cluster-authenticated"
    DENY = "deny"
    AUDIT = "audit"


@dataclass(frozen=True, slots=True, kw_only=True)
class Server(Object):
    """policy.linkerd.io Server: a port on the pods its selector picks."""

    pod_selector: LabelSelector
    port: int | str
    proxy_protocol: ProxyProtocol = ProxyProtocol.UNKNOWN
    access_policy: AccessPolicy = AccessPolicy.DENY


@dataclass(frozen=True, slots=True, kw_only=True)
class Network:
    """An authorized client network: `cidr` minus `except_`."""

    cidr: IPNetwork
    except_: tuple[IPNetwork, ...] = ()

    def contains(self, ip: str) -> bool:
        """Whether the address is in this network and not excepted."""
        addr = ipaddress.ip_address(ip)
        if addr.version != self.cidr.version or addr not in self.cidr:
            return False
        return not any(addr.version == ex.version and addr in ex for ex in self.except_)


@dataclass(frozen=True, slots=True, kw_only=True)
class ServiceAccountRef:
    """A service account by name; namespace "" means the referrer's."""

    name: str
    namespace: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class MeshTLSClient:
    """ServerAuthorization client.meshTLS."""

    unauthenticated_tls: bool = False
    identities: tuple[str, ...] = ()
    service_accounts: tuple[ServiceAccountRef, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerAuthorization(Object):
    """policy.linkerd.io ServerAuthorization; exactly one of server_name/server_selector."""

    server_name: str = ""
    server_selector: LabelSelector | None = None
    networks: tuple[Network, ...] = ()  # () means all networks
    unauthenticated: bool = False
    mesh_tls: MeshTLSClient | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class AuthorizationPolicy(Object):
    """policy.linkerd.io AuthorizationPolicy: target plus required authentications."""

    target_ref: ObjectRef
    required_authentication_refs: tuple[ObjectRef, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class MeshTLSAuthentication(Object):
    """Authenticated client identities (strings, or refs to ServiceAccounts/Namespaces)."""

    identities: tuple[str, ...] = ()
    identity_refs: tuple[ObjectRef, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class NetworkAuthentication(Object):
    """Authenticated client networks."""

    networks: tuple[Network, ...] = ()


# --- HTTPRoute (policy.linkerd.io and gateway.networking.k8s.io) -------------------


class PathMatchType(enum.Enum):
    """HTTPPathMatch type."""

    EXACT = "Exact"
    PATH_PREFIX = "PathPrefix"
    REGULAR_EXPRESSION = "RegularExpression"


class ValueMatchType(enum.Enum):
    """Header and query-param match type."""

    EXACT = "Exact"
    REGULAR_EXPRESSION = "RegularExpression"


@dataclass(frozen=True, slots=True, kw_only=True)
class PathMatch:
    """Defaults are the Gateway API's: PathPrefix "/"."""

    type: PathMatchType = PathMatchType.PATH_PREFIX
    value: str = "/"


@dataclass(frozen=True, slots=True, kw_only=True)
class ValueMatch:
    """A header or query-param match."""

    name: str
    value: str
    type: ValueMatchType = ValueMatchType.EXACT


@dataclass(frozen=True, slots=True, kw_only=True)
class RouteMatch:
    """One HTTPRouteMatch; all present parts must hold."""

    path: PathMatch | None = field(default_factory=PathMatch)
    headers: tuple[ValueMatch, ...] = ()
    query_params: tuple[ValueMatch, ...] = ()
    method: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class ParentRef:
    """A route's parent (Server, Service or Gateway)."""

    name: str
    kind: str
    group: str
    namespace: str = ""  # "" means the route's namespace
    port: int | None = None
    section_name: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class BackendRef:
    """A route backend (a Service by default)."""

    name: str
    namespace: str = ""
    port: int | None = None
    weight: int = 1
    kind: str = "Service"
    group: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class RouteRule:
    """matches (ORed) -> backends; filters are kept by type only."""

    matches: tuple[RouteMatch, ...] = (RouteMatch(),)
    backend_refs: tuple[BackendRef, ...] = ()
    filters: tuple[str, ...] = ()
    timeout: float | None = None
    backend_timeout: float | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class HTTPRoute(Object):
    """An HTTPRoute; `group` tells policy.linkerd.io from gateway.networking.k8s.io."""

    group: str
    parent_refs: tuple[ParentRef, ...] = ()
    hostnames: tuple[str, ...] = ()
    rules: tuple[RouteRule, ...] = (RouteRule(),)

    @property
    def key(self) -> tuple[str, str, str]:
        """Routes of the two API groups are distinct objects."""
        return (f"HTTPRoute.{self.group}", self.namespace, self.name)
