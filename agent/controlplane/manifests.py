"""Kubernetes-format YAML manifests -> validated domain objects (the pydantic edge).

`parse_text`/`load_file`/`load_folder` return `(objects, errors)`: objects are
`agent.controlplane.resources` dataclasses, errors are `ManifestError`s
locating each rejected document by file, document index, kind/name and field.

Rules:
1. A bad document rejects only itself. A file is split at its `---` markers
   before parsing, so even broken YAML costs only the document it is in.
2. pydantic lives only in this module; nothing it builds is returned.
3. Document indexes are 0-based and count every document, empty ones too,
   as `yaml.safe_load_all` would. `kind: List` items keep their List's index
   and carry `items[i].` in front of their field.
4. `check_references` validates what a single document cannot: duplicates,
   a selector-less Service with no Endpoints, a Server's named port that no
   selected container declares. The store runs it over all files together.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, TypeAlias

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic.alias_generators import to_camel

from agent.controlplane import resources as r
from agent.errors import ManifestError

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

MANIFEST_SUFFIXES = (".yaml", ".yml", ".json")

Loaded: TypeAlias = tuple[list[r.Resource], list[ManifestError]]


class _Invalid(Exception):  # noqa: N818 - internal signal, becomes ManifestError
    """A semantic error found while converting; `field` is a dotted path."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(reason)
        self.field = field
        self.reason = reason


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


class _Model(BaseModel):
    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="ignore", frozen=True
    )

    @model_validator(mode="before")
    @classmethod
    def _nulls(cls, data: Any) -> Any:
        return _drop_nulls(data)


# --- shared models ----------------------------------------------------------------


class _Meta(_Model):
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
        if policy is not None and policy not in {p.value for p in r.AccessPolicy}:
            raise ValueError(f"{r.DEFAULT_INBOUND_POLICY_ANNOTATION}: unknown policy {policy!r}")
        return value


class _Requirement(_Model):
    key: str
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist"]
    values: list[str] = []

    @model_validator(mode="after")
    def _values_fit(self) -> _Requirement:
        if self.operator in ("In", "NotIn") and not self.values:
            raise ValueError(f"operator {self.operator} needs values")
        if self.operator in ("Exists", "DoesNotExist") and self.values:
            raise ValueError(f"operator {self.operator} takes no values")
        return self


class _Selector(_Model):
    match_labels: dict[str, str] = {}
    match_expressions: list[_Requirement] = []


class _Ref(_Model):
    kind: str = Field(min_length=1)
    name: str = ""
    namespace: str = ""
    group: str = ""


class _ContainerPort(_Model):
    container_port: Port
    name: str = ""
    protocol: Protocol = "TCP"

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        return r.check_port_name(value) if value else value


class _Container(_Model):
    name: str
    image: str = ""
    ports: list[_ContainerPort] = []


class _Network(_Model):
    cidr: Cidr
    except_: list[Cidr] = Field([], alias="except")


def _selector(model: _Selector) -> r.LabelSelector:
    return r.LabelSelector(
        match_labels=r.FrozenMap(model.match_labels),
        match_expressions=tuple(
            r.SelectorRequirement(
                key=req.key, operator=r.SelectorOperator(req.operator), values=tuple(req.values)
            )
            for req in model.match_expressions
        ),
    )


def _ref(model: _Ref) -> r.ObjectRef:
    return r.ObjectRef(
        kind=model.kind, name=model.name, namespace=model.namespace, group=model.group
    )


def _containers(models: list[_Container]) -> tuple[r.Container, ...]:
    return tuple(
        r.Container(
            name=c.name,
            image=c.image,
            ports=tuple(
                r.ContainerPort(container_port=p.container_port, name=p.name, protocol=p.protocol)
                for p in c.ports
            ),
        )
        for c in models
    )


def _networks(models: list[_Network]) -> tuple[r.Network, ...]:
    return tuple(r.Network(cidr=n.cidr, except_=tuple(n.except_)) for n in models)


# --- core kinds ---------------------------------------------------------------------


class _Doc(_Model):
    metadata: _Meta


class _PodSpec(_Model):
    service_account_name: str = ""
    service_account: str = ""  # deprecated alias Kubernetes still reads
    node_name: str = ""
    hostname: str = ""
    subdomain: str = ""
    host_network: bool = False
    containers: list[_Container] = Field(min_length=1)


class _Condition(_Model):
    type: str
    status: str


class _PodIP(_Model):
    ip: IP


class _PodStatus(_Model):
    phase: Literal["Pending", "Running", "Succeeded", "Failed", "Unknown"] = "Pending"
    pod_ip: IP = Field("", alias="podIP")
    pod_ips: list[_PodIP] = Field([], alias="podIPs")
    host_ip: IP = Field("", alias="hostIP")
    conditions: list[_Condition] = []


