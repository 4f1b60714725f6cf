"""Destination translation (pure): store snapshot -> `Update`s and `DestinationProfile`s.

`resolve(snapshot, target, token, mesh)` gives the `EndpointSet` a `Get` stream
should show now; `diff(old, new)` the `Update`s that move a client from `old`
to `new`; `profile(...)` the `DestinationProfile` a `GetProfile` stream should
show now (in `agent.controlplane.profiles`, rules 3 and 4). No I/O, no clock,
no logging; the gRPC shell is `servers.py`.

Rules (linkerd2-proxy-api `destination.proto`, linkerd2
`controller/api/destination/{endpoint_translator,profile_translator,server}.go`):
1. Every stream starts with one message: `add` with every ready endpoint, or
   `no_endpoints{exists}` when there are none (`exists=false`: no such service).
   Later changes are `add` (new or changed endpoints) before `remove` (gone
   ones), so a client never sees a transient empty set; a change that leaves a
   live service with no endpoints is `no_endpoints{exists:true}` (the proto's
   "remove of the last endpoint" equivalent), a deleted service
   `no_endpoints{exists:false}`. No change, no message.
2. Endpoints as Linkerd describes them: weight 10000; metric labels `pod`,
   `serviceaccount`, the owner (`deployment`), `pod_template_hash`,
   `control_plane_ns` (meshed pods), `zone`, `zone_locality`; the set carries
   `namespace` and `service`. A meshed pod gets `tls_identity` (its service
   account's DNS identity, also as `server_name`) and a protocol hint: `opaque`
   plus `opaque_transport{inbound_port}` on its opaque ports, else `h2`.
   Ports in `config.linkerd.io/skip-inbound-ports` get neither.
3. Profiles: a Service port the Service does not declare gets an empty
   profile (edge-26.7.1), so the proxy's policy refuses it. Otherwise routes,
   retry budget (default 20%/10 per s/10s), `dst_overrides`, `opaque_protocol`
   from the Service's opaque ports (its annotation, else its namespace's,
   else Linkerd's default list; the ServiceProfile's own list is replaced by
   it, as Linkerd's opaque-ports adaptor does), `fully_qualified_name`,
   `parent_ref`, `profile_ref`. A ServiceProfile in the client's namespace
   (context token) wins over the Service's namespace.
4. IP lookups: a Service cluster IP is that Service; a pod IP (or an unknown
   IP) is an endpoint profile with `endpoint` set and no name.
"""

from __future__ import annotations

import enum
import ipaddress
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

from agent._proto import destination_pb2 as pb
from agent._proto import net_pb2
from agent.controlplane import kinds_core as k8s
from agent.controlplane import resources as r
from agent.controlplane.endpoints import PodRef, opaque_ports

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    from agent.controlplane.endpoints import Catalog, EndpointAddress

DEFAULT_WEIGHT = 10_000
INBOUND_PORT = 4143
SKIP_INBOUND_PORTS_ANNOTATION = "config.linkerd.io/skip-inbound-ports"
CONTROL_PLANE_NS_LABEL = "linkerd.io/control-plane-ns"
POD_TEMPLATE_HASH_LABEL = "pod-template-hash"
DEFAULT_HTTP_PORT = 80


class InvalidTarget(ValueError):  # noqa: N818 - mirrors Linkerd's InvalidService
    """A path the Destination service refuses (INVALID_ARGUMENT)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class MeshConfig:
    """What translation needs from the control plane's settings."""

    cluster_domain: str = "cluster.local"
    trust_domain: str = "cluster.local"
    control_ns: str = "linkerd"
    inbound_port: int = INBOUND_PORT


