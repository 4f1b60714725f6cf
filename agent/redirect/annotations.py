"""Pod and namespace annotations -> the capture fields of a `CaptureSpec`.

Pure: strings in, values out, no I/O.

Rules:
1. A pod annotation wins over the same annotation on its namespace (as
   Linkerd's injector does); an absent or blank value means "not set".
2. Port lists are Linkerd's syntax: comma-separated ports and inclusive ranges
   `lo-hi`, spaces around items ignored, one trailing comma tolerated. Ports are
   0-65535 as Linkerd accepts them; port 0 cannot be a TCP destination, so a
   range starting at 0 starts at 1 and a bare `0` is refused.
3. `opaque-ports` may also name container ports (`mysql`), resolved through
   `named_ports`; the other port annotations take numbers only.
4. `skip-subnets` is a comma-separated list of CIDRs (host bits are dropped, as
   Go's net.ParseCIDR does).
5. A malformed value raises `AnnotationError(pod, annotation, value, reason)`:
   it rejects that pod only, never the agent.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from agent.errors import AnnotationError
from agent.redirect.model import CaptureSpec, PortRange, PortSet

if TYPE_CHECKING:
    from collections.abc import Mapping
    from pathlib import Path

PREFIX = "config.linkerd.io/"
SKIP_INBOUND_PORTS = PREFIX + "skip-inbound-ports"
SKIP_OUTBOUND_PORTS = PREFIX + "skip-outbound-ports"
SKIP_SUBNETS = PREFIX + "skip-subnets"
OPAQUE_PORTS = PREFIX + "opaque-ports"
# meshagent's own: ports whose connections eBPF same-node acceleration leaves on the
# TCP path (e.g. bulk streams, bpf/sockops.c rule 2); Linkerd has no such setting
SKIP_ACCEL_PORTS = "config.meshagent.io/skip-accel-ports"

# Linkerd's cluster-wide default for opaque ports (protocols that speak first
# or are not HTTP: SMTP, MySQL, Galera, PostgreSQL, Redis, ES, memcached).
DEFAULT_OPAQUE_PORTS = "25,587,3306,4444,5432,6379,9300,11211"

Subnet = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass(frozen=True, slots=True, kw_only=True)
class CaptureAnnotations:
    """The capture settings a pod's annotations ask for."""

    skip_inbound_ports: PortSet = field(default_factory=PortSet)
    skip_outbound_ports: PortSet = field(default_factory=PortSet)
    skip_subnets: tuple[Subnet, ...] = ()
    opaque_ports: PortSet = field(default_factory=PortSet)
    skip_accel_ports: PortSet = field(default_factory=PortSet)


def parse_port_range(item: str) -> PortRange:
    """One `port` or `lo-hi` item.

    Raises:
        ValueError: with the reason, e.g. `"70000" is not a valid port`.
    """
    bounds = item.split("-")
    if len(bounds) > 2:
        raise ValueError(f"{item!r}: ranges are written <lower>-<upper>")
    lower = _port(bounds[0], "lower bound")
    upper = _port(bounds[-1], "upper bound")
    if upper < lower:
        raise ValueError(f"{item!r}: upper bound must be greater than or equal to lower bound")
    if upper == 0:
        raise ValueError(f"{item!r}: port 0 is not a TCP destination port")
    return PortRange(max(lower, 1), upper)


def _port(text: str, what: str) -> int:
    text = text.strip()
    if not text.isdigit():
        raise ValueError(f"{text!r} is not a valid {what}")
    value = int(text)
    if value > 65535:
        raise ValueError(f"{text!r} is not a valid {what} (0-65535)")
    return value


def parse_port_set(value: str, named_ports: Mapping[str, int] | None = None) -> PortSet:
    """A comma-separated list of ports and ranges (and names, if `named_ports`).

    Raises:
        ValueError: the first bad item and why.
    """
    ranges: list[PortRange] = []
    for item in _items(value):
        if named_ports is not None and not item[0].isdigit():
            if item not in named_ports:
                raise ValueError(f"{item!r} is neither a port nor a named container port")
            port = named_ports[item]
            ranges.append(PortRange(port, port))
            continue
        ranges.append(parse_port_range(item))
    return PortSet(tuple(ranges))