class _PodDoc(_Doc):
    spec: _PodSpec
    status: _PodStatus = _PodStatus()


def _pod(doc: _PodDoc, base: dict[str, Any]) -> r.Pod:
    st = doc.status
    ready = any(c.type == "Ready" and c.status == "True" for c in st.conditions)
    ips = tuple(p.ip for p in st.pod_ips) or ((st.pod_ip,) if st.pod_ip else ())
    return r.Pod(
        **base,
        service_account=doc.spec.service_account_name or doc.spec.service_account or "default",
        node_name=doc.spec.node_name,
        hostname=doc.spec.hostname,
        subdomain=doc.spec.subdomain,
        host_network=doc.spec.host_network,
        containers=_containers(doc.spec.containers),
        status=r.PodStatus(
            phase=r.PodPhase(st.phase),
            pod_ip=st.pod_ip or (ips[0] if ips else ""),
            pod_ips=ips,
            host_ip=st.host_ip,
            ready=ready,
        ),
    )


class _TemplateMeta(_Model):
    labels: dict[str, str] = {}
    annotations: dict[str, str] = {}


class _Template(_Model):
    metadata: _TemplateMeta = _TemplateMeta()
    spec: _PodSpec


class _DeploymentSpec(_Model):
    replicas: int = Field(1, ge=0)
    selector: _Selector
    template: _Template


class _DeploymentDoc(_Doc):
    spec: _DeploymentSpec


def _deployment(doc: _DeploymentDoc, base: dict[str, Any]) -> r.Deployment:
    spec = doc.spec
    selector = _selector(spec.selector)
    labels = r.FrozenMap(spec.template.metadata.labels)
    if not selector.match_labels and not selector.match_expressions:
        raise _Invalid("spec.selector", "a Deployment needs a non-empty selector")
    if not selector.matches(labels):
        raise _Invalid("spec.selector", "selector does not match template labels")
    pod = spec.template.spec
    return r.Deployment(
        **base,
        replicas=spec.replicas,
        selector=selector,
        template=r.PodTemplate(
            labels=labels,
            annotations=r.FrozenMap(spec.template.metadata.annotations),
            service_account=pod.service_account_name or pod.service_account or "default",
            containers=_containers(pod.containers),
        ),
    )


class _ServicePort(_Model):
    port: Port
    target_port: PortValue | None = None
    name: str = ""
    protocol: Protocol = "TCP"
    node_port: Port | None = None
    app_protocol: str = ""


class _ServiceSpec(_Model):
    type: Literal["ClusterIP", "NodePort", "LoadBalancer", "ExternalName"] = "ClusterIP"
    cluster_ip: str = Field("", alias="clusterIP")
    cluster_ips: list[IP] = Field([], alias="clusterIPs")
    selector: dict[str, str] = {}
    ports: list[_ServicePort] = []
    external_name: str = ""
    publish_not_ready_addresses: bool = False

    @field_validator("cluster_ip")
    @classmethod
    def _cluster_ip(cls, value: str) -> str:
        return value if value == "None" else _ip(value)


class _ServiceDoc(_Doc):
    spec: _ServiceSpec = _ServiceSpec()


def _service(doc: _ServiceDoc, base: dict[str, Any]) -> r.Service:
    spec = doc.spec
    stype = r.ServiceType(spec.type)
    if stype is r.ServiceType.EXTERNAL_NAME and not spec.external_name:
        raise _Invalid("spec.externalName", "an ExternalName Service needs externalName")
    if stype is not r.ServiceType.EXTERNAL_NAME and spec.cluster_ip != "None" and not spec.ports:
        raise _Invalid("spec.ports", "a Service needs at least one port")
    seen: set[str] = set()
    for i, port in enumerate(spec.ports):
        if len(spec.ports) > 1 and not port.name:
            raise _Invalid(f"spec.ports[{i}].name", "required when a Service has several ports")
        if port.name:
            try:
                r.check_port_name(port.name)
            except ValueError as exc:
                raise _Invalid(f"spec.ports[{i}].name", str(exc)) from None
        if port.name in seen:
            raise _Invalid(f"spec.ports[{i}].name", f"duplicate port name {port.name!r}")
        seen.add(port.name)
    return r.Service(
        **base,
        type=stype,
        cluster_ip=spec.cluster_ip,
        cluster_ips=tuple(spec.cluster_ips) or ((spec.cluster_ip,) if spec.cluster_ip else ()),
        selector=r.FrozenMap(spec.selector) if spec.selector else None,
        ports=tuple(
            r.ServicePort(
                port=p.port,
                target_port=p.target_port if p.target_port is not None else p.port,
                name=p.name,
                protocol=p.protocol,
                node_port=p.node_port,
                app_protocol=p.app_protocol,
            )
            for p in spec.ports
        ),
        external_name=spec.external_name,
        publish_not_ready_addresses=spec.publish_not_ready_addresses,
    )


