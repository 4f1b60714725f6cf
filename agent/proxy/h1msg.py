"""HTTP/1 header fields and the messages the proxy writes itself.

Pure functions beside the parser (agent.proxy.http1): hop-by-hop fields
(RFC 9110 7.6.1) and Linkerd's `l5d-*` headers, request and response heads as
bytes, and the proxy's own answers: `error_response` (with `l5d-proxy-error`,
as linkerd2-proxy sends) and trailers-only gRPC errors (`grpc_error_headers` is
shared with the HTTP/2 shell).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from collections.abc import Iterable

    from agent.proxy.http1 import Headers

HOP_BY_HOP: Final = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-connection",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
    }
)
_HOP_LENGTHS: Final = frozenset(len(n) for n in HOP_BY_HOP)
DST_OVERRIDE: Final = b"l5d-dst-override"
CLIENT_ID: Final = b"l5d-client-id"
PROXY_ERROR: Final = b"l5d-proxy-error"


def get_header(headers: Iterable[tuple[bytes, bytes]], name: bytes) -> bytes | None:
    """The first value of header `name` (lowercase), or None."""
    size = len(name)
    for key, value in headers:
        if len(key) == size and key.lower() == name:
            return value
    return None


def strip_hop_by_hop(headers: Headers, *, keep: frozenset[bytes] = frozenset()) -> Headers:
    """Headers without hop-by-hop fields, `Proxy-*`, and those `Connection` names.

    Returns `headers` itself (not a copy) when nothing is dropped: do not mutate the result.

    `keep` (lowercase names) survives anyway: e.g. `{b"transfer-encoding"}` when
    a chunked body is passed through raw.
    """
    for key, _ in headers:  # fast path: no name that could be dropped (by length or prefix)
        if len(key) in _HOP_LENGTHS or key[0] | 0x20 == 0x70:  # 0x70: p, as in proxy-
            break
    else:
        return headers
    drop = set(HOP_BY_HOP)
    for key, value in headers:
        if key.lower() == b"connection":
            drop.update(t.strip(b" \t").lower() for t in value.split(b","))
    drop -= keep
    out: Headers = []
    for key, value in headers:
        lname = key.lower()
        if lname in drop or (lname.startswith(b"proxy-") and lname not in keep):
            continue
        out.append((key, value))
    return out


def dst_override(headers: Iterable[tuple[bytes, bytes]]) -> str | None:
    """The `l5d-dst-override` authority a client asked for, or None (bad bytes: None).

    HTTP/1 and HTTP/2 alike; surrounding whitespace is not part of a field value.
    """
    value = get_header(headers, DST_OVERRIDE)
    if not value or not value.isascii():
        return None
    return value.decode("ascii").strip() or None


def set_client_id(headers: Headers, identity: str | None) -> Headers:
    """Drop any client-sent `l5d-client-id`; add the verified identity when there is one."""
    out = [(k, v) for k, v in headers if not (len(k) == 13 and k.lower() == CLIENT_ID)]
    if identity is not None:
        out.append((CLIENT_ID, identity.encode("ascii")))
    return out


def request_head_bytes(
    method: bytes, target: bytes, headers: Iterable[tuple[bytes, bytes]], version: bytes = b"1.1"
) -> bytes:
    """Serialize a request head (request line, headers, blank line) in one join."""
    parts = [method, b" ", target, b" HTTP/", version, b"\r\n"]
    for key, value in headers:
        parts.append(key)  # four appends compile inline; `+=` a tuple is a generic call
        parts.append(b": ")
        parts.append(value)
        parts.append(b"\r\n")
    parts.append(b"\r\n")
    return b"".join(parts)


def response_head_bytes(
    status: int,
    headers: Iterable[tuple[bytes, bytes]],
    reason: bytes | None = None,
    version: bytes = b"1.1",
) -> bytes:
    """Serialize a response head; `reason` defaults to the standard phrase."""
    if reason is None:
        reason = REASONS.get(status, b"")
    parts = [b"HTTP/", version, b" ", b"%d" % status, b" ", reason, b"\r\n"]
    for key, value in headers:
        parts.append(key)  # four appends compile inline; `+=` a tuple is a generic call
        parts.append(b": ")
        parts.append(value)
        parts.append(b"\r\n")
    parts.append(b"\r\n")
    return b"".join(parts)


REASONS: Final = {
    200: b"OK",
    400: b"Bad Request",
    403: b"Forbidden",
    404: b"Not Found",
    408: b"Request Timeout",
    413: b"Content Too Large",
    431: b"Request Header Fields Too Large",
    500: b"Internal Server Error",
    501: b"Not Implemented",
    502: b"Bad Gateway",
    503: b"Service Unavailable",
    504: b"Gateway Timeout",
    505: b"HTTP Version Not Supported",
}


def _header_text(message: str) -> bytes:
    # Header values must not carry CR, LF or non-ASCII: squash them.
    return message.encode("ascii", "replace").replace(b"\r", b" ").replace(b"\n", b" ")


def error_response(status: int, message: str, *, close: bool = False) -> bytes:
    """A bodiless proxy error response carrying `l5d-proxy-error`, as linkerd2-proxy sends.

    403 unauthorized, 502 connection failed, 503 unavailable (no endpoints,
    load shed), 504 timeout. With `close`, the connection is to be closed.
    """
    headers: Headers = [(PROXY_ERROR, _header_text(message)), (b"content-length", b"0")]
    if close:
        headers += ((b"connection", b"close"), (b"l5d-proxy-connection", b"close"))
    return response_head_bytes(status, headers)


GRPC_PERMISSION_DENIED: Final = 7
GRPC_UNAVAILABLE: Final = 14
GRPC_DEADLINE_EXCEEDED: Final = 4


def grpc_error_headers(grpc_status: int, message: str) -> Headers:
    """Headers of a trailers-only gRPC error (HTTP 200, no body): for h1 or h2 shells."""
    return [
        (b"content-type", b"application/grpc"),
        (b"grpc-status", b"%d" % grpc_status),
        (b"grpc-message", _grpc_percent_encode(message)),
        (PROXY_ERROR, _header_text(message)),
    ]


def grpc_error_response(grpc_status: int, message: str) -> bytes:
    """A trailers-only gRPC error as an HTTP/1.1 response (e.g. deny: grpc-status 7)."""
    headers = grpc_error_headers(grpc_status, message)
    headers.append((b"content-length", b"0"))
    return response_head_bytes(200, headers)


def _grpc_percent_encode(message: str) -> bytes:
    # gRPC's grpc-message: UTF-8, bytes outside 0x20..0x7E and '%' percent-encoded.
    out = bytearray()
    for b in message.encode("utf-8"):
        if 0x20 <= b <= 0x7E and b != 0x25:
            out.append(b)
        else:
            out += b"%%%02X" % b
    return bytes(out)
