"""Validated core documents -> `kinds_core` dataclasses, and what every converter shares.

The converters of v1 Namespace, ServiceAccount, Pod, Service and Endpoints,
discovery.k8s.io/v1 EndpointSlice and apps/v1 Deployment, listed in
`KIND_TABLE` with the model and apiVersions of each kind. Shared with
`convert_linkerd`: `Invalid`, `Kind`, `label_selector` and `object_ref`.

Rules:
1. A converter takes a validated `schema_core` model and the `base` fields
   `documents` read from its metadata (name, namespace, uid, labels,
   annotations, source) and returns one `kinds_core` dataclass; no pydantic
   model is returned.
2. What pydantic cannot check field by field (several fields together) is
   checked here and raised as `Invalid(field, reason)`, `field` a dotted path
   in the document; `documents` makes it a `ManifestError`.
3. A kind is namespaced unless its `Kind` says otherwise; `documents` fills
   in the "default" namespace.
4. Pure: no I/O. Imports the schema and the resource model, never
   `convert_linkerd` or `documents` (import-linter layers).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from agent.controlplane import kinds_core as k8s
from agent.controlplane import manifests_schema as schema
from agent.controlplane import resources as r
from agent.controlplane import schema_core as sk8s

if TYPE_CHECKING:
    from collections.abc import Callable

    from agent.controlplane import kinds


class Invalid(Exception):  # noqa: N818 - internal signal, becomes ManifestError
    """A semantic error found while converting; `field` is a dotted path."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(reason)
        self.field = field
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Kind:
    """One kind's entry in a `KIND_TABLE`: its model, its converter, the apiVersions served."""

    model: type[schema.Doc]
    convert: Callable[[Any, dict[str, Any]], kinds.Resource]
    versions: frozenset[str]  # accepted apiVersion values
    namespaced: bool = True


# --- shared conversions (also used by convert_linkerd) ----------------------------------


def label_selector(model: schema.Selector) -> r.LabelSelector:
    """A validated selector (Deployment, Server, ServerAuthorization) -> its domain form."""
    return r.LabelSelector(
        match_labels=r.FrozenMap(model.match_labels),
        match_expressions=tuple(
            r.SelectorRequirement(
                key=req.key, operator=r.SelectorOperator(req.operator), values=tuple(req.values)
            )
            for req in model.match_expressions
        ),
    )


def object_ref(model: schema.Ref) -> r.ObjectRef:
    """A validated object reference (targetRef and the like) -> its domain form."""
    return r.ObjectRef(
        kind=model.kind, name=model.name, namespace=model.namespace, group=model.group
    )


def _containers(models: list[schema.Container]) -> tuple[r.Container, ...]:
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


# --- core kinds ---------------------------------------------------------------------------


def _pod(doc: sk8s.PodDoc, base: dict[str, Any]) -> k8s.Pod:
    st = doc.status
    ready = any(c.type == "Ready" and c.status == "True" for c in st.conditions)
    ips = tuple(p.ip for p in st.pod_ips) or ((st.pod_ip,) if st.pod_ip else ())
    return k8s.Pod(
        **base,
        service_account=doc.spec.service_account_name or doc.spec.service_account or "default",
        node_name=doc.spec.node_name,
        hostname=doc.spec.hostname,
        subdomain=doc.spec.subdomain,
        host_network=doc.spec.host_network,
        containers=_containers(doc.spec.containers),
        status=k8s.PodStatus(
            phase=k8s.PodPhase(st.phase),
            pod_ip=st.pod_ip or (ips[0] if ips else ""),
            pod_ips=ips,
            host_ip=st.host_ip,
            ready=ready,
        ),
    )


def _deployment(doc: sk8s.DeploymentDoc, base: dict[str, Any]) -> k8s.Deployment:
    spec = doc.spec
    selector = label_selector(spec.selector)
    labels = r.FrozenMap(spec.template.metadata.labels)
    if not selector.match_labels and not selector.match_expressions:
        raise Invalid("spec.selector", "a Deployment needs a non-empty selector")
    if not selector.matches(labels):
        raise Invalid("spec.selector", "selector does not match template labels")
    pod = spec.template.spec
    return k8s.Deployment(
        **base,
        replicas=spec.replicas,
        selector=selector,
        template=k8s.PodTemplate(
            labels=labels,
            annotations=r.FrozenMap(spec.template.metadata.annotations),
            service_account=pod.service_account_name or pod.service_account or "default",
            containers=_containers(pod.containers),
        ),
    )