class _EndpointsAddress(_Model):
    ip: IP = Field(min_length=1)
    hostname: str = ""
    node_name: str = ""
    target_ref: _Ref | None = None


class _EndpointsPort(_Model):
    port: Port
    name: str = ""
    protocol: Protocol = "TCP"


class _Subset(_Model):
    addresses: list[_EndpointsAddress] = []
    not_ready_addresses: list[_EndpointsAddress] = []
    ports: list[_EndpointsPort] = []


class _EndpointsDoc(_Doc):
    subsets: list[_Subset] = []


def _address(model: _EndpointsAddress) -> r.EndpointsAddress:
    ref = _ref(model.target_ref) if model.target_ref else None
    return r.EndpointsAddress(
        ip=model.ip, hostname=model.hostname, node_name=model.node_name, target_ref=ref
    )


def _endpoints(doc: _EndpointsDoc, base: dict[str, Any]) -> r.Endpoints:
    return r.Endpoints(
        **base,
        subsets=tuple(
            r.EndpointsSubset(
                addresses=tuple(_address(a) for a in s.addresses),
                not_ready_addresses=tuple(_address(a) for a in s.not_ready_addresses),
                ports=tuple(
                    r.EndpointsPort(port=p.port, name=p.name, protocol=p.protocol) for p in s.ports
                ),
            )
            for s in doc.subsets
        ),
    )


class _SliceConditions(_Model):
    ready: bool = True
    serving: bool = True
    terminating: bool = False


class _SliceEndpoint(_Model):
    addresses: list[str] = Field(min_length=1)
    conditions: _SliceConditions = _SliceConditions()
    hostname: str = ""
    node_name: str = ""
    zone: str = ""
    target_ref: _Ref | None = None


class _SlicePort(_Model):
    port: Port | None = None
    name: str = ""
    protocol: Protocol = "TCP"


class _SliceDoc(_Doc):
    address_type: Literal["IPv4", "IPv6", "FQDN"]
    endpoints: list[_SliceEndpoint] = []
    ports: list[_SlicePort] = []

    @model_validator(mode="after")
    def _addresses_fit(self) -> _SliceDoc:
        if self.address_type != "FQDN":
            for ep in self.endpoints:
                for addr in ep.addresses:
                    _ip(addr)
        return self


def _slice(doc: _SliceDoc, base: dict[str, Any]) -> r.EndpointSlice:
    return r.EndpointSlice(
        **base,
        service_name=doc.metadata.labels.get(r.SERVICE_NAME_LABEL, ""),
        address_type=doc.address_type,
        endpoints=tuple(
            r.SliceEndpoint(
                addresses=tuple(e.addresses),
                ready=e.conditions.ready,
                serving=e.conditions.serving,
                terminating=e.conditions.terminating,
                hostname=e.hostname,
                node_name=e.node_name,
                zone=e.zone,
                target_ref=_ref(e.target_ref) if e.target_ref else None,
            )
            for e in doc.endpoints
        ),
        ports=tuple(
            r.EndpointsPort(port=p.port, name=p.name, protocol=p.protocol) for p in doc.ports
        ),
    )


def _plain(_doc: _Doc, base: dict[str, Any], cls: type[r.Namespace | r.ServiceAccount]) -> Any:
    return cls(**base)


# --- ServiceProfile ---------------------------------------------------------------


def _one_or_any(value: Any) -> Any:
    """The CRD types request `not` as a list; Linkerd's Go type is one match."""
    if isinstance(value, list):
        return value[0] if len(value) == 1 else {"any": value}
    return value


_METHODS = Literal["GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE", "PATCH"]


class _RequestMatch(_Model):
    all: list[_RequestMatch] = []
    any: list[_RequestMatch] = []
    not_: Annotated[_RequestMatch | None, BeforeValidator(_one_or_any)] = Field(None, alias="not")
    method: _METHODS | None = None
    path_regex: Regex = ""

    @model_validator(mode="after")
    def _not_empty(self) -> _RequestMatch:
        if not (self.all or self.any or self.not_ or self.method or self.path_regex):
            raise ValueError("a request match needs one of all, any, not, method, pathRegex")
        return self


class _Range(_Model):
    min: int | None = Field(None, ge=100, le=599)
    max: int | None = Field(None, ge=100, le=599)

    @model_validator(mode="after")
    def _ordered(self) -> _Range:
        if self.min is None and self.max is None:
            raise ValueError("a status range needs min and/or max")
        if self.min is not None and self.max is not None and self.min > self.max:
            raise ValueError("status range min is greater than max")
        return self


