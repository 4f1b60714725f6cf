"""Inbound policy protobuf (`inbound.proto` `Server`) -> `agent.policy.model` (pure).

`server_policy(Server)` converts or raises `InvalidResource`;
`policy_from_proto(Server)` never raises and fails closed. The shared helpers
(`FieldError`, `at_field`, networks, durations, methods) are `agent.control.convert`'s,
whose rules 1, 3 and 4 apply here (linkerd2-proxy
`server-policy/src/{lib,authz,http,meta}.rs`):
1. A malformed message raises `InvalidResource(kind, name, field, reason)`,
   where `field` is a path into the message (`http1.routes[0].rules[1]...`).
2. A `Server` that cannot be converted becomes `ServerPolicy.invalid()`, which
   denies everything, as linkerd2-proxy fails closed. Route header,
   query-parameter and host matches and route filters are refused too, never
   silently dropped: a dropped condition would change which authorizations apply.
3. Every `Server` also authorizes unauthenticated clients from 127.0.0.1 and
   ::1 (meta `default/localhost`), after its own authorizations; every route's
   authorizations are its own followed by the server's. A protocol with no
   routes gets one default route.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from agent.control.convert import (
    FieldError,
    at_field,
    method_name,
    network_from_proto,
    seconds_from_proto,
)
from agent.errors import InvalidResource
from agent.policy import model as pm

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Mapping, Sequence

    from agent._proto import grpc_route_pb2, http_route_pb2, inbound_pb2, meta_pb2

SERVER = "Server"

POLICY_GROUP = "policy.linkerd.io"
LOCALHOST = pm.Authorization(
    networks=(pm.Network.parse("127.0.0.1/32"), pm.Network.parse("::1/128")),
    authentication=pm.Unauthenticated(),
    meta=pm.Meta(name="localhost"),
)


def policy_from_proto(
    msg: inbound_pb2.Server,
    *,
    name: str = "",
    detect_timeout_s: float = pm.DEFAULT_DETECT_TIMEOUT_S,
) -> pm.ServerPolicy:
    """The policy `msg` describes, or `ServerPolicy.invalid()` when it is malformed (rule 3).

    Never raises; the caller logs `policy_error(msg)` when the result is not `valid`.
    """
    try:
        return server_policy(msg, name=name)
    except InvalidResource:
        return pm.ServerPolicy.invalid(detect_timeout_s)


def server_policy(msg: inbound_pb2.Server, *, name: str = "") -> pm.ServerPolicy:
    """Convert a `Server`; `name` (e.g. `ns/pod:port`) locates errors. Raises `InvalidResource`."""
    try:
        return _server(msg)
    except FieldError as exc:
        raise InvalidResource(SERVER, name, exc.field, exc.reason) from None


def _server(msg: inbound_pb2.Server) -> pm.ServerPolicy:
    kind = msg.protocol.WhichOneof("kind") if msg.HasField("protocol") else None
    if kind is None:
        raise FieldError("protocol", "missing")
    authzs = (*_authorizations(msg.authorizations, "authorizations"), LOCALHOST)
    meta = at_field("labels", lambda: meta_from_labels(msg.labels, "server"))
    proto = msg.protocol
    timeout = pm.DEFAULT_DETECT_TIMEOUT_S
    routes: tuple[pm.HttpRoute, ...] | None = None
    if kind == "detect":
        if not proto.detect.HasField("timeout"):
            raise FieldError("protocol.detect.timeout", "missing")
        timeout = at_field("protocol.detect.timeout", seconds_from_proto, proto.detect.timeout)
        routes = _http_routes(proto.detect.http_routes, authzs, "protocol.detect.http_routes")
    elif kind in {"http1", "http2"}:
        routes = _http_routes(getattr(proto, kind).routes, authzs, f"protocol.{kind}.routes")
    elif kind == "grpc":
        routes = _grpc_routes(proto.grpc.routes, authzs, "protocol.grpc.routes")
    return pm.ServerPolicy(
        protocol=_PROTOCOLS[kind],
        detect_timeout_s=timeout,
        authorizations=authzs,
        meta=meta,
        labels=dict(msg.labels),
        http_routes=routes,
    )


# `tls`: the application terminates TLS itself, so the proxy cannot look inside;
# like `opaque`, it is authorized per connection.
_PROTOCOLS = {
    "detect": pm.ProxyProtocol.DETECT,
    "http1": pm.ProxyProtocol.HTTP1,
    "http2": pm.ProxyProtocol.HTTP2,
    "grpc": pm.ProxyProtocol.GRPC,
    "opaque": pm.ProxyProtocol.OPAQUE,
    "tls": pm.ProxyProtocol.OPAQUE,
}


def _authorizations(
    authzs: Iterable[inbound_pb2.Authz], field: str
) -> tuple[pm.Authorization, ...]:
    return tuple(at_field(f"{field}[{i}]", authorization, a) for i, a in enumerate(authzs))


def authorization(msg: inbound_pb2.Authz) -> pm.Authorization:
    """One `Authz`; raises `FieldError` (internal) with the failing field."""
    if not msg.networks:
        raise FieldError("networks", "missing: an authorization must name at least one network")
    networks = tuple(
        at_field(f"networks[{i}]", _client_network, n) for i, n in enumerate(msg.networks)
    )
    authn = at_field("authentication", lambda: _authentication(msg))
    if msg.HasField("metadata"):
        meta = at_field("metadata", lambda: meta_from_proto(msg.metadata))
    else:
        meta = at_field("labels", lambda: meta_from_labels(msg.labels, "serverauthorization"))
    return pm.Authorization(networks=networks, authentication=authn, meta=meta)


def _client_network(msg: inbound_pb2.Network) -> pm.Network:
    if not msg.HasField("net"):
        raise FieldError("net", "missing")
    net = at_field("net", lambda: network_from_proto(msg.net))
    excepts = getattr(msg, "except")  # `except` is a Python keyword
    return pm.Network(
        net=net,
        excepts=tuple(
            at_field(f"except[{i}]", network_from_proto, e) for i, e in enumerate(excepts)
        ),
    )


def _authentication(msg: inbound_pb2.Authz) -> pm.Authentication:
    if not msg.HasField("authentication"):
        raise FieldError("", "missing")
    authn = msg.authentication
    permit = authn.WhichOneof("permit")
    if permit == "unauthenticated":
        return pm.Unauthenticated()
    if permit != "meshTLS":
        raise FieldError("permit", "neither unauthenticated nor meshTLS is set")
    clients = authn.meshTLS.WhichOneof("clients")
    if clients == "unauthenticated":
        return pm.TLSUnauthenticated()
    if clients != "identities":
        raise FieldError("meshTLS.clients", "neither unauthenticated nor identities is set")
    ids = authn.meshTLS.identities
    return pm.MeshTLS(
        identities=frozenset(i.name for i in ids.identities),
        suffixes=tuple(".".join(s.parts) for s in ids.suffixes),
    )


def meta_from_proto(msg: meta_pb2.Metadata) -> pm.Meta:
    """`Metadata` as `Meta`; raises `FieldError` (internal) when neither kind is set."""
    kind = msg.WhichOneof("kind")
    if kind == "default":
        return pm.Meta(name=msg.default)
    if kind == "resource":
        res = msg.resource
        if not res.name or not res.kind:
            raise FieldError("resource", "kind and name are required")
        return pm.Meta(name=res.name, kind=res.kind, group=res.group)
    raise FieldError("kind", "neither default nor resource is set")


def meta_from_labels(labels: Mapping[str, str], default_kind: str) -> pm.Meta:
    """Old-style `group`/`kind`/`name` labels as `Meta` (linkerd2-proxy `try_new_with_default`)."""
    if "name" not in labels:
        raise FieldError("name", "missing")
    name, group = labels["name"], labels.get("group", POLICY_GROUP)
    if "kind" in labels:
        kind = labels["kind"]
        if not group and kind == "default":
            return pm.Meta(name=name)
        return pm.Meta(name=name, kind=kind, group=group)
    # Older control planes encode the kind in the name: `default:deny`, `server:web`.
    prefix, sep, rest = name.partition(":")
    if sep and prefix == "default":
        return pm.Meta(name=rest)
    if sep:
        return pm.Meta(name=rest, kind=prefix, group=group)
    return pm.Meta(name=name, kind=default_kind, group=group)


# --- inbound routes --------------------------------------------------------------------

_DEFAULT_ROUTE_META = pm.Meta(name="default")


def _http_routes(
    routes: Sequence[inbound_pb2.HttpRoute],
    server_authzs: tuple[pm.Authorization, ...],
    field: str,
) -> tuple[pm.HttpRoute, ...]:
    if not routes:
        return (pm.HttpRoute(meta=_DEFAULT_ROUTE_META, authorizations=server_authzs),)
    out = [at_field(f"{field}[{i}]", _http_route, r, server_authzs) for i, r in enumerate(routes)]
    return tuple(r for r in out if r is not None)


def _route_common(
    msg: inbound_pb2.HttpRoute | inbound_pb2.GrpcRoute,
    server_authzs: tuple[pm.Authorization, ...],
) -> tuple[pm.Meta, tuple[pm.Authorization, ...]]:
    if msg.hosts:
        raise FieldError("hosts", "host matches are not supported")
    if not msg.HasField("metadata"):
        raise FieldError("metadata", "missing")
    meta = at_field("metadata", lambda: meta_from_proto(msg.metadata))
    authzs = (*_authorizations(msg.authorizations, "authorizations"), *server_authzs)
    return meta, authzs


def _http_route(
    msg: inbound_pb2.HttpRoute, server_authzs: tuple[pm.Authorization, ...]
) -> pm.HttpRoute | None:
    return _route(msg, server_authzs, http_route_match)


def _route(
    msg: inbound_pb2.HttpRoute | inbound_pb2.GrpcRoute,
    server_authzs: tuple[pm.Authorization, ...],
    match: Callable[[Any], pm.HttpRouteMatch],
) -> pm.HttpRoute | None:
    """An HTTP or gRPC route: its rules' matches (converted by `match`) and authorizations."""
    meta, authzs = _route_common(msg, server_authzs)
    matches: list[pm.HttpRouteMatch] = []
    rules: Sequence[Any] = msg.rules  # HttpRoute.Rule or GrpcRoute.Rule: same shape
    for i, rule in enumerate(rules):
        if rule.filters:
            raise FieldError(f"rules[{i}].filters", "route filters are not supported")
        if not rule.matches:
            # A rule without matches matches every request.
            return pm.HttpRoute(meta=meta, authorizations=authzs)
        matches.extend(
            at_field(f"rules[{i}].matches[{j}]", match, m) for j, m in enumerate(rule.matches)
        )
    if not matches:
        return None  # no rules: the route matches no request
    return pm.HttpRoute(meta=meta, matches=tuple(matches), authorizations=authzs)


