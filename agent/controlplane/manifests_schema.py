"""pydantic models of the manifest documents meshagent reads (the shapes, not the meaning).

One model per Kubernetes/Linkerd/Gateway-API object part, validated field by
field; `agent.controlplane.manifests` converts a validated `*Doc` into a
`kinds_core`/`kinds_linkerd` dataclass and turns validation errors into `ManifestError`s.

Rules:
1. Only `manifests` imports this module; no model leaves the two of them.
2. Field validators raise `ValueError` (pydantic locates it in the document);
   checks that need several fields or the whole object live in `manifests`'s
   converters, which raise its `_Invalid` with a dotted field path.
3. Fields use snake_case names with camelCase aliases, like the YAML; unknown
   fields are ignored and `key:` with no value means unset, as in Kubernetes.
"""

from __future__ import annotations

import ipaddress
import re
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)
from pydantic.alias_generators import to_camel

from agent.controlplane import kinds_linkerd as l5d
from agent.controlplane import resources as r

# --- value validators (raise ValueError; pydantic locates them) ----------------


def _ip(value: str) -> str:
    if value:
        try:
            ipaddress.ip_address(value)
        except ValueError:
            raise ValueError(f"{value!r} is not an IP address") from None
    return value


def _port_value(value: Any) -> int | str:
    if not isinstance(value, int | str):
        raise ValueError("expected a port number or name")  # noqa: TRY004 - pydantic wants ValueError
    return r.int_or_name(value)


def _duration(value: Any) -> float:
    if not isinstance(value, str):
        raise ValueError("expected a duration such as 300ms or 10s")  # noqa: TRY004 - as above
    return r.parse_duration(value)


def _cidr(value: Any) -> r.IPNetwork:
    if not isinstance(value, str):
        raise ValueError("expected a CIDR string")  # noqa: TRY004 - as above
    return r.parse_network(value)


def _port_list(value: str) -> str:
    r.parse_port_list(value)
    return value


def _regex(value: str) -> str:
    try:
        re.compile(value)
    except re.error as exc:
        raise ValueError(f"invalid regular expression: {exc}") from None
    return value


IP = Annotated[str, AfterValidator(_ip)]
PortValue = Annotated[Any, AfterValidator(_port_value)]
Port = Annotated[int, AfterValidator(r.check_port)]
Duration = Annotated[Any, AfterValidator(_duration)]
Cidr = Annotated[Any, AfterValidator(_cidr)]
Regex = Annotated[str, AfterValidator(_regex)]
Protocol = Literal["TCP", "UDP", "SCTP"]


def _drop_nulls(value: Any) -> Any:
    """YAML `key:` with nothing after it means unset, as Kubernetes reads it."""
    if isinstance(value, dict):
        return {k: v for k, v in value.items() if v is not None}
    return value


class Model(BaseModel):
    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="ignore", frozen=True
    )

    @model_validator(mode="before")
    @classmethod
    def _nulls(cls, data: Any) -> Any:
        return _drop_nulls(data)


# --- shared models ----------------------------------------------------------------


class Meta(Model):
    name: str = Field(min_length=1)
    namespace: str = ""
    uid: str = ""
    labels: dict[str, str] = {}
    annotations: dict[str, str] = {}

    @field_validator("annotations")
    @classmethod
    def _known_annotations(cls, value: dict[str, str]) -> dict[str, str]:
        if (ports := value.get(r.OPAQUE_PORTS_ANNOTATION)) is not None:
            try:
                r.parse_port_list(ports)
            except ValueError as exc:
                raise ValueError(f"{r.OPAQUE_PORTS_ANNOTATION}: {exc}") from None
        policy = value.get(r.DEFAULT_INBOUND_POLICY_ANNOTATION)
        if policy is not None and policy not in {p.value for p in l5d.AccessPolicy}:
            raise ValueError(f"{r.DEFAULT_INBOUND_POLICY_ANNOTATION}: unknown policy {policy!r}")
        return value


class Requirement(Model):
    key: str
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist"]
    values: list[str] = []

    @model_validator(mode="after")
    def _values_fit(self) -> Requirement:
        if self.operator in ("In", "NotIn") and not self.values:
            raise ValueError(f"operator {self.operator} needs values")
        if self.operator in ("Exists", "DoesNotExist") and self.values:
            raise ValueError(f"operator {self.operator} takes no values")
        return self


class Selector(Model):
    match_labels: dict[str, str] = {}
    match_expressions: list[Requirement] = []


class Ref(Model):
    kind: str = Field(min_length=1)
    name: str = ""
    namespace: str = ""
    group: str = ""


class ContainerPort(Model):
    container_port: Port
    name: str = ""
    protocol: Protocol = "TCP"

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        return r.check_port_name(value) if value else value


class Container(Model):
    name: str
    image: str = ""
    ports: list[ContainerPort] = []


class Network(Model):
    cidr: Cidr
    except_: list[Cidr] = Field([], alias="except")


# --- core kinds ---------------------------------------------------------------------


class Doc(Model):
    metadata: Meta


