"""The state of one HTTP/2 connection that agent.proxy.h2codec's halves share.

`CodecState` holds the settings, windows and streams, and what both the receiving half
(agent.proxy.h2recv) and the sending half (`h2codec.H2Codec`) need of them; the rules are
h2codec's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final

from agent.proxy import h2frame as f
from agent.proxy.h2events import H2ConnectionError, H2StreamClosedError
from agent.proxy.h2hpack import Decoder, Encoder

if TYPE_CHECKING:
    from agent.proxy.h2frame import ErrorCode

MAX_HEADER_LIST: Final = 64 * 1024  # decoded size we accept (advertised), as nghttp2's default
MAX_HEADER_BLOCK: Final = 256 * 1024  # encoded bytes across CONTINUATIONs before we give up


class StreamError(Exception):
    """A stream error (h2codec rule 2): RST_STREAM `code` for stream `sid`."""

    def __init__(self, sid: int, code: ErrorCode, reason: str) -> None:
        self.sid = sid
        self.code = code
        super().__init__(reason)


class Stream:
    """What the codec knows of one open stream: windows, ends, the peer's headers and
    content-length."""

    __slots__ = (
        "bodiless",
        "expect",
        "got",
        "head",
        "local_ended",
        "owed",
        "recv",
        "remote_ended",
        "send",
    )

    def __init__(self, send: int, recv: int) -> None:
        self.send = send  # what we may still send
        self.recv = recv  # what the peer may still send
        self.owed = 0  # consumed, not yet handed back by WINDOW_UPDATE
        self.local_ended = False
        self.remote_ended = False
        self.head = False  # the peer's (final) headers arrived
        self.expect: int | None = None  # the peer's content-length
        self.bodiless = False  # client: a HEAD request, its response has no body
        self.got = 0


class CodecState:
    """One HTTP/2 connection's protocol state (agent.proxy.h2codec's rules)."""

    def __init__(
        self, *, client_side: bool, stream_window: int, conn_window: int, max_streams: int
    ) -> None:
        self.client_side = client_side
        self._stream_window = stream_window
        self._conn_window = conn_window
        self._max_streams = max_streams
        self._out = bytearray()
        self._in = b""
        self._preface = not client_side  # server: the client preface is still due
        self._settled = False  # the peer's first SETTINGS arrived
        self._dead: H2ConnectionError | None = None
        self._streams: dict[int, Stream] = {}
        self._next_sid = 1 if client_side else 2
        self._last_peer_sid = 0
        self._send_conn = f.DEFAULT_WINDOW
        # Until they see ours, peers assume the RFC's initial windows (RFC 9113 6.9.2):
        self._recv_conn = max(conn_window, f.DEFAULT_WINDOW)
        self._recv_initial = max(stream_window, f.DEFAULT_WINDOW)
        self._owed_conn = 0
        self._peer_window = f.DEFAULT_WINDOW
        self.max_outbound_frame_size = f.DEFAULT_MAX_FRAME
        self.remote_max_streams = f.MAX_WINDOW
        self.going_away = False  # the peer sent GOAWAY: open no more streams
        self._block: bytearray | None = None  # a header block awaiting CONTINUATION
        self._block_sid = 0
        self._block_end = False
        self._encoder = Encoder()
        self._decoder = Decoder(max_list=MAX_HEADER_LIST)
        # The last header list checked (as a request, or as a response) and what the
        # checks found: a repeated block decodes to the same list (h2hpack rule 6).
        self._checked: tuple[list[tuple[bytes, bytes]], str | None, int | None] | None = None
        self._windowed = False

    # --- shared by both halves ---------------------------------------------------------------

    def acknowledge(self, sid: int, size: int) -> None:
        """`size` received bytes were consumed: hand the windows back (rule 3)."""
        if self._dead is not None or size <= 0:
            return
        self._owed_conn += size
        if self._owed_conn >= self._conn_window // 2:
            self._recv_conn += self._owed_conn
            self._out += f.frame(f.WINDOW_UPDATE, 0, 0, self._owed_conn.to_bytes(4, "big"))
            self._owed_conn = 0
        st = self._streams.get(sid)
        if st is None or st.remote_ended:
            return
        st.owed += size
        if st.owed >= self._stream_window // 2:
            st.recv += st.owed
            self._out += f.frame(f.WINDOW_UPDATE, 0, sid, st.owed.to_bytes(4, "big"))
            st.owed = 0

    def _open(self, sid: int) -> Stream:
        self._alive()
        st = self._streams.get(sid)
        if st is None or st.local_ended:
            raise H2StreamClosedError(sid)
        return st

    def _alive(self) -> None:
        if self._dead is not None:
            raise self._dead

    def _local_end(self, sid: int, st: Stream) -> None:
        st.local_ended = True
        if st.remote_ended:
            self._streams.pop(sid, None)

    def _goaway(self, code: ErrorCode) -> None:
        payload = self._last_peer_sid.to_bytes(4, "big") + int(code).to_bytes(4, "big")
        self._out += f.frame(f.GOAWAY, 0, 0, payload)

    def _idle(self, sid: int) -> bool:
        """Whether `sid` was never opened (by either side)."""
        if (sid & 1) == self.client_side:  # one of ours: client odd, server even
            return sid >= self._next_sid
        return sid > self._last_peer_sid
