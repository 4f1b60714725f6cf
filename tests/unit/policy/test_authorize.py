"""Inbound authorization over server policies."""

from __future__ import annotations

import ipaddress

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent.policy.authorize import Decision, Facts, Reason, authorize
from agent.policy.model import (
    DEFAULT_POLICY_NAMES,
    Authorization,
    HttpRoute,
    HttpRouteMatch,
    MeshTLS,
    Meta,
    Network,
    PathKind,
    ProxyProtocol,
    ServerPolicy,
    TLSUnauthenticated,
    Unauthenticated,
)

WEB = "web.shop.serviceaccount.identity.linkerd.cluster.local"
OTHER_NS = "api.other.serviceaccount.identity.linkerd.cluster.local"


def facts(ip="10.1.2.3", *, identity=None, tls=False, method=None, path=None):
    return Facts.of(ip, dst_port=8080, client_identity=identity, tls=tls, method=method, path=path)


def policy_with(*authzs, routes=None):
    return ServerPolicy(
        meta=Meta(name="web-http", kind="server", group="policy.linkerd.io"),
        authorizations=authzs,
        http_routes=routes,
    )


def authz(authn, *nets, name="a"):
    networks = tuple(Network.parse(*n) if isinstance(n, tuple) else Network.parse(n) for n in nets)
    return Authorization(
        networks=networks or (Network.parse("0.0.0.0/0"), Network.parse("::/0")),
        authentication=authn,
        meta=Meta(name=name, kind="authorizationpolicy", group="policy.linkerd.io"),
    )


# --- default policies: every default crossed with every kind of client ---------

CLIENTS = {
    "plain-cluster": facts("10.1.2.3"),
    "plain-outside": facts("203.0.113.9"),
    "tls-no-id-cluster": facts("10.1.2.3", tls=True),
    "mtls-cluster": facts("10.1.2.3", identity=WEB),
    "mtls-outside": facts("203.0.113.9", identity=WEB),
    "mtls-v6-cluster": facts("fd00::5", identity=WEB),
}
EXPECTED_ALLOWED = {
    "all-unauthenticated": set(CLIENTS),
    "cluster-unauthenticated": {
        "plain-cluster",
        "tls-no-id-cluster",
        "mtls-cluster",
        "mtls-v6-cluster",
    },
    "all-authenticated": {"mtls-cluster", "mtls-outside", "mtls-v6-cluster"},
    "cluster-authenticated": {"mtls-cluster", "mtls-v6-cluster"},
    "deny": set(),
}


@pytest.mark.parametrize("name", DEFAULT_POLICY_NAMES)
@pytest.mark.parametrize("client", sorted(CLIENTS))
def test_default_policies_against_every_client_kind(name, client):
    decision = authorize(ServerPolicy.default(name), CLIENTS[client])
    assert decision.allowed is (client in EXPECTED_ALLOWED[name])
    assert decision.server == Meta(name=name)
    if decision.allowed:
        assert decision.labels() == {
            "srv_group": "",
            "srv_kind": "default",
            "srv_name": name,
            "authz_group": "",
            "authz_kind": "default",
            "authz_name": name,
        }
    else:
        assert decision.reason is Reason.UNAUTHORIZED
        assert decision.http_status == 403


def test_cluster_networks_are_configurable():
    policy = ServerPolicy.default("cluster-unauthenticated", cluster_networks=["192.0.2.0/24"])
    assert authorize(policy, facts("192.0.2.7")).allowed
    assert not authorize(policy, facts("10.1.2.3")).allowed


def test_unknown_default_policy_name_is_an_error():
    with pytest.raises(ValueError, match="unknown default policy"):
        ServerPolicy.default("audit-everything")


def test_invalid_policy_denies_everyone():
    policy = ServerPolicy.invalid()
    decision = authorize(policy, facts(identity=WEB))
    assert decision == Decision(
        allowed=False, reason=Reason.INVALID_POLICY, server=Meta(name="invalid")
    )
    assert policy.protocol is ProxyProtocol.OPAQUE


# --- authentication kinds crossed with client kinds (Hypothesis) ---------------

AUTHNS = st.sampled_from(
    [
        Unauthenticated(),
        TLSUnauthenticated(),
        MeshTLS(identities=frozenset({WEB})),
        MeshTLS(suffixes=("shop.serviceaccount.identity.linkerd.cluster.local",)),
        MeshTLS(suffixes=("",)),
        MeshTLS(identities=frozenset({"*"})),
        MeshTLS(),
    ]
)
CLIENT_KINDS = st.sampled_from(["plaintext", "tls", "mtls-web", "mtls-other"])
IPS = st.one_of(st.ip_addresses(v=4), st.ip_addresses(v=6))


def expected_authenticated(authn, kind):  # noqa: PLR0911 - one answer per case
    identity = {"mtls-web": WEB, "mtls-other": OTHER_NS}.get(kind)
    if isinstance(authn, Unauthenticated):
        return True
    if isinstance(authn, TLSUnauthenticated):
        return kind != "plaintext"
    if identity is None:
        return False
    if authn.identities == frozenset({"*"}) or authn.suffixes == ("",):
        return True
    if WEB in authn.identities:
        return identity == WEB
    if authn.suffixes:
        return identity == WEB  # only web is in the shop namespace
    return False


@given(authn=AUTHNS, kind=CLIENT_KINDS, ip=IPS)
def test_every_authentication_kind_against_every_client_kind(authn, kind, ip):
    identity = {"mtls-web": WEB, "mtls-other": OTHER_NS}.get(kind)
    f = Facts(client_ip=ip, client_identity=identity, tls=kind != "plaintext", dst_port=80)
    decision = authorize(policy_with(authz(authn)), f)
    assert decision.allowed is expected_authenticated(authn, kind)
    assert (decision.authz is not None) is decision.allowed