class PodSpec(Model):
    service_account_name: str = ""
    service_account: str = ""  # deprecated alias Kubernetes still reads
    node_name: str = ""
    hostname: str = ""
    subdomain: str = ""
    host_network: bool = False
    containers: list[Container] = Field(min_length=1)


class Condition(Model):
    type: str
    status: str


class PodIP(Model):
    ip: IP


class PodStatus(Model):
    phase: Literal["Pending", "Running", "Succeeded", "Failed", "Unknown"] = "Pending"
    pod_ip: IP = Field("", alias="podIP")
    pod_ips: list[PodIP] = Field([], alias="podIPs")
    host_ip: IP = Field("", alias="hostIP")
    conditions: list[Condition] = []


class PodDoc(Doc):
    spec: PodSpec
    status: PodStatus = PodStatus()


class TemplateMeta(Model):
    labels: dict[str, str] = {}
    annotations: dict[str, str] = {}


class Template(Model):
    metadata: TemplateMeta = TemplateMeta()
    spec: PodSpec


class DeploymentSpec(Model):
    replicas: int = Field(1, ge=0)
    selector: Selector
    template: Template


class DeploymentDoc(Doc):
    spec: DeploymentSpec


class ServicePort(Model):
    port: Port
    target_port: PortValue | None = None
    name: str = ""
    protocol: Protocol = "TCP"
    node_port: Port | None = None
    app_protocol: str = ""


class ServiceSpec(Model):
    type: Literal["ClusterIP", "NodePort", "LoadBalancer", "ExternalName"] = "ClusterIP"
    cluster_ip: str = Field("", alias="clusterIP")
    cluster_ips: list[IP] = Field([], alias="clusterIPs")
    selector: dict[str, str] = {}
    ports: list[ServicePort] = []
    external_name: str = ""
    publish_not_ready_addresses: bool = False

    @field_validator("cluster_ip")
    @classmethod
    def _cluster_ip(cls, value: str) -> str:
        return value if value == "None" else _ip(value)


class ServiceDoc(Doc):
    spec: ServiceSpec = ServiceSpec()


class EndpointsAddress(Model):
    ip: IP = Field(min_length=1)
    hostname: str = ""
    node_name: str = ""
    target_ref: Ref | None = None


class EndpointsPort(Model):
    port: Port
    name: str = ""
    protocol: Protocol = "TCP"


class Subset(Model):
    addresses: list[EndpointsAddress] = []
    not_ready_addresses: list[EndpointsAddress] = []
    ports: list[EndpointsPort] = []


class EndpointsDoc(Doc):
    subsets: list[Subset] = []


class SliceConditions(Model):
    ready: bool = True
    serving: bool = True
    terminating: bool = False


class SliceEndpoint(Model):
    addresses: list[str] = Field(min_length=1)
    conditions: SliceConditions = SliceConditions()
    hostname: str = ""
    node_name: str = ""
    zone: str = ""
    target_ref: Ref | None = None


class SlicePort(Model):
    port: Port | None = None
    name: str = ""
    protocol: Protocol = "TCP"


class SliceDoc(Doc):
    address_type: Literal["IPv4", "IPv6", "FQDN"]
    endpoints: list[SliceEndpoint] = []
    ports: list[SlicePort] = []

    @model_validator(mode="after")
    def _addresses_fit(self) -> SliceDoc:
        if self.address_type != "FQDN":
            for ep in self.endpoints:
                for addr in ep.addresses:
                    _ip(addr)
        return self


# --- ServiceProfile ---------------------------------------------------------------


def _one_or_any(value: Any) -> Any:
    """The CRD types request `not` as a list; Linkerd's Go type is one match."""
    if isinstance(value, list):
        return value[0] if len(value) == 1 else {"any": value}
    return value


Method = Literal["GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE", "PATCH"]


class RequestMatch(Model):
    all: list[RequestMatch] = []
    any: list[RequestMatch] = []
    not_: Annotated[RequestMatch | None, BeforeValidator(_one_or_any)] = Field(None, alias="not")
    method: Method | None = None
    path_regex: Regex = ""

    @model_validator(mode="after")
    def _not_empty(self) -> RequestMatch:
        if not (self.all or self.any or self.not_ or self.method or self.path_regex):
            raise ValueError("a request match needs one of all, any, not, method, pathRegex")
        return self


class Range(Model):
    min: int | None = Field(None, ge=100, le=599)
    max: int | None = Field(None, ge=100, le=599)

    @model_validator(mode="after")
    def _ordered(self) -> Range:
        if self.min is None and self.max is None:
            raise ValueError("a status range needs min and/or max")
        if self.min is not None and self.max is not None and self.min > self.max:
            raise ValueError("status range min is greater than max")
        return self


class ResponseMatch(Model):
    all: list[ResponseMatch] = []
    any: list[ResponseMatch] = []
    not_: ResponseMatch | None = Field(None, alias="not")
    status: Range | None = None

    @model_validator(mode="after")
    def _not_empty(self) -> ResponseMatch:
        if not (self.all or self.any or self.not_ or self.status):
            raise ValueError("a response match needs one of all, any, not, status")
        return self


