"""Protocol detection on a connection's first bytes, and TLS ClientHello SNI parsing.

Pure functions over a byte prefix; no I/O, no clock, never raise. The shell
reads into a buffer, calls `detect(prefix, eof=...)` after each read and
keeps reading while it returns `NEED_MORE` (up to `MAX_DETECT_BYTES`, or
until its detect timeout, when it treats the connection as opaque).

Rules:
1. HTTP/2 is the prior-knowledge preface `PRI * HTTP/2.0\\r\\n\\r\\nSM\\r\\n\\r\\n`.
2. HTTP/1 is a request line `METHOD SP target SP HTTP/1.x CRLF` with a known
   method; the whole line must arrive within `max_len` bytes.
3. Anything else is opaque. A prefix that could still become HTTP is
   `NEED_MORE`, unless `eof` (no more bytes will come): then it is opaque.
4. TLS: `is_tls_client_hello` looks at the record and handshake headers;
   `parse_sni` walks the ClientHello (possibly spread over several handshake
   records) to the server_name extension (type 0) and returns the host name,
   `None` when there is none or the bytes are not a well-formed ClientHello,
   or `NEED_MORE` while the hello is incomplete.
"""

from __future__ import annotations

import enum
from typing import Final, Literal

MAX_DETECT_BYTES: Final = 8192  # bytes read before giving up on finding an HTTP request line
H2_PREFACE: Final = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
HTTP_METHODS: Final = frozenset(
    {b"GET", b"HEAD", b"POST", b"PUT", b"DELETE", b"CONNECT", b"OPTIONS", b"TRACE", b"PATCH"}
)
_MAX_METHOD_LEN: Final = max(len(m) for m in HTTP_METHODS)
_VERSIONS: Final = (b"HTTP/1.1", b"HTTP/1.0")


class Protocol(enum.Enum):
    """What a connection speaks."""

    HTTP1 = "http/1"
    HTTP2 = "h2"
    OPAQUE = "opaque"


class _Need(enum.Enum):
    MORE = "need more"


NEED_MORE: Final = _Need.MORE
NeedMore = Literal[_Need.MORE]


def detect(prefix: bytes, *, eof: bool, max_len: int = MAX_DETECT_BYTES) -> Protocol | NeedMore:
    """Classify a connection by its first bytes. Never raises."""
    if not prefix:
        return Protocol.OPAQUE if eof else NEED_MORE
    if prefix.startswith(H2_PREFACE):
        return Protocol.HTTP2
    if H2_PREFACE.startswith(prefix):  # "P" could also be POST: waiting covers both
        return Protocol.OPAQUE if eof else NEED_MORE
    result = _detect_http1(prefix, max_len)
    if result is NEED_MORE and eof:
        return Protocol.OPAQUE
    return result


def _detect_http1(prefix: bytes, max_len: int) -> Protocol | NeedMore:
    window = prefix[:max_len]
    space = window.find(b" ", 0, _MAX_METHOD_LEN + 1)
    if space < 0:
        head = window[: _MAX_METHOD_LEN + 1]
        if len(head) <= _MAX_METHOD_LEN and any(m.startswith(head) for m in HTTP_METHODS):
            return NEED_MORE if len(window) < max_len else Protocol.OPAQUE
        return Protocol.OPAQUE
    if window[:space] not in HTTP_METHODS:
        return Protocol.OPAQUE
    end = window.find(b"\r\n", space)
    if end < 0:
        if not _plausible_line(window, space + 1, len(window)):
            return Protocol.OPAQUE
        return NEED_MORE if len(window) < max_len else Protocol.OPAQUE
    line = window[:end]  # a pure verdict on the line: clients repeat theirs (bounded memo)
    known = _REQUEST_LINES.get(line)
    if known is None:
        known = _is_request_line(window, space, end)
        if len(_REQUEST_LINES) >= _REQUEST_LINES_MAX:
            _REQUEST_LINES.clear()
        _REQUEST_LINES[line] = known
    return Protocol.HTTP1 if known else Protocol.OPAQUE


_REQUEST_LINES_MAX: Final = 256
_REQUEST_LINES: Final[dict[bytes, bool]] = {}


def _plausible_line(buf: bytes, start: int, end: int) -> bool:
    # Bytes of a request line so far: no control characters, at most one more space.
    chunk = buf[start:end]
    if chunk.count(b" ") > 1:
        return False
    return not any(b < 0x20 or b == 0x7F for b in chunk)


