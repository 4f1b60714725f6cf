"""Indexes over a set of resources, and the endpoints a Service has (pure).

`Catalog` is built once from a list of objects and then only read: lookups by
name, by cluster IP and by pod IP; derived endpoints; mesh membership; the
policy objects that apply to a pod port. No I/O, no locks, no clocks.

Rules:
1. A Service's endpoints come from its EndpointSlices if it has any, else from
   its Endpoints, else, when it has a selector, from the Pods it selects, as
   the Kubernetes endpoints controller derives them: pods with an IP and a
   non-terminal phase; ready is the Ready condition (every pod counts as ready
   under publishNotReadyAddresses); a named targetPort is resolved per pod and
   a pod without that port name is left out.
2. Results are sorted (by IP then port, or by name) so callers can compare.
3. A pod is meshed when `linkerd.io/inject` is `enabled` (or `ingress`) on the
   pod, or, without a pod annotation, on its namespace; `disabled` on the pod
   opts out; host-network pods are never meshed.
"""

from __future__ import annotations

import dataclasses
import ipaddress
from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from agent.controlplane import kinds
from agent.controlplane import kinds_core as k8s
from agent.controlplane import kinds_linkerd as l5d
from agent.controlplane import resources as r

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping

T = TypeVar("T", bound=r.Object)

MESHED_VALUES = frozenset({"enabled", "ingress"})
DEFAULT_CLUSTER_DOMAIN = "cluster.local"


@dataclass(frozen=True, slots=True, kw_only=True)
class PodRef:
    """A pod by namespace and name."""

    namespace: str
    name: str


@dataclass(frozen=True, slots=True, kw_only=True)
class EndpointAddress:
    """One endpoint of a Service port, with what Destination needs to describe it."""

    ip: str
    port: int
    ready: bool
    pod: PodRef | None = None
    node_name: str = ""
    service_account: str = ""  # "" when no known pod backs it
    hostname: str = ""
    zone: str = ""
    meshed: bool = False


def selector_matches(
    selector: r.LabelSelector | Mapping[str, str], labels: Mapping[str, str]
) -> bool:
    """matchLabels + matchExpressions (In/NotIn/Exists/DoesNotExist), or a plain equality map."""
    if isinstance(selector, r.LabelSelector):
        return selector.matches(labels)
    return all(labels.get(k) == v for k, v in selector.items())


def is_meshed(pod: k8s.Pod, namespace: k8s.Namespace | None) -> bool:
    """Whether the pod gets the mesh (rule 3)."""
    if pod.host_network:
        return False
    value = pod.annotations.get(r.INJECT_ANNOTATION)
    if value is None and namespace is not None:
        value = namespace.annotations.get(r.INJECT_ANNOTATION)
    return value in MESHED_VALUES


def _annotation(name: str, *objects: r.Object | None) -> str | None:
    for obj in objects:
        if obj is not None and (value := obj.annotations.get(name)) is not None:
            return value
    return None


def opaque_ports(obj: k8s.Pod | k8s.Service, namespace: k8s.Namespace | None) -> frozenset[int]:
    """Opaque ports from the object's annotation, else its namespace's, else Linkerd's default.

    Port names in a pod's annotation resolve through its containers; for a
    Service they resolve through its port names (to the service port).
    """
    text = _annotation(r.OPAQUE_PORTS_ANNOTATION, obj, namespace) or r.DEFAULT_OPAQUE_PORTS
    ports: set[int] = set()
    for item in r.parse_port_list(text):
        if isinstance(item, r.PortRange):
            ports.update(range(item.first, item.last + 1))
        elif isinstance(obj, k8s.Pod):
            if (number := obj.port(item)) is not None:
                ports.add(number)
        else:
            ports.update(p.port for p in obj.ports if p.name == item)
    return frozenset(ports)


def default_inbound_policy(
    pod: k8s.Pod, namespace: k8s.Namespace | None, cluster_default: l5d.AccessPolicy
) -> l5d.AccessPolicy:
    """The pod's default-inbound-policy annotation, else its namespace's, else the cluster's."""
    value = _annotation(r.DEFAULT_INBOUND_POLICY_ANNOTATION, pod, namespace)
    return l5d.AccessPolicy(value) if value is not None else cluster_default


