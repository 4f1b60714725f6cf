"""Inbound policy translation (pure): (snapshot, workload, port, config) -> `inbound.Server`.

No I/O, no clock, no logging; the gRPC shell is `servers.py`.

Rules (linkerd2 `policy-controller`: `k8s/index/src/{defaults.rs,inbound/index.rs}`,
`grpc/src/inbound.rs`):
1. A workload is named as Linkerd's proxies name it: JSON `{"ns":..,"pod":..}`
   (or the old `ns:pod`). A bad string is `InvalidWorkload`; a pod the store
   does not hold (or an external workload) is `UnknownWorkload`.
2. The first Server (by name) in the pod's namespace that selects the pod and
   the port decides: its proxy protocol (`unknown` is detect with a 10 s
   timeout), labels `{group: policy.linkerd.io, kind: server, name}`, and the
   Server's authorizations (`policy_authz` rule 1).
3. With no Server, the default policy: the pod's
   `config.linkerd.io/default-inbound-policy` annotation, else its namespace's,
   else the cluster's (an unknown value falls back to the cluster's); opaque
   ports get the opaque protocol, others detect (10 s). Its authorizations are
   the default policy's (`policy_authz` rule 2).
4. Authorizations, their protos and `PolicyConfig` live in `policy_authz`
   (AuthorizationPolicy and ServerAuthorization rules there); this module
   re-exports their public names.
5. HTTP protocols carry routes: HTTPRoutes whose parentRef is the Server (with
   the AuthorizationPolicies targeting each route), else one default route
   matching every path; gRPC a default route matching every RPC.
6. Output order is deterministic (authorizations by kind then name, routes by
   name), so equal inputs give equal protos and a watcher sends only changes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from google.protobuf import duration_pb2

from agent._proto import grpc_route_pb2, http_route_pb2, inbound_pb2, meta_pb2
from agent.controlplane import kinds_core as k8s
from agent.controlplane import kinds_linkerd as l5d
from agent.controlplane import resources as r
from agent.controlplane.endpoints import opaque_ports
from agent.controlplane.policy_authz import (
    ALL_NETWORKS,
    CLUSTER_NETWORKS,
    DETECT_TIMEOUT,
    POLICY_GROUP,
    ClientAuthz,
    PolicyConfig,
    authz_proto,
    default_authzs,
    route_authzs,
    server_authzs,
)
from agent.controlplane.profiles import http_method

if TYPE_CHECKING:
    from agent.controlplane.endpoints import Catalog

# The authorization names moved to `policy_authz`; re-exported for importers.
__all__ = [
    "ALL_NETWORKS",
    "CLUSTER_NETWORKS",
    "DETECT_TIMEOUT",
    "POLICY_GROUP",
    "ClientAuthz",
    "InvalidWorkload",
    "PolicyConfig",
    "PortPolicy",
    "UnknownWorkload",
    "Workload",
    "authz_proto",
    "decide",
    "default_authzs",
    "default_grpc_route",
    "default_http_route",
    "http_routes",
    "inbound_server",
    "route_authzs",
    "server_authzs",
    "server_proto",
]


class InvalidWorkload(ValueError):  # noqa: N818 - Linkerd's "Invalid workload"
    """A PortSpec the policy service refuses (INVALID_ARGUMENT)."""


class UnknownWorkload(LookupError):  # noqa: N818 - Linkerd's "unknown server"
    """A workload the store does not hold (NOT_FOUND)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Workload:
    """A pod by namespace and name."""

    namespace: str
    pod: str

    @classmethod
    def parse(cls, text: str) -> Workload:
        """Raises `InvalidWorkload` (bad text) or `UnknownWorkload` (an external workload)."""
        if text.startswith("{"):
            try:
                data = json.loads(text)
            except ValueError:
                raise InvalidWorkload(f"Invalid workload: {text}") from None
            if not isinstance(data, dict) or not isinstance(data.get("ns"), str):
                raise InvalidWorkload(f"Invalid workload: {text}")
            if isinstance(data.get("external_workload"), str):
                raise UnknownWorkload(
                    f"unknown server: external workload {data['ns']}/{data['external_workload']}"
                    " (not supported by this control plane)"
                )
            if not isinstance(data.get("pod"), str) or not data["ns"] or not data["pod"]:
                raise InvalidWorkload(f"Invalid workload: {text}")
            return cls(namespace=data["ns"], pod=data["pod"])
        ns, sep, pod = text.partition(":")
        if not sep or not ns or not pod:
            raise InvalidWorkload(f"Invalid workload: {text}")
        return cls(namespace=ns, pod=pod)


