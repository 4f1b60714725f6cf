"""Sans-I/O HTTP/1.1 framing for a proxy: message boundaries and head facts, bodies untouched.

Bytes go in (`feed(data)`, `feed_eof()`), events come out, in order:
`RequestHead`/`ResponseHead`, zero or more `BodyData`, `MessageEnd`; a bad
message yields one `ProtocolError(status, reason)` and the parser stops
(terminal state); a switch of protocols yields `Upgraded(data)` and the
connection is opaque from then on. Nothing here does I/O, reads a clock or
logs, and `feed`/`feed_eof` never raise.

Why not httptools: it cannot be told that a response answers a HEAD request
(its llhttp `on_headers_complete` skip-body return is not exposed), so it
would wait for a body that never comes; and it copies every body chunk. This
parser is small, handles both, and hands bodies out as zero-copy views.

Rules:
1. Pipelining: several messages in one buffer come out in order; bytes past
   the current message are kept, never lost.
2. Bodies are never re-encoded. `BodyData.data` is the input object itself or
   a memoryview of it; it stays valid as long as the fed object is unchanged.
   With `decode_chunked=False` (the default, for HTTP/1 to HTTP/1) a chunked
   body is passed as its raw wire bytes, chunk framing and trailers included,
   so the shell keeps `Transfer-Encoding: chunked`; with `decode_chunked=True`
   `BodyData` carries payload and `MessageEnd.trailers` the trailers.
3. Requests: `Transfer-Encoding` with `Content-Length`, conflicting lengths,
   a final coding other than chunked, obs-fold, bare CR/LF and NUL are
   rejected (smuggling defences). A request without either has no body.
4. Responses need the request they answer: call `ResponseParser.expect(method,
   upgrade=...)` per request sent. HEAD, 1xx, 204 and 304 responses have no
   body; 1xx other than 101 are interim; 101 to an upgrade request and 2xx to
   CONNECT switch to opaque. Without a length a response body runs to EOF.
5. After a request that asks to upgrade (or CONNECT) ends, the request parser
   pauses, buffering input, until the shell calls `upgrade_accepted()` (the
   buffered bytes are the start of the tunnel) or `upgrade_declined()`.
6. A message that does not keep the connection alive is the last one; later
   input is ignored.

Transitions (state -> handler) are the table `_Parser._step`; input in a
terminal state (CLOSED, SWITCHED, ERROR) is ignored.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from typing import Final

Headers = list[tuple[bytes, bytes]]
Input = bytes | bytearray | memoryview  # what `feed` takes (copied to bytes unless bytes)

MAX_HEAD_BYTES: Final = 64 * 1024
MAX_CHUNK_LINE: Final = 4096

_TOKEN: Final = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_CHUNK_SIZE: Final = re.compile(rb"[0-9A-Fa-f]{1,16}")
_CTL: Final = re.compile(rb"[\x00-\x20\x7f]")
_BAD_START: Final = re.compile(rb"[\x00\r\n]")
# One header line: token ":" OWS value OWS CRLF; no obs-fold, no bare CR/LF, no NUL.
# The value keeps trailing whitespace (a lazy match to drop it costs 50% more); forwarding it is
# harmless and the framing facts strip it.
_HEADER_LINE: Final = re.compile(rb"([!#$%&'*+\-.^_`|~0-9A-Za-z]+):[ \t]*([^\r\n\x00]*)\r\n")
_HEADER_SECTION: Final = re.compile(rb"(?:[!#$%&'*+\-.^_`|~0-9A-Za-z]+:[^\r\n\x00]*\r\n)*")
_ANY_VERSION: Final = re.compile(rb"HTTP/[0-9]\.[0-9]")


class Framing(enum.Enum):
    """How a message's body is delimited."""

    NONE = "none"
    CONTENT_LENGTH = "content-length"
    CHUNKED = "chunked"
    UNTIL_CLOSE = "until-close"


