"""HTTP/2 message helpers for the per-stream proxy: pure functions over h2 header lists.

Headers are `(name, value)` byte pairs, names lowercase (agent.proxy.h2frame checks
received headers), pseudo-headers (`:method`, `:path`, `:authority`,
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
4. What the proxy sends is not checked again: forwarded headers were checked
   when received (h2frame), and the proxy's own (`answer_headers`,
   `with_client_id`) are built valid. `protect` keeps credentials and short
   cookies out of the HPACK table (never indexed, as nghttp2 does), and
   `with_client_id` keeps the fields as they arrived, a never-indexed one
   (`NeverIndexedHeaderTuple`) included (RFC 7541 7.1.3).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final, cast

from hpack import NeverIndexedHeaderTuple

from agent.proxy import h1msg

H2Headers = list[tuple[bytes, bytes]]

GRPC_DEADLINE_EXCEEDED: Final = 4
GRPC_PERMISSION_DENIED: Final = 7
GRPC_UNAVAILABLE: Final = 14
CLIENT_ID: Final = b"l5d-client-id"
_GRPC_FOR_STATUS: Final = {403: GRPC_PERMISSION_DENIED, 404: 12, 504: GRPC_DEADLINE_EXCEEDED}
_QUERY: Final = 0x3F  # "?", as a byte value (`routing_facts`)
_SECRET: Final = frozenset((b"authorization", b"proxy-authorization"))
_SECRET_SIZE: Final = len(b"authorization")  # `protect` looks closer only at these lengths
_PROXY_SECRET_SIZE: Final = len(b"proxy-authorization")
_COOKIE_SIZE: Final = len(b"cookie")
_CLIENT_ID_SIZE: Final = len(CLIENT_ID)
_SHORT_COOKIE: Final = 20  # shorter cookies are guessable through the HPACK table (as nghttp2)


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
    return is_grpc_type(header(headers, b"content-type"))


def is_grpc_type(ctype: bytes | None) -> bool:
    """Whether a `content-type` value is a gRPC one."""
    return ctype is not None and ctype.lower().startswith(b"application/grpc")


# What routing and authorization read of a request: `:method`, the query-less `:path`,
# `l5d-dst-override`, `content-type` (None when absent).
RoutingFacts = tuple[bytes | None, bytes | None, bytes | None, bytes | None]


def routing_facts(headers: H2Headers) -> RoutingFacts:
    """A request's `RoutingFacts`, in one pass (the first of each field counts)."""
    method = path = override = ctype = None
    for key, value in headers:
        if key == b":method":
            if method is None:
                method = value
        elif key == b":path":
            if path is None:
                # An int: `b"?" in value` first tries the bytes as an index and raises.
                path = value.partition(b"?")[0] if _QUERY in value else value
        elif key == b"l5d-dst-override":
            if override is None:
                override = value
        elif key == b"content-type" and ctype is None:
            ctype = value
    return method, path, override, ctype


def method_path(headers: H2Headers) -> tuple[str, str]:
    """`:method` and the query-less `:path` of a request (empty when missing)."""
    method = header(headers, b":method") or b""
    path = header(headers, b":path") or b""
    return method.decode("latin-1"), path.decode("latin-1").partition("?")[0]


_STATUS_CODES: Final = {b"%d" % code: code for code in range(100, 600)}  # status_of's fast path


def status_of(headers: H2Headers) -> int:
    """The `:status` of a response; 0 when missing or not a number."""
    raw = header(headers, b":status")
    if raw is None:
        return 0
    code = _STATUS_CODES.get(raw)
    if code is not None:
        return code
    return int(raw) if raw.isdigit() else 0


def grpc_status(headers: H2Headers) -> int | None:
    """`grpc-status` as an int (rule 3)."""
    raw = header(headers, b"grpc-status")
    return int(raw) if raw is not None and raw.strip().isdigit() else None


