"""Typed domain objects for the Kubernetes and Linkerd resources the store holds.

Pure data; no I/O, no pydantic. `agent.controlplane.manifests` builds these from
YAML and validates them; everything inward (the store, the control-plane
servers) sees only these frozen dataclasses.

Rules:
1. Field names are Kubernetes'/Linkerd's in snake_case; defaults are theirs
   (a Service port's `target_port` defaults to its `port`, a Pod's service
   account to "default", a Server's `access_policy` to "deny", ...).
2. Mappings are `FrozenMap` so every object is immutable and hashable.
3. Durations are float seconds; CIDRs are `ipaddress` networks; ports named
   or numbered are `int | str` (a digit string is always turned into an int).
4. `source` says which file and document an object came from; it does not
   take part in equality.
"""

from __future__ import annotations

import enum
import ipaddress
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TypeAlias

IPNetwork: TypeAlias = ipaddress.IPv4Network | ipaddress.IPv6Network

INJECT_ANNOTATION = "linkerd.io/inject"
OPAQUE_PORTS_ANNOTATION = "config.linkerd.io/opaque-ports"
DEFAULT_INBOUND_POLICY_ANNOTATION = "config.linkerd.io/default-inbound-policy"
SERVICE_NAME_LABEL = "kubernetes.io/service-name"  # EndpointSlice -> Service

# Linkerd's proxy treats these as opaque unless configured otherwise.
DEFAULT_OPAQUE_PORTS = "25,587,3306,4444,5432,6379,9300,11211"


class FrozenMap(Mapping[str, str]):
    """An immutable, hashable str -> str mapping (labels, annotations, selectors)."""

    __slots__ = ("_data", "_hash")

    def __init__(self, data: Mapping[str, str] | None = None) -> None:
        self._data: dict[str, str] = dict(data or {})
        self._hash: int | None = None

    def __getitem__(self, key: str) -> str:
        return self._data[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __hash__(self) -> int:
        if self._hash is None:
            self._hash = hash(frozenset(self._data.items()))
        return self._hash

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Mapping):
            return dict(self._data) == dict(other)
        return NotImplemented

    def __repr__(self) -> str:
        return f"FrozenMap({self._data!r})"

    def __reduce__(self) -> tuple[type[FrozenMap], tuple[dict[str, str]]]:
        return (FrozenMap, (self._data,))


EMPTY = FrozenMap()


@dataclass(frozen=True, slots=True, kw_only=True)
class Source:
    """Where an object was read: a file and the 0-based document index in it."""

    file: str
    index: int

    def __str__(self) -> str:
        return f"{self.file} document {self.index}"


# --- durations, ports, quantities -------------------------------------------

_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|μs|ms|s|m|h)")
_DURATION_UNITS = {
    "ns": 1e-9,
    "us": 1e-6,
    "µs": 1e-6,
    "μs": 1e-6,
    "ms": 1e-3,
    "s": 1.0,
    "m": 60.0,
    "h": 3600.0,
}


def parse_duration(text: str) -> float:
    """A Go duration ("300ms", "10s", "1m30s", "0") in seconds; ValueError if malformed."""
    raw = text.strip()
    if raw == "0":
        return 0.0
    if not raw:
        raise ValueError("empty duration")
    pos, total = 0, 0.0
    while pos < len(raw):
        match = _DURATION_PART.match(raw, pos)
        if match is None:
            raise ValueError(f"not a duration: {text!r} (examples: 300ms, 10s, 1m30s)")
        total += float(match.group(1)) * _DURATION_UNITS[match.group(2)]
        pos = match.end()
    return total


_PORT_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


def check_port_name(name: str) -> str:
    """A Kubernetes port name (IANA_SVC_NAME): <= 15 chars, lowercase, one letter."""
    if len(name) > 15 or not _PORT_NAME.match(name) or not re.search(r"[a-z]", name):
        raise ValueError(f"{name!r} is not a valid port name")
    return name