# --- routes ------------------------------------------------------------------------


def _host_match(host: str) -> http_route_pb2.HostMatch:
    if host.startswith("*."):
        labels = list(reversed(host[2:].split(".")))
        return http_route_pb2.HostMatch(
            suffix=http_route_pb2.HostMatch.Suffix(reverse_labels=labels)
        )
    return http_route_pb2.HostMatch(exact=host)


def _route_match(m: l5d.RouteMatch) -> http_route_pb2.HttpRouteMatch:
    out = http_route_pb2.HttpRouteMatch()
    if m.path is not None:
        kind = {
            l5d.PathMatchType.EXACT: "exact",
            l5d.PathMatchType.PATH_PREFIX: "prefix",
            l5d.PathMatchType.REGULAR_EXPRESSION: "regex",
        }[m.path.type]
        out.path.CopyFrom(http_route_pb2.PathMatch(**{kind: m.path.value}))
    for h in m.headers:
        if h.type is l5d.ValueMatchType.EXACT:
            out.headers.append(http_route_pb2.HeaderMatch(name=h.name, exact=h.value.encode()))
        else:
            out.headers.append(http_route_pb2.HeaderMatch(name=h.name, regex=h.value))
    for q in m.query_params:
        if q.type is l5d.ValueMatchType.EXACT:
            out.query_params.append(http_route_pb2.QueryParamMatch(name=q.name, exact=q.value))
        else:
            out.query_params.append(http_route_pb2.QueryParamMatch(name=q.name, regex=q.value))
    if m.method:
        out.method.CopyFrom(http_method(m.method))
    return out


def default_http_route() -> inbound_pb2.HttpRoute:
    """The route matching every request, named `default` (no authorizations of its own)."""
    match = http_route_pb2.HttpRouteMatch(path=http_route_pb2.PathMatch(prefix="/"))
    return inbound_pb2.HttpRoute(
        metadata=meta_pb2.Metadata(default="default"),
        rules=[inbound_pb2.HttpRoute.Rule(matches=[match])],
    )


def default_grpc_route() -> inbound_pb2.GrpcRoute:
    """The route matching every RPC, named `default`."""
    match = grpc_route_pb2.GrpcRouteMatch(rpc=grpc_route_pb2.GrpcRpcMatch())
    return inbound_pb2.GrpcRoute(
        metadata=meta_pb2.Metadata(default="default"),
        rules=[inbound_pb2.GrpcRoute.Rule(matches=[match])],
    )


def http_routes(
    snap: Catalog, server: l5d.Server | None, cfg: PolicyConfig
) -> list[inbound_pb2.HttpRoute]:
    """Rule 5."""
    routes = sorted(snap.routes_for_server(server), key=lambda rt: rt.name) if server else []
    if not routes:
        return [default_http_route()]
    return [
        inbound_pb2.HttpRoute(
            metadata=meta_pb2.Metadata(
                resource=meta_pb2.Resource(group=rt.group, kind="HTTPRoute", name=rt.name)
            ),
            hosts=[_host_match(h) for h in rt.hostnames],
            authorizations=[authz_proto(a, cfg) for a in route_authzs(snap, rt, cfg)],
            rules=[
                inbound_pb2.HttpRoute.Rule(matches=[_route_match(m) for m in rule.matches])
                for rule in rt.rules
            ],
        )
        for rt in routes
    ]