def parse_service_fqdn(
    host: str, cluster_domain: str = DEFAULT_CLUSTER_DOMAIN
) -> tuple[str, str, str] | None:
    """`[hostname.]service.namespace.svc[.<domain>]` -> (namespace, service, hostname or "")."""
    labels = host.rstrip(".").lower().split(".")
    domain = cluster_domain.lower().split(".")
    if len(labels) > len(domain) and labels[-len(domain) :] == domain:
        labels = labels[: -len(domain)]
    if labels[-1:] != ["svc"] or len(labels) not in (3, 4):
        return None
    if len(labels) == 3:
        return (labels[1], labels[0], "")
    return (labels[2], labels[1], labels[0])


def _ip_key(ip: str) -> tuple[int, int]:
    try:
        addr = ipaddress.ip_address(ip)
    except ValueError:
        return (9, 0)
    return (addr.version, int(addr))


class Catalog:
    """Read-only indexes over one consistent set of objects."""

    __slots__ = ("_by_cluster_ip", "_by_key", "_by_kind", "_by_pod_ip", "_slices", "objects")

    def __init__(self, objects: Iterable[kinds.Resource]) -> None:
        self.objects: tuple[kinds.Resource, ...] = tuple(objects)
        by_kind: dict[type[r.Object], list[kinds.Resource]] = defaultdict(list)
        self._by_key: dict[tuple[type[r.Object], str, str], kinds.Resource] = {}
        self._by_pod_ip: dict[str, k8s.Pod] = {}
        self._by_cluster_ip: dict[str, k8s.Service] = {}
        slices: dict[tuple[str, str], list[k8s.EndpointSlice]] = defaultdict(list)
        for obj in self.objects:
            by_kind[type(obj)].append(obj)
            self._by_key.setdefault((type(obj), obj.namespace, obj.name), obj)
            if isinstance(obj, k8s.Pod):
                self._index_pod(obj)
            elif isinstance(obj, k8s.Service):
                for ip in obj.cluster_ips or (obj.cluster_ip,):
                    if ip and ip != "None":
                        self._by_cluster_ip.setdefault(ip, obj)
            elif isinstance(obj, k8s.EndpointSlice) and obj.service_name:
                slices[(obj.namespace, obj.service_name)].append(obj)
        self._by_kind = {
            k: tuple(sorted(v, key=lambda o: (o.namespace, o.name))) for k, v in by_kind.items()
        }
        self._slices = {k: tuple(v) for k, v in slices.items()}

    def _index_pod(self, pod: k8s.Pod) -> None:
        if pod.host_network:
            return  # a host-network pod's IP is the node's, not the pod's
        for ip in pod.status.pod_ips or ((pod.ip,) if pod.ip else ()):
            current = self._by_pod_ip.get(ip)
            if current is None or (current.terminal and not pod.terminal):
                self._by_pod_ip[ip] = pod

    # --- generic --------------------------------------------------------------

    def get(self, kind: type[T], namespace: str, name: str) -> T | None:
        """The object of that kind, namespace ("" if cluster-scoped) and name."""
        obj = self._by_key.get((kind, namespace, name))
        return obj if isinstance(obj, kind) else None

    def of_kind(self, kind: type[T], namespace: str | None = None) -> tuple[T, ...]:
        """All objects of a kind, sorted by (namespace, name); optionally in one namespace."""
        found = self._by_kind.get(kind, ())
        return tuple(o for o in found if isinstance(o, kind) and namespace in (None, o.namespace))

    # --- named lookups ------------------------------------------------------------

    def namespace(self, name: str) -> k8s.Namespace | None:
        """A Namespace by name."""
        return self.get(k8s.Namespace, "", name)

    def pod(self, namespace: str, name: str) -> k8s.Pod | None:
        """A Pod by namespace and name."""
        return self.get(k8s.Pod, namespace, name)

    def service(self, namespace: str, name: str) -> k8s.Service | None:
        """A Service by namespace and name."""
        return self.get(k8s.Service, namespace, name)

    def service_by_cluster_ip(self, ip: str) -> k8s.Service | None:
        """The Service owning a cluster IP."""
        return self._by_cluster_ip.get(ip)

    def pod_by_ip(self, ip: str) -> k8s.Pod | None:
        """The pod with that IP (a live one preferred over a terminated one)."""
        return self._by_pod_ip.get(ip)

    def service_by_fqdn(
        self, host: str, cluster_domain: str = DEFAULT_CLUSTER_DOMAIN
    ) -> k8s.Service | None:
        """`name.namespace.svc[.<domain>]` (a `hostname.` prefix allowed) -> Service."""
        parsed = parse_service_fqdn(host, cluster_domain)
        return self.service(parsed[0], parsed[1]) if parsed else None

    def service_profile(
        self,
        service: k8s.Service,
        client_namespace: str = "",
        cluster_domain: str = DEFAULT_CLUSTER_DOMAIN,
    ) -> l5d.ServiceProfile | None:
        """A Service's ServiceProfile: in the client's namespace first, then the service's."""
        fqdn = f"{service.name}.{service.namespace}.svc.{cluster_domain}"
        for ns in (client_namespace, service.namespace):
            if ns and (profile := self.get(l5d.ServiceProfile, ns, fqdn)) is not None:
                return profile
        return None

    def pod_namespace(self, pod: k8s.Pod) -> k8s.Namespace | None:
        """The pod's Namespace object, if one was given."""
        return self.namespace(pod.namespace)

    def is_meshed(self, pod: k8s.Pod) -> bool:
        """Whether the pod is meshed (module rule 3)."""
        return is_meshed(pod, self.namespace(pod.namespace))

    def pods_for(
        self, selector: r.LabelSelector | Mapping[str, str], namespace: str
    ) -> tuple[k8s.Pod, ...]:
        """Pods in a namespace whose labels the selector matches."""
        return tuple(
            p for p in self.of_kind(k8s.Pod, namespace) if selector_matches(selector, p.labels)
        )

    # --- endpoints -------------------------------------------------------------------

    def endpoints(
        self, service: k8s.Service, port: int, protocol: str = "TCP"
    ) -> tuple[EndpointAddress, ...]:
        """The endpoints of a Service port (module rule 1); () if it has no such port."""
        sport = service.port(port, protocol)
        if sport is None:
            return ()
        slices = self._slices.get((service.namespace, service.name))
        if slices:
            found = self._from_slices(service, sport, slices)
        elif (eps := self.get(k8s.Endpoints, service.namespace, service.name)) is not None:
            found = self._from_endpoints(service, sport, eps)
        elif service.selector is not None:
            found = self._from_pods(service, sport)
        else:
            found = []
        unique = {(e.ip, e.port): e for e in found}
        return tuple(sorted(unique.values(), key=lambda e: (_ip_key(e.ip), e.port)))

    def _from_pods(self, service: k8s.Service, sport: k8s.ServicePort) -> list[EndpointAddress]:
        out: list[EndpointAddress] = []
        for pod in self.pods_for(service.selector or {}, service.namespace):
            if not pod.ip or pod.terminal:
                continue
            number = pod.port(sport.target_port, sport.protocol)
            if number is None:
                continue  # the endpoints controller skips a pod lacking the port name
            hostname = pod.hostname if pod.subdomain == service.name else ""
            ready = pod.status.ready or service.publish_not_ready_addresses
            out.extend(
                self._address(ip, number, ready, pod, pod.node_name, hostname)
                for ip in pod.status.pod_ips or (pod.ip,)
            )
        return out

    def _from_endpoints(
        self, service: k8s.Service, sport: k8s.ServicePort, eps: k8s.Endpoints
    ) -> list[EndpointAddress]:
        out: list[EndpointAddress] = []
        for subset in eps.subsets:
            for eport in subset.ports:
                if (
                    eport.name != sport.name
                    or eport.protocol != sport.protocol
                    or eport.port is None
                ):
                    continue
                for ready, addrs in ((True, subset.addresses), (False, subset.not_ready_addresses)):
                    for addr in addrs:
                        pod = self._target_pod(addr.target_ref, service.namespace)
                        ok = ready or service.publish_not_ready_addresses
                        out.append(
                            self._address(
                                addr.ip, eport.port, ok, pod, addr.node_name, addr.hostname
                            )
                        )
        return out

    def _from_slices(
        self, service: k8s.Service, sport: k8s.ServicePort, slices: tuple[k8s.EndpointSlice, ...]
    ) -> list[EndpointAddress]:
        out: list[EndpointAddress] = []
        for eps in slices:
            if eps.address_type == "FQDN":
                continue
            for eport in eps.ports:
                if (
                    eport.name != sport.name
                    or eport.protocol != sport.protocol
                    or eport.port is None
                ):
                    continue
                for ep in eps.endpoints:
                    pod = self._target_pod(ep.target_ref, service.namespace)
                    ready = ep.ready or service.publish_not_ready_addresses
                    for ip in ep.addresses:
                        addr = self._address(ip, eport.port, ready, pod, ep.node_name, ep.hostname)
                        out.append(_with_zone(addr, ep.zone))
        return out

    def _target_pod(self, ref: r.ObjectRef | None, namespace: str) -> k8s.Pod | PodRef | None:
        if ref is None or ref.kind != "Pod" or not ref.name:
            return None
        ns = ref.namespace or namespace
        return self.pod(ns, ref.name) or PodRef(namespace=ns, name=ref.name)

    def _address(  # noqa: PLR0913, PLR0917 - the fields of one address
        self,
        ip: str,
        port: int,
        ready: bool,
        pod: k8s.Pod | PodRef | None,
        node: str,
        hostname: str,
    ) -> EndpointAddress:
        if isinstance(pod, k8s.Pod):
            return EndpointAddress(
                ip=ip,
                port=port,
                ready=ready,
                pod=PodRef(namespace=pod.namespace, name=pod.name),
                node_name=node or pod.node_name,
                service_account=pod.service_account,
                hostname=hostname,
                meshed=self.is_meshed(pod),
            )
        return EndpointAddress(
            ip=ip, port=port, ready=ready, pod=pod, node_name=node, hostname=hostname
        )

    # --- policy -------------------------------------------------------------------------

    def servers_for(self, pod: k8s.Pod, port: int) -> tuple[l5d.Server, ...]:
        """Servers in the pod's namespace selecting it on `port` (a number, or a name for it).

        Sorted by name; with several, Linkerd uses the oldest, and manifests have
        no creation time, so callers take the first.
        """
        return tuple(
            srv
            for srv in self.of_kind(l5d.Server, pod.namespace)
            if srv.pod_selector.matches(pod.labels) and pod.port(srv.port) == port
        )

    def server_authorizations(self, server: l5d.Server) -> tuple[l5d.ServerAuthorization, ...]:
        """ServerAuthorizations naming the Server or selecting its labels."""
        return tuple(
            saz
            for saz in self.of_kind(l5d.ServerAuthorization, server.namespace)
            if saz.server_name == server.name
            or (saz.server_selector is not None and saz.server_selector.matches(server.labels))
        )

    def authorization_policies(
        self, namespace: str, kind: str, name: str
    ) -> tuple[l5d.AuthorizationPolicy, ...]:
        """AuthorizationPolicies in `namespace` whose targetRef is that kind and name.

        Pass kind "Namespace" and the namespace's name for namespace-wide policies.
        """
        return tuple(
            ap
            for ap in self.of_kind(l5d.AuthorizationPolicy, namespace)
            if ap.target_ref.kind == kind and ap.target_ref.name == name
        )

    def routes_for_server(self, server: l5d.Server) -> tuple[l5d.HTTPRoute, ...]:
        """HTTPRoutes (either API group) with a Server parentRef naming this Server."""
        return tuple(
            route
            for route in self.of_kind(l5d.HTTPRoute)
            if any(
                p.kind == "Server"
                and p.name == server.name
                and (p.namespace or route.namespace) == server.namespace
                for p in route.parent_refs
            )
        )

    def routes_for_service(
        self, service: k8s.Service, port: int | None = None
    ) -> tuple[l5d.HTTPRoute, ...]:
        """HTTPRoutes whose Service parentRef names this Service (and port, if the ref has one)."""
        return tuple(
            route
            for route in self.of_kind(l5d.HTTPRoute)
            if any(
                p.kind == "Service"
                and p.group in ("", "core")
                and p.name == service.name
                and (p.namespace or route.namespace) == service.namespace
                and (port is None or p.port in (None, port))
                for p in route.parent_refs
            )
        )


def _with_zone(addr: EndpointAddress, zone: str) -> EndpointAddress:
    return dataclasses.replace(addr, zone=zone) if zone else addr
