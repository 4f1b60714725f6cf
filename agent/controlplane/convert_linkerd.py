"""Validated Linkerd documents -> `kinds_linkerd` dataclasses.

The converters of linkerd.io ServiceProfile, the policy.linkerd.io kinds
(Server, ServerAuthorization, AuthorizationPolicy, MeshTLSAuthentication,
NetworkAuthentication) and HTTPRoute of policy.linkerd.io and
gateway.networking.k8s.io, listed in `KIND_TABLE` with the model and
apiVersions of each kind.

Rules (those of `convert_core`, as they apply here):
1. A converter takes a validated `schema_linkerd` model and the `base` fields
   `plain.base` read from its metadata and returns one `kinds_linkerd`
   dataclass; no pydantic model is returned.
2. Checks across several fields raise `convert_core.Invalid(field, reason)`
   with a dotted field path.
3. Defaults are Linkerd's and the Gateway API's: a route with no rules gets
   one rule, a rule with no matches matches everything (PathPrefix "/"), a
   parentRef with no group takes the route's own API group.
4. Pure: no I/O. Imports `convert_core` for what converters share, never
   `documents` (import-linter layers).
"""

from __future__ import annotations

from typing import Any

from agent.controlplane import convert_core as core
from agent.controlplane import kinds_linkerd as l5d
from agent.controlplane import manifests_schema as schema
from agent.controlplane import resources as r
from agent.controlplane import schema_linkerd as sl5d

# --- networks (ServerAuthorization, NetworkAuthentication) -------------------------------


def _networks(models: list[schema.Network]) -> tuple[l5d.Network, ...]:
    return tuple(l5d.Network(cidr=n.cidr, except_=tuple(n.except_)) for n in models)


# --- ServiceProfile -----------------------------------------------------------------------


def _request_match(m: sl5d.RequestMatch) -> l5d.RequestMatch:
    return l5d.RequestMatch(
        all=tuple(_request_match(x) for x in m.all),
        any=tuple(_request_match(x) for x in m.any),
        not_=_request_match(m.not_) if m.not_ else None,
        method=m.method or "",
        path_regex=m.path_regex,
    )


def _response_match(m: sl5d.ResponseMatch) -> l5d.ResponseMatch:
    status = l5d.StatusRange(min=m.status.min, max=m.status.max) if m.status else None
    return l5d.ResponseMatch(
        all=tuple(_response_match(x) for x in m.all),
        any=tuple(_response_match(x) for x in m.any),
        not_=_response_match(m.not_) if m.not_ else None,
        status=status,
    )


def _profile(doc: sl5d.ProfileDoc, base: dict[str, Any]) -> l5d.ServiceProfile:
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


def _server(doc: sl5d.ServerDoc, base: dict[str, Any]) -> l5d.Server:
    if doc.spec.pod_selector is None:
        raise core.Invalid(
            "spec.podSelector", "required (externalWorkloadSelector is not supported)"
        )
    return l5d.Server(
        **base,
        pod_selector=core.label_selector(doc.spec.pod_selector),
        port=doc.spec.port,
        proxy_protocol=l5d.ProxyProtocol(doc.spec.proxy_protocol),
        access_policy=l5d.AccessPolicy(doc.spec.access_policy),
    )