def parse_subnets(value: str) -> tuple[Subnet, ...]:
    """A comma-separated list of CIDRs.

    Raises:
        ValueError: the first bad item and why.
    """
    subnets: list[Subnet] = []
    for item in _items(value):
        if "/" not in item:
            raise ValueError(f"{item!r} is not a CIDR (expected ADDRESS/PREFIX)")
        try:
            subnets.append(ipaddress.ip_network(item, strict=False))
        except ValueError as exc:
            raise ValueError(f"{item!r} is not a valid CIDR: {exc}") from None
    return tuple(subnets)


def _items(value: str) -> list[str]:
    text = value.strip()
    text = text.removesuffix(",")
    if not text.strip():
        return []
    items = [part.strip() for part in text.split(",")]
    if "" in items:
        raise ValueError("empty item in list")
    return items


def effective(
    name: str, pod_annotations: Mapping[str, str], namespace_annotations: Mapping[str, str]
) -> str | None:
    """The value that applies to a pod: its own, else its namespace's, else None."""
    for source in (pod_annotations, namespace_annotations):
        value = source.get(name)
        if value is not None and value.strip():
            return value
    return None


def parse_annotations(
    pod: str,
    pod_annotations: Mapping[str, str],
    namespace_annotations: Mapping[str, str] | None = None,
    *,
    named_ports: Mapping[str, int] | None = None,
) -> CaptureAnnotations:
    """The capture settings for `pod` ("namespace/name").

    Raises:
        AnnotationError: an annotation that applies to the pod is malformed.
    """
    ns = namespace_annotations or {}

    def get(name: str, default: str = "") -> str:
        value = effective(name, pod_annotations, ns)
        return default if value is None else value

    def parse(name: str, default: str = "", names: Mapping[str, int] | None = None) -> PortSet:
        raw = get(name, default)
        try:
            return parse_port_set(raw, names)
        except ValueError as exc:
            raise AnnotationError(pod, name, raw, str(exc)) from None

    subnets_raw = get(SKIP_SUBNETS)
    try:
        subnets = parse_subnets(subnets_raw)
    except ValueError as exc:
        raise AnnotationError(pod, SKIP_SUBNETS, subnets_raw, str(exc)) from None
    return CaptureAnnotations(
        skip_inbound_ports=parse(SKIP_INBOUND_PORTS),
        skip_outbound_ports=parse(SKIP_OUTBOUND_PORTS),
        skip_subnets=subnets,
        opaque_ports=parse(OPAQUE_PORTS, DEFAULT_OPAQUE_PORTS, named_ports or {}),
        skip_accel_ports=parse(SKIP_ACCEL_PORTS),
    )


def build_spec(  # noqa: PLR0913 - a spec has this many independent facts
    *,
    pod: str,
    netns: Path,
    pod_ip: str,
    pod_annotations: Mapping[str, str],
    namespace_annotations: Mapping[str, str] | None = None,
    cgroup: Path | None = None,
    named_ports: Mapping[str, int] | None = None,
) -> CaptureSpec:
    """A `CaptureSpec` for one pod from its annotations.

    Raises:
        AnnotationError: an annotation that applies to the pod is malformed.
    """
    ann = parse_annotations(pod, pod_annotations, namespace_annotations, named_ports=named_ports)
    return CaptureSpec(
        pod=pod,
        netns=netns,
        pod_ip=pod_ip,
        cgroup=cgroup,
        skip_inbound_ports=ann.skip_inbound_ports,
        skip_outbound_ports=ann.skip_outbound_ports,
        skip_subnets=ann.skip_subnets,
        opaque_ports=ann.opaque_ports,
        skip_accel_ports=ann.skip_accel_ports,
    )
