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
   authorizations of every ServerAuthorization naming or selecting it, every
   AuthorizationPolicy targeting it or its Namespace, plus its own
   `accessPolicy` default (deny adds none).
3. With no Server, the default policy: the pod's
   `config.linkerd.io/default-inbound-policy` annotation, else its namespace's,
   else the cluster's (an unknown value falls back to the cluster's); opaque
   ports get the opaque protocol, others detect (10 s). A default authorization
   is named by its policy (metadata `default: all-unauthenticated`); `all-*`
   allow 0.0.0.0/0 and ::/0, `cluster-*` the cluster networks, `*-authenticated`
   require mesh TLS from any identity, `deny` allows nothing, `audit` allows all.
4. AuthorizationPolicy: one MeshTLSAuthentication or ServiceAccount gives the
   identities (none: unauthenticated), one NetworkAuthentication the networks
   (none: everywhere). A policy that references something missing, or two of
   a kind, is ignored (Linkerd: "Illegal AuthorizationPolicy; ignoring").
   ServerAuthorization networks left empty mean the cluster networks.
5. HTTP protocols carry routes: HTTPRoutes whose parentRef is the Server (with
   the AuthorizationPolicies targeting each route), else one default route
   matching every path; gRPC a default route matching every RPC.
6. Output order is deterministic (authorizations by kind then name, routes by
   name), so equal inputs give equal protos and a watcher sends only changes.
"""

from __future__ import annotations

import ipaddress
import json
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from google.protobuf import duration_pb2

from agent._proto import grpc_route_pb2, http_route_pb2, inbound_pb2, meta_pb2, net_pb2
from agent.controlplane import kinds_core as k8s
from agent.controlplane import kinds_linkerd as l5d
from agent.controlplane import resources as r
from agent.controlplane.destination import ip_address
from agent.controlplane.endpoints import opaque_ports
from agent.controlplane.profiles import http_method

if TYPE_CHECKING:
    from collections.abc import Iterable, Sequence

    from agent.controlplane.endpoints import Catalog

POLICY_GROUP = "policy.linkerd.io"
DETECT_TIMEOUT = 10.0
ALL_NETWORKS: tuple[r.IPNetwork, ...] = (
    ipaddress.ip_network("0.0.0.0/0"),
    ipaddress.ip_network("::/0"),
)
CLUSTER_NETWORKS: tuple[r.IPNetwork, ...] = tuple(
    ipaddress.ip_network(n)
    for n in ("10.0.0.0/8", "100.64.0.0/10", "172.16.0.0/12", "192.168.0.0/16")
)


class InvalidWorkload(ValueError):  # noqa: N818 - Linkerd's "Invalid workload"
    """A PortSpec the policy service refuses (INVALID_ARGUMENT)."""


class UnknownWorkload(LookupError):  # noqa: N818 - Linkerd's "unknown server"
    """A workload the store does not hold (NOT_FOUND)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PolicyConfig:
    """Cluster-wide policy settings."""

    default_policy: l5d.AccessPolicy = l5d.AccessPolicy.ALL_UNAUTHENTICATED
    cluster_networks: tuple[r.IPNetwork, ...] = CLUSTER_NETWORKS
    control_ns: str = "linkerd"
    trust_domain: str = "cluster.local"
    detect_timeout: float = DETECT_TIMEOUT

    def sa_identity(self, ns: str, sa: str) -> str:
        return f"{sa}.{ns}.serviceaccount.identity.{self.control_ns}.{self.trust_domain}"


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


# --- authorizations ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class ClientAuthz:
    """One authorization: who (authn) from where (networks), and its reference."""

    kind: str  # "default", "serverauthorization", "authorizationpolicy"
    name: str
    networks: tuple[l5d.Network, ...] = ()  # () means the cluster networks
    unauthenticated: bool = False  # plaintext allowed
    tls_unauthenticated: bool = False  # mesh TLS, any (or no) client identity
    identities: tuple[str, ...] = ()  # exact identities and "*"/"*.suffix" patterns

    @property
    def sort_key(self) -> tuple[int, str]:
        order = {"default": 0, "serverauthorization": 1, "authorizationpolicy": 2}
        return (order.get(self.kind, 3), self.name)


