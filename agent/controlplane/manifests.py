"""Kubernetes-format YAML manifests -> validated domain objects (the pydantic edge).

`parse_text`/`load_file`/`load_folder` return `(objects, errors)`: objects are
`agent.controlplane.kinds.Resource`s (the `kinds_core` and `kinds_linkerd`
dataclasses), errors are `ManifestError`s locating each rejected document by
file, document index, kind/name and field.

Rules:
1. A bad document rejects only itself. A file is split at its `---` markers
   before parsing, so even broken YAML costs only the document it is in.
2. pydantic lives only here and in `manifests_schema` (the document shapes);
   nothing it builds is returned: each kind's converter below turns a
   validated model into a `kinds_core`/`kinds_linkerd` dataclass.
3. Document indexes are 0-based and count every document, empty ones too,
   as `yaml.safe_load_all` would. `kind: List` items keep their List's index
   and carry `items[i].` in front of their field.
4. `check_references` validates what a single document cannot: duplicates,
   a selector-less Service with no Endpoints, a Server's named port that no
   selected container declares. The store runs it over all files together.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias

import yaml
from pydantic import ValidationError

from agent.controlplane import kinds
from agent.controlplane import kinds_core as k8s
from agent.controlplane import kinds_linkerd as l5d
from agent.controlplane import manifests_schema as schema
from agent.controlplane import resources as r
from agent.errors import ManifestError

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

MANIFEST_SUFFIXES = (".yaml", ".yml", ".json")

Loaded: TypeAlias = tuple[list[kinds.Resource], list[ManifestError]]


class _Invalid(Exception):  # noqa: N818 - internal signal, becomes ManifestError
    """A semantic error found while converting; `field` is a dotted path."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(reason)
        self.field = field
        self.reason = reason


# --- shared conversions -------------------------------------------------------------------


def _selector(model: schema.Selector) -> r.LabelSelector:
    return r.LabelSelector(
        match_labels=r.FrozenMap(model.match_labels),
        match_expressions=tuple(
            r.SelectorRequirement(
                key=req.key, operator=r.SelectorOperator(req.operator), values=tuple(req.values)
            )
            for req in model.match_expressions
        ),
    )


def _ref(model: schema.Ref) -> r.ObjectRef:
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


def _networks(models: list[schema.Network]) -> tuple[l5d.Network, ...]:
    return tuple(l5d.Network(cidr=n.cidr, except_=tuple(n.except_)) for n in models)


# --- core kinds ---------------------------------------------------------------------------


def _pod(doc: schema.PodDoc, base: dict[str, Any]) -> k8s.Pod:
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


def _deployment(doc: schema.DeploymentDoc, base: dict[str, Any]) -> k8s.Deployment:
    spec = doc.spec
    selector = _selector(spec.selector)
    labels = r.FrozenMap(spec.template.metadata.labels)
    if not selector.match_labels and not selector.match_expressions:
        raise _Invalid("spec.selector", "a Deployment needs a non-empty selector")
    if not selector.matches(labels):
        raise _Invalid("spec.selector", "selector does not match template labels")
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


def _service(doc: schema.ServiceDoc, base: dict[str, Any]) -> k8s.Service:
    spec = doc.spec
    stype = k8s.ServiceType(spec.type)
    if stype is k8s.ServiceType.EXTERNAL_NAME and not spec.external_name:
        raise _Invalid("spec.externalName", "an ExternalName Service needs externalName")
    if stype is not k8s.ServiceType.EXTERNAL_NAME and spec.cluster_ip != "None" and not spec.ports:
        raise _Invalid("spec.ports", "a Service needs at least one port")
    seen: set[str] = set()
    for i, port in enumerate(spec.ports):
        if len(spec.ports) > 1 and not port.name:
            raise _Invalid(f"spec.ports[{i}].name", "required when a Service has several ports")
        if port.name:
            try:
                r.check_port_name(port.name)
            except ValueError as exc:
                raise _Invalid(f"spec.ports[{i}].name", str(exc)) from None
        if port.name in seen:
            raise _Invalid(f"spec.ports[{i}].name", f"duplicate port name {port.name!r}")
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


