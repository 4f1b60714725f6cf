"""What agent.proxy.h2codec reports: its events (past-tense facts, in frame order) and
its two errors (a dead connection, a closed stream).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from agent.proxy.h2frame import ErrorCode

Headers = list[tuple[bytes, bytes]]


class H2ConnectionError(Exception):
    """The connection failed (rule 1): GOAWAY with `code` is queued."""

    def __init__(self, code: ErrorCode, reason: str) -> None:
        self.code = code
        self.reason = reason
        super().__init__(f"h2 connection error {code.name}: {reason}")


class H2StreamClosedError(Exception):
    """The stream is forgotten (rule 4), or cannot be opened."""

    def __init__(self, sid: int) -> None:
        self.sid = sid
        super().__init__(f"h2 stream {sid} is closed")


# --- events -------------------------------------------------------------------------


# The four made per frame write their `__init__` (agent.native rule 5).


@dataclass(slots=True, init=False)
class RequestReceived:
    sid: int
    headers: Headers
    end: bool

    def __init__(self, sid: int, headers: Headers, end: bool) -> None:
        self.sid = sid
        self.headers = headers
        self.end = end


@dataclass(slots=True, init=False)
class ResponseReceived:
    sid: int
    headers: Headers
    end: bool

    def __init__(self, sid: int, headers: Headers, end: bool) -> None:
        self.sid = sid
        self.headers = headers
        self.end = end


@dataclass(slots=True, init=False)
class TrailersReceived:
    sid: int
    headers: Headers

    def __init__(self, sid: int, headers: Headers) -> None:
        self.sid = sid
        self.headers = headers


@dataclass(slots=True, init=False)
class DataReceived:
    sid: int
    data: bytes
    flow: int  # flow-controlled length, padding included: what to acknowledge
    end: bool

    def __init__(self, sid: int, data: bytes, flow: int, end: bool) -> None:
        self.sid = sid
        self.data = data
        self.flow = flow
        self.end = end


@dataclass(slots=True)
class StreamReset:
    sid: int
    code: int


@dataclass(slots=True)
class WindowUpdated:
    pass


@dataclass(slots=True)
class ConnectionTerminated:
    last_sid: int
    code: int


Event = (
    RequestReceived
    | ResponseReceived
    | TrailersReceived
    | DataReceived
    | StreamReset
    | WindowUpdated
    | ConnectionTerminated
)
