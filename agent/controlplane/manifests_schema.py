"""pydantic shapes of manifest documents: the values and parts every kind shares.

The schema of the manifest loader, split as the resource model is: this base
holds the value validators and types (IP, port, duration, CIDR, regex), the
`Model` every shape derives from, metadata, selectors, object refs,
containers, networks and `Doc` (a document with metadata); `schema_core`
(v1, apps/v1, discovery.k8s.io/v1) and `schema_linkerd` (linkerd.io,
policy.linkerd.io, HTTPRoute) hold one `*Doc` per kind. `convert_core` and
`convert_linkerd` turn a validated `*Doc` into a `kinds_core`/`kinds_linkerd`
dataclass; `documents` turns validation errors into `ManifestError`s.

Rules:
1. Only the manifest loader (`documents`, `convert_core`, `convert_linkerd`)
   imports the schema modules; no model leaves it.
2. Field validators raise `ValueError` (pydantic locates it in the document);
   checks that need several fields or the whole object live in the converters,
   which raise `convert_core.Invalid` with a dotted field path.
3. Fields use snake_case names with camelCase aliases, like the YAML; unknown
   fields are ignored and `key:` with no value means unset, as in Kubernetes.
4. Shapes only, no meaning: this base imports neither `schema_core` nor
   `schema_linkerd`, and they never import each other (import-linter layers).
"""

from __future__ import annotations

import ipaddress
import re
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic.alias_generators import to_camel

from agent.controlplane import kinds_linkerd as l5d
from agent.controlplane import resources as r

# --- value validators (raise ValueError; pydantic locates them) ----------------


def check_ip(value: str) -> str:
    """`value` if empty or an IP address; raises `ValueError` otherwise."""
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


def check_regex(value: str) -> str:
    """`value` if it compiles as a Python regular expression; raises `ValueError` otherwise."""
    try:
        re.compile(value)
    except re.error as exc:
        raise ValueError(f"invalid regular expression: {exc}") from None
    return value


IP = Annotated[str, AfterValidator(check_ip)]
PortValue = Annotated[Any, AfterValidator(_port_value)]
Port = Annotated[int, AfterValidator(r.check_port)]
Duration = Annotated[Any, AfterValidator(_duration)]
Cidr = Annotated[Any, AfterValidator(_cidr)]
Regex = Annotated[str, AfterValidator(check_regex)]
PortList = Annotated[str, AfterValidator(_port_list)]
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


# --- the document every kind's `*Doc` extends -----------------------------------------


class Doc(Model):
    metadata: Meta
