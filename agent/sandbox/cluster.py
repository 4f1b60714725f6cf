"""The sandbox acting as the cluster: manifests -> a cluster plan (pure).

`plan(objects, nodes)` expands Deployments (and bare Pods) into pods, places
them on nodes, gives each pod an IP from its node's pod CIDR and each Service a
ClusterIP, and derives what the shell needs: Pod manifests with status (for the
control plane and `meshagent run --pods-from manifests:DIR`), the ports each
pod's built-in app serves, every Service port's endpoints (for kube-proxy rules)
and each pod's /etc/hosts.

Rules:
1. Deterministic: the same manifests and nodes give the same plan (names, UIDs,
   placement, addresses), so `up` twice produces the same cluster.
2. Pods are named `<deployment>-<hash>-<n>`: hash from the pod template, n the
   replica index. UIDs are UUIDv5 of `namespace/name`.
3. Placement: workloads in (namespace, name) order; each replica goes to the
   node holding the fewest replicas of its workload, then the fewest pods, then
   the first; so replicas of one Deployment spread over nodes.
4. Pod IPs are the node CIDR's hosts after the gateway (the first host), in
   placement order. ClusterIPs are taken from `SERVICE_CIDR` in Service order,
   keeping any valid clusterIP a manifest sets.
5. No I/O; the shell (`agent.sandbox.build`) creates what the plan describes.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from agent.controlplane import endpoints as ep
from agent.controlplane import kinds
from agent.controlplane import kinds_core as k8s
from agent.controlplane import resources as r

if TYPE_CHECKING:
    from collections.abc import Iterable, Sequence

SERVICE_CIDR = ipaddress.IPv4Network("10.96.0.0/16")
CLUSTER_DOMAIN = "cluster.local"
COMMAND_ANNOTATION = "sandbox.meshagent.io/command"
_UID_NAMESPACE = uuid.UUID("5f0b1c9e-3d2a-4e51-9a57-6d8f0c2b7e11")


class PlanError(ValueError):
    """The manifests cannot be laid out on the nodes (say which and why)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeSpec:
    """A simulated node: its name and the CIDR its pods get addresses from."""

    name: str
    pod_cidr: ipaddress.IPv4Network

    @property
    def gateway(self) -> str:
        return str(self.pod_cidr.network_address + 1)


@dataclass(frozen=True, slots=True, kw_only=True)
class AppPort:
    """A port the pod's built-in app serves; `opaque` ports echo bytes, others speak HTTP."""

    port: int
    opaque: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class PodPlan:
    """One pod to create."""

    name: str
    namespace: str
    uid: str
    workload: str  # Deployment name, or the pod's own name for a bare Pod
    node: str
    ip: str
    service_account: str
    labels: r.FrozenMap
    annotations: r.FrozenMap
    containers: tuple[r.Container, ...]
    meshed: bool
    app_ports: tuple[AppPort, ...]
    command: str  # sandbox.meshagent.io/command, "" for the built-in app

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"

    def resource(self) -> k8s.Pod:
        """This pod as the store's domain type."""
        return _pod_resource(self)


@dataclass(frozen=True, slots=True, kw_only=True)
class Backend:
    """One endpoint of a Service port."""

    ip: str
    port: int
    pod: str  # namespace/name
    node: str