def check_port(port: int) -> int:
    """A port number 1-65535."""
    if not 0 < port < 65536:
        raise ValueError(f"port {port} is not between 1 and 65535")
    return port


def int_or_name(value: int | str) -> int | str:
    """A port given as number or name; digit strings become ints."""
    if isinstance(value, bool):
        raise ValueError("expected a port number or name")  # noqa: TRY004 - pydantic wants ValueError
    if isinstance(value, int):
        return check_port(value)
    if value.isdigit():
        return check_port(int(value))
    return check_port_name(value)


@dataclass(frozen=True, slots=True)
class PortRange:
    """An inclusive port range; a single port has first == last."""

    first: int
    last: int

    def __contains__(self, port: object) -> bool:
        return isinstance(port, int) and self.first <= port <= self.last


def parse_port_list(text: str) -> tuple[PortRange | str, ...]:
    """Linkerd's port list annotation syntax: "25,8080-8090,http"; ValueError if malformed."""
    items: list[PortRange | str] = []
    for token in (t.strip() for t in text.split(",")):
        if not token:
            continue
        first, sep, last = token.partition("-")
        if first.isdigit() and (not sep or last.isdigit()):
            lo, hi = int(first), int(last) if sep else int(first)
            check_port(lo)
            check_port(hi)
            if lo > hi:
                raise ValueError(f"port range {token!r} is reversed")
            items.append(PortRange(lo, hi))
        else:
            items.append(check_port_name(token))
    return tuple(items)


_QUANTITY = re.compile(r"^([+-]?(?:\d+(?:\.\d*)?|\.\d+))(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$")
_QUANTITY_SCALE = {
    None: 1.0,
    "m": 1e-3,
    "k": 1e3,
    "M": 1e6,
    "G": 1e9,
    "T": 1e12,
    "P": 1e15,
    "E": 1e18,
    "Ki": 2.0**10,
    "Mi": 2.0**20,
    "Gi": 2.0**30,
    "Ti": 2.0**40,
    "Pi": 2.0**50,
    "Ei": 2.0**60,
}


def parse_quantity(value: float | str) -> float:
    """A Kubernetes resource quantity ("1", "500m", "10k") as a float."""
    if isinstance(value, bool):
        raise ValueError("expected a quantity")  # noqa: TRY004 - pydantic wants ValueError
    if isinstance(value, int | float):
        return float(value)
    match = _QUANTITY.match(value.strip())
    if match is None:
        raise ValueError(f"not a quantity: {value!r}")
    return float(match.group(1)) * _QUANTITY_SCALE[match.group(2)]


def parse_network(text: str) -> IPNetwork:
    """A CIDR or a bare IP (a /32 or /128); host bits are allowed and dropped."""
    try:
        return ipaddress.ip_network(text.strip(), strict=False)
    except ValueError:
        raise ValueError(f"{text!r} is not a CIDR or IP address") from None


# --- selectors ----------------------------------------------------------------


class SelectorOperator(enum.Enum):
    """A matchExpressions operator."""

    IN = "In"
    NOT_IN = "NotIn"
    EXISTS = "Exists"
    DOES_NOT_EXIST = "DoesNotExist"


@dataclass(frozen=True, slots=True, kw_only=True)
class SelectorRequirement:
    """One matchExpressions entry."""

    key: str
    operator: SelectorOperator
    values: tuple[str, ...] = ()

    def matches(self, labels: Mapping[str, str]) -> bool:
        """Whether `labels` satisfy this requirement."""
        present = self.key in labels
        if self.operator is SelectorOperator.IN:
            return present and labels[self.key] in self.values
        if self.operator is SelectorOperator.NOT_IN:
            return not present or labels[self.key] not in self.values
        if self.operator is SelectorOperator.EXISTS:
            return present
        return not present


