"""Proxy-API protobuf -> domain types (pure: no I/O, no clock, no logging).

`endpoints_from_update(Update)`, `profile_from_proto(DestinationProfile)` and
`server_policy(Server)` / `policy_from_proto(Server)` turn what the control
plane sends into `agent.proxy.model` and `agent.policy.model` values, which
never hold protobuf (STYLE.md).

Rules (as linkerd2-proxy reads these messages: `proxy/api-resolve/src/pb.rs`,
`service-profiles/src/proto.rs`, `server-policy/src/{lib,authz,http,meta}.rs`):
1. A malformed message raises `InvalidResource(kind, name, field, reason)`,
   where `field` is a path into the message (`routes[1].condition.path.regex`).
2. A bad endpoint rejects only itself: `endpoints_from_update` returns it in
   `rejected` and keeps the others (linkerd2-proxy drops it the same way).
3. A `Server` that cannot be converted becomes `ServerPolicy.invalid()`, which
   denies everything (`policy_from_proto`), as linkerd2-proxy fails closed.
   Conditions our domain cannot evaluate (route header, query-parameter and
   host matches, route filters) are refused too, never silently dropped: a
   dropped condition would change which authorizations apply.
4. Every `Server` also authorizes unauthenticated clients from 127.0.0.1 and
   ::1 (meta `default/localhost`), after its own authorizations, as
   linkerd2-proxy adds; every route's authorizations are its own followed by
   the server's. A protocol with no routes gets one default route.
5. Profiles: a status range missing `min` or `max` is the single other value
   (proto comment); `dst_overrides` of weight 0 are dropped; a zero route
   timeout means none; a missing retry budget is `None`.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from agent._proto import http_types_pb2
from agent.errors import InvalidResource
from agent.policy import model as pm
from agent.proxy import model as xm

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Mapping, Sequence

    from google.protobuf.duration_pb2 import Duration

    from agent._proto import (
        destination_pb2,
        grpc_route_pb2,
        http_route_pb2,
        inbound_pb2,
        meta_pb2,
        net_pb2,
    )

Addr = tuple[str, int]

ENDPOINT = "Endpoint"
UPDATE = "Update"
PROFILE = "DestinationProfile"
SERVER = "Server"

POLICY_GROUP = "policy.linkerd.io"
LOCALHOST = pm.Authorization(
    networks=(pm.Network.parse("127.0.0.1/32"), pm.Network.parse("::1/128")),
    authentication=pm.Unauthenticated(),
    meta=pm.Meta(name="localhost"),
)
_T = TypeVar("_T")
_METHODS = {v: k for k, v in http_types_pb2.HttpMethod.Registered.items()}


class _Bad(Exception):  # noqa: N818 - internal: a located reason, wrapped at the entry points
    def __init__(self, field: str, reason: str) -> None:
        super().__init__(reason)
        self.field = field
        self.reason = reason


def _at(prefix: str, fn: Callable[..., _T], *args: Any) -> _T:
    """Call `fn(*args)`, prefixing the field path of any `_Bad` (or ValueError) it raises."""
    try:
        return fn(*args)
    except _Bad as exc:
        raise _Bad(_join(prefix, exc.field), exc.reason) from None
    except ValueError as exc:
        raise _Bad(prefix, str(exc)) from None


def _join(prefix: str, field: str) -> str:
    if not field:
        return prefix
    if field.startswith("["):
        return prefix + field
    return f"{prefix}.{field}" if prefix else field


# --- net -----------------------------------------------------------------------------


def ip_from_proto(msg: net_pb2.IPAddress) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """An `IPAddress` as a Python address; raises `ValueError` when unset."""
    kind = msg.WhichOneof("ip")
    if kind == "ipv4":
        return ipaddress.IPv4Address(msg.ipv4)
    if kind == "ipv6":
        return ipaddress.IPv6Address((msg.ipv6.first << 64) | msg.ipv6.last)
    raise ValueError("missing ip")


def addr_from_proto(msg: net_pb2.TcpAddress) -> Addr:
    """A `TcpAddress` as `(host, port)`; raises `ValueError` when unset or out of range."""
    if not msg.HasField("ip"):
        raise ValueError("missing ip")
    if not 0 < msg.port < 65536:
        raise ValueError(f"port {msg.port} out of range")
    return str(ip_from_proto(msg.ip)), msg.port


def _network(msg: net_pb2.IPNetwork) -> pm.IPNetwork:
    if not msg.HasField("ip"):
        raise _Bad("ip", "missing")
    ip = _at("ip", lambda: ip_from_proto(msg.ip))
    if msg.prefix_len > ip.max_prefixlen:
        raise _Bad("prefix_len", f"{msg.prefix_len} is longer than {ip.max_prefixlen}")
    return ipaddress.ip_network(f"{ip}/{msg.prefix_len}", strict=False)


# --- destination: endpoints ------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class EndpointsUpdate:
    """One `Update`: endpoints added (or changed), addresses removed, or `no_endpoints`.

    `no_endpoints` is None unless the update is `no_endpoints{exists}`, then `exists`.
    """

    added: tuple[xm.Endpoint, ...] = ()
    removed: tuple[Addr, ...] = ()
    no_endpoints: bool | None = None
    rejected: tuple[InvalidResource, ...] = ()


def endpoints_from_update(update: destination_pb2.Update, *, name: str = "") -> EndpointsUpdate:
    """Convert one `Update` of a `Get` stream for `name` (the path, for errors).

    Raises `InvalidResource` when the update has no `add`, `remove` or
    `no_endpoints`, or a removed address is malformed. Malformed endpoints of
    an `add` are returned in `rejected` (rule 2).
    """
    kind = update.WhichOneof("update")
    if kind == "add":
        added: list[xm.Endpoint] = []
        rejected: list[InvalidResource] = []
        labels = dict(update.add.metric_labels)
        for i, wa in enumerate(update.add.addrs):
            try:
                added.append(endpoint_from_proto(wa, labels, name=name, field=f"add.addrs[{i}]"))
            except InvalidResource as exc:
                rejected.append(exc)
        return EndpointsUpdate(added=tuple(added), rejected=tuple(rejected))
    if kind == "remove":
        removed = []
        for i, a in enumerate(update.remove.addrs):
            try:
                removed.append(addr_from_proto(a))
            except ValueError as exc:
                raise InvalidResource(UPDATE, name, f"remove.addrs[{i}]", str(exc)) from None
        return EndpointsUpdate(removed=tuple(removed))
    if kind == "no_endpoints":
        return EndpointsUpdate(no_endpoints=update.no_endpoints.exists)
    raise InvalidResource(UPDATE, name, "update", "none of add, remove, no_endpoints is set")


def endpoint_from_proto(
    msg: destination_pb2.WeightedAddr,
    set_labels: Mapping[str, str] | None = None,
    *,
    name: str = "",
    field: str = "",
) -> xm.Endpoint:
    """One `WeightedAddr`; its labels override the set's. Raises `InvalidResource`."""
    try:
        return _endpoint(msg, set_labels or {})
    except _Bad as exc:
        raise InvalidResource(ENDPOINT, name, _join(field, exc.field), exc.reason) from None


