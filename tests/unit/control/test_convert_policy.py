"""Inbound policy protobuf -> domain: every field that matters, located errors, fail-closed."""

from __future__ import annotations

import ipaddress

import pytest
from google.protobuf import duration_pb2

from agent._proto import (
    grpc_route_pb2,
    http_route_pb2,
    http_types_pb2,
    inbound_pb2,
    meta_pb2,
    net_pb2,
)
from agent.control import convert_policy
from agent.errors import InvalidResource
from agent.policy import model as pm
from agent.policy.authorize import Facts, Reason, authorize

WEB_ID = "web.shop.serviceaccount.identity.linkerd.cluster.local"
API_ID = "api.shop.serviceaccount.identity.linkerd.cluster.local"


def ip4(text: str) -> net_pb2.IPAddress:
    return net_pb2.IPAddress(ipv4=int(ipaddress.IPv4Address(text)))


def ip6(text: str) -> net_pb2.IPAddress:
    v = int(ipaddress.IPv6Address(text))
    return net_pb2.IPAddress(ipv6=net_pb2.IPv6(first=v >> 64, last=v & (2**64 - 1)))


def dur(seconds: float) -> duration_pb2.Duration:
    d = duration_pb2.Duration()
    d.FromNanoseconds(round(seconds * 1e9))
    return d


def method(name: str) -> http_types_pb2.HttpMethod:
    return http_types_pb2.HttpMethod(registered=getattr(http_types_pb2.HttpMethod, name))


def net(ip: net_pb2.IPAddress, prefix: int) -> net_pb2.IPNetwork:
    return net_pb2.IPNetwork(ip=ip, prefix_len=prefix)


def mesh_authz(name: str = "web-only") -> inbound_pb2.Authz:
    clients = inbound_pb2.Authn.PermitMeshTLS.PermitClientIdentities(
        identities=[inbound_pb2.Identity(name=WEB_ID)],
        suffixes=[inbound_pb2.IdentitySuffix(parts=["other", "serviceaccount", "identity"])],
    )
    return inbound_pb2.Authz(
        networks=[
            inbound_pb2.Network(
                net=net(ip4("10.0.0.0"), 8), **{"except": [net(ip4("10.9.0.0"), 16)]}
            ),
            inbound_pb2.Network(net=net(ip6("fd00::"), 8)),
        ],
        authentication=inbound_pb2.Authn(
            meshTLS=inbound_pb2.Authn.PermitMeshTLS(identities=clients)
        ),
        metadata=meta_pb2.Metadata(
            resource=meta_pb2.Resource(
                group="policy.linkerd.io", kind="AuthorizationPolicy", name=name
            )
        ),
    )


def unauth_authz() -> inbound_pb2.Authz:
    return inbound_pb2.Authz(
        networks=[inbound_pb2.Network(net=net(ip4("0.0.0.0"), 0))],
        authentication=inbound_pb2.Authn(unauthenticated=inbound_pb2.Authn.PermitUnauthenticated()),
        labels={"group": "", "kind": "default", "name": "all-unauthenticated"},
    )


def tls_authz() -> inbound_pb2.Authz:
    return inbound_pb2.Authz(
        networks=[inbound_pb2.Network(net=net(ip4("0.0.0.0"), 0))],
        authentication=inbound_pb2.Authn(
            meshTLS=inbound_pb2.Authn.PermitMeshTLS(
                unauthenticated=inbound_pb2.Authn.PermitUnauthenticated()
            )
        ),
        labels={"name": "server:tls-any"},
    )


def route(name: str, *matches: http_route_pb2.HttpRouteMatch, authzs=()) -> inbound_pb2.HttpRoute:
    return inbound_pb2.HttpRoute(
        metadata=meta_pb2.Metadata(
            resource=meta_pb2.Resource(
                group="gateway.networking.k8s.io", kind="HTTPRoute", name=name
            )
        ),
        authorizations=list(authzs),
        rules=[inbound_pb2.HttpRoute.Rule(matches=list(matches))],
    )