# Events are plain slotted dataclasses (not frozen: they are built on the hot
# path and frozen __init__ costs a setattr call per field); treat them as immutable.


@dataclass(slots=True, kw_only=True)
class RequestHead:
    """A request line and its headers (raw names; values minus leading whitespace)."""

    method: bytes
    target: bytes
    version: bytes  # b"1.1" or b"1.0"
    headers: Headers
    keep_alive: bool
    framing: Framing
    content_length: int | None = None
    upgrade: bytes | None = None  # the Upgrade value when Connection names upgrade
    expect_continue: bool = False
    raw: bytes = b""  # the head as received, without its blank line (b"": not parsed)


@dataclass(slots=True, kw_only=True)
class ResponseHead:
    """A status line and its headers (raw names; values minus leading whitespace)."""

    status: int
    reason: bytes
    version: bytes
    headers: Headers
    keep_alive: bool
    framing: Framing
    content_length: int | None = None
    raw: bytes = b""  # the head as received, without its blank line (b"": not parsed)


@dataclass(slots=True, init=False)
class BodyData:
    """A piece of body: payload, or raw chunked wire bytes (see rule 2)."""

    data: bytes | memoryview

    def __init__(self, data: bytes | memoryview) -> None:  # per piece: agent.native rule 5
        self.data = data


@dataclass(slots=True, init=False)
class MessageEnd:
    """The message is complete; `trailers` only when decoding chunked bodies."""

    trailers: Headers | None

    def __init__(self, trailers: Headers | None = None) -> None:  # per message: rule 5
        self.trailers = trailers


END: Final = MessageEnd()  # the one shared end event of the fast paths (events are never mutated)


@dataclass(slots=True)
class ProtocolError:
    """The peer sent something we will not forward; `status` is what to answer."""

    status: int
    reason: str


@dataclass(slots=True)
class Upgraded:
    """The connection now carries opaque bytes; `data` came right after the head."""

    data: bytes


Event = RequestHead | ResponseHead | BodyData | MessageEnd | ProtocolError | Upgraded


class _S(enum.IntEnum):
    # IntEnum, not Enum: states are hashed on every step, and Enum.__hash__ is Python code.
    HEAD = 0
    BODY = 1
    CHUNK_SIZE = 2
    CHUNK_DATA = 3
    CHUNK_CRLF = 4
    TRAILERS = 5
    UNTIL_CLOSE = 6
    PAUSED = 7
    CLOSED = 8
    SWITCHED = 9
    ERROR = 10

    @property
    def label(self) -> str:
        return self.name.lower().replace("_", "-")


_CHUNKED_STATES: Final = frozenset({_S.CHUNK_SIZE, _S.CHUNK_DATA, _S.CHUNK_CRLF, _S.TRAILERS})
_TERMINAL: Final = frozenset({_S.CLOSED, _S.SWITCHED, _S.ERROR})


class _Invalid(Exception):  # noqa: N818 - private control flow inside head parsing
    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


@dataclass(slots=True)
class _HeadFacts:
    """The few header facts that decide framing; `_NO_FACTS` when none were sent."""

    content_length: int | None = None
    chunked: bool = False
    transfer_encoding: bool = False
    conn_tokens: frozenset[bytes] = frozenset()
    upgrade: bytes | None = None
    expect_continue: bool = False


_NO_FACTS: Final = _HeadFacts()  # shared and never mutated: only built facts are written to
_FACT_NAMES: Final = frozenset(
    {b"content-length", b"transfer-encoding", b"connection", b"upgrade", b"expect"}
)
_FACT_LENGTHS: Final = frozenset(len(n) for n in _FACT_NAMES)