# --- servers -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class PortPolicy:
    """The decision for one pod port, before encoding."""

    name: str
    is_default: bool
    protocol: l5d.ProxyProtocol
    authzs: tuple[ClientAuthz, ...] = field(default=())
    server: l5d.Server | None = None


def _detect(timeout: float) -> duration_pb2.Duration:
    out = duration_pb2.Duration()
    out.FromNanoseconds(round(timeout * 1e9))
    return out


def _pod_default_policy(pod: k8s.Pod, snap: Catalog, cfg: PolicyConfig) -> l5d.AccessPolicy:
    for obj in (pod, snap.pod_namespace(pod)):
        if obj is not None and (value := obj.annotations.get(r.DEFAULT_INBOUND_POLICY_ANNOTATION)):
            try:
                return l5d.AccessPolicy(value)
            except ValueError:
                return cfg.default_policy
    return cfg.default_policy


def decide(snap: Catalog, workload: Workload, port: int, cfg: PolicyConfig) -> PortPolicy:
    """Rules 2 and 3. Raises `UnknownWorkload` if the pod is not in the store."""
    pod = snap.pod(workload.namespace, workload.pod)
    if pod is None:
        raise UnknownWorkload(f"unknown server: no pod {workload.namespace}/{workload.pod}")
    servers = snap.servers_for(pod, port)
    if servers:
        server = servers[0]
        return PortPolicy(
            name=server.name,
            is_default=False,
            protocol=server.proxy_protocol,
            authzs=tuple(server_authzs(snap, server, cfg)),
            server=server,
        )
    policy = _pod_default_policy(pod, snap, cfg)
    opaque = port in opaque_ports(pod, snap.pod_namespace(pod))
    return PortPolicy(
        name=policy.value,
        is_default=True,
        protocol=l5d.ProxyProtocol.OPAQUE if opaque else l5d.ProxyProtocol.UNKNOWN,
        authzs=tuple(default_authzs(policy, cfg)),
    )


def server_proto(snap: Catalog, decision: PortPolicy, cfg: PolicyConfig) -> inbound_pb2.Server:
    """Encode a decision as Linkerd's `to_server` does."""
    proto = inbound_pb2.ProxyProtocol()
    kind = decision.protocol
    if kind is l5d.ProxyProtocol.UNKNOWN:
        proto.detect.CopyFrom(
            inbound_pb2.ProxyProtocol.Detect(
                timeout=_detect(cfg.detect_timeout),
                http_routes=http_routes(snap, decision.server, cfg),
            )
        )
    elif kind is l5d.ProxyProtocol.HTTP1:
        proto.http1.CopyFrom(
            inbound_pb2.ProxyProtocol.Http1(routes=http_routes(snap, decision.server, cfg))
        )
    elif kind is l5d.ProxyProtocol.HTTP2:
        proto.http2.CopyFrom(
            inbound_pb2.ProxyProtocol.Http2(routes=http_routes(snap, decision.server, cfg))
        )
    elif kind is l5d.ProxyProtocol.GRPC:
        proto.grpc.CopyFrom(inbound_pb2.ProxyProtocol.Grpc(routes=[default_grpc_route()]))
    elif kind is l5d.ProxyProtocol.OPAQUE:
        proto.opaque.CopyFrom(inbound_pb2.ProxyProtocol.Opaque())
    else:
        proto.tls.CopyFrom(inbound_pb2.ProxyProtocol.Tls())
    if decision.is_default:
        labels = {"group": "", "kind": "default", "name": decision.name}
    else:
        labels = {"group": POLICY_GROUP, "kind": "server", "name": decision.name}
    return inbound_pb2.Server(
        protocol=proto,
        authorizations=[authz_proto(a, cfg) for a in decision.authzs],
        labels=labels,
    )


def inbound_server(
    snap: Catalog, workload: Workload, port: int, cfg: PolicyConfig
) -> inbound_pb2.Server:
    """The `Server` for a pod port now. Raises `UnknownWorkload`."""
    return server_proto(snap, decide(snap, workload, port, cfg), cfg)
