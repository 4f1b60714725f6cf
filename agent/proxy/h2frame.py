"""HTTP/2 wire facts for agent.proxy.h2codec: frame types, flags, settings, error codes,
the frame header, and the checks of received header lists (RFC 9113 8.2, 8.3).

Rules:
1. Pure: bytes and header lists in, bytes or a reason out.
2. `check_request` / `check_response` / `check_trailers` return None for a well-formed
   header list, else why it is malformed (the codec resets the stream with
   PROTOCOL_ERROR, RFC 9113 8.1.1). What they check: names are visible ASCII
   without upper case or colon; values hold no NUL, CR or LF, and a regular field's
   no surrounding whitespace; pseudo-headers come first, once each, and only those
   of the message's kind; no connection-specific fields, `te` only `trailers`; a
   request has `:method`, `:scheme` and a non-empty `:path` (CONNECT: `:authority`
   and neither of the other two); `:authority` and `host` agree; a response has a
   three-digit `:status`; trailers have no pseudo-headers.
3. A field whose own bytes were found well-formed is remembered (up to
   `_GOOD_MAX`, then the memory starts over): the same fields come on every
   request of a connection, and checking one again is a set lookup instead of
   byte scans. What depends on the list (order, duplicates, which pseudo-headers)
   is checked every time.
"""

from __future__ import annotations

import enum
import struct
from typing import Any, Final, cast

PREFACE: Final = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
HEADER: Final = struct.Struct(">HBBBL")  # length (24 bits as 16 + 8), type, flags, stream id
HEADER_SIZE: Final = 9
DEFAULT_WINDOW: Final = 65535
DEFAULT_MAX_FRAME: Final = 1 << 14
MAX_FRAME_LIMIT: Final = (1 << 24) - 1
MAX_WINDOW: Final = (1 << 31) - 1
SID_MASK: Final = MAX_WINDOW

# frame types
DATA: Final = 0x0
HEADERS: Final = 0x1
PRIORITY: Final = 0x2
RST_STREAM: Final = 0x3
SETTINGS: Final = 0x4
PUSH_PROMISE: Final = 0x5
PING: Final = 0x6
GOAWAY: Final = 0x7
WINDOW_UPDATE: Final = 0x8
CONTINUATION: Final = 0x9

# flags
END_STREAM: Final = 0x1
ACK: Final = 0x1
END_HEADERS: Final = 0x4
PADDED: Final = 0x8
PRIORITY_FLAG: Final = 0x20

# settings
HEADER_TABLE_SIZE: Final = 0x1
ENABLE_PUSH: Final = 0x2
MAX_CONCURRENT_STREAMS: Final = 0x3
INITIAL_WINDOW_SIZE: Final = 0x4
MAX_FRAME_SIZE: Final = 0x5
MAX_HEADER_LIST_SIZE: Final = 0x6
SETTING: Final = struct.Struct(">HL")


class ErrorCode(enum.IntEnum):
    """RFC 9113 section 7."""

    NO_ERROR = 0x0
    PROTOCOL_ERROR = 0x1
    INTERNAL_ERROR = 0x2
    FLOW_CONTROL_ERROR = 0x3
    SETTINGS_TIMEOUT = 0x4
    STREAM_CLOSED = 0x5
    FRAME_SIZE_ERROR = 0x6
    REFUSED_STREAM = 0x7
    CANCEL = 0x8
    COMPRESSION_ERROR = 0x9
    CONNECT_ERROR = 0xA
    ENHANCE_YOUR_CALM = 0xB
    INADEQUATE_SECURITY = 0xC
    HTTP_1_1_REQUIRED = 0xD


def frame(ftype: int, flags: int, sid: int, payload: bytes = b"") -> bytes:
    """One frame: the 9-byte header, then `payload`."""
    return frame_head(len(payload), ftype, flags, sid) + payload


def frame_head(size: int, ftype: int, flags: int, sid: int) -> bytes:
    """The 9-byte header of a frame of `size` payload bytes, as `HEADER` packs it.

    One big-endian int of 72 bits: compiled, one C conversion, where `HEADER.pack` is a
    generic method call on five boxed ints. Below 2**14 bytes (the default largest frame)
    the int is still a small one, its shifts done in C.
    """
    return ((size << 48) | (ftype << 40) | (flags << 32) | sid).to_bytes(9, "big")


def settings_payload(values: dict[int, int]) -> bytes:
    return b"".join(SETTING.pack(key, value) for key, value in values.items())


# --- received header lists ------------------------------------------------------------

