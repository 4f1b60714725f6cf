"""pydantic shapes of manifest documents: the values and parts every kind shares.

The schema of the manifest loader, split as the resource model is: this base
holds the value validators and types (IP, port, duration, CIDR, regex), the
`Model` every shape derives from, selectors, object refs, networks and
`Doc` (a document's body); `schema_core` (v1 Service and Endpoints, apps/v1,
discovery.k8s.io/v1) and `schema_linkerd` (linkerd.io, policy.linkerd.io,
HTTPRoute) hold one `*Doc` per kind. `convert_core` and `convert_linkerd` turn
a validated `*Doc` into a `kinds_core`/`kinds_linkerd` dataclass and its
validation errors into `plain.Invalid`s. Metadata, Namespace, ServiceAccount,
Pod and a pod template's spec have no shapes here: `plain` reads them by hand,
so that the supervisor reads its pods without pydantic.

Rules:
1. Only the manifest loader (`documents`, `convert_core`, `convert_linkerd`)
   imports the schema modules; no model leaves it.
2. Field validators raise `ValueError` (pydantic locates it in the document);
   checks that need several fields or the whole object live in the converters,
   which raise `plain.Invalid` with a dotted field path.
3. Fields use snake_case names with camelCase aliases, like the YAML; unknown
   fields are ignored and `key:` with no value means unset, as in Kubernetes.
4. Shapes only, no meaning: this base imports neither `schema_core` nor
   `schema_linkerd`, and they never import each other (import-linter layers).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator
from pydantic.alias_generators import to_camel

from agent.controlplane import resources as r
from agent.controlplane.plain import check_ip

# --- value validators (raise ValueError; pydantic locates them) ----------------


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


class Network(Model):
    cidr: Cidr
    except_: list[Cidr] = Field([], alias="except")


# --- the document every kind's `*Doc` extends -----------------------------------------


class Doc(Model):
    """A document's body; its metadata is read by `plain.base`, for every kind alike."""
