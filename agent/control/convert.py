"""Proxy-API protobuf -> domain types (pure: no I/O, no clock, no logging).

`endpoints_from_update(Update)` and `profile_from_proto(DestinationProfile)`
here, and `server_policy(Server)` / `policy_from_proto(Server)` in
`agent.control.convert_policy`, turn what the control plane sends into
`agent.proxy.model` and `agent.policy.model` values, which never hold
protobuf (STYLE.md). The shared pieces (`FieldError`, `at_field`, addresses,
networks, durations, methods) live here.

Rules (as linkerd2-proxy reads these messages: `proxy/api-resolve/src/pb.rs`,
`service-profiles/src/proto.rs`, `server-policy/src/{lib,authz,http,meta}.rs`):
1. A malformed message raises `InvalidResource(kind, name, field, reason)`,
   where `field` is a path into the message (`routes[1].condition.path.regex`).
2. A bad endpoint rejects only itself: `endpoints_from_update` returns it in
   `rejected` and keeps the others (linkerd2-proxy drops it the same way).
3. (convert_policy) A `Server` that cannot be converted becomes `ServerPolicy.invalid()`, which
   denies everything (`policy_from_proto`), as linkerd2-proxy fails closed.
   Conditions our domain cannot evaluate (route header, query-parameter and
   host matches, route filters) are refused too, never silently dropped: a
   dropped condition would change which authorizations apply.
4. (convert_policy) Every `Server` also authorizes unauthenticated clients from 127.0.0.1 and
   ::1 (meta `default/localhost`), after its own authorizations, as
   linkerd2-proxy adds; every route's authorizations are its own followed by
   the server's. A protocol with no routes gets one default route.
5. Profiles: a status range missing `min` or `max` is the single other value
   (proto comment); `dst_overrides` of weight 0 are dropped; a zero route
   timeout means none; a missing retry budget is `None`.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from agent._proto import http_types_pb2
from agent.errors import InvalidResource
from agent.proxy import model as xm

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping

    from google.protobuf.duration_pb2 import Duration

    from agent._proto import destination_pb2, net_pb2
    from agent.policy import model as pm

Addr = tuple[str, int]

ENDPOINT = "Endpoint"
UPDATE = "Update"
PROFILE = "DestinationProfile"

_T = TypeVar("_T")
_METHODS = {v: k for k, v in http_types_pb2.HttpMethod.Registered.items()}


class FieldError(Exception):
    """A reason located at `field`; the convert modules' entry points wrap it in InvalidResource."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(reason)
        self.field = field
        self.reason = reason


def at_field(prefix: str, fn: Callable[..., _T], *args: Any) -> _T:
    """Call `fn(*args)`, prefixing the field path of any `FieldError` (or ValueError) it raises."""
    try:
        return fn(*args)
    except FieldError as exc:
        raise FieldError(_join(prefix, exc.field), exc.reason) from None
    except ValueError as exc:
        raise FieldError(prefix, str(exc)) from None


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


def network_from_proto(msg: net_pb2.IPNetwork) -> pm.IPNetwork:
    if not msg.HasField("ip"):
        raise FieldError("ip", "missing")
    ip = at_field("ip", lambda: ip_from_proto(msg.ip))
    if msg.prefix_len > ip.max_prefixlen:
        raise FieldError("prefix_len", f"{msg.prefix_len} is longer than {ip.max_prefixlen}")
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
    except FieldError as exc:
        raise InvalidResource(ENDPOINT, name, _join(field, exc.field), exc.reason) from None