# RFC 9113 8.2.1: visible ASCII, no upper case, no colon (pseudo-headers aside)
_NAME_OK: Final = bytes(c for c in range(0x21, 0x7F) if not 0x41 <= c <= 0x5A and c != 0x3A)
_VALUE_OK: Final = bytes(c for c in range(256) if c not in (0x0, 0xA, 0xD))
_CONNECTION_FIELDS: Final = frozenset(
    (b"connection", b"keep-alive", b"proxy-connection", b"transfer-encoding", b"upgrade")
)
_REQUEST_PSEUDO: Final = frozenset((b":method", b":scheme", b":path", b":authority"))
_RESPONSE_PSEUDO: Final = frozenset((b":status",))
_WHITESPACE: Final = (32, 9)
_LENGTH_DIGITS: Final = 18  # past this a length is absurd (and int() of 4,300 digits raises)
_GOOD: Final[set[Any]] = set()  # fields whose own bytes were found well-formed (rule 3)
_GOOD_MAX: Final = 4096


def _field(name: bytes, value: bytes) -> str | None:
    """Why one regular field is malformed, or None."""
    if not name or name.translate(None, _NAME_OK):
        return f"field name {name!r} is not lowercase visible ASCII without a colon"
    if value.translate(None, _VALUE_OK):
        return f"field {name.decode('latin-1')} holds NUL, CR or LF"
    if value and (value[0] in _WHITESPACE or value[-1] in _WHITESPACE):
        return f"field {name.decode('latin-1')} has surrounding whitespace"
    if name in _CONNECTION_FIELDS:
        return f"connection-specific field {name.decode('latin-1')}"
    if name == b"te" and value != b"trailers":
        return "te other than trailers"
    return None


def _split(
    headers: list[tuple[bytes, bytes]], allowed: frozenset[bytes]
) -> tuple[dict[bytes, bytes], str | None]:
    """The pseudo-headers of `headers`, and why the list is malformed (or None)."""
    pseudo: dict[bytes, bytes] = {}
    regular = False
    good = _GOOD
    # Fields as objects: a set lookup of a compiled tuple[bytes, bytes] boxes a new one.
    for item in cast("list[Any]", headers):
        name: bytes = item[0]
        value: bytes = item[1]
        if name[:1] == b":":
            if regular:
                return pseudo, f"pseudo-header {name.decode('latin-1')} after a regular field"
            if name not in allowed:
                return pseudo, f"pseudo-header {name.decode('latin-1')} not allowed here"
            if name in pseudo:
                return pseudo, f"pseudo-header {name.decode('latin-1')} twice"
            if item not in good:
                if value.translate(None, _VALUE_OK):
                    return pseudo, f"pseudo-header {name.decode('latin-1')} holds NUL, CR or LF"
                _remember(good, item)
            pseudo[name] = value
            continue
        regular = True
        if item in good:  # seen well-formed before (rule 3)
            continue
        reason = _field(name, value)
        if reason is not None:
            return pseudo, reason
        _remember(good, item)
    return pseudo, None


def _remember(good: set[Any], item: object) -> None:
    if len(good) >= _GOOD_MAX:
        good.clear()
    good.add(item)


def check_request(headers: list[tuple[bytes, bytes]]) -> str | None:  # noqa: PLR0911 - one per fault
    """Why a request header list is malformed, or None (rule 2)."""
    pseudo, reason = _split(headers, _REQUEST_PSEUDO)
    if reason is not None:
        return reason
    method = pseudo.get(b":method")
    if not method:
        return "request without :method"
    if method == b"CONNECT":
        if b":scheme" in pseudo or b":path" in pseudo or not pseudo.get(b":authority"):
            return "CONNECT needs :authority only"
        return None
    if not pseudo.get(b":scheme"):
        return "request without :scheme"
    if not pseudo.get(b":path"):
        return "request without :path"
    authority = pseudo.get(b":authority")
    if authority is not None:
        for name, value in headers:
            if name == b"host" and value != authority:
                return ":authority and host differ"
    return None


def check_response(headers: list[tuple[bytes, bytes]]) -> str | None:
    """Why a response header list is malformed, or None (rule 2)."""
    pseudo, reason = _split(headers, _RESPONSE_PSEUDO)
    if reason is not None:
        return reason
    status = pseudo.get(b":status")
    if status is None or len(status) != 3 or not status.isdigit():
        return "response without a three-digit :status"
    return None


def check_trailers(headers: list[tuple[bytes, bytes]]) -> str | None:
    """Why a trailer list is malformed, or None (rule 2)."""
    _, reason = _split(headers, frozenset())
    return reason


def content_length(headers: list[tuple[bytes, bytes]]) -> int | None:
    """The declared body length, None when absent; -1 when unparsable or conflicting."""
    found: int | None = None
    for name, value in headers:
        if name == b"content-length":
            if not value.isdigit() or len(value) > _LENGTH_DIGITS:
                return -1
            if found is not None and int(value) != found:
                return -1
            found = int(value)
    return found