def _nets(nets: Iterable[r.IPNetwork]) -> tuple[l5d.Network, ...]:
    return tuple(l5d.Network(cidr=n) for n in nets)


def default_authzs(policy: l5d.AccessPolicy, cfg: PolicyConfig) -> list[ClientAuthz]:
    """The authorizations a default policy grants (rule 3)."""
    if policy is l5d.AccessPolicy.DENY:
        return []
    if policy is l5d.AccessPolicy.AUDIT:
        return [
            ClientAuthz(
                kind="default",
                name=policy.value,
                networks=_nets(ALL_NETWORKS),
                unauthenticated=True,
            )
        ]
    cluster_only = policy in (
        l5d.AccessPolicy.CLUSTER_AUTHENTICATED,
        l5d.AccessPolicy.CLUSTER_UNAUTHENTICATED,
    )
    authenticated = policy in (
        l5d.AccessPolicy.ALL_AUTHENTICATED,
        l5d.AccessPolicy.CLUSTER_AUTHENTICATED,
    )
    networks = _nets(cfg.cluster_networks if cluster_only else ALL_NETWORKS)
    if authenticated:
        return [
            ClientAuthz(kind="default", name=policy.value, networks=networks, identities=("*",))
        ]
    return [ClientAuthz(kind="default", name=policy.value, networks=networks, unauthenticated=True)]


def _saz_authz(saz: l5d.ServerAuthorization, cfg: PolicyConfig) -> ClientAuthz | None:
    base = ClientAuthz(kind="serverauthorization", name=saz.name, networks=saz.networks)
    if saz.unauthenticated:
        return replace(base, unauthenticated=True)
    mtls = saz.mesh_tls
    if mtls is None:
        return None  # Linkerd: "no client authentication configured"
    if mtls.unauthenticated_tls:
        return replace(base, tls_unauthenticated=True)
    ids = (
        *mtls.identities,
        *(cfg.sa_identity(sa.namespace or saz.namespace, sa.name) for sa in mtls.service_accounts),
    )
    return replace(base, identities=ids) if ids else None


def _ap_authz(snap: Catalog, ap: l5d.AuthorizationPolicy, cfg: PolicyConfig) -> ClientAuthz | None:
    """Rule 4; None when the policy is illegal (then Linkerd ignores it)."""
    identities: tuple[str, ...] | None = None
    networks: tuple[l5d.Network, ...] | None = None
    for ref in ap.required_authentication_refs:
        ns = ref.namespace or ap.namespace
        if ref.kind == "MeshTLSAuthentication":
            authn = snap.get(l5d.MeshTLSAuthentication, ns, ref.name)
            if authn is None or identities is not None:
                return None
            identities = _meshtls_identities(authn, cfg)
            if not identities:
                return None
        elif ref.kind == "ServiceAccount":
            if identities is not None:
                return None
            identities = (cfg.sa_identity(ns, ref.name),)
        elif ref.kind == "NetworkAuthentication":
            net_authn = snap.get(l5d.NetworkAuthentication, ns, ref.name)
            if net_authn is None or networks is not None:
                return None
            networks = net_authn.networks
        else:
            return None
    return ClientAuthz(
        kind="authorizationpolicy",
        name=ap.name,
        networks=networks if networks is not None else _nets(ALL_NETWORKS),
        unauthenticated=identities is None,
        identities=identities or (),
    )


def _meshtls_identities(authn: l5d.MeshTLSAuthentication, cfg: PolicyConfig) -> tuple[str, ...]:
    ids = list(authn.identities)
    for ref in authn.identity_refs:
        if ref.kind == "ServiceAccount":
            ids.append(cfg.sa_identity(ref.namespace or authn.namespace, ref.name))
        elif ref.kind == "Namespace":
            ids.append(f"*.{ref.name}.serviceaccount.identity.{cfg.control_ns}.{cfg.trust_domain}")
    return tuple(ids)