@given(ip=IPS)
def test_network_exceptions_carve_out_clients(ip):
    a = authz(Unauthenticated(), ("10.0.0.0/8", "10.9.0.0/16"), ("fd00::/8", "fd00::/16"))
    inside = (
        ip in ipaddress.ip_network("10.0.0.0/8") and ip not in ipaddress.ip_network("10.9.0.0/16")
    ) or (ip in ipaddress.ip_network("fd00::/8") and ip not in ipaddress.ip_network("fd00::/16"))
    assert authorize(policy_with(a), Facts(client_ip=ip, dst_port=80)).allowed is inside


def test_authorization_without_networks_matches_nobody():
    empty = Authorization(networks=(), authentication=Unauthenticated(), meta=Meta(name="x"))
    assert not authorize(policy_with(empty), facts()).allowed


def test_first_allowing_authorization_names_the_decision():
    mtls = authz(MeshTLS(identities=frozenset({WEB})), name="mtls-only")
    anyone = authz(Unauthenticated(), "10.0.0.0/8", name="cluster")
    assert authorize(policy_with(mtls, anyone), facts(identity=WEB)).authz.name == "mtls-only"
    assert authorize(policy_with(mtls, anyone), facts()).authz.name == "cluster"


def test_suffix_matching_respects_label_boundaries():
    authn = MeshTLS(suffixes=("shop.serviceaccount.identity.linkerd.cluster.local",))
    assert authn.matches(WEB)
    assert not authn.matches("evilshop.serviceaccount.identity.linkerd.cluster.local")
    assert not authn.matches("shop.serviceaccount.identity.linkerd.cluster.local")


def test_identity_without_tls_is_refused_as_facts():
    with pytest.raises(ValueError, match="TLS"):
        Facts(client_ip=ipaddress.ip_address("10.0.0.1"), client_identity=WEB, dst_port=80)
    assert Facts.of("10.0.0.1", dst_port=80, client_identity=WEB).tls is True


# --- HTTP routes ------------------------------------------------------------------------

ADMIN = HttpRoute(
    meta=Meta(name="admin", kind="HTTPRoute", group="policy.linkerd.io"),
    matches=(HttpRouteMatch(path_kind=PathKind.PREFIX, path="/admin"),),
    authorizations=(authz(MeshTLS(identities=frozenset({WEB})), name="admin-authz"),),
)
PUBLIC = HttpRoute(
    meta=Meta(name="public", kind="HTTPRoute", group="policy.linkerd.io"),
    matches=(
        HttpRouteMatch(path_kind=PathKind.EXACT, path="/", method="GET"),
        HttpRouteMatch(path_kind=PathKind.REGEX, path=r"/items/\d+"),
    ),
    authorizations=(authz(Unauthenticated(), name="public-authz"),),
)


@pytest.mark.parametrize(
    ("method", "path", "identity", "allowed", "reason", "route"),
    [
        ("GET", "/admin/users", WEB, True, Reason.AUTHORIZED, "admin"),
        ("GET", "/admin", None, False, Reason.UNAUTHORIZED, "admin"),
        ("GET", "/adminx", None, False, Reason.NO_ROUTE, None),
        ("GET", "/", None, True, Reason.AUTHORIZED, "public"),
        ("POST", "/", None, False, Reason.NO_ROUTE, None),
        ("DELETE", "/items/42", None, True, Reason.AUTHORIZED, "public"),
        ("DELETE", "/items/x", None, False, Reason.NO_ROUTE, None),
    ],
)
def test_http_routes_decide_per_request(method, path, identity, allowed, reason, route):  # noqa: PLR0913, PLR0917
    server_wide = authz(Unauthenticated(), name="server-wide")
    decision = authorize(
        policy_with(server_wide, routes=(ADMIN, PUBLIC)),
        facts(identity=identity, method=method, path=path),
    )
    assert decision.allowed is allowed
    assert decision.reason is reason
    assert (decision.route.name if decision.route else None) == route
    if reason is Reason.NO_ROUTE:
        assert decision.http_status == 404
    if allowed:
        assert decision.http_status == 200
        assert decision.labels()["route_name"] == route


def test_connection_level_check_on_a_routed_policy_uses_server_authorizations():
    policy = policy_with(authz(Unauthenticated(), name="server-wide"), routes=(ADMIN,))
    assert authorize(policy, facts()).authz.name == "server-wide"


def test_route_without_matches_matches_everything_and_root_prefix_too():
    catch_all = HttpRoute(meta=Meta(name="all"), authorizations=(authz(Unauthenticated()),))
    assert authorize(policy_with(routes=(catch_all,)), facts(method="PUT")).allowed
    root = HttpRouteMatch(path_kind=PathKind.PREFIX, path="/")
    assert root.matches("GET", "/anything")
    assert HttpRouteMatch().matches("GET", "/x")


def test_bad_route_regex_is_rejected():
    with pytest.raises(ValueError, match="bad route path regex"):
        HttpRouteMatch(path_kind=PathKind.REGEX, path="(")


def test_parse_ip_remembers_good_addresses_and_refuses_bad_ones_every_time():
    from agent.policy.authorize import parse_ip  # noqa: PLC0415 - the one helper under test

    first = parse_ip("10.1.2.3")
    assert first == ipaddress.ip_address("10.1.2.3")
    assert parse_ip("10.1.2.3") is first  # remembered, not parsed again
    assert parse_ip("fd00::1") == ipaddress.ip_address("fd00::1")
    for _ in range(2):
        with pytest.raises(ValueError, match="does not appear to be an IPv4 or IPv6 address"):
            parse_ip("10.1.2")
    assert Facts.of("10.1.2.3", dst_port=80).client_ip is first