@dataclass(frozen=True, slots=True, kw_only=True)
class ContextToken:
    """The proxy's context token: `{"ns": ..., "nodeName": ..., "pod": ...}`."""

    ns: str = ""
    node_name: str = ""
    pod: str = ""

    @classmethod
    def parse(cls, text: str) -> ContextToken:
        """Parse a token; like Linkerd, accept the old `ns:NAME` form and ignore garbage."""
        if not text:
            return cls()
        try:
            data = json.loads(text)
        except ValueError:
            kind, sep, ns = text.partition(":")
            return cls(ns=ns) if sep and kind == "ns" else cls()
        if not isinstance(data, dict):
            return cls()
        return cls(
            ns=str(data.get("ns") or ""),
            node_name=str(data.get("nodeName") or ""),
            pod=str(data.get("pod") or ""),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class Target:
    """A parsed `GetDestination.path`: `host:port` (port 80 when absent)."""

    host: str
    port: int

    @property
    def ip(self) -> str | None:
        """The normalised address when the host is an IP literal."""
        try:
            return str(ipaddress.ip_address(self.host.strip("[]")))
        except ValueError:
            return None

    @classmethod
    def parse(cls, path: str) -> Target:
        """Raises `InvalidTarget` naming the path and what is wrong with it."""
        if not path:
            raise InvalidTarget("Invalid authority: empty path")
        if ":" not in path:
            return cls(host=path, port=DEFAULT_HTTP_PORT)
        host, _, raw = path.rpartition(":")
        if host.count(":") and not (host.startswith("[") and host.endswith("]")):
            raise InvalidTarget(f"Invalid authority: {path}: IPv6 hosts must be in brackets")
        if not host or not raw.isdigit() or not 0 < int(raw) < 65536:
            raise InvalidTarget(f"Invalid authority: {path}: expected HOST:PORT, port 1-65535")
        return cls(host=host.strip("[]"), port=int(raw))


@dataclass(frozen=True, slots=True, kw_only=True)
class ServiceName:
    """`[instance.]name.namespace.svc.<cluster domain>`."""

    namespace: str
    name: str
    instance: str = ""

    def fqdn(self, cluster_domain: str) -> str:
        return f"{self.name}.{self.namespace}.svc.{cluster_domain}"


def parse_service_name(host: str, cluster_domain: str) -> ServiceName:
    """Raises `InvalidTarget` when `host` is not a service name in the cluster domain."""
    labels = host.rstrip(".").split(".")
    suffix = ["svc", *cluster_domain.split(".")]
    if len(labels) not in (len(suffix) + 2, len(suffix) + 3) or labels[-len(suffix) :] != suffix:
        raise InvalidTarget(
            f"Invalid authority: {host}: not <svc>.<ns>.svc.{cluster_domain} "
            "(or <hostname>.<svc>.<ns>.svc...)"
        )
    if len(labels) == len(suffix) + 3:
        return ServiceName(instance=labels[0], name=labels[1], namespace=labels[2])
    return ServiceName(name=labels[0], namespace=labels[1])


# --- endpoint model -----------------------------------------------------------------


class Hint(enum.Enum):
    """The protocol hint of one endpoint."""

    NONE = "none"
    H2 = "h2"
    OPAQUE = "opaque"


Labels = tuple[tuple[str, str], ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class Endpoint:
    """One address as a `WeightedAddr` describes it; comparable for diffs."""

    ip: str
    port: int
    weight: int = DEFAULT_WEIGHT
    labels: Labels = ()
    identity: str = ""
    hint: Hint = Hint.NONE
    opaque_transport_port: int | None = None

    @property
    def key(self) -> tuple[str, int]:
        return (self.ip, self.port)


@dataclass(frozen=True, slots=True, kw_only=True)
class EndpointSet:
    """What a Get stream shows: does the service exist, its ready endpoints, set labels."""

    exists: bool
    endpoints: tuple[Endpoint, ...] = ()
    labels: Labels = ()

    def by_key(self) -> dict[tuple[str, int], Endpoint]:
        return {e.key: e for e in self.endpoints}


NOT_FOUND = EndpointSet(exists=False)


def port_set(text: str | None, pod: k8s.Pod | None) -> frozenset[int]:
    if not text:
        return frozenset()
    try:
        items = r.parse_port_list(text)
    except ValueError:
        return frozenset()
    ports: set[int] = set()
    for item in items:
        if isinstance(item, r.PortRange):
            ports.update(range(item.first, item.last + 1))
        elif pod is not None and (number := pod.port(item)) is not None:
            ports.add(number)
    return frozenset(ports)


def _owner_labels(snap: Catalog, pod: k8s.Pod) -> dict[str, str]:
    for dep in snap.of_kind(k8s.Deployment, pod.namespace):
        selective = dep.selector.match_labels or dep.selector.match_expressions
        if selective and dep.selector.matches(pod.labels):
            return {"deployment": dep.name}
    return {}


def pod_endpoint(snap: Catalog, pod: k8s.Pod, ip: str, port: int, mesh: MeshConfig) -> Endpoint:
    """A pod's address described as Linkerd's endpoint translator does (rule 2)."""
    meshed = snap.is_meshed(pod)
    labels = {"pod": pod.name, "serviceaccount": pod.service_account, **_owner_labels(snap, pod)}
    if template_hash := pod.labels.get(POD_TEMPLATE_HASH_LABEL):
        labels["pod_template_hash"] = template_hash
    labels["zone"] = ""
    labels["zone_locality"] = "unknown"
    skipped = port in port_set(pod.annotations.get(SKIP_INBOUND_PORTS_ANNOTATION), pod)
    if not meshed or skipped:
        return Endpoint(ip=ip, port=port, labels=tuple(sorted(labels.items())))
    labels["control_plane_ns"] = mesh.control_ns
    opaque = port in opaque_ports(pod, snap.pod_namespace(pod))
    identity = (
        f"{pod.service_account}.{pod.namespace}.serviceaccount.identity."
        f"{mesh.control_ns}.{mesh.trust_domain}"
    )
    return Endpoint(
        ip=ip,
        port=port,
        labels=tuple(sorted(labels.items())),
        identity=identity,
        hint=Hint.OPAQUE if opaque else Hint.H2,
        opaque_transport_port=mesh.inbound_port if opaque else None,
    )


def _address_endpoint(snap: Catalog, addr: EndpointAddress, mesh: MeshConfig) -> Endpoint:
    pod = snap.pod(addr.pod.namespace, addr.pod.name) if isinstance(addr.pod, PodRef) else None
    if pod is None:
        return Endpoint(ip=addr.ip, port=addr.port, labels=(("zone_locality", "unknown"),))
    return pod_endpoint(snap, pod, addr.ip, addr.port, mesh)


def service_endpoints(
    snap: Catalog, service: k8s.Service, port: int, mesh: MeshConfig, instance: str = ""
) -> EndpointSet:
    """The ready endpoints of a Service port (an instance name keeps only that hostname)."""
    labels = (("namespace", service.namespace), ("service", service.name))
    found = tuple(
        _address_endpoint(snap, addr, mesh)
        for addr in snap.endpoints(service, port)
        if addr.ready and (not instance or addr.hostname == instance)
    )
    return EndpointSet(exists=True, endpoints=found, labels=labels)


def resolve(snap: Catalog, target: Target, mesh: MeshConfig) -> EndpointSet:
    """The endpoint set for `target` now (rule 1). Raises `InvalidTarget` for a bad name."""
    if (ip := target.ip) is not None:
        if (svc := snap.service_by_cluster_ip(ip)) is not None:
            return service_endpoints(snap, svc, target.port, mesh)
        if (pod := snap.pod_by_ip(ip)) is not None and not pod.terminal:
            return EndpointSet(
                exists=True, endpoints=(pod_endpoint(snap, pod, ip, target.port, mesh),)
            )
        return NOT_FOUND
    name = parse_service_name(target.host, mesh.cluster_domain)
    service = snap.service(name.namespace, name.name)
    if service is None:
        return NOT_FOUND
    if service.type is k8s.ServiceType.EXTERNAL_NAME:
        raise InvalidTarget(
            f"Invalid authority: {target.host}: ExternalName services have no endpoints"
        )
    return service_endpoints(snap, service, target.port, mesh, name.instance)


def diff(old: EndpointSet | None, new: EndpointSet) -> list[pb.Update]:
    """The updates that take a client from `old` (None: a new stream) to `new` (rule 1)."""
    if old is None:
        if new.endpoints:
            return [_add(new.endpoints, new.labels)]
        return [_no_endpoints(exists=new.exists)]
    if not new.exists:
        return [] if (not old.exists and not old.endpoints) else [_no_endpoints(exists=False)]
    if not new.endpoints:
        if old.exists and not old.endpoints:
            return []
        return [_no_endpoints(exists=True)]
    before = old.by_key() if old.exists else {}
    after = new.by_key()
    changed = [e for e in new.endpoints if before.get(e.key) != e]
    gone = [e for e in old.endpoints if e.key not in after] if old.exists else []
    if new.labels != old.labels:
        changed = list(new.endpoints)
    out: list[pb.Update] = []
    if changed:
        out.append(_add(changed, new.labels))
    if gone:
        out.append(pb.Update(remove=pb.AddrSet(addrs=[tcp_address(e.ip, e.port) for e in gone])))
    return out


def _no_endpoints(*, exists: bool) -> pb.Update:
    return pb.Update(no_endpoints=pb.NoEndpoints(exists=exists))


def _add(endpoints: Sequence[Endpoint], labels: Labels) -> pb.Update:
    return pb.Update(
        add=pb.WeightedAddrSet(
            addrs=[weighted_addr(e) for e in endpoints], metric_labels=dict(labels)
        )
    )


def ip_address(ip: str) -> net_pb2.IPAddress:
    """An IP literal as the proxy API's `IPAddress`."""
    addr = ipaddress.ip_address(ip)
    if isinstance(addr, ipaddress.IPv4Address):
        return net_pb2.IPAddress(ipv4=int(addr))
    value = int(addr)
    return net_pb2.IPAddress(ipv6=net_pb2.IPv6(first=value >> 64, last=value & (2**64 - 1)))


def tcp_address(ip: str, port: int) -> net_pb2.TcpAddress:
    return net_pb2.TcpAddress(ip=ip_address(ip), port=port)


def weighted_addr(e: Endpoint, extra_labels: Mapping[str, str] | None = None) -> pb.WeightedAddr:
    """The wire form of one endpoint."""
    out = pb.WeightedAddr(
        addr=tcp_address(e.ip, e.port),
        weight=e.weight,
        metric_labels={**dict(e.labels), **(extra_labels or {})},
    )
    if e.identity:
        name = pb.TlsIdentity.DnsLikeIdentity(name=e.identity)
        out.tls_identity.CopyFrom(pb.TlsIdentity(dns_like_identity=name, server_name=name))
    if e.hint is Hint.H2:
        out.protocol_hint.CopyFrom(pb.ProtocolHint(h2=pb.ProtocolHint.H2()))
    elif e.hint is Hint.OPAQUE:
        out.protocol_hint.CopyFrom(pb.ProtocolHint(opaque=pb.ProtocolHint.Opaque()))
    if e.opaque_transport_port is not None:
        out.protocol_hint.opaque_transport.inbound_port = e.opaque_transport_port
    return out