@dataclass(frozen=True, slots=True, kw_only=True)
class LabelSelector:
    """matchLabels AND matchExpressions; an empty selector selects everything."""

    match_labels: FrozenMap = EMPTY
    match_expressions: tuple[SelectorRequirement, ...] = ()

    def matches(self, labels: Mapping[str, str]) -> bool:
        """Whether `labels` are selected."""
        for key, value in self.match_labels.items():
            if labels.get(key) != value:
                return False
        return all(req.matches(labels) for req in self.match_expressions)


# --- shared pieces -----------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Object:
    """Fields every resource has (namespace is "" for cluster-scoped kinds)."""

    name: str
    namespace: str = ""
    uid: str = ""
    labels: FrozenMap = EMPTY
    annotations: FrozenMap = EMPTY
    source: Source | None = field(default=None, compare=False)

    @property
    def kind(self) -> str:
        """The Kubernetes kind; the class name."""
        return type(self).__name__

    @property
    def key(self) -> tuple[str, str, str]:
        """(kind, namespace, name): unique in a store."""
        return (self.kind, self.namespace, self.name)

    @property
    def ref(self) -> str:
        """ "namespace/name" (or "name" when cluster-scoped)."""
        return f"{self.namespace}/{self.name}" if self.namespace else self.name


@dataclass(frozen=True, slots=True, kw_only=True)
class ObjectRef:
    """A reference to another object (Endpoints targetRef, policy refs)."""

    kind: str
    name: str = ""  # "" means "all of that kind" where the API allows it
    namespace: str = ""  # "" means the referencing object's namespace
    group: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class ContainerPort:
    """A port a container declares."""

    container_port: int
    name: str = ""
    protocol: str = "TCP"


@dataclass(frozen=True, slots=True, kw_only=True)
class Container:
    """A container: only what the mesh needs."""

    name: str
    image: str = ""
    ports: tuple[ContainerPort, ...] = ()


def resolve_port(
    containers: tuple[Container, ...], port: int | str, protocol: str = "TCP"
) -> int | None:
    """A port number for `port` (a number, or a container port name) in `containers`."""
    if isinstance(port, int):
        return port
    for container in containers:
        for cport in container.ports:
            if cport.name == port and cport.protocol == protocol:
                return cport.container_port
    return None