def server_authzs(snap: Catalog, server: l5d.Server, cfg: PolicyConfig) -> list[ClientAuthz]:
    """Rule 2's authorizations for a Server."""
    out = [a for saz in snap.server_authorizations(server) if (a := _saz_authz(saz, cfg))]
    for ap in snap.of_kind(l5d.AuthorizationPolicy, server.namespace):
        target = ap.target_ref
        targets_server = target.kind == "Server" and target.name == server.name
        if not (targets_server or target.kind == "Namespace"):
            continue
        if (authz := _ap_authz(snap, ap, cfg)) is not None:
            out.append(authz)
    out.extend(default_authzs(server.access_policy, cfg))
    return sorted(out, key=lambda a: a.sort_key)


def route_authzs(snap: Catalog, route: l5d.HTTPRoute, cfg: PolicyConfig) -> list[ClientAuthz]:
    """AuthorizationPolicies targeting an HTTPRoute."""
    out = []
    for ap in snap.of_kind(l5d.AuthorizationPolicy, route.namespace):
        target = ap.target_ref
        if target.kind.lower() == "httproute" and target.name == route.name:
            if target.group and target.group.lower() != route.group.lower():
                continue
            if (authz := _ap_authz(snap, ap, cfg)) is not None:
                out.append(authz)
    return sorted(out, key=lambda a: a.sort_key)


def _ip_network(net: r.IPNetwork) -> net_pb2.IPNetwork:
    return net_pb2.IPNetwork(ip=ip_address(str(net.network_address)), prefix_len=net.prefixlen)


def _identity_authn(identities: Sequence[str]) -> inbound_pb2.Authn:
    exact, suffixes = [], []
    for ident in identities:
        if ident == "*":
            suffixes.append(inbound_pb2.IdentitySuffix(parts=[]))
        elif ident.startswith("*."):
            suffixes.append(inbound_pb2.IdentitySuffix(parts=ident.split(".")[1:]))
        else:
            exact.append(inbound_pb2.Identity(name=ident))
    clients = inbound_pb2.Authn.PermitMeshTLS.PermitClientIdentities(
        identities=exact, suffixes=suffixes
    )
    return inbound_pb2.Authn(meshTLS=inbound_pb2.Authn.PermitMeshTLS(identities=clients))


def authz_proto(authz: ClientAuthz, cfg: PolicyConfig) -> inbound_pb2.Authz:
    """The wire form of one authorization (Linkerd's `to_authz`)."""
    nets = authz.networks or _nets(cfg.cluster_networks)
    networks = [
        inbound_pb2.Network(
            net=_ip_network(n.cidr), **{"except": [_ip_network(e) for e in n.except_]}
        )
        for n in nets
    ]
    if authz.unauthenticated:
        authn = inbound_pb2.Authn(unauthenticated=inbound_pb2.Authn.PermitUnauthenticated())
    elif authz.tls_unauthenticated:
        authn = inbound_pb2.Authn(
            meshTLS=inbound_pb2.Authn.PermitMeshTLS(
                unauthenticated=inbound_pb2.Authn.PermitUnauthenticated()
            )
        )
    else:
        authn = _identity_authn(authz.identities)
    if authz.kind == "default":
        metadata = meta_pb2.Metadata(default=authz.name)
        labels = {"group": "", "kind": "default", "name": authz.name}
    else:
        metadata = meta_pb2.Metadata(
            resource=meta_pb2.Resource(group=POLICY_GROUP, kind=authz.kind, name=authz.name)
        )
        labels = {"group": POLICY_GROUP, "kind": authz.kind, "name": authz.name}
    return inbound_pb2.Authz(
        networks=networks, authentication=authn, labels=labels, metadata=metadata
    )


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