def _saz(doc: sl5d.SazDoc, base: dict[str, Any]) -> l5d.ServerAuthorization:
    client = doc.spec.client
    if not client.unauthenticated and client.mesh_tls is None:
        raise core.Invalid("spec.client", "meshTLS is required unless unauthenticated is true")
    tls = client.mesh_tls
    return l5d.ServerAuthorization(
        **base,
        server_name=doc.spec.server.name,
        server_selector=core.label_selector(doc.spec.server.selector)
        if doc.spec.server.selector
        else None,
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


def _authz(doc: sl5d.AuthzDoc, base: dict[str, Any]) -> l5d.AuthorizationPolicy:
    target = doc.spec.target_ref
    if target.kind not in _TARGET_KINDS:
        raise core.Invalid("spec.targetRef.kind", f"unsupported target kind {target.kind!r}")
    if not target.name:
        raise core.Invalid("spec.targetRef.name", "required")
    for i, ref in enumerate(doc.spec.required_authentication_refs):
        if ref.kind not in _AUTHN_KINDS:
            raise core.Invalid(
                f"spec.requiredAuthenticationRefs[{i}].kind", f"unsupported kind {ref.kind!r}"
            )
    return l5d.AuthorizationPolicy(
        **base,
        target_ref=core.object_ref(target),
        required_authentication_refs=tuple(
            core.object_ref(x) for x in doc.spec.required_authentication_refs
        ),
    )


def _meshtls_authn(doc: sl5d.MeshTLSAuthDoc, base: dict[str, Any]) -> l5d.MeshTLSAuthentication:
    spec = doc.spec
    if bool(spec.identities) == bool(spec.identity_refs):
        raise core.Invalid("spec", "exactly one of identities and identityRefs is required")
    for i, ref in enumerate(spec.identity_refs):
        if ref.kind not in ("ServiceAccount", "Namespace"):
            raise core.Invalid(f"spec.identityRefs[{i}].kind", f"unsupported kind {ref.kind!r}")
    return l5d.MeshTLSAuthentication(
        **base,
        identities=tuple(spec.identities),
        identity_refs=tuple(core.object_ref(x) for x in spec.identity_refs),
    )


def _network_authn(doc: sl5d.NetworkAuthDoc, base: dict[str, Any]) -> l5d.NetworkAuthentication:
    return l5d.NetworkAuthentication(**base, networks=_networks(doc.spec.networks))


# --- HTTPRoute ----------------------------------------------------------------------------


def _route_match(m: sl5d.RouteMatch) -> l5d.RouteMatch:
    def values(items: list[sl5d.ValueMatch]) -> tuple[l5d.ValueMatch, ...]:
        return tuple(
            l5d.ValueMatch(name=v.name, value=v.value, type=l5d.ValueMatchType(v.type))
            for v in items
        )

    path = m.path or sl5d.PathMatch()
    return l5d.RouteMatch(
        path=l5d.PathMatch(type=l5d.PathMatchType(path.type), value=path.value),
        headers=values(m.headers),
        query_params=values(m.query_params),
        method=m.method or "",
    )


def _rule(rule: sl5d.RouteRule) -> l5d.RouteRule:
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


def _http_route(doc: sl5d.HTTPRouteDoc, base: dict[str, Any]) -> l5d.HTTPRoute:
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


_POLICY = "policy.linkerd.io/"
_GATEWAY = "gateway.networking.k8s.io/"
KIND_TABLE: dict[str, core.Kind] = {
    "ServiceProfile": core.validated(
        sl5d.ProfileDoc, _profile, {"linkerd.io/v1alpha2", "linkerd.io/v1alpha1"}
    ),
    "Server": core.validated(
        sl5d.ServerDoc,
        _server,
        (_POLICY + v for v in ("v1beta3", "v1beta2", "v1beta1", "v1alpha1")),
    ),
    "ServerAuthorization": core.validated(
        sl5d.SazDoc, _saz, (_POLICY + v for v in ("v1beta1", "v1alpha1"))
    ),
    "AuthorizationPolicy": core.validated(sl5d.AuthzDoc, _authz, {_POLICY + "v1alpha1"}),
    "MeshTLSAuthentication": core.validated(
        sl5d.MeshTLSAuthDoc, _meshtls_authn, {_POLICY + "v1alpha1"}
    ),
    "NetworkAuthentication": core.validated(
        sl5d.NetworkAuthDoc, _network_authn, {_POLICY + "v1alpha1"}
    ),
    "HTTPRoute": core.validated(
        sl5d.HTTPRouteDoc,
        _http_route,
        [_POLICY + v for v in ("v1beta3", "v1beta2", "v1beta1", "v1alpha1")]
        + [_GATEWAY + v for v in ("v1", "v1beta1", "v1alpha2")],
    ),
}