def _address(model: schema.EndpointsAddress) -> k8s.EndpointsAddress:
    ref = _ref(model.target_ref) if model.target_ref else None
    return k8s.EndpointsAddress(
        ip=model.ip, hostname=model.hostname, node_name=model.node_name, target_ref=ref
    )


def _endpoints(doc: schema.EndpointsDoc, base: dict[str, Any]) -> k8s.Endpoints:
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


def _slice(doc: schema.SliceDoc, base: dict[str, Any]) -> k8s.EndpointSlice:
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
                target_ref=_ref(e.target_ref) if e.target_ref else None,
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


# --- ServiceProfile -----------------------------------------------------------------------


def _request_match(m: schema.RequestMatch) -> l5d.RequestMatch:
    return l5d.RequestMatch(
        all=tuple(_request_match(x) for x in m.all),
        any=tuple(_request_match(x) for x in m.any),
        not_=_request_match(m.not_) if m.not_ else None,
        method=m.method or "",
        path_regex=m.path_regex,
    )


def _response_match(m: schema.ResponseMatch) -> l5d.ResponseMatch:
    status = l5d.StatusRange(min=m.status.min, max=m.status.max) if m.status else None
    return l5d.ResponseMatch(
        all=tuple(_response_match(x) for x in m.all),
        any=tuple(_response_match(x) for x in m.any),
        not_=_response_match(m.not_) if m.not_ else None,
        status=status,
    )


def _profile(doc: schema.ProfileDoc, base: dict[str, Any]) -> l5d.ServiceProfile:
    spec = doc.spec
    budget = spec.retry_budget
    return l5d.ServiceProfile(
        **base,
        routes=tuple(
            l5d.Route(
                name=rt.name,
                condition=_request_match(rt.condition),
                response_classes=tuple(
                    l5d.ResponseClass(
                        condition=_response_match(c.condition), is_failure=c.is_failure
                    )
                    for c in rt.response_classes
                ),
                is_retryable=rt.is_retryable,
                timeout=rt.timeout,
            )
            for rt in spec.routes
        ),
        retry_budget=l5d.RetryBudget(
            retry_ratio=budget.retry_ratio,
            min_retries_per_second=budget.min_retries_per_second,
            ttl=budget.ttl,
        )
        if budget
        else None,
        opaque_ports=tuple(p for text in spec.opaque_ports for p in r.parse_port_list(text)),
        dst_overrides=tuple(
            l5d.WeightedDst(authority=d.authority, weight=d.weight) for d in spec.dst_overrides
        ),
    )


# --- policy.linkerd.io --------------------------------------------------------------------


def _server(doc: schema.ServerDoc, base: dict[str, Any]) -> l5d.Server:
    if doc.spec.pod_selector is None:
        raise _Invalid("spec.podSelector", "required (externalWorkloadSelector is not supported)")
    return l5d.Server(
        **base,
        pod_selector=_selector(doc.spec.pod_selector),
        port=doc.spec.port,
        proxy_protocol=l5d.ProxyProtocol(doc.spec.proxy_protocol),
        access_policy=l5d.AccessPolicy(doc.spec.access_policy),
    )


def _saz(doc: schema.SazDoc, base: dict[str, Any]) -> l5d.ServerAuthorization:
    client = doc.spec.client
    if not client.unauthenticated and client.mesh_tls is None:
        raise _Invalid("spec.client", "meshTLS is required unless unauthenticated is true")
    tls = client.mesh_tls
    return l5d.ServerAuthorization(
        **base,
        server_name=doc.spec.server.name,
        server_selector=_selector(doc.spec.server.selector) if doc.spec.server.selector else None,
        networks=_networks(client.networks),
        unauthenticated=client.unauthenticated,
        mesh_tls=l5d.MeshTLSClient(
            unauthenticated_tls=tls.unauthenticated_tls,
            identities=tuple(tls.identities),
            service_accounts=tuple(
                l5d.ServiceAccountRef(name=s.name, namespace=s.namespace)
                for s in tls.service_accounts
            ),
        )
        if tls
        else None,
    )


