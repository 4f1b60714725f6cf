"""The base of the typed resource model: value parsers, selectors, shared object parts.

Pure data; no I/O, no pydantic. The kinds the store holds are frozen dataclasses
built on this module: `kinds_core` has the Kubernetes ones, `kinds_linkerd` the
Linkerd and HTTPRoute ones, and `kinds` names them all (`Resource`, `KINDS`).
`agent.controlplane.manifests` builds them from YAML and validates them;
everything inward (the store, the control-plane servers) sees only those frozen
dataclasses. Here: the annotation and label names the mesh reads, `FrozenMap`,
`Source`, the parsers of durations, ports, quantities and networks, label
selectors, and the parts every kind shares (`Object`, `ObjectRef`, containers).

Rules (every kind module follows them too):
1. Field names are Kubernetes'/Linkerd's in snake_case; defaults are theirs
   (a Service port's `target_port` defaults to its `port`, a Pod's service
   account to "default", a Server's `access_policy` to "deny", ...).
2. Mappings are `FrozenMap` so every object is immutable and hashable.
3. Durations are float seconds; CIDRs are `ipaddress` networks; ports named
   or numbered are `int | str` (a digit string is always turned into an int).
4. `source` says which file and document an object came from; it does not
   take part in equality.
5. Imports point one way: `kinds_core` and `kinds_linkerd` import this module
   (and never each other), `kinds` imports both; this module imports none of them.
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