def detect_server(*routes: inbound_pb2.HttpRoute, authzs=None) -> inbound_pb2.Server:
    return inbound_pb2.Server(
        protocol=inbound_pb2.ProxyProtocol(
            detect=inbound_pb2.ProxyProtocol.Detect(timeout=dur(3), http_routes=list(routes))
        ),
        authorizations=[mesh_authz(), unauth_authz()] if authzs is None else authzs,
        labels={"group": "policy.linkerd.io", "kind": "server", "name": "web-http"},
    )


def test_detect_server_converts_every_field():
    get_books = http_route_pb2.HttpRouteMatch(
        path=http_route_pb2.PathMatch(prefix="/books"), method=method("GET")
    )
    exact = http_route_pb2.HttpRouteMatch(path=http_route_pb2.PathMatch(exact="/healthz"))
    regex = http_route_pb2.HttpRouteMatch(path=http_route_pb2.PathMatch(regex="/v[0-9]+/.*"))
    p = convert_policy.server_policy(
        detect_server(route("books", get_books, exact, regex, authzs=[tls_authz()])),
        name="shop/web-1:8080",
    )
    assert p.valid is True
    assert p.protocol is pm.ProxyProtocol.DETECT
    assert p.detect_timeout_s == 3.0
    assert p.meta == pm.Meta(name="web-http", kind="server", group="policy.linkerd.io")
    assert dict(p.labels) == {"group": "policy.linkerd.io", "kind": "server", "name": "web-http"}
    mesh, unauth, localhost = p.authorizations
    assert mesh.meta == pm.Meta(
        name="web-only", kind="AuthorizationPolicy", group="policy.linkerd.io"
    )
    assert mesh.networks == (
        pm.Network.parse("10.0.0.0/8", "10.9.0.0/16"),
        pm.Network.parse("fd00::/8"),
    )
    assert mesh.authentication == pm.MeshTLS(
        identities=frozenset({WEB_ID}), suffixes=("other.serviceaccount.identity",)
    )
    assert unauth.authentication == pm.Unauthenticated()
    assert unauth.meta == pm.Meta(name="all-unauthenticated")  # kind default, group ""
    assert localhost == convert_policy.LOCALHOST
    (books,) = p.http_routes
    assert books.meta == pm.Meta(name="books", kind="HTTPRoute", group="gateway.networking.k8s.io")
    assert [(m.path_kind, m.path, m.method) for m in books.matches] == [
        (pm.PathKind.PREFIX, "/books", "GET"),
        (pm.PathKind.EXACT, "/healthz", None),
        (pm.PathKind.REGEX, "/v[0-9]+/.*", None),
    ]
    tls_any, *server_authzs = books.authorizations
    assert tls_any.authentication == pm.TLSUnauthenticated()
    assert tls_any.meta == pm.Meta(name="tls-any", kind="server", group="policy.linkerd.io")
    assert tuple(server_authzs) == p.authorizations


def test_server_policy_decides_as_linkerd_would():
    p = convert_policy.server_policy(
        detect_server(
            route(
                "books",
                http_route_pb2.HttpRouteMatch(path=http_route_pb2.PathMatch(prefix="/books")),
            ),
            authzs=[mesh_authz()],
        )
    )
    web = Facts.of("10.1.1.1", dst_port=8080, client_identity=WEB_ID, method="GET", path="/books/1")
    api = Facts.of("10.1.1.1", dst_port=8080, client_identity=API_ID, method="GET", path="/books/1")
    local = Facts.of("127.0.0.1", dst_port=8080, method="GET", path="/books/1")
    other = Facts.of("10.1.1.1", dst_port=8080, client_identity=WEB_ID, method="GET", path="/x")
    excluded = Facts.of(
        "10.9.1.1", dst_port=8080, client_identity=WEB_ID, method="GET", path="/books"
    )
    assert authorize(p, web).allowed
    assert authorize(p, api).reason is Reason.UNAUTHORIZED
    assert authorize(p, local).allowed  # localhost is always authorized
    assert authorize(p, other).reason is Reason.NO_ROUTE
    assert authorize(p, excluded).reason is Reason.UNAUTHORIZED