def http_route_match(msg: http_route_pb2.HttpRouteMatch) -> pm.HttpRouteMatch:
    """One `HttpRouteMatch`; raises `FieldError` (internal) with the failing field."""
    if msg.headers:
        raise FieldError("headers", "header matches are not supported")
    if msg.query_params:
        raise FieldError("query_params", "query parameter matches are not supported")
    method = at_field("method", lambda: method_name(msg.method)) if msg.HasField("method") else None
    if not msg.HasField("path"):
        return pm.HttpRouteMatch(method=method)
    kind = msg.path.WhichOneof("kind")
    if kind is None:
        raise FieldError("path.kind", "none of exact, prefix, regex is set")
    path_kind = {"exact": pm.PathKind.EXACT, "prefix": pm.PathKind.PREFIX}.get(
        kind, pm.PathKind.REGEX
    )
    value = getattr(msg.path, kind)
    if kind != "regex" and not value.startswith("/"):
        raise FieldError(f"path.{kind}", f"{value!r} does not start with '/'")
    return at_field(
        f"path.{kind}", lambda: pm.HttpRouteMatch(path_kind=path_kind, path=value, method=method)
    )


def _grpc_routes(
    routes: Sequence[inbound_pb2.GrpcRoute],
    server_authzs: tuple[pm.Authorization, ...],
    field: str,
) -> tuple[pm.HttpRoute, ...]:
    if not routes:
        return (pm.HttpRoute(meta=_DEFAULT_ROUTE_META, authorizations=server_authzs),)
    out = [at_field(f"{field}[{i}]", _grpc_route, r, server_authzs) for i, r in enumerate(routes)]
    return tuple(r for r in out if r is not None)


def _grpc_route(
    msg: inbound_pb2.GrpcRoute, server_authzs: tuple[pm.Authorization, ...]
) -> pm.HttpRoute | None:
    return _route(msg, server_authzs, grpc_route_match)


def grpc_route_match(msg: grpc_route_pb2.GrpcRouteMatch) -> pm.HttpRouteMatch:
    """A gRPC match as the HTTP/2 request it describes: `POST /service/method`."""
    if msg.headers:
        raise FieldError("headers", "header matches are not supported")
    service, method = msg.rpc.service, msg.rpc.method
    for part, value in (("service", service), ("method", method)):
        if "/" in value:
            raise FieldError(f"rpc.{part}", f"{value!r} contains '/'")
    if service and method:
        return pm.HttpRouteMatch(
            path_kind=pm.PathKind.EXACT, path=f"/{service}/{method}", method="POST"
        )
    if service:
        return pm.HttpRouteMatch(path_kind=pm.PathKind.PREFIX, path=f"/{service}", method="POST")
    if method:
        pattern = f"/[^/]+/{re.escape(method)}"
        return pm.HttpRouteMatch(path_kind=pm.PathKind.REGEX, path=pattern, method="POST")
    return pm.HttpRouteMatch(method="POST")
