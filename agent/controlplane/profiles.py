"""Profile translation (pure): store snapshot -> `DestinationProfile`s for GetProfile.

`profile_lookup(target, mesh)` classifies what a GetProfile stream follows;
`profile(snapshot, lookup, token, mesh)` is the profile it should show now.
No I/O, no clock, no logging; the gRPC shell is `servers.py`.

Rules (`agent.controlplane.destination` rules 3 and 4, from linkerd2
`controller/api/destination/profile_translator.go`):
1. A Service port the Service does not declare gets an empty profile, so the
   proxy's policy refuses it. Otherwise: routes, retry budget (default 20%/10
   per s/10s), `dst_overrides`, `opaque_protocol`, `fully_qualified_name`,
   `parent_ref`, `profile_ref`; a ServiceProfile in the client's namespace
   (context token) wins over the Service's namespace.
2. IP lookups: a Service cluster IP is that Service; a pod IP (or an unknown
   IP) is an endpoint profile with `endpoint` set and no name.
3. Request and response matches keep Linkerd's field order; several fields of
   one match are ANDed in an `all`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from google.protobuf import duration_pb2

from agent._proto import destination_pb2 as pb
from agent._proto import http_types_pb2, meta_pb2
from agent.controlplane import kinds_core as k8s
from agent.controlplane import kinds_linkerd as l5d
from agent.controlplane import resources as r
from agent.controlplane.destination import (
    ContextToken,
    Endpoint,
    MeshConfig,
    ServiceName,
    Target,
    parse_service_name,
    pod_endpoint,
    port_set,
    weighted_addr,
)
from agent.controlplane.endpoints import opaque_ports

if TYPE_CHECKING:
    from agent.controlplane.endpoints import Catalog


def _duration(seconds: float) -> duration_pb2.Duration:
    out = duration_pb2.Duration()
    out.FromNanoseconds(round(seconds * 1e9))
    return out


def default_retry_budget() -> pb.RetryBudget:
    """Linkerd's default: 20% extra load, at least 10 retries/s, over 10 s."""
    return pb.RetryBudget(retry_ratio=0.2, min_retries_per_second=10, ttl=_duration(10))


