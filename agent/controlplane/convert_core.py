"""Validated core documents -> `kinds_core` dataclasses, and what every converter shares.

The converters of v1 Service and Endpoints, discovery.k8s.io/v1
EndpointSlice and apps/v1 Deployment, listed in `KIND_TABLE` with the model
and apiVersions of each kind (Namespace, ServiceAccount and Pod are read by
hand, in `plain`). Shared with `convert_linkerd`: `validated` (a kind's
`plain.Kind` from its model and converter), `Invalid`, `label_selector` and
`object_ref`.

Rules:
1. A converter takes a validated `schema_core` model and the `base` fields
   `plain.base` read from its metadata (name, namespace, uid, labels,
   annotations, source) and returns one `kinds_core` dataclass; no pydantic
   model is returned.
2. What pydantic cannot check field by field (several fields together) is
   checked here and raised as `Invalid(field, reason)`, `field` a dotted path
   in the document; a pydantic validation error becomes one too, at its
   first location, with how many more (`validated`). `documents` makes
   either a `ManifestError`.
3. A Deployment's pod template spec is read by `plain.pod_template`, the
   reader of a Pod's spec, so the two cannot disagree.
4. Pure: no I/O. Imports the schema and the resource model, never
   `convert_linkerd` or `documents` (import-linter layers).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypeVar

from pydantic import ValidationError

from agent.controlplane import kinds_core as k8s
from agent.controlplane import manifests_schema as schema
from agent.controlplane import plain
from agent.controlplane import resources as r
from agent.controlplane import schema_core as sk8s
from agent.controlplane.plain import Invalid, Kind

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

    from agent.controlplane import kinds

__all__ = ["KIND_TABLE", "Invalid", "Kind", "label_selector", "object_ref", "validated"]

M = TypeVar("M", bound=schema.Doc)


def _loc(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else part
    return out


def _invalid(exc: ValidationError) -> Invalid:
    """A pydantic error as `Invalid`: its first location as a dotted field
    (`spec.ports[0].name`), its message, and how many more."""
    errors = exc.errors(include_url=False)
    first = errors[0]
    reason = str(first["msg"]).removeprefix("Value error, ")
    if len(errors) > 1:
        reason += f" (and {len(errors) - 1} more)"
    return Invalid(_loc(tuple(first["loc"])), reason)


def validated(
    model: type[M],
    convert: Callable[[M, dict[str, Any]], kinds.Resource],
    versions: Iterable[str],
) -> Kind:
    """The `Kind` of a kind with a pydantic shape: validate the document against
    `model`, then `convert` it (rule 1); a validation error is an `Invalid`."""

    def read(doc: dict[str, Any], fields: dict[str, Any]) -> kinds.Resource:
        try:
            valid = model.model_validate(doc)
        except ValidationError as exc:
            raise _invalid(exc) from None
        return convert(valid, fields)

    return Kind(read, frozenset(versions))


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


# --- core kinds ---------------------------------------------------------------------------


def _deployment(doc: sk8s.DeploymentDoc, base: dict[str, Any]) -> k8s.Deployment:
    spec = doc.spec
    selector = label_selector(spec.selector)
    labels = r.FrozenMap(spec.template.metadata.labels)
    if not selector.match_labels and not selector.match_expressions:
        raise Invalid("spec.selector", "a Deployment needs a non-empty selector")
    if not selector.matches(labels):
        raise Invalid("spec.selector", "selector does not match template labels")
    pod = plain.pod_template(spec.template.spec, "spec.template.spec")
    return k8s.Deployment(
        **base,
        replicas=spec.replicas,
        selector=selector,
        template=k8s.PodTemplate(
            labels=labels,
            annotations=r.FrozenMap(spec.template.metadata.annotations),
            service_account=pod.service_account,
            containers=pod.containers,
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
        service_name=base["labels"].get(r.SERVICE_NAME_LABEL, ""),
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


# --- kind table ----------------------------------------------------------------------------


KIND_TABLE: dict[str, Kind] = {
    "Service": validated(sk8s.ServiceDoc, _service, {"v1"}),
    "Endpoints": validated(sk8s.EndpointsDoc, _endpoints, {"v1"}),
    "EndpointSlice": validated(sk8s.SliceDoc, _slice, {"discovery.k8s.io/v1"}),
    "Deployment": validated(sk8s.DeploymentDoc, _deployment, {"apps/v1"}),
}
