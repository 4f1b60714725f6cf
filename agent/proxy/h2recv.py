"""The receiving half of agent.proxy.h2codec: frames in, events out (its rules 1-4, 6).

`Receiver.receive` splits what arrived into frames, checks them and their headers
(agent.proxy.h2frame), decodes header blocks (agent.proxy.h2hpack) and turns each into
events (agent.proxy.h2events); what it answers (SETTINGS and PING acknowledgements,
RST_STREAM, GOAWAY) is queued with the sending half's frames.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final

from agent.proxy import h2frame as f
from agent.proxy.h2events import (
    ConnectionTerminated,
    DataReceived,
    Event,
    H2ConnectionError,
    RequestReceived,
    ResponseReceived,
    StreamReset,
    TrailersReceived,
    WindowUpdated,
)
from agent.proxy.h2frame import ErrorCode
from agent.proxy.h2hpack import HpackError, HpackTooLargeError
from agent.proxy.h2state import MAX_HEADER_BLOCK, CodecState, Stream, StreamError

if TYPE_CHECKING:
    from collections.abc import Callable

    from agent.proxy.h2events import Headers

_NO_BODY_STATUS: Final = (b"204", b"304")
_WINDOW_UPDATED: Final = WindowUpdated()


class Receiver(CodecState):
    """What the codec does with received bytes; see agent.proxy.h2codec's rules."""

    def receive(self, data: bytes) -> list[Event]:
        """The events of every complete frame received so far (rules 1, 2, 6).

        Raises:
            H2ConnectionError: the peer broke the protocol; GOAWAY is queued.
        """
        self._alive()
        if self._in:
            data = self._in + data
            self._in = b""
        events: list[Event] = []
        self._windowed = False
        try:
            pos = self._frames(data, events)
        except H2ConnectionError as exc:
            self._dead = exc
            self._goaway(exc.code)
            raise
        if pos < len(data):
            self._in = data[pos:]
        if self._windowed:
            events.append(_WINDOW_UPDATED)
        return events

    def _frames(self, data: bytes, events: list[Event]) -> int:
        """Handle every complete frame of `data`; the offset of the first incomplete one."""
        pos = 0
        if self._preface:
            if len(data) < len(f.PREFACE):
                if not f.PREFACE.startswith(data):
                    raise H2ConnectionError(ErrorCode.PROTOCOL_ERROR, "no client preface")
                return 0
            if not data.startswith(f.PREFACE):
                raise H2ConnectionError(ErrorCode.PROTOCOL_ERROR, "no client preface")
            self._preface = False
            pos = len(f.PREFACE)
        end = len(data)
        while end - pos >= f.HEADER_SIZE:
            # The 9-byte header read byte by byte: compiled, each is a C read of a small
            # int, where `Struct.unpack_from` is a generic call returning a tuple of objects.
            size = (data[pos] << 16) | (data[pos + 1] << 8) | data[pos + 2]
            ftype = data[pos + 3]
            flags = data[pos + 4]
            sid = (
                ((data[pos + 5] & 0x7F) << 24)
                | (data[pos + 6] << 16)
                | (data[pos + 7] << 8)
                | data[pos + 8]
            )
            if size > f.DEFAULT_MAX_FRAME:
                raise H2ConnectionError(ErrorCode.FRAME_SIZE_ERROR, f"frame of {size} bytes")
            if end - pos - f.HEADER_SIZE < size:
                break
            start = pos + f.HEADER_SIZE
            pos = start + size
            payload = data[start:pos]
            try:
                self._frame(ftype, flags, sid, payload, events)
            except StreamError as err:
                self._stream_error(err, events)
        return pos

    def _frame(  # noqa: C901, PLR0912 - the dispatch table
        self, ftype: int, flags: int, sid: int, payload: bytes, events: list[Event]
    ) -> None:
        if self._block is not None and ftype != f.CONTINUATION:
            raise H2ConnectionError(ErrorCode.PROTOCOL_ERROR, "header block interrupted")
        if not self._settled and ftype != f.SETTINGS:
            raise H2ConnectionError(ErrorCode.PROTOCOL_ERROR, "first frame is not SETTINGS")
        if ftype == f.DATA:
            self._data(flags, sid, payload, events)
        elif ftype == f.HEADERS:
            self._headers(flags, sid, payload, events)
        elif ftype == f.CONTINUATION:
            self._continuation(flags, sid, payload, events)
        elif ftype == f.WINDOW_UPDATE:
            self._window_update(sid, payload)
        elif ftype == f.RST_STREAM:
            self._rst_stream(sid, payload, events)
        elif ftype == f.SETTINGS:
            self._settings(flags, sid, payload)
        elif ftype == f.PING:
            self._ping(flags, sid, payload)
        elif ftype == f.GOAWAY:
            self._goaway_received(sid, payload, events)
        elif ftype == f.PRIORITY:
            if sid == 0:
                raise H2ConnectionError(ErrorCode.PROTOCOL_ERROR, "PRIORITY on stream 0")
            if len(payload) != 5:
                raise StreamError(sid, ErrorCode.FRAME_SIZE_ERROR, "PRIORITY size")
        elif ftype == f.PUSH_PROMISE:
            raise H2ConnectionError(ErrorCode.PROTOCOL_ERROR, "PUSH_PROMISE (push is off)")
        # unknown frame types are ignored (RFC 9113 5.5)

    def _stream_error(self, err: StreamError, events: list[Event]) -> None:
        self._out += f.frame(f.RST_STREAM, 0, err.sid, int(err.code).to_bytes(4, "big"))
        if self._streams.pop(err.sid, None) is not None:
            events.append(StreamReset(err.sid, err.code))

    # --- DATA ---------------------------------------------------------------------------------

    def _data(self, flags: int, sid: int, payload: bytes, events: list[Event]) -> None:
        if sid == 0:
            raise H2ConnectionError(ErrorCode.PROTOCOL_ERROR, "DATA on stream 0")
        flow = len(payload)
        self._recv_conn -= flow
        if self._recv_conn < 0:
            raise H2ConnectionError(ErrorCode.FLOW_CONTROL_ERROR, "connection window overrun")
        st = self._streams.get(sid)
        if st is None:
            if self._idle(sid):
                raise H2ConnectionError(ErrorCode.PROTOCOL_ERROR, f"DATA on idle stream {sid}")
            self.acknowledge(0, flow)  # a forgotten stream: its bytes go back at once
            return
        end = bool(flags & f.END_STREAM)
        try:
            data = self._accept_data(sid, st, payload, padded=bool(flags & f.PADDED), end=end)
        except StreamError:
            self.acknowledge(0, flow)  # nobody will consume it
            raise
        events.append(DataReceived(sid, data, flow, end))
        if end:
            st.remote_ended = True
            if st.local_ended:
                self._streams.pop(sid, None)

    @staticmethod
    def _accept_data(sid: int, st: Stream, payload: bytes, *, padded: bool, end: bool) -> bytes:
        """The body bytes of a DATA frame the stream may take (rule 2)."""
        data = _unpad(payload) if padded else payload
        if st.remote_ended:
            raise StreamError(sid, ErrorCode.STREAM_CLOSED, "DATA after END_STREAM")
        if not st.head:
            raise StreamError(sid, ErrorCode.PROTOCOL_ERROR, "DATA before the response")
        st.recv -= len(payload)
        if st.recv < 0:
            raise StreamError(sid, ErrorCode.FLOW_CONTROL_ERROR, "stream window overrun")
        st.got += len(data)
        if st.expect is not None and (st.got > st.expect or (end and st.got != st.expect)):
            raise StreamError(sid, ErrorCode.PROTOCOL_ERROR, "body and content-length")
        return data

    # --- HEADERS and CONTINUATION ----------------------------------------------------------

    def _headers(self, flags: int, sid: int, payload: bytes, events: list[Event]) -> None:
        if sid == 0:
            raise H2ConnectionError(ErrorCode.PROTOCOL_ERROR, "HEADERS on stream 0")
        padded = bool(flags & f.PADDED)
        block = _unpad(payload) if padded else payload
        if flags & f.PRIORITY_FLAG:
            if len(block) < 5:  # RFC 9113 6.2
                if padded and len(payload) >= 6:  # room for them: the padding ate them (6.1)
                    raise H2ConnectionError(ErrorCode.PROTOCOL_ERROR, "padding past the frame")
                raise H2ConnectionError(ErrorCode.FRAME_SIZE_ERROR, "HEADERS priority")
            block = block[5:]
        end = bool(flags & f.END_STREAM)
        if flags & f.END_HEADERS:
            self._header_block(sid, block, end, events)
        else:
            self._block = bytearray(block)
            self._block_sid = sid
            self._block_end = end

    def _continuation(self, flags: int, sid: int, payload: bytes, events: list[Event]) -> None:
        block = self._block
        if block is None or sid != self._block_sid:
            raise H2ConnectionError(ErrorCode.PROTOCOL_ERROR, "CONTINUATION out of place")
        block += payload
        if len(block) > MAX_HEADER_BLOCK:
            raise H2ConnectionError(ErrorCode.ENHANCE_YOUR_CALM, "header block too large")
        if flags & f.END_HEADERS:
            self._block = None
            self._header_block(sid, bytes(block), self._block_end, events)

    def _decode(self, block: bytes) -> Headers:
        try:
            return self._decoder.decode(block)
        except HpackError as exc:  # one clause: mypyc mistypes `exc` bound twice (#620)
            too_large = isinstance(exc, HpackTooLargeError)
            code = ErrorCode.ENHANCE_YOUR_CALM if too_large else ErrorCode.COMPRESSION_ERROR
            raise H2ConnectionError(code, str(exc)) from exc

    def _header_block(self, sid: int, block: bytes, end: bool, events: list[Event]) -> None:
        headers = self._decode(block)  # always: HPACK state must stay in step (rule 2)
        st = self._streams.get(sid)
        if st is not None:
            self._known_headers(sid, st, headers, end=end, events=events)
            return
        if self.client_side or (sid & 1) == 0:
            if self._idle(sid):
                raise H2ConnectionError(ErrorCode.PROTOCOL_ERROR, f"HEADERS on stream {sid}")
            return  # a stream we forgot: ignored
        if sid <= self._last_peer_sid:
            raise StreamError(sid, ErrorCode.STREAM_CLOSED, "HEADERS on a closed stream")
        self._last_peer_sid = sid
        if len(self._streams) >= self._max_streams:
            raise StreamError(sid, ErrorCode.REFUSED_STREAM, "too many streams")
        reason, expect = self._check(headers, f.check_request)
        if reason is not None or expect == -1 or (end and expect not in (None, 0)):
            raise StreamError(sid, ErrorCode.PROTOCOL_ERROR, reason or "content-length")
        st = Stream(self._peer_window, self._recv_initial)
        st.head = True
        st.expect = expect
        st.remote_ended = end
        self._streams[sid] = st
        events.append(RequestReceived(sid, headers, end))

    def _check(
        self, headers: Headers, check: Callable[[Headers], str | None]
    ) -> tuple[str | None, int | None]:
        """`check(headers)` and the content-length; a repeat of the last list is remembered
        (a request list never meets a response check: a connection's peer sends one kind)."""
        last = self._checked
        if last is not None and last[0] is headers:
            return last[1], last[2]
        reason = check(headers)
        expect = f.content_length(headers)
        self._checked = (headers, reason, expect)
        return reason, expect

    def _known_headers(
        self, sid: int, st: Stream, headers: Headers, *, end: bool, events: list[Event]
    ) -> None:
        if st.remote_ended:
            raise StreamError(sid, ErrorCode.STREAM_CLOSED, "HEADERS after END_STREAM")
        if st.head:
            reason = f.check_trailers(headers)
            if reason is not None or not end:
                raise StreamError(sid, ErrorCode.PROTOCOL_ERROR, reason or "trailers not last")
            if st.expect is not None and st.got != st.expect:
                raise StreamError(sid, ErrorCode.PROTOCOL_ERROR, "body and content-length")
            events.append(TrailersReceived(sid, headers))
        elif self._response(sid, st, headers, end=end):
            events.append(ResponseReceived(sid, headers, end))
        else:
            return  # informational: nothing to forward
        if end:
            st.remote_ended = True
            if st.local_ended:
                self._streams.pop(sid, None)

    def _response(self, sid: int, st: Stream, headers: Headers, *, end: bool) -> bool:
        """Client side: check a response head; whether it is the final one."""
        reason, expect = self._check(headers, f.check_response)
        if reason is not None:
            raise StreamError(sid, ErrorCode.PROTOCOL_ERROR, reason)
        status = headers[0][1]
        if status[:1] == b"1":
            if end or status == b"101":
                raise StreamError(sid, ErrorCode.PROTOCOL_ERROR, f"{status!r} response")
            return False
        st.head = True
        if st.bodiless or status in _NO_BODY_STATUS:
            st.expect = 0  # no body, whatever content-length says (RFC 9110 6.4.1)
        else:
            st.expect = expect
            if st.expect == -1 or (end and st.expect not in (None, 0)):
                raise StreamError(sid, ErrorCode.PROTOCOL_ERROR, "content-length")
        return True

    # --- control frames --------------------------------------------------------------------

    def _window_update(self, sid: int, payload: bytes) -> None:
        if len(payload) != 4:
            raise H2ConnectionError(ErrorCode.FRAME_SIZE_ERROR, "WINDOW_UPDATE size")
        grow = int.from_bytes(payload, "big") & f.SID_MASK
        if sid == 0:
            if grow == 0:
                raise H2ConnectionError(ErrorCode.PROTOCOL_ERROR, "WINDOW_UPDATE of 0")
            self._send_conn += grow
            if self._send_conn > f.MAX_WINDOW:
                raise H2ConnectionError(ErrorCode.FLOW_CONTROL_ERROR, "window past 2^31-1")
            self._windowed = True
            return
        st = self._streams.get(sid)
        if st is None:
            if self._idle(sid):
                raise H2ConnectionError(ErrorCode.PROTOCOL_ERROR, "WINDOW_UPDATE on idle")
            return
        if grow == 0:
            raise StreamError(sid, ErrorCode.PROTOCOL_ERROR, "WINDOW_UPDATE of 0")
        st.send += grow
        if st.send > f.MAX_WINDOW:
            raise StreamError(sid, ErrorCode.FLOW_CONTROL_ERROR, "window past 2^31-1")
        self._windowed = True

    def _rst_stream(self, sid: int, payload: bytes, events: list[Event]) -> None:
        if sid == 0:
            raise H2ConnectionError(ErrorCode.PROTOCOL_ERROR, "RST_STREAM on stream 0")
        if len(payload) != 4:
            raise H2ConnectionError(ErrorCode.FRAME_SIZE_ERROR, "RST_STREAM size")
        if self._streams.pop(sid, None) is not None:
            events.append(StreamReset(sid, int.from_bytes(payload, "big")))
        elif self._idle(sid):
            raise H2ConnectionError(ErrorCode.PROTOCOL_ERROR, "RST_STREAM on idle stream")

    def _settings(self, flags: int, sid: int, payload: bytes) -> None:
        if sid != 0:
            raise H2ConnectionError(ErrorCode.PROTOCOL_ERROR, "SETTINGS on a stream")
        if flags & f.ACK:
            if payload:
                raise H2ConnectionError(ErrorCode.FRAME_SIZE_ERROR, "SETTINGS ACK with payload")
            self._settings_acked()
            return
        if len(payload) % f.SETTING.size:
            raise H2ConnectionError(ErrorCode.FRAME_SIZE_ERROR, "SETTINGS size")
        for key, value in f.SETTING.iter_unpack(payload):
            self._setting(key, value)
        self._settled = True
        self._out += f.frame(f.SETTINGS, f.ACK, 0)

    def _settings_acked(self) -> None:
        """The peer applies our SETTINGS from now on: a stream window under the RFC's
        initial 65,535 holds only from here (RFC 9113 6.9.2, rule 3)."""
        delta = self._stream_window - self._recv_initial
        if delta:
            self._recv_initial = self._stream_window
            for st in self._streams.values():
                st.recv += delta

    def _setting(self, key: int, value: int) -> None:
        if key == f.INITIAL_WINDOW_SIZE:
            if value > f.MAX_WINDOW:
                raise H2ConnectionError(ErrorCode.FLOW_CONTROL_ERROR, "initial window")
            delta = value - self._peer_window
            self._peer_window = value
            for st in self._streams.values():
                st.send += delta
                if st.send > f.MAX_WINDOW:
                    raise H2ConnectionError(ErrorCode.FLOW_CONTROL_ERROR, "stream window")
            self._windowed = self._windowed or delta > 0
        elif key == f.MAX_FRAME_SIZE:
            if not f.DEFAULT_MAX_FRAME <= value <= f.MAX_FRAME_LIMIT:
                raise H2ConnectionError(ErrorCode.PROTOCOL_ERROR, f"max frame size {value}")
            self.max_outbound_frame_size = value
        elif key == f.MAX_CONCURRENT_STREAMS:
            self.remote_max_streams = value
        elif key == f.HEADER_TABLE_SIZE:
            self._encoder.resize(value)
        elif key == f.ENABLE_PUSH and (value > 1 or (value == 1 and self.client_side)):
            raise H2ConnectionError(ErrorCode.PROTOCOL_ERROR, f"enable push {value}")

    def _ping(self, flags: int, sid: int, payload: bytes) -> None:
        if sid != 0:
            raise H2ConnectionError(ErrorCode.PROTOCOL_ERROR, "PING on a stream")
        if len(payload) != 8:
            raise H2ConnectionError(ErrorCode.FRAME_SIZE_ERROR, "PING size")
        if not flags & f.ACK:
            self._out += f.frame(f.PING, f.ACK, 0, payload)

    def _goaway_received(self, sid: int, payload: bytes, events: list[Event]) -> None:
        if sid != 0:
            raise H2ConnectionError(ErrorCode.PROTOCOL_ERROR, "GOAWAY on a stream")
        if len(payload) < 8:
            raise H2ConnectionError(ErrorCode.FRAME_SIZE_ERROR, "GOAWAY size")
        self.going_away = True
        last = int.from_bytes(payload[:4], "big") & f.SID_MASK
        events.append(ConnectionTerminated(last, int.from_bytes(payload[4:8], "big")))


def _unpad(payload: bytes) -> bytes:
    if not payload or payload[0] >= len(payload):
        raise H2ConnectionError(ErrorCode.PROTOCOL_ERROR, "padding past the frame")
    return payload[1 : len(payload) - payload[0]]