class _Parser:
    """Shared machinery; see RequestParser and ResponseParser."""

    _error_status = 400  # what a malformed message is answered with
    _too_large = 431

    def __init__(self, *, decode_chunked: bool = False, max_head: int = MAX_HEAD_BYTES) -> None:
        self.decode_chunked = decode_chunked
        self.max_head = max_head
        self._state = _S.HEAD
        self._stash = b""
        self._scan = 0  # where to resume looking for the end of a partial head
        self._remaining = 0  # body or chunk bytes still to come
        self._raw_from = -1  # start of raw chunked bytes not yet emitted (-1: none)
        self._keep_alive = True

    @property
    def state(self) -> str:
        """The parser state's name (for tests and debugging)."""
        return self._state.label

    @property
    def between_messages(self) -> bool:
        """Waiting for a next head, nothing buffered (a cheap `state == "head"`)."""
        return self._state is _S.HEAD and not self._stash

    def feed(self, data: Input) -> list[Event]:
        """Parse more input; returns the events it completes. Never raises."""
        events: list[Event] = []
        if self._state in _TERMINAL:
            return events
        if type(data) is not bytes:
            data = bytes(data)
        if self._stash:
            data = self._stash + data
            self._stash = b""
        pos, end = 0, len(data)
        raw = not self.decode_chunked
        while pos < end and self._state not in _TERMINAL:
            if raw and self._raw_from < 0 and self._state in _CHUNKED_STATES:
                self._raw_from = pos
            pos = self._step(data, pos, events)
        self._flush_raw(data, end, events)
        return events

    def feed_eof(self) -> list[Event]:
        """The peer closed its sending side; returns the last events. Never raises."""
        state = self._state
        if state is _S.UNTIL_CLOSE:
            self._state = _S.CLOSED
            return [MessageEnd()]
        if state is _S.HEAD and not self._stash:
            self._state = _S.CLOSED
            return []
        if state in _TERMINAL or state is _S.PAUSED:
            return []
        return [self._fail(self._error_status, f"connection closed in {state.label}")]

    # --- shared steps -----------------------------------------------------

    def _fail(self, status: int, reason: str) -> ProtocolError:
        self._state = _S.ERROR
        self._stash = b""
        self._raw_from = -1
        return ProtocolError(status, reason)

    def _wait(self, data: bytes, pos: int, events: list[Event]) -> int:
        """Keep data[pos:] for the next feed, after emitting raw chunked bytes before it."""
        self._flush_raw(data, pos, events)
        self._stash = data[pos:]
        return len(data)

    def _flush_raw(self, data: bytes, upto: int, events: list[Event]) -> None:
        start = self._raw_from
        if start >= 0:
            self._raw_from = -1
            if upto > start:
                events.append(BodyData(_view(data, start, upto)))

    def _find_head(self, data: bytes, pos: int, events: list[Event]) -> tuple[int, int]:
        """(start, end) of the next head, end just past its blank line; end < 0 if not yet."""
        while data.startswith(b"\r\n", pos):  # tolerate blank lines between messages
            pos += 2
        idx = data.find(b"\r\n\r\n", pos + self._scan)
        if idx < 0:
            if len(data) - pos > self.max_head:
                events.append(self._fail(self._too_large, "message head too large"))
            elif pos < len(data):
                self._scan = max(len(data) - pos - 3, 0)
                self._wait(data, pos, events)
            return pos, -1
        self._scan = 0
        if idx - pos > self.max_head:
            events.append(self._fail(self._too_large, "message head too large"))
            return pos, -1
        return pos, idx + 4

    def _split_head(self, block: bytes) -> tuple[bytes, Headers, _HeadFacts]:
        eol = block.find(b"\r\n")
        if eol < 0:
            start, section = block, b""
        else:
            start, section = block[:eol], block[eol + 2 :] + b"\r\n"
        if _BAD_START.search(start) or (section and _HEADER_SECTION.fullmatch(section) is None):
            raise _Invalid(self._error_status, "malformed header section")
        headers: Headers = _HEADER_LINE.findall(section)
        facts = _NO_FACTS
        for name, value in headers:
            # Only five header names decide framing; skip the rest without lowering them.
            if len(name) in _FACT_LENGTHS and (lname := name.lower()) in _FACT_NAMES:
                if facts is _NO_FACTS:
                    facts = _HeadFacts()
                _note(facts, lname, value, self._error_status)
        return start, headers, facts

    def _begin_body(self, framing: Framing, length: int | None, events: list[Event]) -> None:
        if framing is Framing.CHUNKED:
            self._state = _S.CHUNK_SIZE
        elif framing is Framing.UNTIL_CLOSE:
            self._state = _S.UNTIL_CLOSE
        elif framing is Framing.CONTENT_LENGTH and length:
            self._state, self._remaining = _S.BODY, length
        else:
            self._message_end(events)

    def _message_end(self, events: list[Event], trailers: Headers | None = None) -> None:
        events.append(END if trailers is None else MessageEnd(trailers))
        self._state = _S.HEAD if self._keep_alive else _S.CLOSED

    # --- handlers: the transition table is _step --------------------------------

    def _step(self, data: bytes, pos: int, events: list[Event]) -> int:  # noqa: PLR0911 - the table
        """The current state's handler (a branch per state, not a dict of bound methods:
        those would tie every parser into a reference cycle only the collector frees)."""
        state = self._state
        if state is _S.HEAD:
            return self._on_head(data, pos, events)
        if state is _S.BODY:
            return self._on_body(data, pos, events)
        if state is _S.CHUNK_SIZE:
            return self._on_chunk_size(data, pos, events)
        if state is _S.CHUNK_DATA:
            return self._on_chunk_data(data, pos, events)
        if state is _S.CHUNK_CRLF:
            return self._on_chunk_crlf(data, pos, events)
        if state is _S.TRAILERS:
            return self._on_trailers(data, pos, events)
        if state is _S.UNTIL_CLOSE:
            return self._on_until_close(data, pos, events)
        return self._on_paused(data, pos, events)

    def _on_head(self, data: bytes, pos: int, events: list[Event]) -> int:  # pragma: no cover
        raise NotImplementedError

    def _on_body(self, data: bytes, pos: int, events: list[Event]) -> int:
        take = min(self._remaining, len(data) - pos)
        events.append(BodyData(_view(data, pos, pos + take)))
        self._remaining -= take
        if self._remaining == 0:
            self._message_end(events)
        return pos + take

    def _on_chunk_size(self, data: bytes, pos: int, events: list[Event]) -> int:
        idx = data.find(b"\r\n", pos, pos + MAX_CHUNK_LINE)
        if idx < 0:
            if len(data) - pos >= MAX_CHUNK_LINE:
                events.append(self._fail(self._error_status, "chunk size line too long"))
                return len(data)
            return self._wait(data, pos, events)
        size_field = data[pos:idx].partition(b";")[0].rstrip(b" \t")
        if _CHUNK_SIZE.fullmatch(size_field) is None:
            events.append(self._fail(self._error_status, "bad chunk size"))
            return len(data)
        size = int(size_field, 16)
        if size == 0:
            self._state = _S.TRAILERS
        else:
            self._state, self._remaining = _S.CHUNK_DATA, size
        return idx + 2

    def _on_chunk_data(self, data: bytes, pos: int, events: list[Event]) -> int:
        take = min(self._remaining, len(data) - pos)
        if self.decode_chunked:
            events.append(BodyData(_view(data, pos, pos + take)))
        self._remaining -= take
        if self._remaining == 0:
            self._state = _S.CHUNK_CRLF
        return pos + take

    def _on_chunk_crlf(self, data: bytes, pos: int, events: list[Event]) -> int:
        if data.startswith(b"\r\n", pos):
            self._state = _S.CHUNK_SIZE
            return pos + 2
        if pos + 1 == len(data) and data[pos] == 0x0D:
            return self._wait(data, pos, events)
        events.append(self._fail(self._error_status, "chunk data not followed by CRLF"))
        return len(data)

    def _on_trailers(self, data: bytes, pos: int, events: list[Event]) -> int:
        trailers: Headers = []
        if data.startswith(b"\r\n", pos):
            end = pos + 2
        else:
            idx = data.find(b"\r\n\r\n", pos)
            if idx < 0:
                if len(data) - pos > self.max_head:
                    events.append(self._fail(self._error_status, "trailers too large"))
                    return len(data)
                return self._wait(data, pos, events)
            end = idx + 4
            try:
                _, trailers, _ = self._split_head(b"trailers\r\n" + data[pos:idx])
            except _Invalid as exc:
                events.append(self._fail(exc.status, exc.reason))
                return len(data)
        self._flush_raw(data, end, events)
        self._message_end(events, trailers if self.decode_chunked else None)
        return end

    def _on_until_close(self, data: bytes, pos: int, events: list[Event]) -> int:
        events.append(BodyData(_view(data, pos, len(data))))
        return len(data)

    def _on_paused(self, data: bytes, pos: int, events: list[Event]) -> int:  # noqa: ARG002
        self._stash = data[pos:]
        return len(data)


