"""HAProxy configurations for the bench's peer setups (pure: values in, text out).

Rules:
1. One `Route` is one listener: `bind` address, where it goes, and whether
   either side speaks TLS. TLS is mutual (`verify required` with the bench
   CA on both sides, TLS 1.3 only), as mTLS between two mesh proxies is.
2. `mode http` routes keep client and server connections alive and let
   HAProxy detect h2c on the clear listener (it does from 2.0 on); `mode tcp`
   routes are byte relays. `alpn` on a TLS side offers those protocols there:
   `h2` on a `mode http` route's upstream multiplexes every client's requests
   as streams on its kept-alive TLS connections (`http-reuse always`).
3. No stats socket, and a connection is logged (to stderr, which the bench keeps
   beside the config) only when it ended abnormally (`option dontlog-normal`): a
   server that timed out or refused, a TLS handshake that failed. A clean run logs
   nothing, and a peer that answered nothing says why.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True, kw_only=True)
class TlsFiles:
    """PEM paths: `cert` holds the certificate chain and the key; `ca` the trust anchor."""

    cert: str
    ca: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Route:
    """One listener and its single upstream."""

    name: str
    bind: str  # "127.0.0.1:18080"
    target: str  # "10.200.1.3:8080"
    mode: str = "tcp"  # tcp | http
    bind_tls: TlsFiles | None = None  # terminate mTLS on the listener
    target_tls: TlsFiles | None = None  # originate mTLS to the target
    sni: str = ""
    alpn: str = ""  # "h2", "h2,http/1.1": offered on the TLS side(s); "" offers none

    def __post_init__(self) -> None:
        if self.mode not in ("tcp", "http"):
            raise ValueError(f"route {self.name}: mode must be tcp or http, not {self.mode!r}")
        if self.alpn and (self.bind_tls is None and self.target_tls is None):
            raise ValueError(f"route {self.name}: alpn needs a TLS side")


def _bind_line(route: Route) -> str:
    line = f"    bind {route.bind}"
    if route.bind_tls is not None:
        tls = route.bind_tls
        line += f" ssl crt {tls.cert} ca-file {tls.ca} verify required ssl-min-ver TLSv1.3"
        if route.alpn:
            line += f" alpn {route.alpn}"
    return line


def _server_line(route: Route) -> str:
    line = f"    server s1 {route.target}"
    if route.target_tls is not None:
        tls = route.target_tls
        line += f" ssl crt {tls.cert} ca-file {tls.ca} verify required ssl-min-ver TLSv1.3"
        if route.sni:
            line += f" sni str({route.sni}) verifyhost {route.sni}"
        if route.alpn:
            line += f" alpn {route.alpn}"
    return line


def render(routes: list[Route], *, threads: int = 2, maxconn: int = 8000) -> str:
    """The whole haproxy.cfg for `routes`.

    Raises:
        ValueError: no routes, or two with the same name.
    """
    if not routes:
        raise ValueError("haproxy config needs at least one route")
    names = [r.name for r in routes]
    if len(set(names)) != len(names):
        raise ValueError(f"route names must be unique: {names}")
    lines = [
        "global",
        f"    nbthread {threads}",
        f"    maxconn {maxconn}",
        "    log stderr format raw local0",
        "",
        "defaults",
        "    log global",
        "    option dontlog-normal",
        "    timeout connect 5s",
        "    timeout client 60s",
        "    timeout server 60s",
        "    timeout http-keep-alive 60s",
    ]
    for route in routes:
        lines += ["", f"listen {route.name}", f"    mode {route.mode}", _bind_line(route)]
        lines.append(f"    option {route.mode}log")
        if route.mode == "http":
            lines.append("    http-reuse always")
        lines.append(_server_line(route))
    return "\n".join(lines) + "\n"