def _endpoint(msg: destination_pb2.WeightedAddr, set_labels: Mapping[str, str]) -> xm.Endpoint:
    if not msg.HasField("addr"):
        raise _Bad("addr", "missing")
    addr = _at("addr", lambda: addr_from_proto(msg.addr))
    hint, opaque_port = _protocol_hint(msg)
    override = (
        msg.authority_override.authority_override if msg.HasField("authority_override") else ""
    )
    return _at(
        "",
        lambda: xm.Endpoint(
            addr=addr,
            weight=msg.weight,
            labels={**set_labels, **msg.metric_labels},
            tls_identity=_at("tls_identity", lambda: _tls_identity(msg)),
            protocol_hint=hint,
            opaque_transport_port=opaque_port,
            authority_override=override or None,
        ),
    )


def _protocol_hint(msg: destination_pb2.WeightedAddr) -> tuple[xm.ProtocolHint | None, int | None]:
    if not msg.HasField("protocol_hint"):
        return None, None
    ph = msg.protocol_hint
    kind = ph.WhichOneof("protocol")
    hint = {"h2": xm.ProtocolHint.H2, "opaque": xm.ProtocolHint.OPAQUE}.get(kind or "")
    port = None
    if ph.HasField("opaque_transport"):
        port = ph.opaque_transport.inbound_port
        if not 0 < port < 65536:
            raise _Bad("protocol_hint.opaque_transport.inbound_port", f"{port} out of range")
    return hint, port