def _view(data: bytes, start: int, end: int) -> bytes | memoryview:
    if start == 0 and end == len(data):
        return data
    return memoryview(data)[start:end]


def _note(facts: _HeadFacts, lname: bytes, value: bytes, status: int) -> None:
    """Record the headers that decide framing and connection handling."""
    if lname == b"content-length":
        for raw_part in value.split(b","):
            part = raw_part.strip(b" \t")
            if not part.isdigit() or len(part) > 18:
                raise _Invalid(status, "bad content-length")
            n = int(part)
            if facts.content_length is not None and facts.content_length != n:
                raise _Invalid(status, "conflicting content-length values")
            facts.content_length = n
    elif lname == b"transfer-encoding":
        facts.transfer_encoding = True
        codings = [c.strip(b" \t").lower() for c in value.split(b",")]
        if facts.chunked or b"chunked" in codings[:-1]:
            raise _Invalid(status, "chunked is not the final transfer coding")
        facts.chunked = codings[-1] == b"chunked"
    elif lname == b"connection":
        tokens = {t.strip(b" \t").lower() for t in value.split(b",")}
        facts.conn_tokens = facts.conn_tokens | tokens if facts.conn_tokens else frozenset(tokens)
    elif lname == b"upgrade":
        facts.upgrade = value
    else:  # expect
        facts.expect_continue = value.lower() == b"100-continue"