_METHODS = {
    name: getattr(http_types_pb2.HttpMethod, name)
    for name in ("GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "CONNECT", "HEAD", "TRACE")
}


def http_method(name: str) -> http_types_pb2.HttpMethod:
    """A method: a registered one when well known, else the token itself."""
    if (registered := _METHODS.get(name.upper())) is not None:
        return http_types_pb2.HttpMethod(registered=registered)
    return http_types_pb2.HttpMethod(unregistered=name)


def request_match(m: l5d.RequestMatch) -> pb.RequestMatch:
    """Linkerd's order (all, any, method, not, path); several fields are ANDed in `all`."""
    parts: list[pb.RequestMatch] = []
    if m.all:
        parts.append(
            pb.RequestMatch(all=pb.RequestMatch.Seq(matches=[request_match(x) for x in m.all]))
        )
    if m.any:
        parts.append(
            pb.RequestMatch(any=pb.RequestMatch.Seq(matches=[request_match(x) for x in m.any]))
        )
    if m.method:
        parts.append(pb.RequestMatch(method=http_method(m.method)))
    if m.not_ is not None:
        negated = pb.RequestMatch()
        getattr(negated, "not").CopyFrom(request_match(m.not_))  # `not` is a Python keyword
        parts.append(negated)
    if m.path_regex:
        parts.append(pb.RequestMatch(path=pb.PathMatch(regex=m.path_regex)))
    return parts[0] if len(parts) == 1 else pb.RequestMatch(all=pb.RequestMatch.Seq(matches=parts))


def response_match(m: l5d.ResponseMatch) -> pb.ResponseMatch:
    """Linkerd's order (all, any, status, not); several fields are ANDed in `all`."""
    parts: list[pb.ResponseMatch] = []
    if m.all:
        parts.append(
            pb.ResponseMatch(all=pb.ResponseMatch.Seq(matches=[response_match(x) for x in m.all]))
        )
    if m.any:
        parts.append(
            pb.ResponseMatch(any=pb.ResponseMatch.Seq(matches=[response_match(x) for x in m.any]))
        )
    if m.status is not None:
        status = pb.HttpStatusRange(min=m.status.min or 0, max=m.status.max or 0)
        parts.append(pb.ResponseMatch(status=status))
    if m.not_ is not None:
        negated_rsp = pb.ResponseMatch()
        getattr(negated_rsp, "not").CopyFrom(response_match(m.not_))  # `not` is a keyword
        parts.append(negated_rsp)
    return (
        parts[0] if len(parts) == 1 else pb.ResponseMatch(all=pb.ResponseMatch.Seq(matches=parts))
    )


def route(rt: l5d.Route) -> pb.Route:
    out = pb.Route(
        condition=request_match(rt.condition),
        response_classes=[
            pb.ResponseClass(condition=response_match(rc.condition), is_failure=rc.is_failure)
            for rc in rt.response_classes
        ],
        metrics_labels={"route": rt.name},
        is_retryable=rt.is_retryable,
    )
    if rt.timeout:
        out.timeout.CopyFrom(_duration(rt.timeout))
    return out


def _dst_override(dst: l5d.WeightedDst, port: int) -> pb.WeightedDst:
    authority = dst.authority
    if ":" not in authority.rpartition("]")[2]:
        authority = f"{authority}:{port}"
    # Weights are decimillis: 10000 is 100% ("1" -> 10000, "500m" -> 5000).
    return pb.WeightedDst(authority=authority, weight=round(dst.weight * 10_000))


def service_profile(
    snap: Catalog, service: k8s.Service, port: int, token: ContextToken, mesh: MeshConfig
) -> pb.DestinationProfile:
    """The profile of a Service port (rule 3)."""
    if not any(p.port == port for p in service.ports):
        return pb.DestinationProfile()
    fqdn = f"{service.name}.{service.namespace}.svc.{mesh.cluster_domain}"
    out = pb.DestinationProfile(
        fully_qualified_name=fqdn,
        retry_budget=default_retry_budget(),
        opaque_protocol=port in opaque_ports(service, snap.namespace(service.namespace)),
        parent_ref=meta_pb2.Metadata(
            resource=meta_pb2.Resource(
                group="core",
                kind="Service",
                name=service.name,
                namespace=service.namespace,
                port=port,
            )
        ),
    )
    sp = snap.service_profile(service, token.ns, mesh.cluster_domain)
    if sp is None:
        return out
    out.profile_ref.CopyFrom(
        meta_pb2.Metadata(
            resource=meta_pb2.Resource(
                group="linkerd.io", kind="ServiceProfile", name=sp.name, namespace=sp.namespace
            )
        )
    )
    out.routes.extend(route(rt) for rt in sp.routes)
    if (budget := sp.retry_budget) is not None:
        out.retry_budget.CopyFrom(
            pb.RetryBudget(
                retry_ratio=budget.retry_ratio,
                min_retries_per_second=budget.min_retries_per_second,
                ttl=_duration(budget.ttl),
            )
        )
    out.dst_overrides.extend(_dst_override(d, port) for d in sp.dst_overrides)
    return out


def endpoint_profile(snap: Catalog, ip: str, port: int, mesh: MeshConfig) -> pb.DestinationProfile:
    """The profile of a pod (or unknown) IP: `endpoint` set, no name (rule 4)."""
    pod = snap.pod_by_ip(ip)
    if pod is None:
        return pb.DestinationProfile(
            retry_budget=default_retry_budget(),
            endpoint=weighted_addr(Endpoint(ip=ip, port=port)),
            opaque_protocol=port in port_set(r.DEFAULT_OPAQUE_PORTS, None),
        )
    endpoint = pod_endpoint(snap, pod, ip, port, mesh)
    return pb.DestinationProfile(
        retry_budget=default_retry_budget(),
        endpoint=weighted_addr(endpoint, {"namespace": pod.namespace}),
        opaque_protocol=port in opaque_ports(pod, snap.pod_namespace(pod)),
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class ProfileLookup:
    """What a GetProfile stream follows: a Service port, a pod instance, or an IP."""

    target: Target
    service: ServiceName | None = None
    ip: str | None = None


def profile_lookup(target: Target, mesh: MeshConfig) -> ProfileLookup:
    """Classify a GetProfile target. Raises `InvalidTarget` for a name outside the cluster."""
    if (ip := target.ip) is not None:
        return ProfileLookup(target=target, ip=ip)
    return ProfileLookup(
        target=target, service=parse_service_name(target.host, mesh.cluster_domain)
    )


def profile(
    snap: Catalog, lookup: ProfileLookup, token: ContextToken, mesh: MeshConfig
) -> pb.DestinationProfile | None:
    """The profile now; None when the named Service does not exist."""
    port = lookup.target.port
    if lookup.ip is not None:
        if (svc := snap.service_by_cluster_ip(lookup.ip)) is not None:
            return service_profile(snap, svc, port, token, mesh)
        return endpoint_profile(snap, lookup.ip, port, mesh)
    assert lookup.service is not None  # noqa: S101 - profile_lookup sets one of ip/service
    service = snap.service(lookup.service.namespace, lookup.service.name)
    if service is None:
        return None
    if lookup.service.instance:
        for addr in snap.endpoints(service, port):
            if addr.hostname == lookup.service.instance:
                return endpoint_profile(snap, addr.ip, addr.port, mesh)
        return pb.DestinationProfile(retry_budget=default_retry_budget())
    return service_profile(snap, service, port, token, mesh)
