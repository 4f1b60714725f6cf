"""pydantic shapes of Linkerd's manifest documents: linkerd.io, policy.linkerd.io, HTTPRoute.

`ProfileDoc` (ServiceProfile), the policy.linkerd.io documents (`ServerDoc`,
`SazDoc`, `AuthzDoc`, `MeshTLSAuthDoc`, `NetworkAuthDoc`) and `HTTPRouteDoc`
(policy.linkerd.io and gateway.networking.k8s.io alike), with their parts, as
Linkerd and the Gateway API name and default them. `convert_linkerd` turns
each into its `kinds_linkerd` dataclass.

Rules (those of `manifests_schema`, as they apply here):
1. Only the manifest loader imports this module; no model leaves it.
2. Field validators raise `ValueError`; checks across several fields of a
   kind (a ServerAuthorization's client, an AuthorizationPolicy's refs) live
   in `convert_linkerd`.
3. Builds on `manifests_schema` only, never on `schema_core`.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BeforeValidator, Field, model_validator

from agent.config import InboundPolicy  # noqa: TC001 - pydantic resolves annotations at runtime
from agent.controlplane import resources as r
from agent.controlplane.manifests_schema import (
    Doc,
    Duration,
    Model,
    Network,
    Port,
    PortList,
    PortValue,
    Ref,
    Regex,
    Selector,
    check_regex,
)

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
    opaque_ports: list[PortList] = []
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
    access_policy: InboundPolicy = "deny"


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
            check_regex(self.value)
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
            check_regex(self.value)
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