def _version(raw: bytes, bad: int, unsupported: int) -> bytes:
    if raw == b"HTTP/1.1":
        return b"1.1"
    if raw == b"HTTP/1.0":
        return b"1.0"
    if _ANY_VERSION.fullmatch(raw):
        raise _Invalid(unsupported, f"unsupported version {raw!r}")
    raise _Invalid(bad, f"bad HTTP version {raw[:16]!r}")


def _keep_alive(version: bytes, tokens: frozenset[bytes]) -> bool:
    if b"close" in tokens:
        return False
    return version == b"1.1" or b"keep-alive" in tokens


# Parsed heads by their bytes (a pure function of them): clients and servers repeat the
# same heads, so most parses are one dict lookup. Bounded. A hit returns the cached head
# object itself: heads and their header lists are never mutated (see "Events" above).
_CACHE_BLOCK_MAX: Final = 2048
_CACHE_ENTRIES_MAX: Final = 256
_REQUEST_HEADS: Final[dict[bytes, RequestHead]] = {}
# Responses by head bytes, one table for answers to HEAD (index 1) and one for the rest (0).
_RESPONSE_HEADS: Final[tuple[dict[bytes, ResponseHead], dict[bytes, ResponseHead]]] = ({}, {})


class RequestParser(_Parser):
    """Parses the requests a client sends."""

    def __init__(self, *, decode_chunked: bool = False, max_head: int = MAX_HEAD_BYTES) -> None:
        super().__init__(decode_chunked=decode_chunked, max_head=max_head)
        self._switching = False  # the current request asks to upgrade or CONNECT
        # The last head `whole` returned and its bytes with the blank line: a client
        # repeating its request is answered by one comparison (no search, slice or hash).
        self._last: RequestHead | None = None
        self._last_block = b""

    def whole(self, data: Input) -> RequestHead | None:
        """The head when `data` is exactly one whole request whose head was parsed before.

        "Whole": without a body, or with all of its Content-Length body here (a POST's
        usual read), not asking to switch protocols. The parser moves past it; the body
        is `data[len(head.raw) + 4:]` (`whole_request_events`). None otherwise, with nothing
        consumed: `feed` the data.
        """
        if self._state is not _S.HEAD or self._stash or type(data) is not bytes:
            return None
        hit = self._last
        block = self._last_block
        if hit is None or not data.startswith(block):
            idx = data.find(b"\r\n\r\n")
            if idx <= 0 or idx > self.max_head:
                return None
            hit = _REQUEST_HEADS.get(data[:idx])
            if hit is None or hit.upgrade is not None or hit.method == b"CONNECT":
                return None
            block = data if idx + 4 == len(data) else data[: idx + 4]
            self._last = hit
            self._last_block = block
        if not _body_all_here(hit.framing, hit.content_length, len(data) - len(block)):
            return None
        keep = hit.keep_alive
        self._keep_alive = keep
        self._switching = False
        if not keep:
            self._state = _S.CLOSED
        return hit

    def feed(self, data: Input) -> list[Event]:
        """Parse more input; returns the events it completes. Never raises."""
        if type(data) is bytes:
            hit = self.whole(data)
            if hit is not None:
                return whole_request_events(hit, data)
        return super().feed(data)

    def upgrade_accepted(self) -> bytes:
        """The server switched protocols: returns buffered bytes, the start of the tunnel."""
        data, self._stash = self._stash, b""
        self._state = _S.SWITCHED
        return data

    def upgrade_declined(self) -> list[Event]:
        """The server did not switch: parse what was buffered as further requests."""
        self._switching = False
        if self._state is not _S.PAUSED:
            return []
        self._state = _S.HEAD if self._keep_alive else _S.CLOSED
        data, self._stash = self._stash, b""
        return self.feed(data) if data else []

    def _on_head(self, data: bytes, pos: int, events: list[Event]) -> int:
        start, end = self._find_head(data, pos, events)
        if end < 0:
            return len(data)
        try:
            head = self._request_head(data[start : end - 4])
        except _Invalid as exc:
            events.append(self._fail(exc.status, exc.reason))
            return len(data)
        events.append(head)
        self._keep_alive = head.keep_alive
        self._switching = head.upgrade is not None or head.method == b"CONNECT"
        self._begin_body(head.framing, head.content_length, events)
        return end

    def _message_end(self, events: list[Event], trailers: Headers | None = None) -> None:
        super()._message_end(events, trailers)
        if self._switching:
            self._state = _S.PAUSED

    def _request_head(self, block: bytes) -> RequestHead:
        hit = _REQUEST_HEADS.get(block)
        if hit is not None:
            return hit
        head = self._parse_request_head(block)
        head.raw = block
        if len(block) <= _CACHE_BLOCK_MAX:
            if len(_REQUEST_HEADS) >= _CACHE_ENTRIES_MAX:
                _REQUEST_HEADS.clear()
            _REQUEST_HEADS[block] = head
        return head

    def _parse_request_head(self, block: bytes) -> RequestHead:
        start, headers, facts = self._split_head(block)
        parts = start.split(b" ")
        if len(parts) != 3 or _TOKEN.fullmatch(parts[0]) is None or not parts[1]:
            raise _Invalid(400, f"bad request line {start[:60]!r}")
        method, target, raw_version = parts
        if _CTL.search(target):
            raise _Invalid(400, "control character in request target")
        version = _version(raw_version, 400, 505)
        if facts.transfer_encoding:
            if facts.content_length is not None:
                raise _Invalid(400, "both transfer-encoding and content-length")
            if version == b"1.0" or not facts.chunked:
                raise _Invalid(400, "request transfer-encoding must end in chunked (HTTP/1.1)")
            framing = Framing.CHUNKED
        elif facts.content_length is not None:
            framing = Framing.CONTENT_LENGTH
        else:
            framing = Framing.NONE
        upgrade = facts.upgrade if b"upgrade" in facts.conn_tokens else None
        return RequestHead(
            method=method,
            target=target,
            version=version,
            headers=headers,
            keep_alive=_keep_alive(version, facts.conn_tokens),
            framing=framing,
            content_length=facts.content_length,
            upgrade=upgrade,
            expect_continue=facts.expect_continue,
        )