# --- core kinds ----------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Namespace(Object):
    """A namespace; cluster-scoped."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ServiceAccount(Object):
    """A service account: the workload identity."""


class PodPhase(enum.Enum):
    """status.phase."""

    PENDING = "Pending"
    RUNNING = "Running"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    UNKNOWN = "Unknown"


@dataclass(frozen=True, slots=True, kw_only=True)
class PodStatus:
    """The part of status the mesh reads; `ready` is the Ready condition."""

    phase: PodPhase = PodPhase.PENDING
    pod_ip: str = ""
    pod_ips: tuple[str, ...] = ()
    host_ip: str = ""
    ready: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class Pod(Object):
    """A pod."""

    service_account: str = "default"
    node_name: str = ""
    hostname: str = ""
    subdomain: str = ""
    host_network: bool = False
    containers: tuple[Container, ...] = ()
    status: PodStatus = field(default_factory=PodStatus)

    @property
    def ip(self) -> str:
        """The pod IP, "" until it has one."""
        return self.status.pod_ip

    @property
    def terminal(self) -> bool:
        """Succeeded or Failed: it will never serve again."""
        return self.status.phase in (PodPhase.SUCCEEDED, PodPhase.FAILED)

    def port(self, port: int | str, protocol: str = "TCP") -> int | None:
        """The container port number for a number or a declared port name."""
        return resolve_port(self.containers, port, protocol)


@dataclass(frozen=True, slots=True, kw_only=True)
class PodTemplate:
    """A Deployment's pod template: what the pods it makes will carry."""

    labels: FrozenMap = EMPTY
    annotations: FrozenMap = EMPTY
    service_account: str = "default"
    containers: tuple[Container, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class Deployment(Object):
    """apps/v1 Deployment; a sandbox expands it into pods."""

    replicas: int = 1
    selector: LabelSelector = field(default_factory=LabelSelector)
    template: PodTemplate = field(default_factory=PodTemplate)


class ServiceType(enum.Enum):
    """spec.type."""

    CLUSTER_IP = "ClusterIP"
    NODE_PORT = "NodePort"
    LOAD_BALANCER = "LoadBalancer"
    EXTERNAL_NAME = "ExternalName"


@dataclass(frozen=True, slots=True, kw_only=True)
class ServicePort:
    """One service port; `target_port` is a number or a container port name."""

    port: int
    target_port: int | str
    name: str = ""
    protocol: str = "TCP"
    node_port: int | None = None
    app_protocol: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class Service(Object):
    """A service; `selector` is None when it has none (explicit Endpoints only)."""

    type: ServiceType = ServiceType.CLUSTER_IP
    cluster_ip: str = ""  # "" unassigned, "None" headless
    cluster_ips: tuple[str, ...] = ()
    selector: FrozenMap | None = None
    ports: tuple[ServicePort, ...] = ()
    external_name: str = ""
    publish_not_ready_addresses: bool = False

    @property
    def headless(self) -> bool:
        """clusterIP: None."""
        return self.cluster_ip == "None"

    def port(self, number: int, protocol: str = "TCP") -> ServicePort | None:
        """The service port with that number and protocol."""
        for sport in self.ports:
            if sport.port == number and sport.protocol == protocol:
                return sport
        return None


@dataclass(frozen=True, slots=True, kw_only=True)
class EndpointsAddress:
    """An address in an Endpoints subset."""

    ip: str
    hostname: str = ""
    node_name: str = ""
    target_ref: ObjectRef | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class EndpointsPort:
    """A port of an Endpoints subset or EndpointSlice (port None: all ports, slices only)."""

    port: int | None
    name: str = ""
    protocol: str = "TCP"


@dataclass(frozen=True, slots=True, kw_only=True)
class EndpointsSubset:
    """addresses x ports."""

    addresses: tuple[EndpointsAddress, ...] = ()
    not_ready_addresses: tuple[EndpointsAddress, ...] = ()
    ports: tuple[EndpointsPort, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class Endpoints(Object):
    """v1 Endpoints; named as the Service it belongs to."""

    subsets: tuple[EndpointsSubset, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class SliceEndpoint:
    """One endpoint of an EndpointSlice; conditions left unset count as ready/serving."""

    addresses: tuple[str, ...]
    ready: bool = True
    serving: bool = True
    terminating: bool = False
    hostname: str = ""
    node_name: str = ""
    zone: str = ""
    target_ref: ObjectRef | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class EndpointSlice(Object):
    """discovery.k8s.io/v1 EndpointSlice; `service_name` is its kubernetes.io/service-name."""

    service_name: str = ""
    address_type: str = "IPv4"
    endpoints: tuple[SliceEndpoint, ...] = ()
    ports: tuple[EndpointsPort, ...] = ()


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


Resource: TypeAlias = (
    Namespace
    | Pod
    | ServiceAccount
    | Service
    | Endpoints
    | EndpointSlice
    | Deployment
    | ServiceProfile
    | Server
    | ServerAuthorization
    | AuthorizationPolicy
    | MeshTLSAuthentication
    | NetworkAuthentication
    | HTTPRoute
)

KINDS: tuple[type[Object], ...] = (
    Namespace,
    Pod,
    ServiceAccount,
    Service,
    Endpoints,
    EndpointSlice,
    Deployment,
    ServiceProfile,
    Server,
    ServerAuthorization,
    AuthorizationPolicy,
    MeshTLSAuthentication,
    NetworkAuthentication,
    HTTPRoute,
)