class _ResponseMatch(_Model):
    all: list[_ResponseMatch] = []
    any: list[_ResponseMatch] = []
    not_: _ResponseMatch | None = Field(None, alias="not")
    status: _Range | None = None

    @model_validator(mode="after")
    def _not_empty(self) -> _ResponseMatch:
        if not (self.all or self.any or self.not_ or self.status):
            raise ValueError("a response match needs one of all, any, not, status")
        return self


class _ResponseClass(_Model):
    condition: _ResponseMatch
    is_failure: bool = False


class _Route(_Model):
    name: str = Field(min_length=1)
    condition: _RequestMatch
    response_classes: list[_ResponseClass] = []
    is_retryable: bool = False
    timeout: Duration | None = None


class _RetryBudget(_Model):
    retry_ratio: float = Field(ge=0)
    min_retries_per_second: int = Field(ge=0)
    ttl: Duration


class _WeightedDst(_Model):
    authority: str = Field(min_length=1)
    weight: Annotated[Any, AfterValidator(r.parse_quantity)]


class _ProfileSpec(_Model):
    routes: list[_Route] = []
    retry_budget: _RetryBudget | None = None
    opaque_ports: list[Annotated[str, AfterValidator(_port_list)]] = []
    dst_overrides: list[_WeightedDst] = []


class _ProfileDoc(_Doc):
    spec: _ProfileSpec = _ProfileSpec()


def _request_match(m: _RequestMatch) -> r.RequestMatch:
    return r.RequestMatch(
        all=tuple(_request_match(x) for x in m.all),
        any=tuple(_request_match(x) for x in m.any),
        not_=_request_match(m.not_) if m.not_ else None,
        method=m.method or "",
        path_regex=m.path_regex,
    )


def _response_match(m: _ResponseMatch) -> r.ResponseMatch:
    status = r.StatusRange(min=m.status.min, max=m.status.max) if m.status else None
    return r.ResponseMatch(
        all=tuple(_response_match(x) for x in m.all),
        any=tuple(_response_match(x) for x in m.any),
        not_=_response_match(m.not_) if m.not_ else None,
        status=status,
    )


def _profile(doc: _ProfileDoc, base: dict[str, Any]) -> r.ServiceProfile:
    spec = doc.spec
    budget = spec.retry_budget
    return r.ServiceProfile(
        **base,
        routes=tuple(
            r.Route(
                name=rt.name,
                condition=_request_match(rt.condition),
                response_classes=tuple(
                    r.ResponseClass(condition=_response_match(c.condition), is_failure=c.is_failure)
                    for c in rt.response_classes
                ),
                is_retryable=rt.is_retryable,
                timeout=rt.timeout,
            )
            for rt in spec.routes
        ),
        retry_budget=r.RetryBudget(
            retry_ratio=budget.retry_ratio,
            min_retries_per_second=budget.min_retries_per_second,
            ttl=budget.ttl,
        )
        if budget
        else None,
        opaque_ports=tuple(p for text in spec.opaque_ports for p in r.parse_port_list(text)),
        dst_overrides=tuple(
            r.WeightedDst(authority=d.authority, weight=d.weight) for d in spec.dst_overrides
        ),
    )


# --- policy.linkerd.io ---------------------------------------------------------------