@dataclass(slots=True, frozen=True)
class _Pending:
    method: bytes
    upgrade: bool
    plain: bool  # neither an upgrade nor CONNECT: the response cannot switch protocols
    is_head: bool  # the response has no body whatever its framing says


_PENDING: Final[dict[bytes, _Pending]] = {}  # by method, for requests asking no upgrade (immutable)


class ResponseParser(_Parser):
    """Parses the responses a server sends; tell it each request with `expect`."""

    _error_status = 502
    _too_large = 502

    def __init__(self, *, decode_chunked: bool = False, max_head: int = MAX_HEAD_BYTES) -> None:
        super().__init__(decode_chunked=decode_chunked, max_head=max_head)
        # The requests sent, oldest first. A list, not a deque: its append and `del [0]`
        # are compiled to C calls, the deque's were method calls by name, two per
        # request (agent.native rule 12); a connection has few requests in flight.
        self._pending: list[_Pending] = []
        # The last head `whole` found (answering HEAD or not) and its bytes with the blank
        # line: a server repeating its head is recognised by one prefix comparison.
        self._last: ResponseHead | None = None
        self._last_is_head = False
        self._last_block = b""

    def expect(self, method: bytes, *, upgrade: bool = False) -> None:
        """A request was sent; its response comes after those already expected."""
        pend = None if upgrade else _PENDING.get(method)
        if pend is None:
            pend = _Pending(
                method, upgrade, not upgrade and method != b"CONNECT", method == b"HEAD"
            )
            if not upgrade and len(_PENDING) < _CACHE_ENTRIES_MAX:
                _PENDING[method] = pend
        self._pending.append(pend)

    def whole(self, data: Input) -> ResponseHead | None:
        """The head when `data` is exactly one whole final response whose head was seen before.

        "Whole": without a body, or with all of its Content-Length body here, answering a
        request that is neither CONNECT nor an upgrade. The parser moves past it; the body
        is `data[len(head.raw) + 4:]`. None otherwise, with nothing consumed: `feed` it.
        """
        pending = self._pending
        if self._state is not _S.HEAD or self._stash or not pending or type(data) is not bytes:
            return None
        request = pending[0]
        if not request.plain:
            return None
        hit = self._last
        if (
            hit is not None
            and request.is_head == self._last_is_head
            and data.startswith(self._last_block)
        ):
            idx = len(hit.raw)
        else:
            idx = data.find(b"\r\n\r\n")
            if idx <= 0 or idx > self.max_head:
                return None
            hit = _RESPONSE_HEADS[request.is_head].get(data[:idx])
            if hit is None or hit.status < 200:
                return None
            self._last = hit
            self._last_is_head = request.is_head
            self._last_block = data[: idx + 4]
        if not _body_all_here(hit.framing, hit.content_length, len(data) - idx - 4):
            return None
        del pending[0]
        keep = hit.keep_alive
        self._keep_alive = keep
        if not keep:
            self._state = _S.CLOSED
        return hit

    def feed(self, data: Input) -> list[Event]:
        """Parse more input; returns the events it completes. Never raises."""
        if type(data) is bytes:
            hit = self.whole(data)
            if hit is not None:
                return whole_events(hit, data)
        return super().feed(data)

    def _on_head(self, data: bytes, pos: int, events: list[Event]) -> int:  # noqa: PLR0911 - one exit per outcome
        start, end = self._find_head(data, pos, events)
        if end < 0:
            return len(data)
        if not self._pending:
            events.append(self._fail(502, "response without a request"))
            return len(data)
        request = self._pending[0]
        try:
            head = self._response_head(data[start : end - 4], request.method)
        except _Invalid as exc:
            events.append(self._fail(exc.status, exc.reason))
            return len(data)
        status = head.status
        if status < 200 and status != 101:  # interim: the final response still comes
            events.append(head)
            events.append(MessageEnd())
            return end
        del self._pending[0]
        if status == 101 or (request.method == b"CONNECT" and status < 300):
            if status == 101 and not request.upgrade:
                events.append(self._fail(502, "101 without an upgrade request"))
                return len(data)
            events.append(head)
            events.append(MessageEnd())
            events.append(Upgraded(data[end:]))
            self._state = _S.SWITCHED
            return len(data)
        events.append(head)
        self._keep_alive = head.keep_alive
        self._begin_body(head.framing, head.content_length, events)
        return end

    def _response_head(self, block: bytes, method: bytes) -> ResponseHead:
        table = _RESPONSE_HEADS[method == b"HEAD"]  # the only use of the method below
        hit = table.get(block)
        if hit is not None:
            return hit
        head = self._parse_response_head(block, method)
        if len(block) <= _CACHE_BLOCK_MAX:
            if len(table) >= _CACHE_ENTRIES_MAX:
                table.clear()
            table[block] = head
        return head

    def _parse_response_head(self, block: bytes, method: bytes) -> ResponseHead:
        start, headers, facts = self._split_head(block)
        raw_version, _, rest = start.partition(b" ")
        code, _, reason = rest.partition(b" ")
        version = _version(raw_version, 502, 502)
        if len(code) != 3 or not code.isdigit() or code[:1] == b"0":
            raise _Invalid(502, f"bad status line {start[:60]!r}")
        status = int(code)
        content_length = facts.content_length
        if status < 200 or status in (204, 304) or method == b"HEAD":
            framing = Framing.NONE
        elif facts.transfer_encoding:
            framing = Framing.CHUNKED if facts.chunked else Framing.UNTIL_CLOSE
            content_length = None  # transfer-encoding overrides a length
        elif content_length is not None:
            framing = Framing.CONTENT_LENGTH
        else:
            framing = Framing.UNTIL_CLOSE
        keep_alive = framing is not Framing.UNTIL_CLOSE and _keep_alive(version, facts.conn_tokens)
        return ResponseHead(
            status=status,
            reason=reason,
            version=version,
            headers=headers,
            keep_alive=keep_alive,
            framing=framing,
            content_length=content_length,
            raw=block,
        )


def _body_all_here(framing: Framing, length: int | None, rest: int) -> bool:
    """Whether the `rest` bytes after a head are exactly its message's body (`whole`):
    none without a body, all `length` of a Content-Length one."""
    if framing is Framing.NONE:
        return rest == 0
    # `length` narrowed first: compared as `int | None`, the compare was generic
    return framing is Framing.CONTENT_LENGTH and length is not None and rest == length


def whole_events(head: ResponseHead, data: bytes) -> list[Event]:
    """The events of a whole response `data` that `ResponseParser.whole` returned `head` for."""
    return _whole(head, len(head.raw) + 4, data)


def whole_request_events(head: RequestHead, data: bytes) -> list[Event]:
    """The events of a whole request `data` that `RequestParser.whole` returned `head` for."""
    return _whole(head, len(head.raw) + 4, data)


def _whole(head: Event, end: int, data: bytes) -> list[Event]:
    if len(data) > end:
        return [head, BodyData(memoryview(data)[end:]), END]
    return [head, END]