_TARGET_KINDS = {"Server", "HTTPRoute", "GRPCRoute", "Namespace"}
_AUTHN_KINDS = {"MeshTLSAuthentication", "NetworkAuthentication", "ServiceAccount"}


def _authz(doc: schema.AuthzDoc, base: dict[str, Any]) -> l5d.AuthorizationPolicy:
    target = doc.spec.target_ref
    if target.kind not in _TARGET_KINDS:
        raise _Invalid("spec.targetRef.kind", f"unsupported target kind {target.kind!r}")
    if not target.name:
        raise _Invalid("spec.targetRef.name", "required")
    for i, ref in enumerate(doc.spec.required_authentication_refs):
        if ref.kind not in _AUTHN_KINDS:
            raise _Invalid(
                f"spec.requiredAuthenticationRefs[{i}].kind", f"unsupported kind {ref.kind!r}"
            )
    return l5d.AuthorizationPolicy(
        **base,
        target_ref=_ref(target),
        required_authentication_refs=tuple(_ref(x) for x in doc.spec.required_authentication_refs),
    )


def _meshtls_authn(doc: schema.MeshTLSAuthDoc, base: dict[str, Any]) -> l5d.MeshTLSAuthentication:
    spec = doc.spec
    if bool(spec.identities) == bool(spec.identity_refs):
        raise _Invalid("spec", "exactly one of identities and identityRefs is required")
    for i, ref in enumerate(spec.identity_refs):
        if ref.kind not in ("ServiceAccount", "Namespace"):
            raise _Invalid(f"spec.identityRefs[{i}].kind", f"unsupported kind {ref.kind!r}")
    return l5d.MeshTLSAuthentication(
        **base,
        identities=tuple(spec.identities),
        identity_refs=tuple(_ref(x) for x in spec.identity_refs),
    )


def _network_authn(doc: schema.NetworkAuthDoc, base: dict[str, Any]) -> l5d.NetworkAuthentication:
    return l5d.NetworkAuthentication(**base, networks=_networks(doc.spec.networks))


# --- HTTPRoute ----------------------------------------------------------------------------


def _route_match(m: schema.RouteMatch) -> l5d.RouteMatch:
    def values(items: list[schema.ValueMatch]) -> tuple[l5d.ValueMatch, ...]:
        return tuple(
            l5d.ValueMatch(name=v.name, value=v.value, type=l5d.ValueMatchType(v.type))
            for v in items
        )

    path = m.path or schema.PathMatch()
    return l5d.RouteMatch(
        path=l5d.PathMatch(type=l5d.PathMatchType(path.type), value=path.value),
        headers=values(m.headers),
        query_params=values(m.query_params),
        method=m.method or "",
    )


def _rule(rule: schema.RouteRule) -> l5d.RouteRule:
    return l5d.RouteRule(
        matches=tuple(_route_match(m) for m in rule.matches) or (l5d.RouteMatch(),),
        backend_refs=tuple(
            l5d.BackendRef(
                name=b.name,
                namespace=b.namespace,
                port=b.port,
                weight=b.weight,
                kind=b.kind,
                group=b.group,
            )
            for b in rule.backend_refs
        ),
        filters=tuple(f.type for f in rule.filters),
        timeout=rule.timeouts.request,
        backend_timeout=rule.timeouts.backend_request,
    )


def _http_route(doc: schema.HTTPRouteDoc, base: dict[str, Any]) -> l5d.HTTPRoute:
    group = doc.api_version.partition("/")[0]
    return l5d.HTTPRoute(
        **base,
        group=group,
        parent_refs=tuple(
            l5d.ParentRef(
                name=p.name,
                kind=p.kind,
                group=group if p.group is None else p.group,
                namespace=p.namespace,
                port=p.port,
                section_name=p.section_name,
            )
            for p in doc.spec.parent_refs
        ),
        hostnames=tuple(doc.spec.hostnames),
        rules=tuple(_rule(x) for x in doc.spec.rules) or (l5d.RouteRule(),),
    )