def _tls_identity(msg: destination_pb2.WeightedAddr) -> str | None:
    if not msg.HasField("tls_identity"):
        return None
    tls = msg.tls_identity
    kind = tls.WhichOneof("strategy")
    if kind == "dns_like_identity":
        name = tls.dns_like_identity.name
        if not name:
            raise _Bad("dns_like_identity.name", "empty")
        return name
    if kind == "uri_like_identity":
        # Peers are verified by their DNS SAN (DESIGN.md "Identity"); an identity we
        # cannot verify must not turn into a plaintext connection, so refuse it.
        raise _Bad("uri_like_identity", "URI identities are not supported")
    raise _Bad("strategy", "neither dns_like_identity nor uri_like_identity is set")


# --- destination: profiles -------------------------------------------------------------


def profile_from_proto(msg: destination_pb2.DestinationProfile, *, name: str = "") -> xm.Profile:
    """One `DestinationProfile` for `name` (the path, for errors). Raises `InvalidResource`."""
    try:
        return _profile(msg)
    except _Bad as exc:
        raise InvalidResource(PROFILE, name, exc.field, exc.reason) from None


def _profile(msg: destination_pb2.DestinationProfile) -> xm.Profile:
    routes = tuple(_at(f"routes[{i}]", _route, r) for i, r in enumerate(msg.routes))
    budget = (
        _at("retry_budget", lambda: _retry_budget(msg.retry_budget))
        if msg.HasField("retry_budget")
        else None
    )
    overrides = tuple(
        _at(f"dst_overrides[{i}]", _dst, d) for i, d in enumerate(msg.dst_overrides) if d.weight > 0
    )
    endpoint = (
        _at("endpoint", lambda: _endpoint(msg.endpoint, {})) if msg.HasField("endpoint") else None
    )
    return xm.Profile(
        fqn=msg.fully_qualified_name,
        routes=routes,
        retry_budget=budget,
        opaque_protocol=msg.opaque_protocol,
        endpoint=endpoint,
        dst_overrides=overrides,
    )


def _route(msg: destination_pb2.Route) -> xm.Route:
    if not msg.HasField("condition"):
        raise _Bad("condition", "missing")
    condition = _at("condition", lambda: request_match(msg.condition))
    classes = tuple(
        _at(f"response_classes[{i}]", _response_class, c)
        for i, c in enumerate(msg.response_classes)
    )
    timeout = _at("timeout", lambda: _seconds(msg.timeout)) if msg.HasField("timeout") else 0.0
    labels = dict(msg.metrics_labels)
    return xm.Route(
        name=labels.get("route", ""),
        condition=condition,
        response_classes=classes,
        is_retryable=msg.is_retryable,
        timeout_s=timeout or None,
        labels=labels,
    )


