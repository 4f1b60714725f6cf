"""HTTP/1 carried over HTTP/2 between proxies (`l5d-orig-proto`): pure head conversions.

Linkerd's outbound proxy upgrades an HTTP/1 request to an h2 stream when the
Destination gives the endpoint the `h2` protocol hint (every meshed pod's
inbound speaks h2); the request carries `l5d-orig-proto: HTTP/1.1` (or
`HTTP/1.0`, with `; absolute-form` when the request line had an absolute
URI). The peer's inbound downgrades it to the HTTP/1 version it names for the
app, and upgrades the app's response, marking it with `l5d-orig-proto` too;
the outbound removes the mark and answers its client in HTTP/1. Many client
connections then share one multiplexed h2 connection (one TLS session)
between two proxies, and a loop iteration's requests leave in one TLS record.

Rules:
1. Upgraded: HTTP/1.1 and HTTP/1.0 requests without `Upgrade`, `CONNECT`,
   `Expect: 100-continue` or a chunked body, with an authority (`Host`, or the
   absolute URI's). Anything else goes as HTTP/1 (`upgradable`,
   `upgrade_request` returns None).
2. h2 forbids connection-specific fields (RFC 9113 8.2.2): hop-by-hop fields,
   those `Connection` names, `Proxy-*` and `Host` (it becomes `:authority`)
   are dropped, names are lowercased; so is a client-sent `l5d-orig-proto`.
3. An h2 body has no HTTP/1 framing: the side that writes HTTP/1 frames it.
   A message with `content-length` keeps it; a bodiless one (END_STREAM on
   its headers, a HEAD request, 1xx / 204 / 304) gets `content-length: 0`
   when its status allows a body; any other body is chunked for HTTP/1.1 and
   delimited by close for an HTTP/1.0 client.
4. `l5d-orig-proto` never reaches an app or a client: the downgrade removes
   it from the request, the upgrading proxy from the response.
5. Trailers cross both ways: an h2 message's trailers end the chunked HTTP/1
   body written for it (`last_chunk`), and a chunked HTTP/1 body's trailers
   become the stream's trailers (`upgrade_trailers`), under rule 2.
6. `take_body`: what of a stream's body is queued, as the HTTP/1 bytes rule 3
   frames it, for a side that writes it with its head or whole (agent.proxy.h2toh1
   and h1toh2 rule 2).
"""

from __future__ import annotations

from typing import Final

from agent.proxy import h1msg
from agent.proxy.h2msg import H2Headers, header, status_of
from agent.proxy.h2stream import CANCEL, Data, End, H2Stream, StreamGoneError, Trailers
from agent.proxy.http1 import Framing, Headers, RequestHead, ResponseHead

ORIG_PROTO: Final = b"l5d-orig-proto"
ABSOLUTE: Final = b"; absolute-form"
LAST_CHUNK: Final = b"0\r\n\r\n"
_DROP: Final = frozenset((b"host", ORIG_PROTO))


def upgradable(head: RequestHead) -> bool:
    """Whether `head` may go over h2 (rule 1; the authority is checked when converting)."""
    return (
        head.upgrade is None
        and not head.expect_continue
        and head.framing is not Framing.CHUNKED
        and head.framing is not Framing.UNTIL_CLOSE
        and head.method != b"CONNECT"
        and head.version in (b"1.1", b"1.0")
    )


def upgrade_request(head: RequestHead, headers: Headers) -> H2Headers | None:
    """The h2 request headers of an HTTP/1 request (rules 1, 2); None: not upgradable.

    `headers`: `head.headers` as they are to be sent (after the target's rewrite).
    """
    target = head.target
    if target.startswith(b"/"):
        authority = h1msg.get_header(headers, b"host")
        path = target
        absolute = False
    else:
        scheme, sep, rest = target.partition(b"://")
        if not sep or scheme.lower() != b"http":
            return None  # `*` (OPTIONS) or an https / odd URI: stays HTTP/1
        authority, slash, tail = rest.partition(b"/")
        path = slash + tail if slash else b"/"
        absolute = True
    if not authority:
        return None
    out: H2Headers = [
        (b":method", head.method),
        (b":scheme", b"http"),
        (b":authority", authority),
        (b":path", path),
    ]
    _add_fields(out, headers)  # a client's own mark dropped too
    mark = b"HTTP/" + head.version
    out.append((ORIG_PROTO, mark + ABSOLUTE if absolute else mark))
    return out


def downgrade_response(
    headers: H2Headers, request: RequestHead, *, end: bool
) -> tuple[bytes, bool, bool]:
    """An upgraded request's h2 response as HTTP/1 for the client (rules 3, 4).

    Returns (head bytes, chunked: the body must be chunk-encoded, keep the client
    connection). `end`: the response ended with its headers.
    """
    status = status_of(headers) or 502
    fields: Headers = [(k, v) for k, v in headers if k[:1] != b":" and k != ORIG_PROTO]
    keep = request.keep_alive and request.version == b"1.1"
    chunked = False
    if not _has_body(status, request.method) or header(fields, b"content-length") is not None:
        pass
    elif end:
        fields.append((b"content-length", b"0"))
    elif keep:
        fields.append((b"transfer-encoding", b"chunked"))
        chunked = True
    else:
        keep = False
    if not keep:
        fields.append((b"connection", b"close"))
    return h1msg.response_head_bytes(status, fields), chunked, keep


