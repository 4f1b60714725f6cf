"""HTTP/2 message helpers for the per-stream proxy: pure functions over h2 header lists.

Headers are h2's `(name, value)` byte pairs, names lowercase (h2 validates
inbound headers), pseudo-headers (`:method`, `:path`, `:authority`,
`:status`) first.

Rules:
1. A request is gRPC when its `content-type` starts with `application/grpc`;
   proxy answers to gRPC requests are trailers-only (HTTP 200, END_STREAM on
   the headers) with `grpc-status`, as Linkerd answers them: deny 7
   PERMISSION_DENIED, timeout 4 DEADLINE_EXCEEDED, no endpoint / connect
   failure 14 UNAVAILABLE. Other requests get the HTTP status with
   `l5d-proxy-error`.
2. `l5d-client-id` is only ever the verified identity: a client-sent copy is
   dropped before the proxy adds its own (`with_client_id`).
3. `grpc-status` is read from trailers, or from the response headers of a
   trailers-only response; a missing or unparsable value is None.
"""

from __future__ import annotations

from dataclasses import dataclass

from agent.proxy import http1

H2Headers = list[tuple[bytes, bytes]]

GRPC_DEADLINE_EXCEEDED = 4
GRPC_PERMISSION_DENIED = 7
GRPC_UNAVAILABLE = 14
CLIENT_ID = b"l5d-client-id"
_GRPC_FOR_STATUS = {403: GRPC_PERMISSION_DENIED, 404: 12, 504: GRPC_DEADLINE_EXCEEDED}


@dataclass(frozen=True, slots=True, kw_only=True)
class Answer:
    """The proxy answers a stream itself: HTTP `status` (or a gRPC code, rule 1) and why."""

    status: int
    message: str
    grpc: int | None = None  # set: a gRPC trailers-only answer with this grpc-status


def header(headers: H2Headers, name: bytes) -> bytes | None:
    """The first value of `name` (lowercase), or None."""
    for key, value in headers:
        if key == name:
            return value
    return None


def is_grpc(headers: H2Headers) -> bool:
    """Whether a request (or response) carries a gRPC content type."""
    ctype = header(headers, b"content-type")
    return ctype is not None and ctype.lower().startswith(b"application/grpc")


def method_path(headers: H2Headers) -> tuple[str, str]:
    """`:method` and the query-less `:path` of a request (empty when missing)."""
    method = header(headers, b":method") or b""
    path = header(headers, b":path") or b""
    return method.decode("latin-1"), path.decode("latin-1").partition("?")[0]


def status_of(headers: H2Headers) -> int:
    """The `:status` of a response; 0 when missing or not a number."""
    raw = header(headers, b":status")
    return int(raw) if raw is not None and raw.isdigit() else 0


def grpc_status(headers: H2Headers) -> int | None:
    """`grpc-status` as an int (rule 3)."""
    raw = header(headers, b"grpc-status")
    return int(raw) if raw is not None and raw.strip().isdigit() else None


def with_client_id(headers: H2Headers, identity: str | None) -> H2Headers:
    """Drop any `l5d-client-id`; add the verified `identity` when there is one (rule 2)."""
    out = [(k, v) for k, v in headers if k != CLIENT_ID]
    if identity is not None:
        out.append((CLIENT_ID, identity.encode("ascii")))
    return out


def answer_for(status: int, message: str, *, grpc: bool) -> Answer:
    """The proxy answer for a failed request: gRPC code from the HTTP status when gRPC."""
    if not grpc:
        return Answer(status=status, message=message)
    code = _GRPC_FOR_STATUS.get(status, GRPC_UNAVAILABLE)
    return Answer(status=status, message=message, grpc=code)


def answer_headers(answer: Answer) -> H2Headers:
    """The response headers (sent with END_STREAM) of a proxy answer (rule 1)."""
    if answer.grpc is not None:
        return [(b":status", b"200"), *http1.grpc_error_headers(answer.grpc, answer.message)]
    return [
        (b":status", b"%d" % answer.status),
        (http1.PROXY_ERROR, _text(answer.message)),
        (b"content-length", b"0"),
    ]


def answer_outcome(answer: Answer) -> tuple[int, bool]:
    """(HTTP status sent, failure) of a proxy answer, for metrics and balancing."""
    if answer.grpc is not None:
        return 200, True
    return answer.status, answer.status >= 500


def request_head(headers: H2Headers) -> http1.RequestHead:
    """An HTTP/1-shaped head of an h2 request, for the recorder's `REQUEST` context."""
    method = header(headers, b":method") or b""
    path = header(headers, b":path") or b"/"
    plain = [(k, v) for k, v in headers if not k.startswith(b":")]
    authority = header(headers, b":authority")
    if authority is not None and header(plain, b"host") is None:
        plain.append((b"host", authority))
    return http1.RequestHead(
        method=method,
        target=path,
        version=b"2",
        headers=plain,
        keep_alive=True,
        framing=http1.Framing.NONE,
    )


def _text(message: str) -> bytes:
    return message.encode("ascii", "replace").replace(b"\r", b" ").replace(b"\n", b" ")