# --- kind table ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Kind:
    model: type[schema.Doc]
    convert: Callable[[Any, dict[str, Any]], kinds.Resource]
    versions: frozenset[str]  # accepted apiVersion values
    namespaced: bool = True


_POLICY = "policy.linkerd.io/"
_GATEWAY = "gateway.networking.k8s.io/"
_KINDS: dict[str, _Kind] = {
    "Namespace": _Kind(
        schema.Doc, lambda d, b: _plain(d, b, k8s.Namespace), frozenset({"v1"}), namespaced=False
    ),
    "ServiceAccount": _Kind(
        schema.Doc, lambda d, b: _plain(d, b, k8s.ServiceAccount), frozenset({"v1"})
    ),
    "Pod": _Kind(schema.PodDoc, _pod, frozenset({"v1"})),
    "Service": _Kind(schema.ServiceDoc, _service, frozenset({"v1"})),
    "Endpoints": _Kind(schema.EndpointsDoc, _endpoints, frozenset({"v1"})),
    "EndpointSlice": _Kind(schema.SliceDoc, _slice, frozenset({"discovery.k8s.io/v1"})),
    "Deployment": _Kind(schema.DeploymentDoc, _deployment, frozenset({"apps/v1"})),
    "ServiceProfile": _Kind(
        schema.ProfileDoc, _profile, frozenset({"linkerd.io/v1alpha2", "linkerd.io/v1alpha1"})
    ),
    "Server": _Kind(
        schema.ServerDoc,
        _server,
        frozenset(_POLICY + v for v in ("v1beta3", "v1beta2", "v1beta1", "v1alpha1")),
    ),
    "ServerAuthorization": _Kind(
        schema.SazDoc, _saz, frozenset(_POLICY + v for v in ("v1beta1", "v1alpha1"))
    ),
    "AuthorizationPolicy": _Kind(schema.AuthzDoc, _authz, frozenset({_POLICY + "v1alpha1"})),
    "MeshTLSAuthentication": _Kind(
        schema.MeshTLSAuthDoc, _meshtls_authn, frozenset({_POLICY + "v1alpha1"})
    ),
    "NetworkAuthentication": _Kind(
        schema.NetworkAuthDoc, _network_authn, frozenset({_POLICY + "v1alpha1"})
    ),
    "HTTPRoute": _Kind(
        schema.HTTPRouteDoc,
        _http_route,
        frozenset(
            [_POLICY + v for v in ("v1beta3", "v1beta2", "v1beta1", "v1alpha1")]
            + [_GATEWAY + v for v in ("v1", "v1beta1", "v1alpha2")]
        ),
    ),
}


# --- documents ----------------------------------------------------------------------------