_IDENTITY = re.compile(r"^(\*|[a-z0-9]([-a-z0-9]*[a-z0-9])?)(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


def _identity(value: str) -> str:
    if not _IDENTITY.match(value):
        raise ValueError(f"{value!r} is not an identity (DNS name, optionally starting with *)")
    return value


Identity = Annotated[str, AfterValidator(_identity)]


class _ServerSpec(_Model):
    pod_selector: _Selector | None = None
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


class _ServerDoc(_Doc):
    spec: _ServerSpec


def _server(doc: _ServerDoc, base: dict[str, Any]) -> r.Server:
    if doc.spec.pod_selector is None:
        raise _Invalid("spec.podSelector", "required (externalWorkloadSelector is not supported)")
    return r.Server(
        **base,
        pod_selector=_selector(doc.spec.pod_selector),
        port=doc.spec.port,
        proxy_protocol=r.ProxyProtocol(doc.spec.proxy_protocol),
        access_policy=r.AccessPolicy(doc.spec.access_policy),
    )


class _SARef(_Model):
    name: str = Field(min_length=1)
    namespace: str = ""


class _MeshTLS(_Model):
    unauthenticated_tls: bool = Field(default=False, alias="unauthenticatedTLS")
    identities: list[Identity] = []
    service_accounts: list[_SARef] = []


class _Client(_Model):
    networks: list[_Network] = []
    unauthenticated: bool = False
    mesh_tls: _MeshTLS | None = Field(None, alias="meshTLS")


class _ServerTarget(_Model):
    name: str = ""
    selector: _Selector | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> _ServerTarget:
        if bool(self.name) == (self.selector is not None):
            raise ValueError("exactly one of name and selector is required")
        return self


class _SazSpec(_Model):
    server: _ServerTarget
    client: _Client


class _SazDoc(_Doc):
    spec: _SazSpec


def _saz(doc: _SazDoc, base: dict[str, Any]) -> r.ServerAuthorization:
    client = doc.spec.client
    if not client.unauthenticated and client.mesh_tls is None:
        raise _Invalid("spec.client", "meshTLS is required unless unauthenticated is true")
    tls = client.mesh_tls
    return r.ServerAuthorization(
        **base,
        server_name=doc.spec.server.name,
        server_selector=_selector(doc.spec.server.selector) if doc.spec.server.selector else None,
        networks=_networks(client.networks),
        unauthenticated=client.unauthenticated,
        mesh_tls=r.MeshTLSClient(
            unauthenticated_tls=tls.unauthenticated_tls,
            identities=tuple(tls.identities),
            service_accounts=tuple(
                r.ServiceAccountRef(name=s.name, namespace=s.namespace)
                for s in tls.service_accounts
            ),
        )
        if tls
        else None,
    )


_TARGET_KINDS = {"Server", "HTTPRoute", "GRPCRoute", "Namespace"}
_AUTHN_KINDS = {"MeshTLSAuthentication", "NetworkAuthentication", "ServiceAccount"}


class _AuthzSpec(_Model):
    target_ref: _Ref
    required_authentication_refs: list[_Ref]


class _AuthzDoc(_Doc):
    spec: _AuthzSpec


def _authz(doc: _AuthzDoc, base: dict[str, Any]) -> r.AuthorizationPolicy:
    target = doc.spec.target_ref
    if target.kind not in _TARGET_KINDS:
        raise _Invalid("spec.targetRef.kind", f"unsupported target kind {target.kind!r}")
    if not target.name:
        raise _Invalid("spec.targetRef.name", "required")
    for i, ref in enumerate(doc.spec.required_authentication_refs):
        if ref.kind not in _AUTHN_KINDS:
            raise _Invalid(
                f"spec.requiredAuthenticationRefs[{i}].kind", f"unsupported kind {ref.kind!r}"
            )
    return r.AuthorizationPolicy(
        **base,
        target_ref=_ref(target),
        required_authentication_refs=tuple(_ref(x) for x in doc.spec.required_authentication_refs),
    )


class _MeshTLSAuthSpec(_Model):
    identities: list[Identity] = []
    identity_refs: list[_Ref] = []


class _MeshTLSAuthDoc(_Doc):
    spec: _MeshTLSAuthSpec


def _meshtls_authn(doc: _MeshTLSAuthDoc, base: dict[str, Any]) -> r.MeshTLSAuthentication:
    spec = doc.spec
    if bool(spec.identities) == bool(spec.identity_refs):
        raise _Invalid("spec", "exactly one of identities and identityRefs is required")
    for i, ref in enumerate(spec.identity_refs):
        if ref.kind not in ("ServiceAccount", "Namespace"):
            raise _Invalid(f"spec.identityRefs[{i}].kind", f"unsupported kind {ref.kind!r}")
    return r.MeshTLSAuthentication(
        **base,
        identities=tuple(spec.identities),
        identity_refs=tuple(_ref(x) for x in spec.identity_refs),
    )


class _NetworkAuthSpec(_Model):
    networks: list[_Network] = Field(min_length=1)


class _NetworkAuthDoc(_Doc):
    spec: _NetworkAuthSpec


def _network_authn(doc: _NetworkAuthDoc, base: dict[str, Any]) -> r.NetworkAuthentication:
    return r.NetworkAuthentication(**base, networks=_networks(doc.spec.networks))


# --- HTTPRoute -------------------------------------------------------------------------


class _PathMatch(_Model):
    type: Literal["Exact", "PathPrefix", "RegularExpression"] = "PathPrefix"
    value: str = "/"

    @model_validator(mode="after")
    def _value_fits(self) -> _PathMatch:
        if self.type == "RegularExpression":
            _regex(self.value)
        elif not self.value.startswith("/"):
            raise ValueError(f"{self.type} path must start with '/'")
        return self


class _ValueMatch(_Model):
    name: str = Field(min_length=1)
    value: str
    type: Literal["Exact", "RegularExpression"] = "Exact"

    @model_validator(mode="after")
    def _value_fits(self) -> _ValueMatch:
        if self.type == "RegularExpression":
            _regex(self.value)
        return self


class _RouteMatch(_Model):
    path: _PathMatch | None = None
    headers: list[_ValueMatch] = []
    query_params: list[_ValueMatch] = []
    method: _METHODS | None = None


class _BackendRef(_Model):
    name: str = Field(min_length=1)
    namespace: str = ""
    port: Port | None = None
    weight: int = Field(1, ge=0)
    kind: str = "Service"
    group: str = ""


class _Filter(_Model):
    type: str


class _Timeouts(_Model):
    request: Duration | None = None
    backend_request: Duration | None = None


class _RouteRule(_Model):
    matches: list[_RouteMatch] = []
    backend_refs: list[_BackendRef] = []
    filters: list[_Filter] = []
    timeouts: _Timeouts = _Timeouts()


class _ParentRef(_Model):
    name: str = Field(min_length=1)
    kind: str = "Gateway"
    group: str | None = None
    namespace: str = ""
    port: Port | None = None
    section_name: str = ""


class _HTTPRouteSpec(_Model):
    parent_refs: list[_ParentRef] = []
    hostnames: list[str] = []
    rules: list[_RouteRule] = []


class _HTTPRouteDoc(_Doc):
    api_version: str
    spec: _HTTPRouteSpec = _HTTPRouteSpec()


def _route_match(m: _RouteMatch) -> r.RouteMatch:
    def values(items: list[_ValueMatch]) -> tuple[r.ValueMatch, ...]:
        return tuple(
            r.ValueMatch(name=v.name, value=v.value, type=r.ValueMatchType(v.type)) for v in items
        )

    path = m.path or _PathMatch()
    return r.RouteMatch(
        path=r.PathMatch(type=r.PathMatchType(path.type), value=path.value),
        headers=values(m.headers),
        query_params=values(m.query_params),
        method=m.method or "",
    )


def _rule(rule: _RouteRule) -> r.RouteRule:
    return r.RouteRule(
        matches=tuple(_route_match(m) for m in rule.matches) or (r.RouteMatch(),),
        backend_refs=tuple(
            r.BackendRef(
                name=b.name,
                namespace=b.namespace,
                port=b.port,
                weight=b.weight,
                kind=b.kind,
                group=b.group,
            )
            for b in rule.backend_refs
        ),
        filters=tuple(f.type for f in rule.filters),
        timeout=rule.timeouts.request,
        backend_timeout=rule.timeouts.backend_request,
    )


def _http_route(doc: _HTTPRouteDoc, base: dict[str, Any]) -> r.HTTPRoute:
    group = doc.api_version.partition("/")[0]
    return r.HTTPRoute(
        **base,
        group=group,
        parent_refs=tuple(
            r.ParentRef(
                name=p.name,
                kind=p.kind,
                group=group if p.group is None else p.group,
                namespace=p.namespace,
                port=p.port,
                section_name=p.section_name,
            )
            for p in doc.spec.parent_refs
        ),
        hostnames=tuple(doc.spec.hostnames),
        rules=tuple(_rule(x) for x in doc.spec.rules) or (r.RouteRule(),),
    )


# --- kind table ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Kind:
    model: type[_Doc]
    convert: Callable[[Any, dict[str, Any]], r.Resource]
    versions: frozenset[str]  # accepted apiVersion values
    namespaced: bool = True


_POLICY = "policy.linkerd.io/"
_GATEWAY = "gateway.networking.k8s.io/"
_KINDS: dict[str, _Kind] = {
    "Namespace": _Kind(
        _Doc, lambda d, b: _plain(d, b, r.Namespace), frozenset({"v1"}), namespaced=False
    ),
    "ServiceAccount": _Kind(_Doc, lambda d, b: _plain(d, b, r.ServiceAccount), frozenset({"v1"})),
    "Pod": _Kind(_PodDoc, _pod, frozenset({"v1"})),
    "Service": _Kind(_ServiceDoc, _service, frozenset({"v1"})),
    "Endpoints": _Kind(_EndpointsDoc, _endpoints, frozenset({"v1"})),
    "EndpointSlice": _Kind(_SliceDoc, _slice, frozenset({"discovery.k8s.io/v1"})),
    "Deployment": _Kind(_DeploymentDoc, _deployment, frozenset({"apps/v1"})),
    "ServiceProfile": _Kind(
        _ProfileDoc, _profile, frozenset({"linkerd.io/v1alpha2", "linkerd.io/v1alpha1"})
    ),
    "Server": _Kind(
        _ServerDoc,
        _server,
        frozenset(_POLICY + v for v in ("v1beta3", "v1beta2", "v1beta1", "v1alpha1")),
    ),
    "ServerAuthorization": _Kind(
        _SazDoc, _saz, frozenset(_POLICY + v for v in ("v1beta1", "v1alpha1"))
    ),
    "AuthorizationPolicy": _Kind(_AuthzDoc, _authz, frozenset({_POLICY + "v1alpha1"})),
    "MeshTLSAuthentication": _Kind(
        _MeshTLSAuthDoc, _meshtls_authn, frozenset({_POLICY + "v1alpha1"})
    ),
    "NetworkAuthentication": _Kind(
        _NetworkAuthDoc, _network_authn, frozenset({_POLICY + "v1alpha1"})
    ),
    "HTTPRoute": _Kind(
        _HTTPRouteDoc,
        _http_route,
        frozenset(
            [_POLICY + v for v in ("v1beta3", "v1beta2", "v1beta1", "v1alpha1")]
            + [_GATEWAY + v for v in ("v1", "v1beta1", "v1alpha2")]
        ),
    ),
}


# --- documents ----------------------------------------------------------------------------


def _loc(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else part
    return out


def _pydantic_error(exc: ValidationError) -> tuple[str, str]:
    errors = exc.errors(include_url=False)
    first = errors[0]
    reason = str(first["msg"]).removeprefix("Value error, ")
    if len(errors) > 1:
        reason += f" (and {len(errors) - 1} more)"
    return _loc(tuple(first["loc"])), reason


def _parse_document(doc: Any, file: str, index: int, prefix: str = "") -> Loaded:  # noqa: PLR0911
    """One YAML document (or List item) -> objects and errors; never raises."""

    def fail(reason: str, field: str = "", kind: str = "", name: str = "") -> Loaded:
        where = prefix + field if field else prefix.rstrip(".")
        err = ManifestError(
            file=file, index=index, kind=kind, name=name, field=where, reason=reason
        )
        return [], [err]

    if doc is None:
        return [], []
    if not isinstance(doc, dict):
        return fail(f"a document must be a mapping, not {type(doc).__name__}")
    kind, api = doc.get("kind"), doc.get("apiVersion")
    meta = doc.get("metadata")
    name = str(meta.get("name", "")) if isinstance(meta, dict) else ""
    if not isinstance(kind, str) or not kind:
        return fail("kind is missing", "kind", name=name)
    if kind == "List" or (kind.endswith("List") and isinstance(doc.get("items"), list)):
        return _parse_list(doc, file, index, prefix)
    spec = _KINDS.get(kind)
    if spec is None:
        return fail(f"unknown kind {kind!r}", "kind", kind, name)
    if api not in spec.versions:
        served = ", ".join(sorted(spec.versions))
        return fail(f"apiVersion {api!r} is not one of {served}", "apiVersion", kind, name)
    try:
        model = spec.model.model_validate(doc)
        obj = spec.convert(model, _base(model.metadata, spec, file, index))
    except ValidationError as exc:
        field, reason = _pydantic_error(exc)
        return fail(reason, field, kind, name)
    except _Invalid as exc:
        return fail(exc.reason, exc.field, kind, name)
    return [obj], []


def _parse_list(doc: dict[str, Any], file: str, index: int, prefix: str) -> Loaded:
    items = doc.get("items")
    if not isinstance(items, list):
        err = ManifestError(
            file=file,
            index=index,
            kind="List",
            field=prefix + "items",
            reason="items must be a list",
        )
        return [], [err]
    objects: list[r.Resource] = []
    errors: list[ManifestError] = []
    for i, item in enumerate(items):
        objs, errs = _parse_document(item, file, index, f"{prefix}items[{i}].")
        objects += objs
        errors += errs
    return objects, errors


def _base(meta: _Meta, spec: _Kind, file: str, index: int) -> dict[str, Any]:
    return {
        "name": meta.name,
        "namespace": (meta.namespace or "default") if spec.namespaced else "",
        "uid": meta.uid,
        "labels": r.FrozenMap(meta.labels),
        "annotations": r.FrozenMap(meta.annotations),
        "source": r.Source(file=file, index=index),
    }


_MARKER = re.compile(r"^---(?:[ \t]|$)")


def split_documents(text: str) -> list[tuple[int, str]]:
    """Split at `---` lines: (0-based first line, text) per document, as safe_load_all counts them.

    A leading chunk of only comments, blank lines or directives is not a document.
    """
    chunks: list[tuple[int, list[str]]] = [(0, [])]
    for lineno, line in enumerate(text.splitlines(keepends=True)):
        if _MARKER.match(line):
            chunks.append((lineno, [line]))
        else:
            chunks[-1][1].append(line)
    _first_line, first = chunks[0]
    if len(chunks) > 1 and all(
        not ln.strip() or ln.lstrip().startswith(("#", "%")) for ln in first
    ):
        chunks = chunks[1:]
    return [(start, "".join(lines)) for start, lines in chunks]


def _yaml_reason(exc: yaml.YAMLError, first_line: int) -> str:
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc)
    if mark is not None:
        line, column = first_line + mark.line + 1, mark.column + 1
        return f"invalid YAML at line {line}, column {column}: {problem}"
    return f"invalid YAML: {problem}"


def parse_text(text: str, *, file: str = "<text>") -> Loaded:
    """Every document of a manifest text -> (objects, errors). Never raises."""
    objects: list[r.Resource] = []
    errors: list[ManifestError] = []
    for index, (first_line, chunk) in enumerate(split_documents(text)):
        try:
            docs = list(yaml.safe_load_all(chunk))
        except yaml.YAMLError as exc:
            errors.append(
                ManifestError(file=file, index=index, reason=_yaml_reason(exc, first_line))
            )
            continue
        for doc in docs:  # one, or none for an empty chunk
            objs, errs = _parse_document(doc, file, index)
            objects += objs
            errors += errs
    return objects, errors


def load_file(path: str | Path) -> Loaded:
    """Read and parse one manifest file; an unreadable file is one error at index 0."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        return [], [ManifestError(file=str(path), index=0, reason=f"cannot read: {exc}")]
    return parse_text(text, file=str(path))


def manifest_files(directory: str | Path) -> list[Path]:
    """*.yaml, *.yml and *.json files under `directory`, recursively, sorted; dot-names skipped."""
    root = Path(directory)
    found = [
        p
        for p in root.rglob("*")
        if p.suffix in MANIFEST_SUFFIXES
        and p.is_file()
        and not any(part.startswith(".") for part in p.relative_to(root).parts)
    ]
    return sorted(found)


def load_folder(directory: str | Path) -> Loaded:
    """Every manifest file under `directory`, then `check_references` over all of them."""
    objects: list[r.Resource] = []
    errors: list[ManifestError] = []
    for path in manifest_files(directory):
        objs, errs = load_file(path)
        objects += objs
        errors += errs
    kept, ref_errors = check_references(objects)
    return kept, errors + ref_errors


# --- checks across documents ---------------------------------------------------------------


def _error(obj: r.Resource, field: str, reason: str) -> ManifestError:
    src = obj.source or r.Source(file="<unknown>", index=0)
    return ManifestError(
        file=src.file, index=src.index, kind=obj.kind, name=obj.name, field=field, reason=reason
    )


def check_references(objects: Iterable[r.Resource]) -> Loaded:
    """Reject what only the whole set shows; the first of duplicate objects wins.

    Kept objects keep their order. Checks: duplicate kind/namespace/name; a
    Service without a selector needs Endpoints or an EndpointSlice (ExternalName
    and headless Services excepted); a Server naming its port needs a selected
    pod or Deployment template that declares that port (when any is selected).
    """
    unique: list[r.Resource] = []
    errors: list[ManifestError] = []
    seen: dict[tuple[str, str, str], r.Resource] = {}
    for obj in objects:
        if (first := seen.get(obj.key)) is not None:
            errors.append(_error(obj, "metadata.name", f"duplicate of {first.source}"))
            continue
        seen[obj.key] = obj
        unique.append(obj)
    ctx = _Context(unique)
    kept: list[r.Resource] = []
    for obj in unique:
        err = ctx.check(obj)
        if err is None:
            kept.append(obj)
        else:
            errors.append(err)
    return kept, errors


class _Context:
    """What the cross-document checks look up, indexed once."""

    def __init__(self, objects: list[r.Resource]) -> None:
        self.backed: set[tuple[str, str]] = set()  # (namespace, service) with Endpoints/slices
        self.workloads: dict[str, list[tuple[tuple[r.Container, ...], r.FrozenMap]]] = {}
        for obj in objects:
            if isinstance(obj, r.Endpoints):
                self.backed.add((obj.namespace, obj.name))
            elif isinstance(obj, r.EndpointSlice) and obj.service_name:
                self.backed.add((obj.namespace, obj.service_name))
            elif isinstance(obj, r.Pod):
                self.workloads.setdefault(obj.namespace, []).append((obj.containers, obj.labels))
            elif isinstance(obj, r.Deployment):
                entry = (obj.template.containers, obj.template.labels)
                self.workloads.setdefault(obj.namespace, []).append(entry)

    def check(self, obj: r.Resource) -> ManifestError | None:
        if isinstance(obj, r.Service):
            return self._service(obj)
        if isinstance(obj, r.Server) and isinstance(obj.port, str):
            return self._server_port(obj, obj.port)
        return None

    def _service(self, svc: r.Service) -> ManifestError | None:
        if svc.selector is not None or svc.type is r.ServiceType.EXTERNAL_NAME or svc.headless:
            return None
        if (svc.namespace, svc.name) in self.backed:
            return None
        return _error(svc, "spec.selector", "no selector, and no Endpoints or EndpointSlice for it")

    def _server_port(self, srv: r.Server, port: str) -> ManifestError | None:
        selected = [
            containers
            for containers, labels in self.workloads.get(srv.namespace, [])
            if srv.pod_selector.matches(labels)
        ]
        if not selected or any(r.resolve_port(c, port) is not None for c in selected):
            return None
        return _error(srv, "spec.port", f"no selected container declares a port named {port!r}")