def _endpoint(msg: destination_pb2.WeightedAddr, set_labels: Mapping[str, str]) -> xm.Endpoint:
    if not msg.HasField("addr"):
        raise FieldError("addr", "missing")
    addr = at_field("addr", lambda: addr_from_proto(msg.addr))
    hint, opaque_port = _protocol_hint(msg)
    override = (
        msg.authority_override.authority_override if msg.HasField("authority_override") else ""
    )
    return at_field(
        "",
        lambda: xm.Endpoint(
            addr=addr,
            weight=msg.weight,
            labels={**set_labels, **msg.metric_labels},
            tls_identity=at_field("tls_identity", lambda: _tls_identity(msg)),
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
            raise FieldError("protocol_hint.opaque_transport.inbound_port", f"{port} out of range")
    return hint, port


def _tls_identity(msg: destination_pb2.WeightedAddr) -> str | None:
    if not msg.HasField("tls_identity"):
        return None
    tls = msg.tls_identity
    kind = tls.WhichOneof("strategy")
    if kind == "dns_like_identity":
        name = tls.dns_like_identity.name
        if not name:
            raise FieldError("dns_like_identity.name", "empty")
        return name
    if kind == "uri_like_identity":
        # Peers are verified by their DNS SAN (DESIGN.md "Identity"); an identity we
        # cannot verify must not turn into a plaintext connection, so refuse it.
        raise FieldError("uri_like_identity", "URI identities are not supported")
    raise FieldError("strategy", "neither dns_like_identity nor uri_like_identity is set")


# --- destination: profiles -------------------------------------------------------------


def profile_from_proto(msg: destination_pb2.DestinationProfile, *, name: str = "") -> xm.Profile:
    """One `DestinationProfile` for `name` (the path, for errors). Raises `InvalidResource`."""
    try:
        return _profile(msg)
    except FieldError as exc:
        raise InvalidResource(PROFILE, name, exc.field, exc.reason) from None


def _profile(msg: destination_pb2.DestinationProfile) -> xm.Profile:
    routes = tuple(at_field(f"routes[{i}]", _route, r) for i, r in enumerate(msg.routes))
    budget = (
        at_field("retry_budget", lambda: _retry_budget(msg.retry_budget))
        if msg.HasField("retry_budget")
        else None
    )
    overrides = tuple(
        at_field(f"dst_overrides[{i}]", _dst, d)
        for i, d in enumerate(msg.dst_overrides)
        if d.weight > 0
    )
    endpoint = (
        at_field("endpoint", lambda: _endpoint(msg.endpoint, {}))
        if msg.HasField("endpoint")
        else None
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
        raise FieldError("condition", "missing")
    condition = at_field("condition", lambda: request_match(msg.condition))
    classes = tuple(
        at_field(f"response_classes[{i}]", _response_class, c)
        for i, c in enumerate(msg.response_classes)
    )
    timeout = (
        at_field("timeout", lambda: seconds_from_proto(msg.timeout))
        if msg.HasField("timeout")
        else 0.0
    )
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
    """A `RequestMatch` tree; raises `FieldError` (internal) with the failing field."""
    kind = msg.WhichOneof("match")
    if kind in {"all", "any"}:
        seq = getattr(msg, kind).matches
        children = tuple(
            at_field(f"{kind}.matches[{i}]", request_match, m) for i, m in enumerate(seq)
        )
        return xm.MatchAll(children) if kind == "all" else xm.MatchAny(children)
    if kind == "not":
        return xm.MatchNot(at_field("not", lambda: request_match(getattr(msg, "not"))))
    if kind == "path":
        return at_field("path.regex", lambda: xm.PathRegex(_unanchored(msg.path.regex)))
    if kind == "method":
        return xm.MethodIs(at_field("method", lambda: method_name(msg.method)))
    raise FieldError("match", "none of all, any, not, path, method is set")


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
        raise FieldError("condition", "missing")
    return xm.ResponseClass(
        condition=at_field("condition", lambda: response_match(msg.condition)),
        is_failure=msg.is_failure,
    )


def response_match(msg: destination_pb2.ResponseMatch) -> xm.ResponseMatch:
    """A `ResponseMatch` tree; raises `FieldError` (internal) with the failing field."""
    kind = msg.WhichOneof("match")
    if kind in {"all", "any"}:
        seq = getattr(msg, kind).matches
        if not seq:
            raise FieldError(f"{kind}.matches", "empty")
        children = tuple(
            at_field(f"{kind}.matches[{i}]", response_match, m) for i, m in enumerate(seq)
        )
        return xm.ResponseAll(children) if kind == "all" else xm.ResponseAny(children)
    if kind == "not":
        return xm.ResponseNot(at_field("not", lambda: response_match(getattr(msg, "not"))))
    if kind == "status":
        lo, hi = msg.status.min or msg.status.max, msg.status.max or msg.status.min
        return at_field("status", lambda: xm.StatusRange(lo, hi))
    raise FieldError("match", "none of all, any, not, status is set")


def _retry_budget(msg: destination_pb2.RetryBudget) -> xm.RetryBudget:
    if not msg.HasField("ttl"):
        raise FieldError("ttl", "missing")
    return xm.RetryBudget(
        retry_ratio=msg.retry_ratio,
        min_retries_per_second=msg.min_retries_per_second,
        ttl_s=at_field("ttl", lambda: seconds_from_proto(msg.ttl)),
    )


def _dst(msg: destination_pb2.WeightedDst) -> xm.WeightedDst:
    if not msg.authority:
        raise FieldError("authority", "empty")
    return xm.WeightedDst(authority=msg.authority, weight=msg.weight)


def seconds_from_proto(msg: Duration) -> float:
    if msg.seconds < 0 or msg.nanos < 0 or msg.nanos >= 1_000_000_000:
        raise ValueError(f"bad duration {msg.seconds}s {msg.nanos}ns")
    return msg.seconds + msg.nanos / 1e9