def _loc(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else part
    return out


def _pydantic_error(exc: ValidationError) -> tuple[str, str]:
    errors = exc.errors(include_url=False)
    first = errors[0]
    reason = str(first["msg"]).removeprefix("Value error, ")
    if len(errors) > 1:
        reason += f" (and {len(errors) - 1} more)"
    return _loc(tuple(first["loc"])), reason


def _parse_document(doc: Any, file: str, index: int, prefix: str = "") -> Loaded:  # noqa: PLR0911
    """One YAML document (or List item) -> objects and errors; never raises."""

    def fail(reason: str, field: str = "", kind: str = "", name: str = "") -> Loaded:
        where = prefix + field if field else prefix.rstrip(".")
        err = ManifestError(
            file=file, index=index, kind=kind, name=name, field=where, reason=reason
        )
        return [], [err]

    if doc is None:
        return [], []
    if not isinstance(doc, dict):
        return fail(f"a document must be a mapping, not {type(doc).__name__}")
    kind, api = doc.get("kind"), doc.get("apiVersion")
    meta = doc.get("metadata")
    name = str(meta.get("name", "")) if isinstance(meta, dict) else ""
    if not isinstance(kind, str) or not kind:
        return fail("kind is missing", "kind", name=name)
    if kind == "List" or (kind.endswith("List") and isinstance(doc.get("items"), list)):
        return _parse_list(doc, file, index, prefix)
    spec = _KINDS.get(kind)
    if spec is None:
        return fail(f"unknown kind {kind!r}", "kind", kind, name)
    if api not in spec.versions:
        served = ", ".join(sorted(spec.versions))
        return fail(f"apiVersion {api!r} is not one of {served}", "apiVersion", kind, name)
    try:
        model = spec.model.model_validate(doc)
        obj = spec.convert(model, _base(model.metadata, spec, file, index))
    except ValidationError as exc:
        field, reason = _pydantic_error(exc)
        return fail(reason, field, kind, name)
    except _Invalid as exc:
        return fail(exc.reason, exc.field, kind, name)
    return [obj], []


def _parse_list(doc: dict[str, Any], file: str, index: int, prefix: str) -> Loaded:
    items = doc.get("items")
    if not isinstance(items, list):
        err = ManifestError(
            file=file,
            index=index,
            kind="List",
            field=prefix + "items",
            reason="items must be a list",
        )
        return [], [err]
    objects: list[kinds.Resource] = []
    errors: list[ManifestError] = []
    for i, item in enumerate(items):
        objs, errs = _parse_document(item, file, index, f"{prefix}items[{i}].")
        objects += objs
        errors += errs
    return objects, errors


def _base(meta: schema.Meta, spec: _Kind, file: str, index: int) -> dict[str, Any]:
    return {
        "name": meta.name,
        "namespace": (meta.namespace or "default") if spec.namespaced else "",
        "uid": meta.uid,
        "labels": r.FrozenMap(meta.labels),
        "annotations": r.FrozenMap(meta.annotations),
        "source": r.Source(file=file, index=index),
    }


_MARKER = re.compile(r"^---(?:[ \t]|$)")


def split_documents(text: str) -> list[tuple[int, str]]:
    """Split at `---` lines: (0-based first line, text) per document, as safe_load_all counts them.

    A leading chunk of only comments, blank lines or directives is not a document.
    """
    chunks: list[tuple[int, list[str]]] = [(0, [])]
    for lineno, line in enumerate(text.splitlines(keepends=True)):
        if _MARKER.match(line):
            chunks.append((lineno, [line]))
        else:
            chunks[-1][1].append(line)
    _first_line, first = chunks[0]
    if len(chunks) > 1 and all(
        not ln.strip() or ln.lstrip().startswith(("#", "%")) for ln in first
    ):
        chunks = chunks[1:]
    return [(start, "".join(lines)) for start, lines in chunks]


def _yaml_reason(exc: yaml.YAMLError, first_line: int) -> str:
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc)
    if mark is not None:
        line, column = first_line + mark.line + 1, mark.column + 1
        return f"invalid YAML at line {line}, column {column}: {problem}"
    return f"invalid YAML: {problem}"


def parse_text(text: str, *, file: str = "<text>") -> Loaded:
    """Every document of a manifest text -> (objects, errors). Never raises."""
    objects: list[kinds.Resource] = []
    errors: list[ManifestError] = []
    for index, (first_line, chunk) in enumerate(split_documents(text)):
        try:
            docs = list(yaml.safe_load_all(chunk))
        except yaml.YAMLError as exc:
            errors.append(
                ManifestError(file=file, index=index, reason=_yaml_reason(exc, first_line))
            )
            continue
        for doc in docs:  # one, or none for an empty chunk
            objs, errs = _parse_document(doc, file, index)
            objects += objs
            errors += errs
    return objects, errors