def _is_request_line(buf: bytes, space: int, end: int) -> bool:
    rest = buf[space + 1 : end]
    target, sep, version = rest.partition(b" ")
    if not sep or not target or version not in _VERSIONS:
        return False
    return not any(b <= 0x20 or b == 0x7F for b in target)


# --- TLS ----------------------------------------------------------------------

_TLS_HANDSHAKE: Final = 0x16
_CLIENT_HELLO: Final = 0x01
_EXT_SERVER_NAME: Final = 0x0000
_MAX_HELLO_LEN: Final = 1 << 16  # refuse to buffer more than this for one ClientHello


def is_tls_client_hello(prefix: bytes) -> bool | NeedMore:
    """True when `prefix` starts like a TLS ClientHello record; `NEED_MORE` under 6 bytes."""
    # content type handshake, record version 3.x with x <= 4 (SSL 3 .. TLS 1.3 legacy)
    for i, ok in enumerate((_TLS_HANDSHAKE, 0x03)):
        if len(prefix) <= i:
            return NEED_MORE
        if prefix[i] != ok:
            return False
    if len(prefix) < 3:
        return NEED_MORE
    if prefix[2] > 0x04:
        return False
    if len(prefix) < 6:
        return NEED_MORE
    length = int.from_bytes(prefix[3:5], "big")
    return 0 < length <= 16384 + 2048 and prefix[5] == _CLIENT_HELLO


def parse_sni(prefix: bytes) -> str | NeedMore | None:
    """The ClientHello's server name, `None` if absent or malformed, or `NEED_MORE`."""
    hello = _handshake_message(prefix)
    if hello is None or hello is NEED_MORE:
        return hello
    try:
        return _sni_from_hello(hello)
    except _Malformed:
        return None


class _Malformed(Exception):  # noqa: N818 - private control flow
    pass


def _handshake_message(buf: bytes) -> bytes | NeedMore | None:  # noqa: PLR0911 - one exit per verdict
    """Reassemble the first handshake message from consecutive handshake records."""
    body = bytearray()
    pos = 0
    while True:
        if len(buf) < pos + 5:
            return NEED_MORE
        if buf[pos] != _TLS_HANDSHAKE or buf[pos + 1] != 0x03:
            return None
        length = int.from_bytes(buf[pos + 3 : pos + 5], "big")
        if length == 0:
            return None
        end = pos + 5 + length
        body += buf[pos + 5 : end]
        if len(body) >= 4:
            if body[0] != _CLIENT_HELLO:
                return None
            need = int.from_bytes(body[1:4], "big")
            if need > _MAX_HELLO_LEN:
                return None
            if len(body) >= 4 + need:
                return bytes(body[4 : 4 + need])
        if len(buf) < end:
            return NEED_MORE
        pos = end


def _sni_from_hello(hello: bytes) -> str | None:
    pos = 2 + 32  # legacy_version, random
    pos = _skip_vector(hello, pos, 1)  # legacy_session_id
    pos = _skip_vector(hello, pos, 2)  # cipher_suites
    pos = _skip_vector(hello, pos, 1)  # legacy_compression_methods
    if pos == len(hello):
        return None  # no extensions at all (old clients)
    ext_end = _vector_end(hello, pos, 2)
    pos += 2
    while pos < ext_end:
        if pos + 4 > ext_end:
            raise _Malformed
        ext_type = int.from_bytes(hello[pos : pos + 2], "big")
        data_end = _vector_end(hello, pos + 2, 2)
        if data_end > ext_end:
            raise _Malformed
        if ext_type == _EXT_SERVER_NAME:
            return _server_name(hello, pos + 4, data_end)
        pos = data_end
    return None


def _server_name(buf: bytes, pos: int, end: int) -> str | None:
    list_end = _vector_end(buf, pos, 2)
    if list_end != end:
        raise _Malformed
    pos += 2
    while pos < list_end:
        if pos + 3 > list_end:
            raise _Malformed
        name_type = buf[pos]
        name_end = _vector_end(buf, pos + 1, 2)
        if name_end > list_end:
            raise _Malformed
        if name_type == 0:  # host_name
            raw = buf[pos + 3 : name_end]
            if not raw or not raw.isascii() or any(b <= 0x20 or b == 0x7F for b in raw):
                raise _Malformed
            return raw.decode("ascii").lower()
        pos = name_end
    return None


def _vector_end(buf: bytes, pos: int, width: int) -> int:
    if pos + width > len(buf):
        raise _Malformed
    end = pos + width + int.from_bytes(buf[pos : pos + width], "big")
    if end > len(buf):
        raise _Malformed
    return end


def _skip_vector(buf: bytes, pos: int, width: int) -> int:
    return _vector_end(buf, pos, width)
