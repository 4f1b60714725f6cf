"""Inbound authorization: `authorize(policy, facts) -> Decision`.

Pure function over a `ServerPolicy` and what the proxy knows about a
connection or request; no I/O, no logging, never raises.

Rules:
1. An invalid policy denies (`Reason.INVALID_POLICY`).
2. For an HTTP request (facts carry a method) on a policy with HTTP routes,
   the first route whose matches fit decides with its own authorizations; no
   fitting route denies with `Reason.NO_ROUTE` (HTTP 404). Otherwise the
   server's authorizations decide.
3. An authorization allows when the client IP is in one of its networks (and
   none of that network's exceptions) and its authentication accepts the
   client: `Unauthenticated` anyone; `TLSUnauthenticated` any TLS-terminated
   client; `MeshTLS` a TLS client whose verified identity it names.
4. The first allowing authorization wins; its labels go into the decision
   for metrics. No allowing authorization denies (`Reason.UNAUTHORIZED`).

Shells call this once per connection for opaque traffic and once per
request for HTTP (Linkerd enforces HTTP policy per request).
"""

from __future__ import annotations

import enum
import functools
import ipaddress
from dataclasses import dataclass

from agent.policy.model import (
    Authentication,
    Authorization,
    MeshTLS,
    Meta,
    ServerPolicy,
    TLSUnauthenticated,
    Unauthenticated,
)

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


@functools.lru_cache(maxsize=4096)
def parse_ip(text: str) -> IPAddress:
    """`ipaddress.ip_address(text)`, remembered: the proxy asks it for every new
    connection's client, and a node sees few distinct clients (the module is pure
    Python, some microseconds a parse). Raises ValueError on a bad IP (not remembered).
    """
    return ipaddress.ip_address(text)


class Reason(enum.Enum):
    """Why a decision came out as it did."""

    AUTHORIZED = "authorized"
    UNAUTHORIZED = "unauthorized"
    NO_ROUTE = "no route"
    INVALID_POLICY = "invalid policy"


@dataclass(frozen=True, slots=True, kw_only=True)
class Facts:
    """What the proxy knows about a client; `client_identity` only with `tls`."""

    client_ip: IPAddress
    client_identity: str | None = None  # verified peer identity from mTLS
    tls: bool = False  # the proxy terminated TLS for this connection
    dst_port: int
    method: str | None = None  # HTTP requests only
    path: str | None = None  # HTTP requests only, query excluded

    def __post_init__(self) -> None:
        if self.client_identity is not None and not self.tls:
            raise ValueError("a client identity needs a TLS connection")

    @classmethod
    def of(  # noqa: PLR0913 - one per fact
        cls,
        client_ip: str | IPAddress,
        *,
        dst_port: int,
        client_identity: str | None = None,
        tls: bool = False,
        method: str | None = None,
        path: str | None = None,
    ) -> Facts:
        """Build facts, parsing a textual client IP; raises ValueError on a bad IP."""
        ip = parse_ip(client_ip) if isinstance(client_ip, str) else client_ip
        return cls(
            client_ip=ip,
            client_identity=client_identity,
            tls=tls or client_identity is not None,
            dst_port=dst_port,
            method=method,
            path=path,
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class Decision:
    """An authorization outcome and the labels metrics need."""

    allowed: bool
    reason: Reason
    server: Meta
    authz: Meta | None = None
    route: Meta | None = None

    @property
    def http_status(self) -> int:
        """The HTTP status a denied request gets (200 when allowed)."""
        if self.allowed:
            return 200
        return 404 if self.reason is Reason.NO_ROUTE else 403

    def labels(self) -> dict[str, str]:
        """Linkerd's `srv_*`, `route_*` and `authz_*` metric labels."""
        out = {"srv_group": self.server.group, "srv_kind": self.server.kind}
        out["srv_name"] = self.server.name
        for prefix, meta in (("route", self.route), ("authz", self.authz)):
            if meta is not None:
                out[f"{prefix}_group"] = meta.group
                out[f"{prefix}_kind"] = meta.kind
                out[f"{prefix}_name"] = meta.name
        return out


def authorize(policy: ServerPolicy, facts: Facts) -> Decision:
    """Decide whether `facts` pass `policy`. Never raises."""
    if not policy.valid:
        return Decision(allowed=False, reason=Reason.INVALID_POLICY, server=policy.meta)
    authorizations = policy.authorizations
    route_meta: Meta | None = None
    if policy.http_routes is not None and facts.method is not None:
        path = facts.path or "/"
        for route in policy.http_routes:
            if route.matches_request(facts.method, path):
                authorizations, route_meta = route.authorizations, route.meta
                break
        else:
            return Decision(allowed=False, reason=Reason.NO_ROUTE, server=policy.meta)
    authz = _first_allowing(authorizations, facts)
    if authz is None:
        return Decision(
            allowed=False, reason=Reason.UNAUTHORIZED, server=policy.meta, route=route_meta
        )
    return Decision(
        allowed=True,
        reason=Reason.AUTHORIZED,
        server=policy.meta,
        authz=authz.meta,
        route=route_meta,
    )


def _first_allowing(
    authorizations: tuple[Authorization, ...], facts: Facts
) -> Authorization | None:
    ip = facts.client_ip
    for authz in authorizations:
        if not _authenticated(authz.authentication, facts):
            continue
        for n in authz.networks:  # not `any` over a generator: asked per connection
            if n.contains(ip):
                return authz
    return None


def _authenticated(authn: Authentication, facts: Facts) -> bool:
    if isinstance(authn, Unauthenticated):
        return True
    if isinstance(authn, TLSUnauthenticated):
        return facts.tls
    if isinstance(authn, MeshTLS):
        return (
            facts.tls and facts.client_identity is not None and authn.matches(facts.client_identity)
        )
    raise AssertionError(f"BUG: unknown authentication {authn!r}")