def request_match(msg: destination_pb2.RequestMatch) -> xm.RequestMatch:
    """A `RequestMatch` tree; raises `_Bad` (internal) with the failing field."""
    kind = msg.WhichOneof("match")
    if kind in {"all", "any"}:
        seq = getattr(msg, kind).matches
        children = tuple(_at(f"{kind}.matches[{i}]", request_match, m) for i, m in enumerate(seq))
        return xm.MatchAll(children) if kind == "all" else xm.MatchAny(children)
    if kind == "not":
        return xm.MatchNot(_at("not", lambda: request_match(getattr(msg, "not"))))
    if kind == "path":
        return _at("path.regex", lambda: xm.PathRegex(_unanchored(msg.path.regex)))
    if kind == "method":
        return xm.MethodIs(_at("method", lambda: method_name(msg.method)))
    raise _Bad("match", "none of all, any, not, path, method is set")


def _unanchored(regex: str) -> str:
    # linkerd2-proxy anchors profile regexes at both ends; we match with fullmatch,
    # which is the same, so only surrounding spaces (which it trims) go.
    return regex.strip()


def method_name(msg: http_types_pb2.HttpMethod) -> str:
    """`GET`, `POST`, ... or the unregistered token; raises `ValueError` when unset."""
    kind = msg.WhichOneof("type")
    if kind == "registered":
        try:
            return _METHODS[msg.registered]
        except KeyError:
            raise ValueError(f"unknown registered method {msg.registered}") from None
    if kind == "unregistered" and msg.unregistered:
        return msg.unregistered
    raise ValueError("neither registered nor unregistered is set")


def _response_class(msg: destination_pb2.ResponseClass) -> xm.ResponseClass:
    if not msg.HasField("condition"):
        raise _Bad("condition", "missing")
    return xm.ResponseClass(
        condition=_at("condition", lambda: response_match(msg.condition)),
        is_failure=msg.is_failure,
    )


def response_match(msg: destination_pb2.ResponseMatch) -> xm.ResponseMatch:
    """A `ResponseMatch` tree; raises `_Bad` (internal) with the failing field."""
    kind = msg.WhichOneof("match")
    if kind in {"all", "any"}:
        seq = getattr(msg, kind).matches
        if not seq:
            raise _Bad(f"{kind}.matches", "empty")
        children = tuple(_at(f"{kind}.matches[{i}]", response_match, m) for i, m in enumerate(seq))
        return xm.ResponseAll(children) if kind == "all" else xm.ResponseAny(children)
    if kind == "not":
        return xm.ResponseNot(_at("not", lambda: response_match(getattr(msg, "not"))))
    if kind == "status":
        lo, hi = msg.status.min or msg.status.max, msg.status.max or msg.status.min
        return _at("status", lambda: xm.StatusRange(lo, hi))
    raise _Bad("match", "none of all, any, not, status is set")


def _retry_budget(msg: destination_pb2.RetryBudget) -> xm.RetryBudget:
    if not msg.HasField("ttl"):
        raise _Bad("ttl", "missing")
    return xm.RetryBudget(
        retry_ratio=msg.retry_ratio,
        min_retries_per_second=msg.min_retries_per_second,
        ttl_s=_at("ttl", lambda: _seconds(msg.ttl)),
    )


def _dst(msg: destination_pb2.WeightedDst) -> xm.WeightedDst:
    if not msg.authority:
        raise _Bad("authority", "empty")
    return xm.WeightedDst(authority=msg.authority, weight=msg.weight)


def _seconds(msg: Duration) -> float:
    if msg.seconds < 0 or msg.nanos < 0 or msg.nanos >= 1_000_000_000:
        raise ValueError(f"bad duration {msg.seconds}s {msg.nanos}ns")
    return msg.seconds + msg.nanos / 1e9


# --- inbound policy ---------------------------------------------------------------------


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
    except _Bad as exc:
        raise InvalidResource(SERVER, name, exc.field, exc.reason) from None