def load_file(path: str | Path) -> Loaded:
    """Read and parse one manifest file; an unreadable file is one error at index 0."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        return [], [ManifestError(file=str(path), index=0, reason=f"cannot read: {exc}")]
    return parse_text(text, file=str(path))


def manifest_files(directory: str | Path) -> list[Path]:
    """*.yaml, *.yml and *.json files under `directory`, recursively, sorted; dot-names skipped."""
    root = Path(directory)
    found = [
        p
        for p in root.rglob("*")
        if p.suffix in MANIFEST_SUFFIXES
        and p.is_file()
        and not any(part.startswith(".") for part in p.relative_to(root).parts)
    ]
    return sorted(found)


def load_folder(directory: str | Path) -> Loaded:
    """Every manifest file under `directory`, then `check_references` over all of them."""
    objects: list[kinds.Resource] = []
    errors: list[ManifestError] = []
    for path in manifest_files(directory):
        objs, errs = load_file(path)
        objects += objs
        errors += errs
    kept, ref_errors = check_references(objects)
    return kept, errors + ref_errors


# --- checks across documents ---------------------------------------------------------------


def _error(obj: kinds.Resource, field: str, reason: str) -> ManifestError:
    src = obj.source or r.Source(file="<unknown>", index=0)
    return ManifestError(
        file=src.file, index=src.index, kind=obj.kind, name=obj.name, field=field, reason=reason
    )


def check_references(objects: Iterable[kinds.Resource]) -> Loaded:
    """Reject what only the whole set shows; the first of duplicate objects wins.

    Kept objects keep their order. Checks: duplicate kind/namespace/name; a
    Service without a selector needs Endpoints or an EndpointSlice (ExternalName
    and headless Services excepted); a Server naming its port needs a selected
    pod or Deployment template that declares that port (when any is selected).
    """
    unique: list[kinds.Resource] = []
    errors: list[ManifestError] = []
    seen: dict[tuple[str, str, str], kinds.Resource] = {}
    for obj in objects:
        if (first := seen.get(obj.key)) is not None:
            errors.append(_error(obj, "metadata.name", f"duplicate of {first.source}"))
            continue
        seen[obj.key] = obj
        unique.append(obj)
    ctx = _Context(unique)
    kept: list[kinds.Resource] = []
    for obj in unique:
        err = ctx.check(obj)
        if err is None:
            kept.append(obj)
        else:
            errors.append(err)
    return kept, errors


class _Context:
    """What the cross-document checks look up, indexed once."""

    def __init__(self, objects: list[kinds.Resource]) -> None:
        self.backed: set[tuple[str, str]] = set()  # (namespace, service) with Endpoints/slices
        self.workloads: dict[str, list[tuple[tuple[r.Container, ...], r.FrozenMap]]] = {}
        for obj in objects:
            if isinstance(obj, k8s.Endpoints):
                self.backed.add((obj.namespace, obj.name))
            elif isinstance(obj, k8s.EndpointSlice) and obj.service_name:
                self.backed.add((obj.namespace, obj.service_name))
            elif isinstance(obj, k8s.Pod):
                self.workloads.setdefault(obj.namespace, []).append((obj.containers, obj.labels))
            elif isinstance(obj, k8s.Deployment):
                entry = (obj.template.containers, obj.template.labels)
                self.workloads.setdefault(obj.namespace, []).append(entry)

    def check(self, obj: kinds.Resource) -> ManifestError | None:
        if isinstance(obj, k8s.Service):
            return self._service(obj)
        if isinstance(obj, l5d.Server) and isinstance(obj.port, str):
            return self._server_port(obj, obj.port)
        return None

    def _service(self, svc: k8s.Service) -> ManifestError | None:
        if svc.selector is not None or svc.type is k8s.ServiceType.EXTERNAL_NAME or svc.headless:
            return None
        if (svc.namespace, svc.name) in self.backed:
            return None
        return _error(svc, "spec.selector", "no selector, and no Endpoints or EndpointSlice for it")

    def _server_port(self, srv: l5d.Server, port: str) -> ManifestError | None:
        selected = [
            containers
            for containers, labels in self.workloads.get(srv.namespace, [])
            if srv.pod_selector.matches(labels)
        ]
        if not selected or any(r.resolve_port(c, port) is not None for c in selected):
            return None
        return _error(srv, "spec.port", f"no selected container declares a port named {port!r}")