def test_server_without_routes_gets_one_default_route_with_server_authorizations():
    p = convert_policy.server_policy(detect_server())
    (default,) = p.http_routes
    assert default.meta == pm.Meta(name="default")
    assert default.matches == ()
    assert default.authorizations == p.authorizations


def test_empty_suffix_matches_every_identity():
    authz = mesh_authz()
    clients = authz.authentication.meshTLS.identities
    del clients.identities[:]
    del clients.suffixes[:]
    clients.suffixes.append(inbound_pb2.IdentitySuffix())
    p = convert_policy.server_policy(detect_server(authzs=[authz]))
    assert p.authorizations[0].authentication.matches(API_ID)


@pytest.mark.parametrize(
    ("kind", "expected"),
    [("http1", pm.ProxyProtocol.HTTP1), ("http2", pm.ProxyProtocol.HTTP2)],
)
def test_http_servers_convert_with_routes(kind, expected):
    match = http_route_pb2.HttpRouteMatch(path=http_route_pb2.PathMatch(exact="/"))
    proto_kind = getattr(inbound_pb2.ProxyProtocol, kind.capitalize())
    srv = inbound_pb2.Server(
        protocol=inbound_pb2.ProxyProtocol(**{kind: proto_kind(routes=[route("root", match)])}),
        authorizations=[unauth_authz()],
        labels={"name": "web"},
    )
    p = convert_policy.server_policy(srv)
    assert p.protocol is expected
    assert p.meta == pm.Meta(name="web", kind="server", group="policy.linkerd.io")
    assert p.http_routes[0].matches[0].path == "/"


def test_grpc_server_routes_become_post_path_matches():
    def rpc(service="", method_=""):
        return grpc_route_pb2.GrpcRouteMatch(
            rpc=grpc_route_pb2.GrpcRpcMatch(service=service, method=method_)
        )

    groute = inbound_pb2.GrpcRoute(
        metadata=meta_pb2.Metadata(default="default"),
        rules=[
            inbound_pb2.GrpcRoute.Rule(
                matches=[rpc("shop.Books", "Get"), rpc("shop.Books"), rpc(method_="Watch"), rpc()]
            )
        ],
    )
    srv = inbound_pb2.Server(
        protocol=inbound_pb2.ProxyProtocol(grpc=inbound_pb2.ProxyProtocol.Grpc(routes=[groute])),
        authorizations=[unauth_authz()],
        labels={"name": "default:all-unauthenticated"},
    )
    p = convert_policy.server_policy(srv)
    assert p.protocol is pm.ProxyProtocol.GRPC
    assert p.meta == pm.Meta(name="all-unauthenticated")
    (r,) = p.http_routes
    get, books, watch, anything = r.matches
    assert get.matches("POST", "/shop.Books/Get")
    assert not get.matches("POST", "/shop.Books/Put")
    assert books.matches("POST", "/shop.Books/Put")
    assert not books.matches("POST", "/shop.Cart/Put")
    assert watch.matches("POST", "/a.B/Watch")
    assert not watch.matches("POST", "/a.B/Get")
    assert anything.matches("POST", "/x/y")
    assert not anything.matches("GET", "/x/y")


@pytest.mark.parametrize("kind", ["opaque", "tls"])
def test_opaque_and_tls_servers_are_authorized_per_connection(kind):
    proto_kind = getattr(inbound_pb2.ProxyProtocol, kind.capitalize())
    srv = inbound_pb2.Server(
        protocol=inbound_pb2.ProxyProtocol(**{kind: proto_kind()}),
        authorizations=[unauth_authz()],
        labels={"name": "db", "kind": "server"},
    )
    p = convert_policy.server_policy(srv)
    assert p.protocol is pm.ProxyProtocol.OPAQUE
    assert p.http_routes is None
    assert len(p.authorizations) == 2