def _server(msg: inbound_pb2.Server) -> pm.ServerPolicy:
    kind = msg.protocol.WhichOneof("kind") if msg.HasField("protocol") else None
    if kind is None:
        raise _Bad("protocol", "missing")
    authzs = (*_authorizations(msg.authorizations, "authorizations"), LOCALHOST)
    meta = _at("labels", lambda: meta_from_labels(msg.labels, "server"))
    proto = msg.protocol
    timeout = pm.DEFAULT_DETECT_TIMEOUT_S
    routes: tuple[pm.HttpRoute, ...] | None = None
    if kind == "detect":
        if not proto.detect.HasField("timeout"):
            raise _Bad("protocol.detect.timeout", "missing")
        timeout = _at("protocol.detect.timeout", _seconds, proto.detect.timeout)
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
    return tuple(_at(f"{field}[{i}]", authorization, a) for i, a in enumerate(authzs))


def authorization(msg: inbound_pb2.Authz) -> pm.Authorization:
    """One `Authz`; raises `_Bad` (internal) with the failing field."""
    if not msg.networks:
        raise _Bad("networks", "missing: an authorization must name at least one network")
    networks = tuple(_at(f"networks[{i}]", _client_network, n) for i, n in enumerate(msg.networks))
    authn = _at("authentication", lambda: _authentication(msg))
    if msg.HasField("metadata"):
        meta = _at("metadata", lambda: meta_from_proto(msg.metadata))
    else:
        meta = _at("labels", lambda: meta_from_labels(msg.labels, "serverauthorization"))
    return pm.Authorization(networks=networks, authentication=authn, meta=meta)


def _client_network(msg: inbound_pb2.Network) -> pm.Network:
    if not msg.HasField("net"):
        raise _Bad("net", "missing")
    net = _at("net", lambda: _network(msg.net))
    excepts = getattr(msg, "except")  # `except` is a Python keyword
    return pm.Network(
        net=net,
        excepts=tuple(_at(f"except[{i}]", _network, e) for i, e in enumerate(excepts)),
    )


def _authentication(msg: inbound_pb2.Authz) -> pm.Authentication:
    if not msg.HasField("authentication"):
        raise _Bad("", "missing")
    authn = msg.authentication
    permit = authn.WhichOneof("permit")
    if permit == "unauthenticated":
        return pm.Unauthenticated()
    if permit != "meshTLS":
        raise _Bad("permit", "neither unauthenticated nor meshTLS is set")
    clients = authn.meshTLS.WhichOneof("clients")
    if clients == "unauthenticated":
        return pm.TLSUnauthenticated()
    if clients != "identities":
        raise _Bad("meshTLS.clients", "neither unauthenticated nor identities is set")
    ids = authn.meshTLS.identities
    return pm.MeshTLS(
        identities=frozenset(i.name for i in ids.identities),
        suffixes=tuple(".".join(s.parts) for s in ids.suffixes),
    )


def meta_from_proto(msg: meta_pb2.Metadata) -> pm.Meta:
    """`Metadata` as `Meta`; raises `_Bad` (internal) when neither kind is set."""
    kind = msg.WhichOneof("kind")
    if kind == "default":
        return pm.Meta(name=msg.default)
    if kind == "resource":
        res = msg.resource
        if not res.name or not res.kind:
            raise _Bad("resource", "kind and name are required")
        return pm.Meta(name=res.name, kind=res.kind, group=res.group)
    raise _Bad("kind", "neither default nor resource is set")


def meta_from_labels(labels: Mapping[str, str], default_kind: str) -> pm.Meta:
    """Old-style `group`/`kind`/`name` labels as `Meta` (linkerd2-proxy `try_new_with_default`)."""
    if "name" not in labels:
        raise _Bad("name", "missing")
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
    out = [_at(f"{field}[{i}]", _http_route, r, server_authzs) for i, r in enumerate(routes)]
    return tuple(r for r in out if r is not None)


def _route_common(
    msg: inbound_pb2.HttpRoute | inbound_pb2.GrpcRoute,
    server_authzs: tuple[pm.Authorization, ...],
) -> tuple[pm.Meta, tuple[pm.Authorization, ...]]:
    if msg.hosts:
        raise _Bad("hosts", "host matches are not supported")
    if not msg.HasField("metadata"):
        raise _Bad("metadata", "missing")
    meta = _at("metadata", lambda: meta_from_proto(msg.metadata))
    authzs = (*_authorizations(msg.authorizations, "authorizations"), *server_authzs)
    return meta, authzs


