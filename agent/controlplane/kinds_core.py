"""Kubernetes kinds: Namespace, ServiceAccount, Pod, Deployment, Service, Endpoints, EndpointSlice.

The core/v1, apps/v1 and discovery.k8s.io/v1 objects the mesh reads, with the
parts only they use (pod status and template, service ports, Endpoints
subsets, slice endpoints). Pure data, built on `agent.controlplane.resources`.

Rules (those of `resources`, as they apply here):
1. Field names are Kubernetes' in snake_case; defaults are Kubernetes' (a Pod's
   service account is "default", a Service's type ClusterIP, a port's protocol
   TCP; a Service port's `target_port` defaults to its `port`).
2. Labels, annotations and selectors are `FrozenMap`s; every object is
   immutable and hashable.
3. Ports named or numbered are `int | str` (a digit string is always an int).
4. `source` (from `Object`) does not take part in equality.
5. Imports only `resources` of the model, never `kinds_linkerd` or `kinds`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from agent.controlplane.resources import (
    EMPTY,
    Container,
    FrozenMap,
    LabelSelector,
    Object,
    ObjectRef,
    resolve_port,
)


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
