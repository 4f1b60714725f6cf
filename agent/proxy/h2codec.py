"""A lean HTTP/2 connection (RFC 9113), sans-I/O: bytes in, events out, frames queued.

What the per-stream proxy (agent.proxy.h2conn) needs of h2, and no more: streams,
flow control, settings, PING, RST_STREAM, GOAWAY, HPACK (agent.proxy.h2hpack), and
the checks of received headers (agent.proxy.h2frame). It replaces hyper-h2, whose
frame objects, per-stream state machines and event classes were about 70% of a
proxied stream's cost (bench/RESULTS.md).

Rules:
1. `receive(data)` returns the events of every complete frame in `data`, in order.
   A connection error (RFC 9113 5.4.1) queues GOAWAY and raises `H2ConnectionError`;
   the codec is then dead (every later call raises it again).
2. A stream error (malformed headers, a body longer or shorter than its
   content-length, DATA past END_STREAM, a stream window overrun) queues RST_STREAM
   and, when the caller knows the stream, yields `StreamReset` for it. A request the
   caller never saw (malformed, or past our MAX_CONCURRENT_STREAMS: REFUSED_STREAM)
   is reset without an event. Header blocks are always decoded, so HPACK stays in step.
3. Flow control: what the peer may send is bounded by our windows; the caller returns
   what it consumed with `acknowledge(sid, n)`, and a WINDOW_UPDATE goes out once half
   a window is owed. DATA for a stream the codec already forgot is credited back to
   the connection at once. `window(sid)` is what we may send now; `send_data` past it,
   or past `max_outbound_frame_size`, is a bug (AssertionError).
4. A stream is forgotten once both sides ended it or it was reset either way;
   calls on a forgotten stream raise `H2StreamClosedError`.
5. Frames queue in one buffer in call order; `data_to_send()` takes them.
6. One `WindowUpdated` per `receive` call at most, when any send window grew.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from agent.proxy import h2frame as f
from agent.proxy.h2events import H2StreamClosedError
from agent.proxy.h2frame import ErrorCode
from agent.proxy.h2recv import Receiver
from agent.proxy.h2state import MAX_HEADER_LIST, Stream

if TYPE_CHECKING:
    from agent.proxy.h2events import Headers


class H2Codec(Receiver):
    """One HTTP/2 connection's protocol state; see the module rules. Receiving is
    agent.proxy.h2recv's, the state both halves share agent.proxy.h2state's."""

    # --- starting and ending -------------------------------------------------------------

    def initiate(self) -> None:
        """Queue the preface (client), our SETTINGS and the connection window's growth."""
        settings = {
            f.INITIAL_WINDOW_SIZE: self._stream_window,
            f.MAX_CONCURRENT_STREAMS: self._max_streams,
            f.MAX_HEADER_LIST_SIZE: MAX_HEADER_LIST,
        }
        if self.client_side:
            settings[f.ENABLE_PUSH] = 0
            self._out += f.PREFACE
        self._out += f.frame(f.SETTINGS, 0, 0, f.settings_payload(settings))
        if self._conn_window > f.DEFAULT_WINDOW:
            grow = (self._conn_window - f.DEFAULT_WINDOW).to_bytes(4, "big")
            self._out += f.frame(f.WINDOW_UPDATE, 0, 0, grow)

    def close(self, code: ErrorCode = ErrorCode.NO_ERROR) -> None:
        """Queue GOAWAY (no-op once dead)."""
        if self._dead is None:
            self._goaway(code)

    def data_to_send(self) -> bytes:
        out = bytes(self._out)
        self._out.clear()
        return out

    # --- sending ----------------------------------------------------------------------------

    def open_stream(self, headers: Headers, *, end: bool) -> int:
        """Client side: a new stream carrying the request `headers`; its id.

        Raises:
            H2StreamClosedError: no stream can be opened (GOAWAY, ids exhausted, dead).
            H2ConnectionError: the connection is dead.
        """
        self._alive()
        sid = self._next_sid
        if self.going_away or sid > f.SID_MASK:
            raise H2StreamClosedError(sid)
        self._next_sid += 2
        st = self._streams[sid] = Stream(self._peer_window, self._recv_initial)
        st.bodiless = _is_head(headers)
        self.send_headers(sid, headers, end=end)
        return sid

    def send_headers(self, sid: int, headers: Headers, *, end: bool) -> None:
        """Queue headers (or trailers with `end`) on an open stream.

        Raises:
            H2StreamClosedError: the stream is forgotten or our side already ended.
            H2ConnectionError: the connection is dead.
        """
        st = self._open(sid)
        block = self._encoder.encode(headers)
        limit = self.max_outbound_frame_size
        flags = f.END_STREAM if end else 0
        if len(block) <= limit:
            self._out += f.frame(f.HEADERS, flags | f.END_HEADERS, sid, block)
        else:
            chunks = [block[i : i + limit] for i in range(0, len(block), limit)]
            self._out += f.frame(f.HEADERS, flags, sid, chunks[0])
            for chunk in chunks[1:-1]:
                self._out += f.frame(f.CONTINUATION, 0, sid, chunk)
            self._out += f.frame(f.CONTINUATION, f.END_HEADERS, sid, chunks[-1])
        if end:
            self._local_end(sid, st)

    def new_stream_window(self) -> int:
        """What a stream opened now may send in one DATA frame (rule 3): its initial
        window, the connection's, one frame's size."""
        return min(self._peer_window, self._send_conn, self.max_outbound_frame_size)

    def window(self, sid: int) -> int:
        """What may be sent on `sid` now (rule 3).

        Raises:
            H2StreamClosedError: the stream is forgotten or our side already ended.
            H2ConnectionError: the connection is dead.
        """
        st = self._open(sid)
        return min(st.send, self._send_conn)

    def send_data(self, sid: int, data: bytes, *, end: bool) -> None:
        """Queue one DATA frame within `window(sid)` (rule 3).

        Raises:
            H2StreamClosedError: the stream is forgotten or our side already ended.
            H2ConnectionError: the connection is dead.
        """
        st = self._open(sid)
        size = len(data)
        if size > st.send or size > self._send_conn or size > self.max_outbound_frame_size:
            msg = f"BUG: {size} bytes past the window of stream {sid}"
            raise AssertionError(msg)
        st.send -= size
        self._send_conn -= size
        out = self._out
        out += f.frame_head(size, f.DATA, f.END_STREAM if end else 0, sid)
        out += data
        if end:
            self._local_end(sid, st)

    def end_stream(self, sid: int) -> None:
        """Queue an empty DATA with END_STREAM.

        Raises:
            H2StreamClosedError: the stream is forgotten or our side already ended.
            H2ConnectionError: the connection is dead.
        """
        st = self._open(sid)
        self._out += f.frame(f.DATA, f.END_STREAM, sid)
        self._local_end(sid, st)

    def reset_stream(self, sid: int, code: int) -> None:
        """Queue RST_STREAM and forget the stream.

        Raises:
            H2StreamClosedError: the stream is already forgotten.
            H2ConnectionError: the connection is dead.
        """
        self._alive()
        if self._streams.pop(sid, None) is None:
            raise H2StreamClosedError(sid)
        self._out += f.frame(f.RST_STREAM, 0, sid, code.to_bytes(4, "big"))


def _is_head(headers: Headers) -> bool:
    """Whether request `headers` say `:method: HEAD`, read from the pseudo-header fields
    only: they come first (RFC 9113 8.3), so the scan stops at the first regular one."""
    for name, value in headers:
        if name == b":method":
            return value == b"HEAD"
        if not name.startswith(b":"):
            return False
    return False