def _http_route(
    msg: inbound_pb2.HttpRoute, server_authzs: tuple[pm.Authorization, ...]
) -> pm.HttpRoute | None:
    meta, authzs = _route_common(msg, server_authzs)
    matches: list[pm.HttpRouteMatch] = []
    for i, rule in enumerate(msg.rules):
        if rule.filters:
            raise _Bad(f"rules[{i}].filters", "route filters are not supported")
        if not rule.matches:
            # A rule without matches matches every request.
            return pm.HttpRoute(meta=meta, authorizations=authzs)
        matches.extend(
            _at(f"rules[{i}].matches[{j}]", http_route_match, m) for j, m in enumerate(rule.matches)
        )
    if not matches:
        return None  # no rules: the route matches no request
    return pm.HttpRoute(meta=meta, matches=tuple(matches), authorizations=authzs)


def http_route_match(msg: http_route_pb2.HttpRouteMatch) -> pm.HttpRouteMatch:
    """One `HttpRouteMatch`; raises `_Bad` (internal) with the failing field."""
    if msg.headers:
        raise _Bad("headers", "header matches are not supported")
    if msg.query_params:
        raise _Bad("query_params", "query parameter matches are not supported")
    method = _at("method", lambda: method_name(msg.method)) if msg.HasField("method") else None
    if not msg.HasField("path"):
        return pm.HttpRouteMatch(method=method)
    kind = msg.path.WhichOneof("kind")
    if kind is None:
        raise _Bad("path.kind", "none of exact, prefix, regex is set")
    path_kind = {"exact": pm.PathKind.EXACT, "prefix": pm.PathKind.PREFIX}.get(
        kind, pm.PathKind.REGEX
    )
    value = getattr(msg.path, kind)
    if kind != "regex" and not value.startswith("/"):
        raise _Bad(f"path.{kind}", f"{value!r} does not start with '/'")
    return _at(
        f"path.{kind}", lambda: pm.HttpRouteMatch(path_kind=path_kind, path=value, method=method)
    )


def _grpc_routes(
    routes: Sequence[inbound_pb2.GrpcRoute],
    server_authzs: tuple[pm.Authorization, ...],
    field: str,
) -> tuple[pm.HttpRoute, ...]:
    if not routes:
        return (pm.HttpRoute(meta=_DEFAULT_ROUTE_META, authorizations=server_authzs),)
    out = [_at(f"{field}[{i}]", _grpc_route, r, server_authzs) for i, r in enumerate(routes)]
    return tuple(r for r in out if r is not None)


def _grpc_route(
    msg: inbound_pb2.GrpcRoute, server_authzs: tuple[pm.Authorization, ...]
) -> pm.HttpRoute | None:
    meta, authzs = _route_common(msg, server_authzs)
    matches: list[pm.HttpRouteMatch] = []
    for i, rule in enumerate(msg.rules):
        if rule.filters:
            raise _Bad(f"rules[{i}].filters", "route filters are not supported")
        if not rule.matches:
            return pm.HttpRoute(meta=meta, authorizations=authzs)
        matches.extend(
            _at(f"rules[{i}].matches[{j}]", grpc_route_match, m) for j, m in enumerate(rule.matches)
        )
    if not matches:
        return None
    return pm.HttpRoute(meta=meta, matches=tuple(matches), authorizations=authzs)


def grpc_route_match(msg: grpc_route_pb2.GrpcRouteMatch) -> pm.HttpRouteMatch:
    """A gRPC match as the HTTP/2 request it describes: `POST /service/method`."""
    if msg.headers:
        raise _Bad("headers", "header matches are not supported")
    service, method = msg.rpc.service, msg.rpc.method
    for part, value in (("service", service), ("method", method)):
        if "/" in value:
            raise _Bad(f"rpc.{part}", f"{value!r} contains '/'")
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