class Downgraded:
    """An upgraded h2 request as the HTTP/1 request for the app (rules 2-4)."""

    __slots__ = ("fields", "method", "target", "version")

    def __init__(self, method: bytes, target: bytes, version: bytes, fields: Headers) -> None:
        self.method = method
        self.target = target
        self.version = version
        self.fields = fields

    def head_bytes(self, *, end: bool) -> tuple[bytes, bool]:
        """The request head; whether the body that follows must be chunk-encoded.

        `end`: the request has no body (END_STREAM on its headers).
        """
        fields = self.fields
        chunked = False
        if header(fields, b"content-length") is None and (not end or _sends_length(self.method)):
            if end:
                fields = [*fields, (b"content-length", b"0")]
            else:
                fields = [*fields, (b"transfer-encoding", b"chunked")]
                chunked = True
        version = b"1.1" if chunked else self.version
        return h1msg.request_head_bytes(self.method, self.target, fields, version), chunked


def downgrade_request(headers: H2Headers) -> Downgraded | None:
    """The HTTP/1 request an upgraded h2 request stands for; None: not upgraded (rule 4).

    One pass for the mark, one for the rest; pseudo-fields are read from their own
    short list (the inbound downgrades every upgraded stream: a scan of all the
    fields per field read cost a pass each)."""
    mark = header(headers, ORIG_PROTO)
    if mark is None:
        return None
    pseudo: H2Headers = []  # a handful: scanned once per field read
    fields: Headers = []
    has_host = False
    for key, value in headers:
        if key[:1] == b":":
            pseudo.append((key, value))
        elif key != ORIG_PROTO:
            has_host = has_host or key == b"host"
            fields.append((key, value))
    path = header(pseudo, b":path")
    authority = header(pseudo, b":authority")
    version = b"1.0" if mark.startswith(b"HTTP/1.0") else b"1.1"
    target = path or b"/"
    if mark.endswith(b"absolute-form") and authority is not None:
        target = (header(pseudo, b":scheme") or b"http") + b"://" + authority + target
    if authority is not None and not has_host:
        fields.insert(0, (b"host", authority))
    return Downgraded(header(pseudo, b":method") or b"GET", target, version, fields)


def upgrade_response(head: ResponseHead) -> H2Headers:
    """The app's HTTP/1 response as the h2 response to an upgraded request (rules 2, 4)."""
    out: H2Headers = [(b":status", b"%d" % head.status)]
    _add_fields(out, head.headers)
    out.append((ORIG_PROTO, b"HTTP/" + head.version))
    return out


def upgrade_trailers(trailers: Headers) -> H2Headers:
    """A chunked HTTP/1 body's trailers as h2 trailers (rules 2, 5)."""
    out: H2Headers = []
    _add_fields(out, trailers)
    return out


def chunk(data: bytes | memoryview) -> bytes:
    """One chunk of a chunk-encoded body (empty data: nothing, not the last chunk)."""
    size = len(data)
    if not size:
        return b""
    return b"%x\r\n" % size + bytes(data) + b"\r\n"


def last_chunk(trailers: H2Headers | None = None) -> bytes:
    """The end of a chunk-encoded body, with trailers (pseudo-fields dropped)."""
    if not trailers:
        return LAST_CHUNK
    parts = [b"0\r\n"]
    for key, value in trailers:
        if key[:1] != b":":
            parts += (key, b": ", value, b"\r\n")
    parts.append(b"\r\n")
    return b"".join(parts)


def _add_fields(out: H2Headers, headers: Headers) -> None:
    """HTTP/1 fields as h2 fields (rule 2): connection-specific ones, Host and any
    `l5d-orig-proto` dropped, names lowercased."""
    for key, value in h1msg.strip_hop_by_hop(headers):
        name = key.lower()
        if name not in _DROP:
            out.append((name, value))


def _has_body(status: int, method: bytes) -> bool:
    return not (status < 200 or status in (204, 304) or method == b"HEAD")


def _sends_length(method: bytes) -> bool:
    """Methods whose bodiless requests say `content-length: 0` (RFC 9110 8.6)."""
    return method in (b"POST", b"PUT", b"PATCH")


def take_body(stream: H2Stream, parts: list[bytes], *, chunked: bool, limit: int) -> bool:
    """Rule 6: add the body items queued on `stream` to `parts` (chunk-encoded when
    `chunked`), each DATA acknowledged, until `limit` bytes of it are taken; True when
    its end (or trailers) was among them.

    Raises:
        StreamGoneError: the stream was reset, or sent something other than a body.
    """
    size = 0
    while size < limit:
        item = stream.next_now()
        if item is None:
            return False
        if isinstance(item, Data):
            parts.append(chunk(item.data) if chunked else item.data)
            size += len(item.data)
            stream.ack(item.flow)
        elif isinstance(item, (Trailers, End)):
            if chunked:
                parts.append(last_chunk(item.headers if isinstance(item, Trailers) else None))
            return True
        else:
            raise StreamGoneError(CANCEL)
    return False
