"""Inbound authorizations (pure): who may reach a pod port, and their `inbound.Authz` protos.

No I/O, no clock, no logging. `policy.py` decides which Server (or default
policy) governs a port and builds the `inbound.Server`; this module gives the
authorizations it carries and the cluster-wide `PolicyConfig` both read.

Rules (linkerd2 `policy-controller`: `k8s/index/src/{defaults.rs,inbound/index.rs}`,
`grpc/src/inbound.rs` `to_authz`):
1. A Server is authorized by every ServerAuthorization naming or selecting it,
   every AuthorizationPolicy targeting it or its Namespace, plus its own
   `accessPolicy` default (deny adds none); an HTTPRoute by the
   AuthorizationPolicies targeting it.
2. A default authorization is named by its policy (metadata `default:
   all-unauthenticated`); `all-*` allow 0.0.0.0/0 and ::/0, `cluster-*` the
   cluster networks, `*-authenticated` require mesh TLS from any identity,
   `deny` allows nothing, `audit` allows all.
3. AuthorizationPolicy: one MeshTLSAuthentication or ServiceAccount gives the
   identities (none: unauthenticated), one NetworkAuthentication the networks
   (none: everywhere). A policy that references something missing, or two of
   a kind, is ignored (Linkerd: "Illegal AuthorizationPolicy; ignoring").
   ServerAuthorization networks left empty mean the cluster networks.
4. Authorizations are sorted by kind (default, serverauthorization,
   authorizationpolicy) then name, so equal inputs give equal protos.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from agent._proto import inbound_pb2, meta_pb2, net_pb2
from agent.controlplane import kinds_linkerd as l5d
from agent.controlplane import resources as r
from agent.controlplane.destination import ip_address

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