def _service(doc: sk8s.ServiceDoc, base: dict[str, Any]) -> k8s.Service:
    spec = doc.spec
    stype = k8s.ServiceType(spec.type)
    if stype is k8s.ServiceType.EXTERNAL_NAME and not spec.external_name:
        raise Invalid("spec.externalName", "an ExternalName Service needs externalName")
    if stype is not k8s.ServiceType.EXTERNAL_NAME and spec.cluster_ip != "None" and not spec.ports:
        raise Invalid("spec.ports", "a Service needs at least one port")
    seen: set[str] = set()
    for i, port in enumerate(spec.ports):
        if len(spec.ports) > 1 and not port.name:
            raise Invalid(f"spec.ports[{i}].name", "required when a Service has several ports")
        if port.name:
            try:
                r.check_port_name(port.name)
            except ValueError as exc:
                raise Invalid(f"spec.ports[{i}].name", str(exc)) from None
        if port.name in seen:
            raise Invalid(f"spec.ports[{i}].name", f"duplicate port name {port.name!r}")
        seen.add(port.name)
    return k8s.Service(
        **base,
        type=stype,
        cluster_ip=spec.cluster_ip,
        cluster_ips=tuple(spec.cluster_ips) or ((spec.cluster_ip,) if spec.cluster_ip else ()),
        selector=r.FrozenMap(spec.selector) if spec.selector else None,
        ports=tuple(
            k8s.ServicePort(
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


def _address(model: sk8s.EndpointsAddress) -> k8s.EndpointsAddress:
    ref = object_ref(model.target_ref) if model.target_ref else None
    return k8s.EndpointsAddress(
        ip=model.ip, hostname=model.hostname, node_name=model.node_name, target_ref=ref
    )


def _endpoints(doc: sk8s.EndpointsDoc, base: dict[str, Any]) -> k8s.Endpoints:
    return k8s.Endpoints(
        **base,
        subsets=tuple(
            k8s.EndpointsSubset(
                addresses=tuple(_address(a) for a in s.addresses),
                not_ready_addresses=tuple(_address(a) for a in s.not_ready_addresses),
                ports=tuple(
                    k8s.EndpointsPort(port=p.port, name=p.name, protocol=p.protocol)
                    for p in s.ports
                ),
            )
            for s in doc.subsets
        ),
    )


def _slice(doc: sk8s.SliceDoc, base: dict[str, Any]) -> k8s.EndpointSlice:
    return k8s.EndpointSlice(
        **base,
        service_name=doc.metadata.labels.get(r.SERVICE_NAME_LABEL, ""),
        address_type=doc.address_type,
        endpoints=tuple(
            k8s.SliceEndpoint(
                addresses=tuple(e.addresses),
                ready=e.conditions.ready,
                serving=e.conditions.serving,
                terminating=e.conditions.terminating,
                hostname=e.hostname,
                node_name=e.node_name,
                zone=e.zone,
                target_ref=object_ref(e.target_ref) if e.target_ref else None,
            )
            for e in doc.endpoints
        ),
        ports=tuple(
            k8s.EndpointsPort(port=p.port, name=p.name, protocol=p.protocol) for p in doc.ports
        ),
    )


def _plain(
    _doc: schema.Doc, base: dict[str, Any], cls: type[k8s.Namespace | k8s.ServiceAccount]
) -> Any:
    return cls(**base)


# --- kind table ----------------------------------------------------------------------------


KIND_TABLE: dict[str, Kind] = {
    "Namespace": Kind(
        schema.Doc, lambda d, b: _plain(d, b, k8s.Namespace), frozenset({"v1"}), namespaced=False
    ),
    "ServiceAccount": Kind(
        schema.Doc, lambda d, b: _plain(d, b, k8s.ServiceAccount), frozenset({"v1"})
    ),
    "Pod": Kind(sk8s.PodDoc, _pod, frozenset({"v1"})),
    "Service": Kind(sk8s.ServiceDoc, _service, frozenset({"v1"})),
    "Endpoints": Kind(sk8s.EndpointsDoc, _endpoints, frozenset({"v1"})),
    "EndpointSlice": Kind(sk8s.SliceDoc, _slice, frozenset({"discovery.k8s.io/v1"})),
    "Deployment": Kind(sk8s.DeploymentDoc, _deployment, frozenset({"apps/v1"})),
}