def with_client_id(headers: H2Headers, identity: str | None) -> H2Headers:
    """Drop any `l5d-client-id`; add the verified `identity` when there is one (rule 2)."""
    out: list[Any] = []
    for item in _fields(headers):
        if isinstance(item, tuple):  # read as a tuple: compiled, no generic item lookup
            key: bytes = item[0]
            if len(key) == _CLIENT_ID_SIZE and key == CLIENT_ID:
                continue
        elif item[0] == CLIENT_ID:
            continue
        out.append(item)
    if identity is not None:
        out.append((CLIENT_ID, identity.encode("ascii")))
    return out


def protect(headers: H2Headers) -> H2Headers:
    """`headers` with credentials and short cookies never indexed by HPACK (rule 4).

    Returns `headers` itself when nothing needs marking (the common case).
    """
    out: list[Any] | None = None
    for i, item in enumerate(_fields(headers)):
        if isinstance(item, tuple):  # read as a tuple: compiled, no generic item lookup
            key: bytes = item[0]
            size = len(key)  # only three names can need it: most fields stop here
            if size not in (_SECRET_SIZE, _PROXY_SECRET_SIZE, _COOKIE_SIZE):
                continue
            value: bytes = item[1]
        else:
            key, value = item[0], item[1]
        if (key in _SECRET or (key == b"cookie" and len(value) < _SHORT_COOKIE)) and not (
            isinstance(item, NeverIndexedHeaderTuple)
        ):
            if out is None:
                out = list(headers)
            out[i] = NeverIndexedHeaderTuple(key, value)
    return headers if out is None else out


def _fields(headers: H2Headers) -> list[Any]:
    """`headers` as a list of objects: a field may be a `NeverIndexedHeaderTuple`, and
    compiled code (agent.native) would copy a `tuple[bytes, bytes]`-typed one into a
    plain tuple, dropping the mark (rule 4)."""
    return cast("list[Any]", headers)


def answer_for(status: int, message: str, *, grpc: bool) -> Answer:
    """The proxy answer for a failed request: gRPC code from the HTTP status when gRPC."""
    if not grpc:
        return Answer(status=status, message=message)
    code = _GRPC_FOR_STATUS.get(status, GRPC_UNAVAILABLE)
    return Answer(status=status, message=message, grpc=code)


def answer_headers(answer: Answer) -> H2Headers:
    """The response headers (sent with END_STREAM) of a proxy answer (rule 1)."""
    if answer.grpc is not None:
        grpc = h1msg.grpc_error_headers(answer.grpc, answer.message)
        return [(b":status", b"200"), *((k, _valid(v)) for k, v in grpc)]
    return [
        (b":status", b"%d" % answer.status),
        (h1msg.PROXY_ERROR, _text(answer.message)),
        (b"content-length", b"0"),
    ]


def answer_outcome(answer: Answer) -> tuple[int, bool]:
    """(HTTP status sent, failure) of a proxy answer, for metrics and balancing."""
    if answer.grpc is not None:
        return 200, True
    return answer.status, answer.status >= 500


class RequestHead:
    """An HTTP/1-shaped head of an h2 request, for the recorder's `REQUEST` context: the
    fields tap reads (`method`, `target`, `headers` with `host`), made only when read,
    so a stream nobody taps pays for one small object."""

    __slots__ = ("_h2",)

    def __init__(self, headers: H2Headers) -> None:
        self._h2 = headers

    @property
    def method(self) -> bytes:
        return header(self._h2, b":method") or b""

    @property
    def target(self) -> bytes:
        return header(self._h2, b":path") or b"/"

    @property
    def headers(self) -> list[tuple[bytes, bytes]]:
        plain = [(k, v) for k, v in self._h2 if not k.startswith(b":")]
        authority = header(self._h2, b":authority")
        if authority is not None and header(plain, b"host") is None:
            plain.append((b"host", authority))
        return plain


def _text(message: str) -> bytes:
    return _valid(message.encode("ascii", "replace"))


def _valid(value: bytes) -> bytes:
    """A valid header value: no NUL, CR, LF; no surrounding whitespace (rule 4)."""
    return value.translate(_SQUASH).strip(b" \t")


_SQUASH: Final = bytes.maketrans(b"\0\r\n", b"   ")