@dataclass(frozen=True, slots=True, kw_only=True)
class ServicePortPlan:
    """A Service port and where kube-proxy sends it."""

    namespace: str
    service: str
    name: str
    cluster_ip: str
    port: int
    protocol: str
    backends: tuple[Backend, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class ClusterPlan:
    """Everything `up` creates, in creation order."""

    nodes: tuple[NodeSpec, ...]
    pods: tuple[PodPlan, ...]
    cluster_ips: dict[tuple[str, str], str]  # (namespace, service) -> ClusterIP
    service_ports: tuple[ServicePortPlan, ...]
    cluster_domain: str = CLUSTER_DOMAIN

    def pod(self, namespace: str, name: str) -> PodPlan:
        """Raises KeyError."""
        for pod in self.pods:
            if pod.namespace == namespace and pod.name == name:
                return pod
        raise KeyError(f"{namespace}/{name}")

    def pods_of(self, namespace: str, workload: str) -> tuple[PodPlan, ...]:
        return tuple(p for p in self.pods if p.namespace == namespace and p.workload == workload)


# --- expansion ---------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class _Workload:
    namespace: str
    name: str
    replicas: int
    template: k8s.PodTemplate
    bare: bool  # a Pod manifest: keep its name


def _workloads(objects: Iterable[kinds.Resource]) -> list[_Workload]:
    found: list[_Workload] = []
    for obj in objects:
        if isinstance(obj, k8s.Deployment):
            found.append(
                _Workload(
                    namespace=obj.namespace,
                    name=obj.name,
                    replicas=obj.replicas,
                    template=obj.template,
                    bare=False,
                )
            )
        elif isinstance(obj, k8s.Pod) and not obj.host_network:
            tmpl = k8s.PodTemplate(
                labels=obj.labels,
                annotations=obj.annotations,
                service_account=obj.service_account,
                containers=obj.containers,
            )
            found.append(
                _Workload(
                    namespace=obj.namespace, name=obj.name, replicas=1, template=tmpl, bare=True
                )
            )
    return sorted(found, key=lambda w: (w.namespace, w.name))


def template_hash(template: k8s.PodTemplate) -> str:
    """Five characters standing for the template, as `pod-template-hash` does."""
    data = json.dumps(
        {
            "labels": dict(template.labels),
            "annotations": dict(template.annotations),
            "sa": template.service_account,
            "containers": [
                [c.name, c.image, [[p.name, p.container_port, p.protocol] for p in c.ports]]
                for c in template.containers
            ],
        },
        sort_keys=True,
    )
    return hashlib.sha256(data.encode()).hexdigest()[:5]


def pod_uid(namespace: str, name: str) -> str:
    return str(uuid.uuid5(_UID_NAMESPACE, f"{namespace}/{name}"))


def _place(
    workloads: list[_Workload], nodes: Sequence[NodeSpec]
) -> list[tuple[_Workload, int, str]]:
    total = dict.fromkeys((n.name for n in nodes), 0)
    order = [n.name for n in nodes]
    placed: list[tuple[_Workload, int, str]] = []
    for wl in workloads:
        mine = dict.fromkeys(order, 0)
        for i in range(wl.replicas):
            node = min(order, key=lambda n: (mine[n], total[n], order.index(n)))
            mine[node] += 1
            total[node] += 1
            placed.append((wl, i, node))
    return placed


def _node_ips(nodes: Sequence[NodeSpec]) -> dict[str, Any]:
    iters = {}
    for node in nodes:
        hosts = node.pod_cidr.hosts()
        next(hosts)  # the gateway
        iters[node.name] = hosts
    return iters


def _app_ports(pod: k8s.Pod, namespace: k8s.Namespace | None) -> tuple[AppPort, ...]:
    opaque = ep.opaque_ports(pod, namespace)
    ports = sorted(
        {p.container_port for c in pod.containers for p in c.ports if p.protocol == "TCP"}
    )
    return tuple(AppPort(port=p, opaque=p in opaque) for p in ports)


def _pod_resource(p: PodPlan) -> k8s.Pod:
    return k8s.Pod(
        name=p.name,
        namespace=p.namespace,
        uid=p.uid,
        labels=p.labels,
        annotations=p.annotations,
        service_account=p.service_account,
        node_name=p.node,
        containers=p.containers,
        status=k8s.PodStatus(phase=k8s.PodPhase.RUNNING, pod_ip=p.ip, pod_ips=(p.ip,), ready=True),
    )


def _expand_pods(objects: list[kinds.Resource], nodes: Sequence[NodeSpec]) -> list[PodPlan]:
    namespaces = {o.name: o for o in objects if isinstance(o, k8s.Namespace)}
    ips = _node_ips(nodes)
    pods: list[PodPlan] = []
    for wl, index, node in _place(_workloads(objects), nodes):
        name = wl.name if wl.bare else f"{wl.name}-{template_hash(wl.template)}-{index}"
        try:
            ip = str(next(ips[node]))
        except StopIteration:
            raise PlanError(f"node {node}: pod CIDR is full at pod {wl.namespace}/{name}") from None
        tmpl = wl.template
        stub = PodPlan(
            name=name,
            namespace=wl.namespace,
            uid=pod_uid(wl.namespace, name),
            workload=wl.name,
            node=node,
            ip=ip,
            service_account=tmpl.service_account,
            labels=tmpl.labels,
            annotations=tmpl.annotations,
            containers=tmpl.containers,
            meshed=False,
            app_ports=(),
            command=tmpl.annotations.get(COMMAND_ANNOTATION, ""),
        )
        res = _pod_resource(stub)
        ns = namespaces.get(wl.namespace)
        pods.append(_replace(stub, meshed=ep.is_meshed(res, ns), app_ports=_app_ports(res, ns)))
    return pods


def _replace(pod: PodPlan, **changes: Any) -> PodPlan:
    import dataclasses  # noqa: PLC0415 - local to keep the namespace small

    return dataclasses.replace(pod, **changes)


# --- services ------------------------------------------------------------------


def _cluster_ips(services: list[k8s.Service]) -> dict[tuple[str, str], str]:
    taken: dict[tuple[str, str], str] = {}
    for svc in services:
        if svc.cluster_ip and svc.cluster_ip != "None":
            taken[(svc.namespace, svc.name)] = svc.cluster_ip
    used = set(taken.values())
    hosts = SERVICE_CIDR.hosts()
    next(hosts)  # .0.1 is the apiserver's in Kubernetes
    for svc in services:
        key = (svc.namespace, svc.name)
        if key in taken or svc.headless or svc.type is k8s.ServiceType.EXTERNAL_NAME:
            continue
        ip = str(next(hosts))
        while ip in used:
            ip = str(next(hosts))
        taken[key] = ip
        used.add(ip)
    return taken


def _backends(svc: k8s.Service, sport: k8s.ServicePort, pods: list[PodPlan]) -> tuple[Backend, ...]:
    if svc.selector is None:
        return ()
    found = []
    for pod in pods:
        if pod.namespace != svc.namespace or not ep.selector_matches(svc.selector, pod.labels):
            continue
        port = r.resolve_port(pod.containers, sport.target_port, sport.protocol)
        if port is not None:
            found.append(Backend(ip=pod.ip, port=port, pod=pod.key, node=pod.node))
    return tuple(found)


def plan(objects: Iterable[kinds.Resource], nodes: Sequence[NodeSpec]) -> ClusterPlan:
    """Lay the manifests out on `nodes` (see the module rules).

    Raises:
        PlanError: no nodes, or a node's pod CIDR has no room.
    """
    if not nodes:
        raise PlanError("a cluster needs at least one node")
    objs = list(objects)
    pods = _expand_pods(objs, nodes)
    services = sorted(
        (o for o in objs if isinstance(o, k8s.Service)), key=lambda s: (s.namespace, s.name)
    )
    ips = _cluster_ips(services)
    ports = tuple(
        ServicePortPlan(
            namespace=svc.namespace,
            service=svc.name,
            name=sport.name,
            cluster_ip=ips[(svc.namespace, svc.name)],
            port=sport.port,
            protocol=sport.protocol,
            backends=_backends(svc, sport, pods),
        )
        for svc in services
        if (svc.namespace, svc.name) in ips
        for sport in svc.ports
    )
    return ClusterPlan(nodes=tuple(nodes), pods=tuple(pods), cluster_ips=ips, service_ports=ports)


# --- outputs -------------------------------------------------------------------


def pod_manifest(pod: PodPlan, node_ip: str = "") -> dict[str, Any]:
    """The Pod as a Kubernetes manifest with `spec.nodeName`, `status.podIP` and Ready."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": pod.name,
            "namespace": pod.namespace,
            "uid": pod.uid,
            "labels": dict(pod.labels),
            "annotations": dict(pod.annotations),
        },
        "spec": {
            "serviceAccountName": pod.service_account,
            "nodeName": pod.node,
            "containers": [
                {
                    "name": c.name,
                    "image": c.image,
                    "ports": [
                        {
                            "containerPort": p.container_port,
                            "protocol": p.protocol,
                            **({"name": p.name} if p.name else {}),
                        }
                        for p in c.ports
                    ],
                }
                for c in pod.containers
            ],
        },
        "status": {
            "phase": "Running",
            "podIP": pod.ip,
            "podIPs": [{"ip": pod.ip}],
            **({"hostIP": node_ip} if node_ip else {}),
            "conditions": [{"type": "Ready", "status": "True"}],
        },
    }


def patch_documents(docs: Iterable[Any], cluster: ClusterPlan) -> list[Any]:
    """The user's documents for the generated folder: Pods dropped (the plan
    re-emits them), Services given their ClusterIP. Inputs are not modified."""
    out: list[Any] = []
    for doc in docs:
        if not isinstance(doc, dict):
            continue
        kind = doc.get("kind")
        if kind == "Pod":
            continue
        if kind == "Service":
            meta = doc.get("metadata") or {}
            key = (meta.get("namespace") or "default", meta.get("name", ""))
            ip = cluster.cluster_ips.get(key)
            if ip is not None:
                spec = dict(doc.get("spec") or {})
                spec["clusterIP"] = ip
                spec["clusterIPs"] = [ip]
                doc = {**doc, "spec": spec}  # noqa: PLW2901 - a patched copy
        out.append(doc)
    return out


def service_names(namespace: str, service: str, domain: str = CLUSTER_DOMAIN) -> list[str]:
    """Names a Service resolves by, longest first."""
    return [
        f"{service}.{namespace}.svc.{domain}",
        f"{service}.{namespace}.svc",
        f"{service}.{namespace}",
    ]


def hosts_file(cluster: ClusterPlan, pod: PodPlan) -> str:
    """/etc/hosts for `pod`: localhost, itself, and every Service with a ClusterIP
    (short names for Services in the pod's own namespace, as its search path would)."""
    lines = [
        "# written by meshagent sandbox",
        "127.0.0.1\tlocalhost",
        "::1\tlocalhost ip6-localhost ip6-loopback",
        f"{pod.ip}\t{pod.name}",
    ]
    for (ns, name), ip in sorted(cluster.cluster_ips.items()):
        names = service_names(ns, name, cluster.cluster_domain)
        if ns == pod.namespace:
            names.append(name)
        lines.append(f"{ip}\t{' '.join(names)}")
    return "\n".join(lines) + "\n"


def resolve(cluster: ClusterPlan, host: str) -> str | None:
    """The ClusterIP a Service name resolves to (any of `service_names`), else None."""
    for (ns, name), ip in cluster.cluster_ips.items():
        if host in service_names(ns, name, cluster.cluster_domain):
            return ip
    return None