class ResponseClass(Model):
    condition: ResponseMatch
    is_failure: bool = False


class Route(Model):
    name: str = Field(min_length=1)
    condition: RequestMatch
    response_classes: list[ResponseClass] = []
    is_retryable: bool = False
    timeout: Duration | None = None


class RetryBudget(Model):
    retry_ratio: float = Field(ge=0)
    min_retries_per_second: int = Field(ge=0)
    ttl: Duration


class WeightedDst(Model):
    authority: str = Field(min_length=1)
    weight: Annotated[Any, AfterValidator(r.parse_quantity)]


class ProfileSpec(Model):
    routes: list[Route] = []
    retry_budget: RetryBudget | None = None
    opaque_ports: list[Annotated[str, AfterValidator(_port_list)]] = []
    dst_overrides: list[WeightedDst] = []


class ProfileDoc(Doc):
    spec: ProfileSpec = ProfileSpec()


# --- policy.linkerd.io ---------------------------------------------------------------

_IDENTITY = re.compile(r"^(\*|[a-z0-9]([-a-z0-9]*[a-z0-9])?)(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


def _identity(value: str) -> str:
    if not _IDENTITY.match(value):
        raise ValueError(f"{value!r} is not an identity (DNS name, optionally starting with *)")
    return value


Identity = Annotated[str, AfterValidator(_identity)]


class ServerSpec(Model):
    pod_selector: Selector | None = None
    port: PortValue
    proxy_protocol: Literal["unknown", "HTTP/1", "HTTP/2", "gRPC", "opaque", "TLS"] = "unknown"
    access_policy: Literal[
        "all-unauthenticated",
        "all-authenticated",
        "cluster-unauthenticated",
        "cluster-authenticated",
        "deny",
        "audit",
    ] = "deny"


class ServerDoc(Doc):
    spec: ServerSpec


class SARef(Model):
    name: str = Field(min_length=1)
    namespace: str = ""


class MeshTLS(Model):
    unauthenticated_tls: bool = Field(default=False, alias="unauthenticatedTLS")
    identities: list[Identity] = []
    service_accounts: list[SARef] = []


class Client(Model):
    networks: list[Network] = []
    unauthenticated: bool = False
    mesh_tls: MeshTLS | None = Field(None, alias="meshTLS")


class ServerTarget(Model):
    name: str = ""
    selector: Selector | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> ServerTarget:
        if bool(self.name) == (self.selector is not None):
            raise ValueError("exactly one of name and selector is required")
        return self


class SazSpec(Model):
    server: ServerTarget
    client: Client


class SazDoc(Doc):
    spec: SazSpec


class AuthzSpec(Model):
    target_ref: Ref
    required_authentication_refs: list[Ref]


class AuthzDoc(Doc):
    spec: AuthzSpec


class MeshTLSAuthSpec(Model):
    identities: list[Identity] = []
    identity_refs: list[Ref] = []


class MeshTLSAuthDoc(Doc):
    spec: MeshTLSAuthSpec


class NetworkAuthSpec(Model):
    networks: list[Network] = Field(min_length=1)


class NetworkAuthDoc(Doc):
    spec: NetworkAuthSpec


# --- HTTPRoute -------------------------------------------------------------------------


class PathMatch(Model):
    type: Literal["Exact", "PathPrefix", "RegularExpression"] = "PathPrefix"
    value: str = "/"

    @model_validator(mode="after")
    def _value_fits(self) -> PathMatch:
        if self.type == "RegularExpression":
            _regex(self.value)
        elif not self.value.startswith("/"):
            raise ValueError(f"{self.type} path must start with '/'")
        return self


class ValueMatch(Model):
    name: str = Field(min_length=1)
    value: str
    type: Literal["Exact", "RegularExpression"] = "Exact"

    @model_validator(mode="after")
    def _value_fits(self) -> ValueMatch:
        if self.type == "RegularExpression":
            _regex(self.value)
        return self


class RouteMatch(Model):
    path: PathMatch | None = None
    headers: list[ValueMatch] = []
    query_params: list[ValueMatch] = []
    method: Method | None = None


class BackendRef(Model):
    name: str = Field(min_length=1)
    namespace: str = ""
    port: Port | None = None
    weight: int = Field(1, ge=0)
    kind: str = "Service"
    group: str = ""


class Filter(Model):
    type: str


class Timeouts(Model):
    request: Duration | None = None
    backend_request: Duration | None = None


class RouteRule(Model):
    matches: list[RouteMatch] = []
    backend_refs: list[BackendRef] = []
    filters: list[Filter] = []
    timeouts: Timeouts = Timeouts()


class ParentRef(Model):
    name: str = Field(min_length=1)
    kind: str = "Gateway"
    group: str | None = None
    namespace: str = ""
    port: Port | None = None
    section_name: str = ""


class HTTPRouteSpec(Model):
    parent_refs: list[ParentRef] = []
    hostnames: list[str] = []
    rules: list[RouteRule] = []


class HTTPRouteDoc(Doc):
    api_version: str
    spec: HTTPRouteSpec = HTTPRouteSpec()