def _invalid(mutate) -> InvalidResource:
    srv = detect_server(
        route("r", http_route_pb2.HttpRouteMatch(path=http_route_pb2.PathMatch(prefix="/")))
    )
    mutate(srv)
    with pytest.raises(InvalidResource) as info:
        convert_policy.server_policy(srv, name="shop/web-1:8080")
    assert info.value.kind == "Server"
    assert info.value.name == "shop/web-1:8080"
    fallback = convert_policy.policy_from_proto(srv, name="shop/web-1:8080", detect_timeout_s=4.0)
    assert fallback.valid is False
    assert fallback.authorizations == ()
    assert fallback.detect_timeout_s == 4.0
    facts = Facts.of("127.0.0.1", dst_port=8080, method="GET", path="/")
    assert authorize(fallback, facts).reason is Reason.INVALID_POLICY
    return info.value


def test_missing_protocol_denies():
    assert _invalid(lambda s: s.ClearField("protocol")).field == "protocol"


def test_missing_detect_timeout_denies():
    assert (
        _invalid(lambda s: s.protocol.detect.ClearField("timeout")).field
        == "protocol.detect.timeout"
    )


def test_authorization_without_networks_denies():
    assert (
        _invalid(lambda s: s.authorizations[0].ClearField("networks")).field
        == "authorizations[0].networks"
    )


def test_bad_prefix_length_denies():
    err = _invalid(lambda s: s.authorizations[0].networks[0].net.__setattr__("prefix_len", 33))
    assert err.field == "authorizations[0].networks[0].net.prefix_len"


def test_missing_authentication_denies():
    err = _invalid(lambda s: s.authorizations[1].ClearField("authentication"))
    assert err.field == "authorizations[1].authentication"


def test_meshtls_without_clients_denies():
    err = _invalid(lambda s: s.authorizations[0].authentication.meshTLS.ClearField("identities"))
    assert err.field == "authorizations[0].authentication.meshTLS.clients"


def test_server_without_name_label_denies():
    assert _invalid(lambda s: s.labels.pop("name")).field == "labels.name"


def test_route_header_match_denies_rather_than_matching_more():
    err = _invalid(
        lambda s: (
            s.protocol.detect.http_routes[0]
            .rules[0]
            .matches[0]
            .headers.append(http_route_pb2.HeaderMatch(name="x-user", exact=b"admin"))
        )
    )
    assert err.field == "protocol.detect.http_routes[0].rules[0].matches[0].headers"


def test_route_host_match_denies():
    err = _invalid(
        lambda s: s.protocol.detect.http_routes[0].hosts.append(
            http_route_pb2.HostMatch(exact="web.example.com")
        )
    )
    assert err.field == "protocol.detect.http_routes[0].hosts"


def test_route_without_metadata_denies():
    err = _invalid(lambda s: s.protocol.detect.http_routes[0].ClearField("metadata"))
    assert err.field == "protocol.detect.http_routes[0].metadata"


def test_bad_route_regex_denies():
    err = _invalid(
        lambda s: (
            s.protocol.detect.http_routes[0].rules[0].matches[0].path.__setattr__("regex", "([")
        )
    )
    assert err.field == "protocol.detect.http_routes[0].rules[0].matches[0].path.regex"


def test_route_filters_deny():
    def mutate(s):
        s.protocol.detect.http_routes[0].rules[0].filters.append(
            inbound_pb2.HttpRoute.Filter(
                failure_injector=http_route_pb2.HttpFailureInjector(status=500)
            )
        )

    assert _invalid(mutate).field == "protocol.detect.http_routes[0].rules[0].filters"


def test_route_with_no_rules_matches_nothing():
    empty = route("empty")
    del empty.rules[:]
    p = convert_policy.server_policy(detect_server(empty))
    assert p.http_routes == ()
    facts = Facts.of("0.0.0.0", dst_port=80, method="GET", path="/")
    assert authorize(p, facts).reason is Reason.NO_ROUTE


def test_rule_without_matches_matches_every_request():
    p = convert_policy.server_policy(detect_server(route("all")))
    assert p.http_routes[0].matches == ()
    assert p.http_routes[0].matches_request("PUT", "/anything")
