"""h2codec: the sans-I/O HTTP/2 connection, against hyper-h2 as the reference peer both ways,
and against hand-built frames for the protocol and stream errors (RFC 9113)."""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, NamedTuple, TypeVar

import h2.config
import h2.connection
import h2.events
import h2.settings
import hpack
import hpack.exceptions
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from agent.proxy import h2frame as f
from agent.proxy.h2codec import H2Codec
from agent.proxy.h2events import (
    ConnectionTerminated,
    DataReceived,
    H2ConnectionError,
    H2StreamClosedError,
    RequestReceived,
    ResponseReceived,
    StreamReset,
    TrailersReceived,
    WindowUpdated,
)
from agent.proxy.h2frame import ErrorCode

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

    from agent.proxy.h2events import Event, Headers

T = TypeVar("T")

WINDOW = f.DEFAULT_WINDOW
GET: Headers = [
    (b":method", b"GET"),
    (b":scheme", b"http"),
    (b":path", b"/"),
    (b":authority", b"a"),
]
POST: Headers = [
    (b":method", b"POST"),
    (b":scheme", b"http"),
    (b":path", b"/up"),
    (b":authority", b"a"),
]
OK: Headers = [(b":status", b"200")]
TRAILERS: Headers = [(b"grpc-status", b"0"), (b"grpc-message", b"fine")]
SETTING = h2.settings.SettingCodes

# index 63 while the dynamic table is empty
HPACK_GARBAGE = f.frame(f.HEADERS, f.END_HEADERS, 1, b"\x82\xbf")


# --- helpers: frames --------------------------------------------------------------------------


class Frame(NamedTuple):
    type: int
    flags: int
    sid: int
    payload: bytes


def parse(data: bytes) -> list[Frame]:
    """Every frame of `data`, which must hold whole frames only."""
    frames = []
    pos = 0
    while pos < len(data):
        hi, lo, ftype, flags, sid = f.HEADER.unpack_from(data, pos)
        start = pos + f.HEADER_SIZE
        pos = start + ((hi << 8) | lo)
        frames.append(Frame(ftype, flags, sid & f.SID_MASK, data[start:pos]))
    assert pos == len(data)
    return frames


def rst(sid: int, code: int) -> Frame:
    return Frame(f.RST_STREAM, 0, sid, code.to_bytes(4, "big"))


def increments(frames: Iterable[Frame], sid: int) -> list[int]:
    """The WINDOW_UPDATE increments for `sid` among `frames`."""
    return [
        int.from_bytes(fr.payload, "big")
        for fr in frames
        if fr.type == f.WINDOW_UPDATE and fr.sid == sid
    ]


def goaway(frames: list[Frame]) -> tuple[int, int]:
    """The last frame, which must be GOAWAY: (last stream id, error code)."""
    last = frames[-1]
    assert (last.type, last.sid) == (f.GOAWAY, 0)
    return int.from_bytes(last.payload[:4], "big"), int.from_bytes(last.payload[4:8], "big")


def hdrs(enc: hpack.Encoder, sid: int, headers: Headers, *, end: bool = False) -> bytes:
    flags = f.END_HEADERS | (f.END_STREAM if end else 0)
    return f.frame(f.HEADERS, flags, sid, enc.encode(headers))


def data(sid: int, payload: bytes, *, end: bool = False) -> bytes:
    return f.frame(f.DATA, f.END_STREAM if end else 0, sid, payload)


def window_update(sid: int, grow: int) -> bytes:
    return f.frame(f.WINDOW_UPDATE, 0, sid, grow.to_bytes(4, "big"))


def settings_frame(values: dict[int, int]) -> bytes:
    return f.frame(f.SETTINGS, 0, 0, f.settings_payload(values))


def chunks(payload: bytes, size: int = f.DEFAULT_MAX_FRAME) -> list[bytes]:
    return [payload[i : i + size] for i in range(0, len(payload), size)]


def only(events: Iterable[object], kind: type[T]) -> list[T]:
    return [ev for ev in events if isinstance(ev, kind)]


# --- helpers: our codec ------------------------------------------------------------------------


def codec(
    *,
    client_side: bool,
    stream_window: int = WINDOW,
    conn_window: int = WINDOW,
    max_streams: int = 100,
) -> H2Codec:
    return H2Codec(
        client_side=client_side,
        stream_window=stream_window,
        conn_window=conn_window,
        max_streams=max_streams,
    )


def ready_server(
    *, stream_window: int = WINDOW, conn_window: int = WINDOW, max_streams: int = 100
) -> H2Codec:
    """A server codec past the client preface and an empty SETTINGS; nothing left to send."""
    srv = codec(
        client_side=False,
        stream_window=stream_window,
        conn_window=conn_window,
        max_streams=max_streams,
    )
    srv.initiate()
    assert srv.receive(f.PREFACE + settings_frame({})) == []
    srv.data_to_send()
    return srv


def ready_client(*, stream_window: int = WINDOW, conn_window: int = WINDOW) -> H2Codec:
    """A client codec past the server's empty SETTINGS; nothing left to send."""
    cli = codec(client_side=True, stream_window=stream_window, conn_window=conn_window)
    cli.initiate()
    assert cli.receive(settings_frame({})) == []
    cli.data_to_send()
    return cli


# --- helpers: hyper-h2 as the peer ------------------------------------------------------------


def h2_peer(*, client_side: bool) -> h2.connection.H2Connection:
    conn = h2.connection.H2Connection(
        h2.config.H2Configuration(client_side=client_side, header_encoding=None)
    )
    conn.initiate_connection()
    return conn


def pump(
    ours: H2Codec, theirs: h2.connection.H2Connection
) -> tuple[list[Event], list[h2.events.Event]]:
    """Move bytes both ways until both sides are quiet; the events each side saw."""
    mine: list[Event] = []
    seen: list[h2.events.Event] = []
    while True:
        out = ours.data_to_send()
        if out:
            seen += theirs.receive_data(out)
        back = theirs.data_to_send()
        if back:
            mine += ours.receive(back)
        if not out and not back:
            return mine, seen


def with_h2_server(
    *, stream_window: int = WINDOW, conn_window: int = WINDOW
) -> tuple[H2Codec, h2.connection.H2Connection]:
    """Our client codec and an h2 server, settings exchanged."""
    ours = codec(client_side=True, stream_window=stream_window, conn_window=conn_window)
    ours.initiate()
    theirs = h2_peer(client_side=False)
    pump(ours, theirs)
    return ours, theirs


def with_h2_client(
    *, stream_window: int = WINDOW, conn_window: int = WINDOW, max_streams: int = 100
) -> tuple[H2Codec, h2.connection.H2Connection]:
    """Our server codec and an h2 client, settings exchanged."""
    ours = codec(
        client_side=False,
        stream_window=stream_window,
        conn_window=conn_window,
        max_streams=max_streams,
    )
    ours.initiate()
    theirs = h2_peer(client_side=True)
    pump(ours, theirs)
    return ours, theirs


def h2_body(events: Iterable[h2.events.Event], sid: int) -> bytes:
    return b"".join(
        ev.data or b"" for ev in only(events, h2.events.DataReceived) if ev.stream_id == sid
    )


def our_body(events: Iterable[Event], sid: int) -> bytes:
    return b"".join(ev.data for ev in only(events, DataReceived) if ev.sid == sid)


# --- setting up ---------------------------------------------------------------------------------


def test_client_initiate_queues_preface_settings_and_the_connection_window_growth() -> None:
    cli = codec(client_side=True, stream_window=1 << 20, conn_window=8 << 20, max_streams=7)
    cli.initiate()
    out = cli.data_to_send()
    assert out.startswith(f.PREFACE)
    frames = parse(out[len(f.PREFACE) :])
    assert [fr.type for fr in frames] == [f.SETTINGS, f.WINDOW_UPDATE]
    assert dict(f.SETTING.iter_unpack(frames[0].payload)) == {
        f.INITIAL_WINDOW_SIZE: 1 << 20,
        f.MAX_CONCURRENT_STREAMS: 7,
        f.MAX_HEADER_LIST_SIZE: 64 * 1024,
        f.ENABLE_PUSH: 0,
    }
    assert increments(frames, 0) == [(8 << 20) - WINDOW]


def test_server_initiate_queues_settings_only_and_no_window_update_at_the_default_window() -> None:
    srv = codec(client_side=False)
    srv.initiate()
    frames = parse(srv.data_to_send())
    assert [fr.type for fr in frames] == [f.SETTINGS]
    assert f.ENABLE_PUSH not in dict(f.SETTING.iter_unpack(frames[0].payload))


def test_h2_peers_accept_our_settings_and_we_acknowledge_theirs() -> None:
    ours, theirs = with_h2_server(stream_window=1 << 20, conn_window=8 << 20)
    assert theirs.remote_settings.initial_window_size == 1 << 20
    assert theirs.remote_settings.enable_push == 0
    assert theirs.outbound_flow_control_window == 8 << 20
    assert ours.remote_max_streams == theirs.local_settings.max_concurrent_streams
    srv, client = with_h2_client(max_streams=3)
    assert client.remote_settings.max_concurrent_streams == 3
    assert srv.max_outbound_frame_size == f.DEFAULT_MAX_FRAME


# --- interop: our client, h2 server -----------------------------------------------------------


def test_client_get_gets_the_h2_servers_response_and_forgets_the_stream() -> None:
    ours, srv = with_h2_server()
    sid = ours.open_stream(GET, end=True)
    _, seen = pump(ours, srv)
    (req,) = only(seen, h2.events.RequestReceived)
    assert (req.stream_id, req.headers) == (sid, GET)
    assert only(seen, h2.events.StreamEnded)
    srv.send_headers(sid, [*OK, (b"content-length", b"5")])
    srv.send_data(sid, b"hello", end_stream=True)
    mine, _ = pump(ours, srv)
    assert mine == [
        ResponseReceived(sid, [*OK, (b"content-length", b"5")], end=False),
        DataReceived(sid, b"hello", 5, end=True),
    ]
    with pytest.raises(H2StreamClosedError):
        ours.reset_stream(sid, ErrorCode.CANCEL)  # both sides ended: forgotten


def test_client_post_with_body_and_trailers_round_trips_with_h2_trailers() -> None:
    ours, srv = with_h2_server()
    sid = ours.open_stream(POST, end=False)
    ours.send_data(sid, b"part1", end=False)
    ours.send_data(sid, b"part2", end=False)
    ours.send_headers(sid, TRAILERS, end=True)
    _, seen = pump(ours, srv)
    assert h2_body(seen, sid) == b"part1part2"
    (tr,) = only(seen, h2.events.TrailersReceived)
    assert tr.headers == TRAILERS
    assert only(seen, h2.events.StreamEnded)
    srv.send_headers(sid, OK)
    srv.send_data(sid, b"reply")
    srv.send_headers(sid, [(b"grpc-status", b"3")], end_stream=True)
    mine, _ = pump(ours, srv)
    assert mine == [
        ResponseReceived(sid, OK, end=False),
        DataReceived(sid, b"reply", 5, end=False),
        TrailersReceived(sid, [(b"grpc-status", b"3")]),
    ]


def test_client_large_header_goes_out_as_headers_and_continuations_and_h2_decodes_it() -> None:
    ours, srv = with_h2_server()
    big = bytes(range(97, 123)) * 1600  # 41,600 bytes, no huffman gain worth speaking of
    sid = ours.open_stream([*GET, (b"x-big", big)], end=True)
    out = ours.data_to_send()
    frames = parse(out)
    assert [fr.type for fr in frames] == [f.HEADERS, f.CONTINUATION, f.CONTINUATION]
    assert all(len(fr.payload) <= f.DEFAULT_MAX_FRAME for fr in frames)
    assert [fr.flags & f.END_HEADERS for fr in frames] == [0, 0, f.END_HEADERS]
    assert frames[0].flags & f.END_STREAM
    assert {fr.sid for fr in frames} == {sid}
    (req,) = only(srv.receive_data(out), h2.events.RequestReceived)
    assert req.headers == [*GET, (b"x-big", big)]


def test_client_decodes_a_large_response_header_split_by_h2_into_continuations() -> None:
    ours, srv = with_h2_server()
    big = b"v" * 40_000
    sid = ours.open_stream(GET, end=True)
    pump(ours, srv)
    srv.send_headers(sid, [*OK, (b"x-big", big), (b"x-after", b"1")], end_stream=True)
    out = srv.data_to_send()
    assert f.CONTINUATION in [fr.type for fr in parse(out)]
    assert ours.receive(out) == [
        ResponseReceived(sid, [*OK, (b"x-big", big), (b"x-after", b"1")], end=True)
    ]


def test_client_body_past_the_initial_window_waits_for_h2s_window_update() -> None:
    ours, srv = with_h2_server()
    sid = ours.open_stream(POST, end=False)
    body = bytes(range(256)) * 800  # 204,800 bytes: three windows and more
    sent = 0
    stalls = []
    got = b""
    while sent < len(body):
        room = min(ours.window(sid), ours.max_outbound_frame_size, len(body) - sent)
        if room:
            ours.send_data(sid, body[sent : sent + room], end=sent + room == len(body))
            sent += room
            continue
        stalls.append(sent)
        _, seen = pump(ours, srv)  # the DATA, and nothing comes back until h2 consumes it
        assert ours.window(sid) == 0
        got += h2_body(seen, sid)
        for ev in only(seen, h2.events.DataReceived):
            srv.acknowledge_received_data(ev.flow_controlled_length, sid)
        mine, _ = pump(ours, srv)
        assert mine == [WindowUpdated()]
        assert ours.window(sid) > 0
    _, seen = pump(ours, srv)
    got += h2_body(seen, sid)
    assert got == body
    assert stalls[0] == WINDOW
    assert only(seen, h2.events.StreamEnded)


def test_h2_servers_body_past_our_window_resumes_after_acknowledge() -> None:
    ours, srv = with_h2_server()
    sid = ours.open_stream(GET, end=True)
    pump(ours, srv)
    srv.send_headers(sid, OK)
    body = b"0123456789abcdef" * 12_800  # 204,800 bytes
    sent = 0
    got = b""
    while sent < len(body):
        room = min(srv.local_flow_control_window(sid), len(body) - sent)
        for piece in chunks(body[sent : sent + room], srv.max_outbound_frame_size):
            srv.send_data(sid, piece, end_stream=sent + len(piece) == len(body))
            sent += len(piece)
        events = ours.receive(srv.data_to_send())
        got += our_body(events, sid)
        if sent < len(body):
            assert srv.local_flow_control_window(sid) == 0
            assert ours.data_to_send() == b""  # nothing is handed back before it is consumed
        for ev in only(events, DataReceived):
            ours.acknowledge(sid, ev.flow)
        seen = srv.receive_data(ours.data_to_send())
        if sent < len(body):
            assert only(seen, h2.events.WindowUpdated)
            assert srv.local_flow_control_window(sid) > 0
    assert got == body


def test_many_concurrent_client_streams_each_get_their_own_h2_response() -> None:
    ours, srv = with_h2_server()
    sids = [ours.open_stream(POST, end=False) for _ in range(60)]
    assert sids == list(range(1, 121, 2))
    for sid in sids:
        ours.send_data(sid, b"req-%d" % sid, end=True)
    _, seen = pump(ours, srv)
    assert len(only(seen, h2.events.RequestReceived)) == 60
    for sid in sids:
        assert h2_body(seen, sid) == b"req-%d" % sid
    for sid in reversed(sids):
        srv.send_headers(sid, OK)
        srv.send_data(sid, b"resp-%d" % sid, end_stream=True)
    mine, _ = pump(ours, srv)
    assert [ev.sid for ev in only(mine, ResponseReceived)] == sids[::-1]
    for sid in sids:
        assert our_body(mine, sid) == b"resp-%d" % sid


def test_h2_server_reset_reaches_our_client_and_the_stream_is_forgotten() -> None:
    ours, srv = with_h2_server()
    sid = ours.open_stream(POST, end=False)
    pump(ours, srv)
    srv.reset_stream(sid, ErrorCode.REFUSED_STREAM)
    mine, _ = pump(ours, srv)
    assert mine == [StreamReset(sid, ErrorCode.REFUSED_STREAM)]
    with pytest.raises(H2StreamClosedError) as info:
        ours.send_data(sid, b"x", end=False)
    assert info.value.sid == sid


def test_our_client_reset_reaches_h2_and_its_late_data_is_credited_back_at_once() -> None:
    ours, srv = with_h2_server()
    sid = ours.open_stream(GET, end=True)
    pump(ours, srv)
    srv.send_headers(sid, OK)
    srv.send_data(sid, b"a" * 16_000)
    srv.send_data(sid, b"b" * 16_000)
    srv.send_data(sid, b"c" * 8_000)
    in_flight = srv.data_to_send()
    ours.reset_stream(sid, ErrorCode.CANCEL)
    seen = srv.receive_data(ours.data_to_send())
    (reset,) = only(seen, h2.events.StreamReset)
    assert (reset.stream_id, reset.error_code) == (sid, ErrorCode.CANCEL)
    assert ours.receive(in_flight) == []  # the stream is forgotten: no events for it
    back = ours.data_to_send()
    assert sum(increments(parse(back), 0)) >= WINDOW // 2  # at least half the window, at once
    srv.receive_data(back)
    assert srv.outbound_flow_control_window >= WINDOW - 40_000 + WINDOW // 2


def test_h2_servers_goaway_stops_new_streams_but_not_the_open_ones() -> None:
    ours, srv = with_h2_server()
    sid = ours.open_stream(POST, end=False)
    pump(ours, srv)
    srv.close_connection(error_code=ErrorCode.NO_ERROR, last_stream_id=sid)
    mine, _ = pump(ours, srv)
    assert mine == [ConnectionTerminated(sid, ErrorCode.NO_ERROR)]
    assert ours.going_away
    with pytest.raises(H2StreamClosedError):
        ours.open_stream(GET, end=True)
    ours.send_data(sid, b"still", end=True)  # the open stream may finish
    assert parse(ours.data_to_send()) == [Frame(f.DATA, f.END_STREAM, sid, b"still")]


def test_our_client_close_sends_goaway_to_h2() -> None:
    ours, srv = with_h2_server()
    ours.close(ErrorCode.ENHANCE_YOUR_CALM)
    _, seen = pump(ours, srv)
    (term,) = only(seen, h2.events.ConnectionTerminated)
    assert (term.error_code, term.last_stream_id) == (ErrorCode.ENHANCE_YOUR_CALM, 0)


def test_h2_servers_ping_is_answered_with_an_ack_and_no_event() -> None:
    ours, srv = with_h2_server()
    srv.ping(b"12345678")
    mine, seen = pump(ours, srv)
    assert mine == []
    (ack,) = only(seen, h2.events.PingAckReceived)
    assert ack.ping_data == b"12345678"


def test_h2_servers_settings_change_frame_size_stream_limit_and_open_stream_windows() -> None:
    ours, srv = with_h2_server()
    sid = ours.open_stream(POST, end=False)
    pump(ours, srv)
    srv.increment_flow_control_window(1_000_000)  # the connection window is out of the way
    srv.update_settings(
        {
            SETTING.MAX_FRAME_SIZE: 32_768,
            SETTING.MAX_CONCURRENT_STREAMS: 7,
            SETTING.INITIAL_WINDOW_SIZE: 100_000,
        }
    )
    mine, seen = pump(ours, srv)
    assert mine == [WindowUpdated()]
    assert only(seen, h2.events.SettingsAcknowledged)
    assert (ours.max_outbound_frame_size, ours.remote_max_streams) == (32_768, 7)
    assert ours.window(sid) == 100_000  # 65,535 plus the delta
    ours.send_data(sid, b"z" * 32_768, end=False)  # one frame past the default size
    _, seen = pump(ours, srv)
    (got,) = only(seen, h2.events.DataReceived)
    assert got.flow_controlled_length == 32_768
    assert ours.window(sid) == 100_000 - 32_768
    srv.update_settings({SETTING.INITIAL_WINDOW_SIZE: 50_000})  # a negative delta
    pump(ours, srv)
    assert ours.window(sid) == 50_000 - 32_768
    assert ours.window(ours.open_stream(POST, end=False)) == 50_000


def test_h2_servers_header_table_size_setting_is_honoured_by_our_encoder() -> None:
    ours, srv = with_h2_server()
    srv.update_settings({SETTING.HEADER_TABLE_SIZE: 0})
    pump(ours, srv)
    for _ in range(3):
        sid = ours.open_stream([*GET, (b"x-repeat", b"same-value")], end=True)
        _, seen = pump(ours, srv)
        (req,) = only(seen, h2.events.RequestReceived)
        assert (req.stream_id, req.headers) == (sid, [*GET, (b"x-repeat", b"same-value")])


def test_informational_responses_are_dropped_and_the_final_one_reported() -> None:
    ours, srv = with_h2_server()
    sid = ours.open_stream(GET, end=True)
    pump(ours, srv)
    srv.send_headers(sid, [(b":status", b"100")])
    srv.send_headers(sid, [(b":status", b"103"), (b"link", b"</s.css>; rel=preload")])
    srv.send_headers(sid, OK, end_stream=True)
    mine, _ = pump(ours, srv)
    assert mine == [ResponseReceived(sid, OK, end=True)]


@pytest.mark.parametrize(
    ("method", "status"), [(b"HEAD", b"200"), (b"GET", b"304"), (b"GET", b"204")]
)
def test_response_with_content_length_and_no_body_is_accepted_for_head_304_and_204(
    method: bytes, status: bytes
) -> None:
    ours, srv = with_h2_server()
    sid = ours.open_stream([(b":method", method), *GET[1:]], end=True)
    pump(ours, srv)
    head = [(b":status", status), (b"content-length", b"1234")]
    srv.send_headers(sid, head, end_stream=True)
    mine, seen = pump(ours, srv)
    assert mine == [ResponseReceived(sid, head, end=True)]
    assert not only(seen, h2.events.StreamReset)


@pytest.mark.parametrize(("method", "status"), [(b"HEAD", b"200"), (b"GET", b"204")])
def test_data_on_a_response_that_has_no_body_resets_the_stream(
    method: bytes, status: bytes
) -> None:
    cli = ready_client()
    sid = cli.open_stream([(b":method", method), *GET[1:]], end=True)
    enc = hpack.Encoder()
    head = [(b":status", status), (b"content-length", b"3")]
    assert cli.receive(hdrs(enc, sid, head)) == [ResponseReceived(sid, head, end=False)]
    cli.data_to_send()
    assert cli.receive(data(sid, b"abc", end=True)) == [StreamReset(sid, ErrorCode.PROTOCOL_ERROR)]
    assert rst(sid, ErrorCode.PROTOCOL_ERROR) in parse(cli.data_to_send())


def test_get_response_with_content_length_and_no_body_is_reset_and_h2_told() -> None:
    ours, srv = with_h2_server()
    sid = ours.open_stream(GET, end=True)
    pump(ours, srv)
    srv.send_headers(sid, [*OK, (b"content-length", b"1234")], end_stream=True)
    assert ours.receive(srv.data_to_send()) == [StreamReset(sid, ErrorCode.PROTOCOL_ERROR)]
    out = ours.data_to_send()
    assert parse(out) == [rst(sid, ErrorCode.PROTOCOL_ERROR)]
    assert srv.receive_data(out) == []  # h2 had closed the stream: it takes the RST quietly


@pytest.mark.parametrize(("length", "body"), [(b"5", b"abc"), (b"2", b"abc")])
def test_response_body_other_than_its_content_length_is_reset(length: bytes, body: bytes) -> None:
    ours, srv = with_h2_server()
    sid = ours.open_stream(GET, end=True)
    pump(ours, srv)
    srv.send_headers(sid, [*OK, (b"content-length", length)])
    srv.send_data(sid, body, end_stream=True)
    mine, _ = pump(ours, srv)
    assert mine[0] == ResponseReceived(sid, [*OK, (b"content-length", length)], end=False)
    assert mine[-1] == StreamReset(sid, ErrorCode.PROTOCOL_ERROR)
    assert not only(mine, DataReceived)


# --- interop: h2 client, our server -----------------------------------------------------------


def test_h2_client_get_reaches_our_server_and_the_response_returns() -> None:
    ours, cli = with_h2_client()
    cli.send_headers(1, GET, end_stream=True)
    mine, _ = pump(ours, cli)
    assert mine == [RequestReceived(1, GET, end=True)]
    ours.send_headers(1, [*OK, (b"content-type", b"text/plain")], end=False)
    ours.send_data(1, b"hi", end=True)
    _, seen = pump(ours, cli)
    (resp,) = only(seen, h2.events.ResponseReceived)
    assert resp.headers == [*OK, (b"content-type", b"text/plain")]
    assert h2_body(seen, 1) == b"hi"
    assert only(seen, h2.events.StreamEnded)
    with pytest.raises(H2StreamClosedError):
        ours.window(1)


def test_h2_client_post_with_body_and_trailers_and_our_trailers_back() -> None:
    ours, cli = with_h2_client()
    cli.send_headers(1, [*POST, (b"content-length", b"6"), (b"te", b"trailers")])
    cli.send_data(1, b"abc")
    cli.send_data(1, b"def")
    cli.send_headers(1, TRAILERS, end_stream=True)
    mine, _ = pump(ours, cli)
    assert mine == [
        RequestReceived(1, [*POST, (b"content-length", b"6"), (b"te", b"trailers")], end=False),
        DataReceived(1, b"abc", 3, end=False),
        DataReceived(1, b"def", 3, end=False),
        TrailersReceived(1, TRAILERS),
    ]
    ours.send_headers(1, OK, end=False)
    ours.send_data(1, b"ok", end=False)
    ours.send_headers(1, [(b"grpc-status", b"0")], end=True)
    _, seen = pump(ours, cli)
    (tr,) = only(seen, h2.events.TrailersReceived)
    assert tr.headers == [(b"grpc-status", b"0")]
    assert only(seen, h2.events.StreamEnded)


def test_h2_clients_large_header_in_continuations_reaches_our_server() -> None:
    ours, cli = with_h2_client()
    big = b"q" * 40_000
    cli.send_headers(1, [*GET, (b"x-big", big)], end_stream=True)
    out = cli.data_to_send()
    assert [fr.type for fr in parse(out)].count(f.CONTINUATION) >= 2
    assert ours.receive(out) == [RequestReceived(1, [*GET, (b"x-big", big)], end=True)]


def test_h2_clients_body_past_our_window_resumes_after_acknowledge() -> None:
    ours, cli = with_h2_client()
    cli.send_headers(1, POST)
    body = bytes(range(200)) * 1000  # 200,000 bytes
    sent = 0
    got = b""
    rounds = 0
    while sent < len(body):
        room = min(cli.local_flow_control_window(1), len(body) - sent)
        assert room > 0
        for piece in chunks(body[sent : sent + room], cli.max_outbound_frame_size):
            cli.send_data(1, piece, end_stream=sent + len(piece) == len(body))
            sent += len(piece)
        events = ours.receive(cli.data_to_send())
        got += our_body(events, 1)
        for ev in only(events, DataReceived):
            ours.acknowledge(1, ev.flow)
        cli.receive_data(ours.data_to_send())
        rounds += 1
    assert got == body
    assert rounds >= 3


def test_our_server_body_past_h2s_window_resumes_on_window_updated() -> None:
    ours, cli = with_h2_client()
    cli.send_headers(1, GET, end_stream=True)
    pump(ours, cli)
    ours.send_headers(1, OK, end=False)
    body = b"xyz" * 70_000
    sent = 0
    got = b""
    updates = 0
    while sent < len(body):
        room = min(ours.window(1), ours.max_outbound_frame_size, len(body) - sent)
        if room:
            ours.send_data(1, body[sent : sent + room], end=sent + room == len(body))
            sent += room
            continue
        seen = cli.receive_data(ours.data_to_send())
        got += h2_body(seen, 1)
        for ev in only(seen, h2.events.DataReceived):
            cli.acknowledge_received_data(ev.flow_controlled_length, 1)
        mine = ours.receive(cli.data_to_send())
        assert mine == [WindowUpdated()]
        updates += 1
    _, seen = pump(ours, cli)
    got += h2_body(seen, 1)
    assert got == body
    assert updates >= 3


def test_many_concurrent_h2_client_streams_each_get_their_response() -> None:
    ours, cli = with_h2_client()
    sids = list(range(1, 121, 2))
    for sid in sids:
        cli.send_headers(sid, [*POST, (b"x-n", b"%d" % sid)])
        cli.send_data(sid, b"body-%d" % sid, end_stream=True)
    mine, _ = pump(ours, cli)
    assert [ev.sid for ev in only(mine, RequestReceived)] == sids
    for sid in sids:
        assert our_body(mine, sid) == b"body-%d" % sid
    for sid in reversed(sids):
        ours.send_headers(sid, [*OK, (b"x-n", b"%d" % sid)], end=True)
    _, seen = pump(ours, cli)
    answers = {ev.stream_id: ev.headers for ev in only(seen, h2.events.ResponseReceived)}
    assert answers == {sid: [*OK, (b"x-n", b"%d" % sid)] for sid in sids}


def test_streams_past_our_limit_are_refused_and_hpack_stays_in_step_with_h2() -> None:
    ours = codec(client_side=False, max_streams=2)
    ours.initiate()
    cli = h2_peer(client_side=True)
    cli.send_headers(1, POST)  # sent before h2 has heard of our limit
    cli.send_headers(3, POST)
    cli.send_headers(5, [*POST, (b"x-refused", b"indexed-by-h2")], end_stream=True)
    mine, seen = pump(ours, cli)
    assert [ev.sid for ev in only(mine, RequestReceived)] == [1, 3]
    (reset,) = only(seen, h2.events.StreamReset)
    assert (reset.stream_id, reset.error_code) == (5, ErrorCode.REFUSED_STREAM)
    cli.send_data(1, b"", end_stream=True)
    pump(ours, cli)
    ours.send_headers(1, OK, end=True)
    pump(ours, cli)
    cli.send_headers(7, [*POST, (b"x-refused", b"indexed-by-h2")], end_stream=True)
    mine, _ = pump(ours, cli)
    assert mine == [RequestReceived(7, [*POST, (b"x-refused", b"indexed-by-h2")], end=True)]


def test_h2_clients_reset_reaches_our_server_and_ours_reaches_h2() -> None:
    ours, cli = with_h2_client()
    cli.send_headers(1, POST)
    cli.send_headers(3, POST)
    pump(ours, cli)
    cli.reset_stream(1, ErrorCode.CANCEL)
    mine, _ = pump(ours, cli)
    assert mine == [StreamReset(1, ErrorCode.CANCEL)]
    ours.reset_stream(3, ErrorCode.INTERNAL_ERROR)
    _, seen = pump(ours, cli)
    (reset,) = only(seen, h2.events.StreamReset)
    assert (reset.stream_id, reset.error_code) == (3, ErrorCode.INTERNAL_ERROR)
    for sid in (1, 3):
        with pytest.raises(H2StreamClosedError):
            ours.send_headers(sid, OK, end=True)


def test_h2_clients_goaway_is_reported_and_our_goaway_names_the_last_stream() -> None:
    ours, cli = with_h2_client()
    cli.send_headers(1, GET, end_stream=True)
    cli.send_headers(3, GET, end_stream=True)
    pump(ours, cli)
    ours.close()
    _, seen = pump(ours, cli)
    (term,) = only(seen, h2.events.ConnectionTerminated)
    assert (term.error_code, term.last_stream_id) == (ErrorCode.NO_ERROR, 3)
    ours2, cli2 = with_h2_client()
    cli2.close_connection(error_code=ErrorCode.NO_ERROR)
    mine, _ = pump(ours2, cli2)
    assert mine == [ConnectionTerminated(0, ErrorCode.NO_ERROR)]
    assert ours2.going_away


def test_never_indexed_fields_arrive_marked_and_go_out_never_indexed() -> None:
    ours, cli = with_h2_client()
    secret = hpack.NeverIndexedHeaderTuple(b"authorization", b"Bearer t")
    cli.send_headers(1, [*GET, secret], end_stream=True)
    mine, _ = pump(ours, cli)
    assert mine == [RequestReceived(1, [*GET, (b"authorization", b"Bearer t")], end=True)]
    assert only(mine, RequestReceived)[0].headers[-1] == secret
    assert isinstance(only(mine, RequestReceived)[0].headers[-1], hpack.NeverIndexedHeaderTuple)
    ours.send_headers(1, [*OK, secret], end=True)
    _, seen = pump(ours, cli)
    (resp,) = only(seen, h2.events.ResponseReceived)
    assert isinstance(resp.headers[-1], hpack.NeverIndexedHeaderTuple)


def test_h2_clients_ping_is_answered_with_the_same_payload() -> None:
    ours, cli = with_h2_client()
    cli.ping(b"\x00\x01\x02\x03\x04\x05\x06\x07")
    mine, seen = pump(ours, cli)
    assert mine == []
    (ack,) = only(seen, h2.events.PingAckReceived)
    assert ack.ping_data == b"\x00\x01\x02\x03\x04\x05\x06\x07"


def test_h2_clients_settings_change_is_applied_to_our_server() -> None:
    ours, cli = with_h2_client()
    cli.send_headers(1, GET, end_stream=True)
    pump(ours, cli)
    cli.update_settings({SETTING.MAX_FRAME_SIZE: 1 << 20, SETTING.INITIAL_WINDOW_SIZE: 1000})
    pump(ours, cli)
    assert ours.max_outbound_frame_size == 1 << 20
    assert ours.window(1) == 1000
    ours.send_headers(1, OK, end=False)
    ours.send_data(1, b"x" * 1000, end=True)
    _, seen = pump(ours, cli)
    assert h2_body(seen, 1) == b"x" * 1000


# --- connection errors (hand-built frames) ----------------------------------------------------


def fresh_server() -> H2Codec:
    """A server codec that has sent its SETTINGS and received nothing yet."""
    srv = codec(client_side=False)
    srv.initiate()
    srv.data_to_send()
    return srv


def fresh_client() -> H2Codec:
    cli = codec(client_side=True)
    cli.initiate()
    cli.data_to_send()
    return cli


def client_with_stream() -> H2Codec:
    """A ready client codec whose stream 1 (a GET) is open."""
    cli = ready_client()
    cli.open_stream(GET, end=True)
    cli.data_to_send()
    return cli


def split_block(sid: int, block: bytes, *, end: bool = False) -> bytes:
    """HEADERS then CONTINUATIONs carrying `block`."""
    pieces = chunks(block)
    out = f.frame(f.HEADERS, f.END_STREAM if end else 0, sid, pieces[0])
    for piece in pieces[1:-1]:
        out += f.frame(f.CONTINUATION, 0, sid, piece)
    return out + f.frame(f.CONTINUATION, f.END_HEADERS, sid, pieces[-1])


PING = f.frame(f.PING, 0, 0, b"pingpong")
RST_CANCEL = b"\x00\x00\x00\x08"


def _over_16384(enc: hpack.Encoder) -> bytes:
    return f.frame(f.DATA, 0, 1, b"x" * (f.DEFAULT_MAX_FRAME + 1))[:20]  # the header says enough


def _block_past_256k(enc: hpack.Encoder) -> bytes:
    piece = b"\x00" * f.DEFAULT_MAX_FRAME  # 16 pieces are 256 KiB; the 17th is one too many
    return f.frame(f.HEADERS, 0, 1, piece) + f.frame(f.CONTINUATION, 0, 1, piece) * 16


def _list_past_64k(enc: hpack.Encoder) -> bytes:
    return split_block(1, enc.encode([*GET, (b"x-big", b"a" * 70_000)], huffman=False), end=True)


CONNECTION_ERRORS = [
    pytest.param(
        fresh_server,
        b"GET / HTTP/1.1\r\nHost: a\r\n\r\n",
        ErrorCode.PROTOCOL_ERROR,
        id="no-client-preface",
    ),
    pytest.param(
        fresh_server,
        b"PRI * HTTP/1.1",
        ErrorCode.PROTOCOL_ERROR,
        id="short-wrong-preface",
    ),
    pytest.param(fresh_server, f.PREFACE + PING, ErrorCode.PROTOCOL_ERROR, id="first-not-settings"),
    pytest.param(fresh_client, PING, ErrorCode.PROTOCOL_ERROR, id="client-first-not-settings"),
    pytest.param(ready_server, _over_16384, ErrorCode.FRAME_SIZE_ERROR, id="frame-over-16384"),
    pytest.param(ready_server, data(0, b"x"), ErrorCode.PROTOCOL_ERROR, id="data-on-stream-0"),
    pytest.param(ready_server, data(1, b"x"), ErrorCode.PROTOCOL_ERROR, id="data-on-idle-stream"),
    pytest.param(ready_server, data(2, b"x"), ErrorCode.PROTOCOL_ERROR, id="data-on-idle-even"),
    pytest.param(
        ready_server, lambda e: hdrs(e, 0, GET), ErrorCode.PROTOCOL_ERROR, id="headers-on-stream-0"
    ),
    pytest.param(
        ready_server, lambda e: hdrs(e, 2, GET), ErrorCode.PROTOCOL_ERROR, id="even-stream-request"
    ),
    pytest.param(
        ready_client, lambda e: hdrs(e, 1, OK), ErrorCode.PROTOCOL_ERROR, id="response-unasked"
    ),
    pytest.param(
        ready_server,
        lambda e: f.frame(f.CONTINUATION, f.END_HEADERS, 1, e.encode(GET)),
        ErrorCode.PROTOCOL_ERROR,
        id="continuation-without-headers",
    ),
    pytest.param(
        ready_server,
        lambda e: hdrs(e, 1, GET) + f.frame(f.CONTINUATION, f.END_HEADERS, 1, b""),
        ErrorCode.PROTOCOL_ERROR,
        id="continuation-after-end-headers",
    ),
    pytest.param(
        ready_server,
        lambda e: (
            f.frame(f.HEADERS, 0, 1, e.encode(GET)) + f.frame(f.CONTINUATION, f.END_HEADERS, 3, b"")
        ),
        ErrorCode.PROTOCOL_ERROR,
        id="continuation-on-another-stream",
    ),
    pytest.param(
        ready_server,
        lambda e: f.frame(f.HEADERS, 0, 1, e.encode(GET)) + PING,
        ErrorCode.PROTOCOL_ERROR,
        id="block-interrupted-by-ping",
    ),
    pytest.param(
        ready_server,
        lambda e: f.frame(f.HEADERS, 0, 1, e.encode(POST)) + data(1, b"x"),
        ErrorCode.PROTOCOL_ERROR,
        id="block-interrupted-by-data",
    ),
    pytest.param(
        ready_client,
        lambda e: f.frame(f.PUSH_PROMISE, f.END_HEADERS, 1, b"\x00\x00\x00\x02" + e.encode(GET)),
        ErrorCode.PROTOCOL_ERROR,
        id="push-promise-to-client",
    ),
    pytest.param(
        ready_server,
        f.frame(f.PUSH_PROMISE, f.END_HEADERS, 1, b"\x00\x00\x00\x02"),
        ErrorCode.PROTOCOL_ERROR,
        id="push-promise-to-server",
    ),
    pytest.param(
        ready_server,
        window_update(0, 0),
        ErrorCode.PROTOCOL_ERROR,
        id="window-update-0-on-connection",
    ),
    pytest.param(
        ready_server,
        window_update(0, f.MAX_WINDOW - WINDOW) + window_update(0, 1),
        ErrorCode.FLOW_CONTROL_ERROR,
        id="connection-window-overflow",
    ),
    pytest.param(
        client_with_stream,
        window_update(1, 1000) + settings_frame({f.INITIAL_WINDOW_SIZE: f.MAX_WINDOW}),
        ErrorCode.FLOW_CONTROL_ERROR,
        id="settings-delta-overflows-a-stream-window",
    ),
    pytest.param(
        ready_server,
        f.frame(f.WINDOW_UPDATE, 0, 0, b"\x00\x01"),
        ErrorCode.FRAME_SIZE_ERROR,
        id="window-update-size",
    ),
    pytest.param(
        ready_server,
        window_update(1, 10),
        ErrorCode.PROTOCOL_ERROR,
        id="window-update-on-idle-stream",
    ),
    pytest.param(
        ready_server,
        f.frame(f.SETTINGS, 0, 0, b"\x00\x04\x00\x00\x01"),
        ErrorCode.FRAME_SIZE_ERROR,
        id="settings-size",
    ),
    pytest.param(
        ready_server,
        f.frame(f.SETTINGS, f.ACK, 0, f.settings_payload({f.ENABLE_PUSH: 0})),
        ErrorCode.FRAME_SIZE_ERROR,
        id="settings-ack-with-payload",
    ),
    pytest.param(
        ready_server,
        f.frame(f.SETTINGS, 0, 1),
        ErrorCode.PROTOCOL_ERROR,
        id="settings-on-a-stream",
    ),
    pytest.param(
        ready_server,
        settings_frame({f.INITIAL_WINDOW_SIZE: f.MAX_WINDOW + 1}),
        ErrorCode.FLOW_CONTROL_ERROR,
        id="initial-window-too-large",
    ),
    pytest.param(
        ready_server,
        settings_frame({f.MAX_FRAME_SIZE: f.DEFAULT_MAX_FRAME - 1}),
        ErrorCode.PROTOCOL_ERROR,
        id="max-frame-size-too-small",
    ),
    pytest.param(
        ready_server,
        settings_frame({f.MAX_FRAME_SIZE: f.MAX_FRAME_LIMIT + 1}),
        ErrorCode.PROTOCOL_ERROR,
        id="max-frame-size-too-large",
    ),
    pytest.param(
        ready_server,
        settings_frame({f.ENABLE_PUSH: 2}),
        ErrorCode.PROTOCOL_ERROR,
        id="enable-push-2",
    ),
    pytest.param(
        ready_client,
        settings_frame({f.ENABLE_PUSH: 1}),
        ErrorCode.PROTOCOL_ERROR,
        id="enable-push-1-to-a-client",
    ),
    pytest.param(
        ready_server,
        f.frame(f.PING, 0, 0, b"1234567"),
        ErrorCode.FRAME_SIZE_ERROR,
        id="ping-size",
    ),
    pytest.param(
        ready_server,
        f.frame(f.PING, f.ACK, 0, b"123456789"),
        ErrorCode.FRAME_SIZE_ERROR,
        id="ping-ack-size",
    ),
    pytest.param(
        ready_server,
        f.frame(f.PING, 0, 1, b"12345678"),
        ErrorCode.PROTOCOL_ERROR,
        id="ping-on-a-stream",
    ),
    pytest.param(
        ready_server,
        f.frame(f.RST_STREAM, 0, 0, RST_CANCEL),
        ErrorCode.PROTOCOL_ERROR,
        id="rst-on-stream-0",
    ),
    pytest.param(
        ready_server,
        f.frame(f.RST_STREAM, 0, 5, RST_CANCEL),
        ErrorCode.PROTOCOL_ERROR,
        id="rst-on-idle-stream",
    ),
    pytest.param(
        ready_server,
        lambda e: hdrs(e, 1, POST) + f.frame(f.RST_STREAM, 0, 1, b"\x08"),
        ErrorCode.FRAME_SIZE_ERROR,
        id="rst-size",
    ),
    pytest.param(
        ready_server,
        f.frame(f.GOAWAY, 0, 1, bytes(8)),
        ErrorCode.PROTOCOL_ERROR,
        id="goaway-on-a-stream",
    ),
    pytest.param(
        ready_server,
        f.frame(f.GOAWAY, 0, 0, bytes(7)),
        ErrorCode.FRAME_SIZE_ERROR,
        id="goaway-size",
    ),
    pytest.param(
        ready_server,
        f.frame(f.PRIORITY, 0, 0, bytes(5)),
        ErrorCode.PROTOCOL_ERROR,
        id="priority-on-stream-0",
    ),
    pytest.param(
        ready_server,
        lambda e: hdrs(e, 1, POST) + f.frame(f.DATA, f.PADDED, 1, b"\x04abc"),
        ErrorCode.PROTOCOL_ERROR,
        id="data-padding-past-the-frame",
    ),
    pytest.param(
        ready_server,
        lambda e: hdrs(e, 1, POST) + f.frame(f.DATA, f.PADDED, 1, b""),
        ErrorCode.PROTOCOL_ERROR,
        id="data-padded-but-empty",
    ),
    pytest.param(
        ready_server,
        lambda e: f.frame(f.HEADERS, f.PADDED | f.END_HEADERS, 1, b"\x09" + e.encode(GET)[:3]),
        ErrorCode.PROTOCOL_ERROR,
        id="headers-padding-past-the-frame",
    ),
    pytest.param(
        ready_server,
        f.frame(f.HEADERS, f.PRIORITY_FLAG | f.END_HEADERS, 1, b"\x00\x00"),
        ErrorCode.FRAME_SIZE_ERROR,
        id="headers-priority-too-short",
    ),
    pytest.param(
        ready_server,
        f.frame(f.HEADERS, f.PADDED | f.PRIORITY_FLAG | f.END_HEADERS, 1, b"\x06" + bytes(9)),
        ErrorCode.PROTOCOL_ERROR,
        id="headers-padding-eats-the-priority",
    ),
    pytest.param(
        ready_server,
        f.frame(f.HEADERS, f.END_HEADERS, 1, b"\xff\xff\xff\xff"),
        ErrorCode.COMPRESSION_ERROR,
        id="hpack-endless-integer",
    ),
    pytest.param(
        ready_server,
        f.frame(f.HEADERS, f.END_HEADERS, 1, b"\x82\xbf"),
        ErrorCode.COMPRESSION_ERROR,
        id="hpack-unknown-index",
    ),
    pytest.param(
        ready_server,
        f.frame(f.HEADERS, f.END_HEADERS, 1, b"\x40\x85ab"),
        ErrorCode.COMPRESSION_ERROR,
        id="hpack-truncated-literal",
    ),
    pytest.param(
        client_with_stream,
        f.frame(f.HEADERS, f.END_HEADERS, 1, b"\x00\x81\xff\x00"),
        ErrorCode.COMPRESSION_ERROR,
        id="hpack-bad-huffman-in-a-response",
    ),
    pytest.param(
        ready_server,
        f.frame(f.HEADERS, f.END_HEADERS, 1, b"\x3f\xe1\xff\x03"),
        ErrorCode.COMPRESSION_ERROR,
        id="hpack-table-size-past-ours",
    ),
    pytest.param(ready_server, _block_past_256k, ErrorCode.ENHANCE_YOUR_CALM, id="block-past-256k"),
    pytest.param(ready_server, _list_past_64k, ErrorCode.ENHANCE_YOUR_CALM, id="list-past-64k"),
]


@pytest.mark.parametrize(("make", "build", "code"), CONNECTION_ERRORS)
def test_protocol_violations_are_connection_errors_that_queue_goaway_and_leave_the_codec_dead(
    make: Callable[[], H2Codec], build: bytes | Callable[[hpack.Encoder], bytes], code: ErrorCode
) -> None:
    conn = make()
    with pytest.raises(H2ConnectionError) as info:
        conn.receive(build(hpack.Encoder()) if callable(build) else build)
    assert info.value.code == code
    assert goaway(parse(conn.data_to_send()))[1] == code
    with pytest.raises(H2ConnectionError) as again:
        conn.receive(PING)
    assert again.value.code == code
    with pytest.raises(H2ConnectionError):
        conn.window(1)
    with pytest.raises(H2ConnectionError):
        conn.send_headers(1, OK, end=True)
    with pytest.raises(H2ConnectionError):
        conn.reset_stream(1, ErrorCode.CANCEL)
    if conn.client_side:
        with pytest.raises(H2ConnectionError):
            conn.open_stream(GET, end=True)
    conn.close()
    conn.acknowledge(1, 100_000)
    assert conn.data_to_send() == b""  # one GOAWAY only, nothing after it


def test_goaway_of_a_connection_error_names_the_last_stream_the_peer_opened() -> None:
    srv = ready_server()
    enc = hpack.Encoder()
    events = srv.receive(hdrs(enc, 1, GET, end=True) + hdrs(enc, 5, GET, end=True))
    assert [ev.sid for ev in only(events, RequestReceived)] == [1, 5]
    with pytest.raises(H2ConnectionError):
        srv.receive(f.frame(f.PING, 0, 0, b"short"))
    assert goaway(parse(srv.data_to_send())) == (5, ErrorCode.FRAME_SIZE_ERROR)


def test_a_partial_client_preface_waits_for_the_rest() -> None:
    srv = fresh_server()
    assert srv.receive(f.PREFACE[:10]) == []
    assert srv.receive(f.PREFACE[10:] + settings_frame({})) == []
    assert parse(srv.data_to_send()) == [Frame(f.SETTINGS, f.ACK, 0, b"")]


def test_frames_queued_before_a_connection_error_in_the_same_call_still_go_out() -> None:
    srv = ready_server()
    with pytest.raises(H2ConnectionError):
        srv.receive(PING + f.frame(f.PING, 0, 0, b""))
    frames = parse(srv.data_to_send())
    assert frames[0] == Frame(f.PING, f.ACK, 0, b"pingpong")
    assert goaway(frames) == (0, ErrorCode.FRAME_SIZE_ERROR)


# --- stream errors ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "bad",
    [
        pytest.param([*GET, (b"X-Upper", b"1")], id="uppercase-name"),
        pytest.param([*GET, (b"connection", b"keep-alive")], id="connection-header"),
        pytest.param([*GET, (b"te", b"gzip")], id="te-gzip"),
        pytest.param(GET[:2] + GET[3:], id="missing-path"),
        pytest.param([GET[0], (b"x-a", b"1"), *GET[1:]], id="pseudo-after-regular"),
        pytest.param([*GET, (b":path", b"/again")], id="duplicate-pseudo"),
        pytest.param([*GET, (b"host", b"b")], id="authority-host-mismatch"),
        pytest.param([*GET, (b":status", b"200")], id="response-pseudo"),
        pytest.param([*GET, (b"content-length", b"ten")], id="content-length-not-a-number"),
        pytest.param([*GET, (b"content-length", b"3")], id="content-length-with-end-stream"),
    ],
)
def test_malformed_request_is_reset_without_an_event_and_hpack_stays_in_step(bad: Headers) -> None:
    srv = ready_server()
    enc = hpack.Encoder()
    marked = [*bad, (b"x-seen-in-refused", b"yes")]
    assert srv.receive(hdrs(enc, 1, marked, end=True)) == []
    assert parse(srv.data_to_send()) == [rst(1, ErrorCode.PROTOCOL_ERROR)]
    good = [*GET, (b"x-seen-in-refused", b"yes")]
    block = enc.encode(good)
    with pytest.raises(hpack.exceptions.InvalidTableIndex):
        hpack.Decoder().decode(block)  # it names entries only the refused block inserted
    events = srv.receive(f.frame(f.HEADERS, f.END_HEADERS | f.END_STREAM, 3, block))
    assert events == [RequestReceived(3, good, end=True)]


def test_streams_past_max_streams_are_refused_without_an_event_until_one_closes() -> None:
    srv = ready_server(max_streams=1)
    enc = hpack.Encoder()
    assert only(srv.receive(hdrs(enc, 1, POST)), RequestReceived)
    refused = [*POST, (b"x-refused", b"abc")]
    assert srv.receive(hdrs(enc, 3, refused)) == []
    assert parse(srv.data_to_send()) == [rst(3, ErrorCode.REFUSED_STREAM)]
    assert srv.receive(data(3, b"late", end=True)) == []  # in flight before our RST: dropped
    srv.send_headers(1, OK, end=True)
    assert srv.receive(data(1, b"", end=True)) == [DataReceived(1, b"", 0, end=True)]
    srv.data_to_send()
    block = enc.encode(refused)
    with pytest.raises(hpack.exceptions.InvalidTableIndex):
        hpack.Decoder().decode(block)
    events = srv.receive(f.frame(f.HEADERS, f.END_HEADERS, 5, block))
    assert events == [RequestReceived(5, refused, end=False)]


@pytest.mark.parametrize(
    ("length", "frames"),
    [
        pytest.param(b"3", [data(1, b"abcde")], id="longer-in-one-frame"),
        pytest.param(b"3", [data(1, b"ab"), data(1, b"cd")], id="longer-over-two-frames"),
        pytest.param(b"5", [data(1, b"ab", end=True)], id="shorter-at-end-stream"),
        pytest.param(
            b"5",
            [
                data(1, b"ab"),
                f.frame(f.HEADERS, f.END_HEADERS | f.END_STREAM, 1, b"\x00\x01x\x01y"),
            ],
            id="shorter-at-trailers",
        ),
    ],
)
def test_body_other_than_content_length_resets_the_stream_with_an_event(
    length: bytes, frames: list[bytes]
) -> None:
    srv = ready_server()
    enc = hpack.Encoder()
    srv.receive(hdrs(enc, 1, [*POST, (b"content-length", length)]))
    events = srv.receive(b"".join(frames))
    assert events[-1] == StreamReset(1, ErrorCode.PROTOCOL_ERROR)
    assert all(isinstance(ev, DataReceived) for ev in events[:-1])
    assert parse(srv.data_to_send()) == [rst(1, ErrorCode.PROTOCOL_ERROR)]
    assert only(srv.receive(hdrs(enc, 3, GET, end=True)), RequestReceived)


def test_body_of_exactly_content_length_is_delivered() -> None:
    srv = ready_server()
    enc = hpack.Encoder()
    srv.receive(hdrs(enc, 1, [*POST, (b"content-length", b"5")]))
    events = srv.receive(data(1, b"ab") + data(1, b"cde") + data(1, b"", end=True))
    assert events == [
        DataReceived(1, b"ab", 2, end=False),
        DataReceived(1, b"cde", 3, end=False),
        DataReceived(1, b"", 0, end=True),
    ]


def test_a_reset_streams_data_is_credited_back_so_the_peer_can_send_a_full_window_again() -> None:
    srv = ready_server()
    enc = hpack.Encoder()
    sent = 0
    srv.receive(hdrs(enc, 1, [*POST, (b"content-length", b"1")]))
    frame_size = f.DEFAULT_MAX_FRAME
    events = srv.receive(data(1, b"x" * frame_size))
    sent += frame_size
    assert events == [StreamReset(1, ErrorCode.PROTOCOL_ERROR)]
    srv.receive(hdrs(enc, 3, POST))
    rest = WINDOW - sent  # what the peer may still send
    for piece in chunks(b"y" * rest):
        for ev in only(srv.receive(data(3, piece)), DataReceived):
            srv.acknowledge(3, ev.flow)  # the caller consumes what it was given
        sent += len(piece)
    peer_window = WINDOW - sent + sum(increments(parse(srv.data_to_send()), 0))
    assert peer_window == WINDOW  # the reset stream's bytes came back too
    srv.receive(hdrs(enc, 5, POST))
    for piece in chunks(b"z" * peer_window):
        assert only(srv.receive(data(5, piece)), DataReceived)  # no FLOW_CONTROL_ERROR


def test_data_after_end_stream_is_stream_closed() -> None:
    srv = ready_server()
    enc = hpack.Encoder()
    srv.receive(hdrs(enc, 1, GET, end=True))
    assert srv.receive(data(1, b"late")) == [StreamReset(1, ErrorCode.STREAM_CLOSED)]
    assert parse(srv.data_to_send()) == [rst(1, ErrorCode.STREAM_CLOSED)]
    assert only(srv.receive(hdrs(enc, 3, GET, end=True)), RequestReceived)


def test_headers_after_end_stream_and_trailers_without_end_stream_reset_the_stream() -> None:
    srv = ready_server()
    enc = hpack.Encoder()
    srv.receive(hdrs(enc, 1, GET, end=True) + hdrs(enc, 3, POST))
    events = srv.receive(hdrs(enc, 1, TRAILERS, end=True) + hdrs(enc, 3, TRAILERS))
    assert events == [
        StreamReset(1, ErrorCode.STREAM_CLOSED),
        StreamReset(3, ErrorCode.PROTOCOL_ERROR),
    ]
    assert parse(srv.data_to_send()) == [
        rst(1, ErrorCode.STREAM_CLOSED),
        rst(3, ErrorCode.PROTOCOL_ERROR),
    ]


def test_trailers_with_a_pseudo_header_reset_the_stream() -> None:
    srv = ready_server()
    enc = hpack.Encoder()
    srv.receive(hdrs(enc, 1, POST))
    events = srv.receive(hdrs(enc, 1, [(b":path", b"/x")], end=True))
    assert events == [StreamReset(1, ErrorCode.PROTOCOL_ERROR)]


def test_a_new_request_on_a_lower_stream_id_is_stream_closed_without_an_event() -> None:
    srv = ready_server()
    enc = hpack.Encoder()
    srv.receive(hdrs(enc, 5, GET, end=True))
    assert srv.receive(hdrs(enc, 3, GET, end=True)) == []
    assert parse(srv.data_to_send()) == [rst(3, ErrorCode.STREAM_CLOSED)]


def test_the_reserved_bit_of_a_stream_id_is_ignored_on_receipt() -> None:
    # RFC 9113 4.1: the bit above the 31-bit id "MUST be ignored when receiving".
    srv = ready_server()
    enc = hpack.Encoder()
    frame = bytearray(hdrs(enc, 3, GET) + data(3, b"abc", end=True))
    frame[5] |= 0x80
    second = len(frame) - (f.HEADER_SIZE + 3)
    frame[second + 5] |= 0x80
    events = srv.receive(bytes(frame))
    assert [ev.sid for ev in only(events, RequestReceived)] == [3]
    assert [(ev.sid, ev.data) for ev in only(events, DataReceived)] == [(3, b"abc")]


def test_stream_window_update_of_0_or_past_2_31_resets_only_that_stream() -> None:
    srv = ready_server()
    enc = hpack.Encoder()
    srv.receive(hdrs(enc, 1, POST) + hdrs(enc, 3, POST) + hdrs(enc, 5, POST))
    events = srv.receive(window_update(1, 0) + window_update(3, f.MAX_WINDOW) + window_update(5, 1))
    assert events == [
        StreamReset(1, ErrorCode.PROTOCOL_ERROR),
        StreamReset(3, ErrorCode.FLOW_CONTROL_ERROR),
        WindowUpdated(),
    ]
    assert parse(srv.data_to_send()) == [
        rst(1, ErrorCode.PROTOCOL_ERROR),
        rst(3, ErrorCode.FLOW_CONTROL_ERROR),
    ]
    assert srv.window(5) == WINDOW  # capped by the connection window
    assert srv.receive(window_update(0, 10)) == [WindowUpdated()]
    assert srv.window(5) == WINDOW + 1


def test_peer_overrunning_a_stream_window_gets_flow_control_error_on_that_stream() -> None:
    srv = ready_server(conn_window=1 << 20)
    enc = hpack.Encoder()
    srv.receive(hdrs(enc, 1, POST))
    body = b"o" * WINDOW
    events = []
    for piece in chunks(body):
        events += srv.receive(data(1, piece))
    assert len(only(events, DataReceived)) == 4  # the full window is fine
    assert srv.receive(data(1, b"!")) == [StreamReset(1, ErrorCode.FLOW_CONTROL_ERROR)]
    assert parse(srv.data_to_send()) == [rst(1, ErrorCode.FLOW_CONTROL_ERROR)]


def test_priority_frames_are_ignored_and_a_bad_size_resets_the_stream() -> None:
    srv = ready_server()
    enc = hpack.Encoder()
    srv.receive(hdrs(enc, 1, POST))
    assert srv.receive(f.frame(f.PRIORITY, 0, 1, b"\x00\x00\x00\x03\x10")) == []
    assert srv.receive(f.frame(f.PRIORITY, 0, 1, b"\x00\x00\x00\x03")) == [
        StreamReset(1, ErrorCode.FRAME_SIZE_ERROR)
    ]
    assert srv.receive(f.frame(f.PRIORITY, 0, 9, b"\x00")) == []  # idle: nothing to tell
    assert parse(srv.data_to_send()) == [
        rst(1, ErrorCode.FRAME_SIZE_ERROR),
        rst(9, ErrorCode.FRAME_SIZE_ERROR),
    ]


def test_unknown_frame_types_are_ignored() -> None:
    srv = ready_server()
    assert srv.receive(f.frame(0x20, 0xFF, 0, b"whatever") + f.frame(0xFA, 0, 7, b"")) == []
    assert srv.data_to_send() == b""


@pytest.mark.parametrize(
    ("response", "end"),
    [
        pytest.param([(b":status", b"200"), (b"Server", b"x")], False, id="uppercase"),
        pytest.param([(b"server", b"x")], False, id="no-status"),
        pytest.param([(b":status", b"101")], False, id="switching-protocols"),
        pytest.param([(b":status", b"100")], True, id="informational-with-end-stream"),
        pytest.param([(b":status", b"200"), (b"content-length", b"x")], False, id="bad-length"),
    ],
)
def test_malformed_response_resets_the_stream_with_an_event(response: Headers, end: bool) -> None:
    cli = client_with_stream()
    enc = hpack.Encoder()
    assert cli.receive(hdrs(enc, 1, response, end=end)) == [
        StreamReset(1, ErrorCode.PROTOCOL_ERROR)
    ]
    assert parse(cli.data_to_send()) == [rst(1, ErrorCode.PROTOCOL_ERROR)]
    sid = cli.open_stream(GET, end=True)
    assert cli.receive(hdrs(enc, sid, OK, end=True)) == [ResponseReceived(sid, OK, end=True)]


def test_data_before_the_response_resets_the_stream() -> None:
    cli = client_with_stream()
    assert cli.receive(data(1, b"early")) == [StreamReset(1, ErrorCode.PROTOCOL_ERROR)]


def test_a_forgotten_streams_response_is_still_decoded_so_hpack_stays_in_step() -> None:
    cli = ready_client()
    one = cli.open_stream(GET, end=True)
    two = cli.open_stream(GET, end=True)
    cli.reset_stream(one, ErrorCode.CANCEL)
    enc = hpack.Encoder()
    head = [*OK, (b"x-only-in-one", b"v")]
    assert cli.receive(hdrs(enc, one, head, end=True)) == []
    block = enc.encode(head)
    with pytest.raises(hpack.exceptions.InvalidTableIndex):
        hpack.Decoder().decode(block)
    out = f.frame(f.HEADERS, f.END_HEADERS | f.END_STREAM, two, block)
    assert cli.receive(out) == [ResponseReceived(two, head, end=True)]


def test_padded_data_and_padded_prioritised_headers_are_unwrapped_and_flow_counts_padding() -> None:
    srv = ready_server()
    enc = hpack.Encoder()
    block = enc.encode(POST)
    flags = f.PADDED | f.PRIORITY_FLAG | f.END_HEADERS
    head = f.frame(f.HEADERS, flags, 1, b"\x03" + b"\x00\x00\x00\x00\x20" + block + b"\x00" * 3)
    body = f.frame(f.DATA, f.PADDED | f.END_STREAM, 1, b"\x04abc\x00\x00\x00\x00")
    assert srv.receive(head + body) == [
        RequestReceived(1, POST, end=False),
        DataReceived(1, b"abc", 8, end=True),
    ]


# --- sending rules ------------------------------------------------------------------------


def test_send_data_past_the_window_or_the_frame_size_is_an_assertion() -> None:
    cli = ready_client()
    sid = cli.open_stream(POST, end=False)
    with pytest.raises(AssertionError):
        cli.send_data(sid, b"x" * (f.DEFAULT_MAX_FRAME + 1), end=False)
    for piece in chunks(b"x" * WINDOW):
        cli.send_data(sid, piece, end=False)
    assert cli.window(sid) == 0
    with pytest.raises(AssertionError):
        cli.send_data(sid, b"x", end=False)
    cli.end_stream(sid)  # an empty END_STREAM needs no window
    assert parse(cli.data_to_send())[-1] == Frame(f.DATA, f.END_STREAM, sid, b"")


def test_the_connection_window_bounds_every_stream() -> None:
    cli = ready_client()
    one = cli.open_stream(POST, end=False)
    two = cli.open_stream(POST, end=False)
    for piece in chunks(b"x" * 60_000):
        cli.send_data(one, piece, end=False)
    assert cli.window(two) == WINDOW - 60_000
    assert cli.receive(window_update(two, 1000)) == [WindowUpdated()]
    assert cli.window(two) == WINDOW - 60_000  # the connection is the limit
    assert cli.receive(window_update(0, 70_000)) == [WindowUpdated()]
    assert (cli.window(one), cli.window(two)) == (WINDOW - 60_000, WINDOW + 1000)


def test_calls_on_a_forgotten_or_unknown_stream_raise_stream_closed() -> None:
    cli = ready_client()
    sid = cli.open_stream(POST, end=False)
    cli.reset_stream(sid, ErrorCode.CANCEL)
    assert parse(cli.data_to_send())[-1] == rst(sid, ErrorCode.CANCEL)
    for target in (sid, 99):
        calls: list[Callable[[], object]] = [
            partial(cli.send_headers, target, TRAILERS, end=True),
            partial(cli.send_data, target, b"x", end=False),
            partial(cli.window, target),
            partial(cli.end_stream, target),
            partial(cli.reset_stream, target, ErrorCode.CANCEL),
        ]
        for call in calls:
            with pytest.raises(H2StreamClosedError) as info:
                call()
            assert info.value.sid == target
    cli.acknowledge(sid, 10)  # credits the connection, never raises
    assert cli.data_to_send() == b""


def test_our_ended_side_refuses_more_but_the_stream_lives_until_the_peer_ends() -> None:
    cli = ready_client()
    sid = cli.open_stream(POST, end=False)
    cli.send_data(sid, b"body", end=True)
    calls: list[Callable[[], object]] = [
        partial(cli.window, sid),
        partial(cli.send_data, sid, b"", end=True),
        partial(cli.send_headers, sid, TRAILERS, end=True),
        partial(cli.end_stream, sid),
    ]
    for call in calls:
        with pytest.raises(H2StreamClosedError):
            call()
    enc = hpack.Encoder()
    assert cli.receive(hdrs(enc, sid, OK)) == [ResponseReceived(sid, OK, end=False)]
    assert cli.receive(data(sid, b"", end=True)) == [DataReceived(sid, b"", 0, end=True)]
    with pytest.raises(H2StreamClosedError):
        cli.reset_stream(sid, ErrorCode.CANCEL)  # both ended: forgotten


def test_server_stream_is_forgotten_once_the_peer_ends_after_we_did() -> None:
    srv = ready_server()
    enc = hpack.Encoder()
    srv.receive(hdrs(enc, 1, POST))
    srv.send_headers(1, OK, end=True)
    assert srv.receive(data(1, b"tail", end=True)) == [DataReceived(1, b"tail", 4, end=True)]
    with pytest.raises(H2StreamClosedError):
        srv.reset_stream(1, ErrorCode.CANCEL)
    srv.data_to_send()
    late = data(1, b"x" * 16_000) + data(1, b"y" * 16_000) + data(1, b"z" * 767)
    assert srv.receive(late) == []  # dropped
    assert increments(parse(srv.data_to_send()), 0) == [16_000 + 16_000 + 767]  # credited


def test_a_peer_reset_forgets_the_stream() -> None:
    cli = ready_client()
    sid = cli.open_stream(POST, end=False)
    reset = f.frame(f.RST_STREAM, 0, sid, RST_CANCEL)
    assert cli.receive(reset) == [StreamReset(sid, ErrorCode.CANCEL)]
    with pytest.raises(H2StreamClosedError):
        cli.window(sid)
    assert cli.receive(reset) == []  # a second RST on a closed stream is ignored


def test_frames_coalesce_in_call_order_and_data_to_send_drains_them() -> None:
    cli = ready_client()
    one = cli.open_stream(POST, end=False)
    two = cli.open_stream(GET, end=True)
    cli.send_data(one, b"abc", end=False)
    cli.send_headers(one, TRAILERS, end=True)
    cli.close()
    frames = parse(cli.data_to_send())
    assert [(fr.type, fr.sid) for fr in frames] == [
        (f.HEADERS, one),
        (f.HEADERS, two),
        (f.DATA, one),
        (f.HEADERS, one),
        (f.GOAWAY, 0),
    ]
    assert [fr.flags for fr in frames[:4]] == [
        f.END_HEADERS,
        f.END_HEADERS | f.END_STREAM,
        0,
        f.END_HEADERS | f.END_STREAM,
    ]
    assert frames[2].payload == b"abc"
    assert cli.data_to_send() == b""


def test_open_stream_uses_odd_ids_in_order_and_goaway_stops_it() -> None:
    cli = ready_client()
    assert [cli.open_stream(GET, end=True) for _ in range(3)] == [1, 3, 5]
    events = cli.receive(f.frame(f.GOAWAY, 0, 0, b"\x00\x00\x00\x03\x00\x00\x00\x00debug"))
    assert events == [ConnectionTerminated(3, ErrorCode.NO_ERROR)]
    assert cli.going_away
    with pytest.raises(H2StreamClosedError) as info:
        cli.open_stream(GET, end=True)
    assert info.value.sid == 7
    enc = hpack.Encoder()
    assert cli.receive(hdrs(enc, 3, OK, end=True)) == [ResponseReceived(3, OK, end=True)]


def test_acknowledge_sends_window_updates_once_half_a_window_is_owed() -> None:
    srv = ready_server()
    enc = hpack.Encoder()
    srv.receive(hdrs(enc, 1, POST))
    events = srv.receive(data(1, b"a" * 16_000) + data(1, b"b" * 16_000) + data(1, b"c" * 1000))
    srv.acknowledge(1, 16_000)
    srv.acknowledge(1, 16_000)
    assert srv.data_to_send() == b""  # 32,000 owed: under half of 65,535
    srv.acknowledge(1, 1000)
    frames = parse(srv.data_to_send())
    assert (increments(frames, 0), increments(frames, 1)) == ([33_000], [33_000])
    assert len(events) == 3


def test_no_stream_window_update_after_the_peer_ended_the_stream() -> None:
    srv = ready_server()
    enc = hpack.Encoder()
    srv.receive(hdrs(enc, 1, POST))
    srv.receive(data(1, b"a" * 16_000) + data(1, b"b" * 16_000, end=True) + hdrs(enc, 3, POST))
    srv.acknowledge(1, 32_000)
    srv.acknowledge(3, 1000)
    frames = parse(srv.data_to_send())
    assert increments(frames, 0) == [33_000]
    assert increments(frames, 1) == []


def test_at_most_one_window_updated_per_receive_call() -> None:
    cli = ready_client()
    sid = cli.open_stream(POST, end=False)
    cli.data_to_send()
    events = cli.receive(window_update(0, 5) + window_update(sid, 5) + window_update(0, 5))
    assert events == [WindowUpdated()]
    assert cli.receive(PING) == []
    assert parse(cli.data_to_send()) == [Frame(f.PING, f.ACK, 0, b"pingpong")]
    assert cli.receive(f.frame(f.PING, f.ACK, 0, b"pingpong")) == []
    assert cli.data_to_send() == b""  # a PING ACK is not answered


def test_a_settings_ack_from_the_peer_is_accepted_silently() -> None:
    srv = ready_server()
    assert srv.receive(f.frame(f.SETTINGS, f.ACK, 0)) == []
    assert srv.data_to_send() == b""


# --- partial frames ----------------------------------------------------------------------------


def _server_wire() -> bytes:
    """A client's side of a connection: preface, SETTINGS, a request in three header frames,
    a padded body, trailers, a second request, PING; no frame that grows a window."""
    enc = hpack.Encoder()
    block = enc.encode([*POST, (b"x-long", b"v" * 40)])
    third = len(block) // 3
    return (
        f.PREFACE
        + settings_frame({f.MAX_FRAME_SIZE: 20_000, f.HEADER_TABLE_SIZE: 1024})
        + f.frame(f.HEADERS, 0, 1, block[:third])
        + f.frame(f.CONTINUATION, 0, 1, block[third : 2 * third])
        + f.frame(f.CONTINUATION, f.END_HEADERS, 1, block[2 * third :])
        + f.frame(f.DATA, f.PADDED, 1, b"\x02body\x00\x00")
        + data(1, b"more")
        + hdrs(enc, 1, TRAILERS, end=True)
        + hdrs(enc, 3, GET, end=True)
        + PING
    )


def _feed(wire: bytes, cuts: Iterable[int]) -> tuple[list[Event], bytes]:
    srv = fresh_server()
    events: list[Event] = []
    last = 0
    for cut in [*cuts, len(wire)]:
        events += srv.receive(wire[last:cut])
        last = cut
    return events, srv.data_to_send()


def test_a_stream_split_at_every_byte_boundary_yields_the_same_events_as_one_call() -> None:
    wire = _server_wire()
    whole = _feed(wire, [])
    assert [type(ev) for ev in whole[0]] == [
        RequestReceived,
        DataReceived,
        DataReceived,
        TrailersReceived,
        RequestReceived,
    ]
    assert whole[0][1] == DataReceived(1, b"body", 7, end=False)
    for cut in range(1, len(wire)):
        assert _feed(wire, [cut]) == whole, cut
    assert _feed(wire, range(1, len(wire))) == whole  # one byte at a time


def test_receive_of_nothing_is_nothing() -> None:
    srv = ready_server()
    assert srv.receive(b"") == []
    assert srv.data_to_send() == b""


# --- fuzzing ---------------------------------------------------------------------------------

_BLOCKS = [
    hpack.Encoder().encode(h)
    for h in (GET, POST, OK, TRAILERS, [*POST, (b"content-length", b"3")], [*GET, (b"te", b"x")])
]

_frames = st.lists(
    st.tuples(
        st.integers(min_value=0, max_value=10),
        st.integers(min_value=0, max_value=255),
        st.integers(min_value=0, max_value=8),
        st.one_of(st.binary(max_size=40), st.sampled_from(_BLOCKS)),
    ),
    max_size=12,
)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=400))
@example(HPACK_GARBAGE)  # was TypeError out of receive() in the mypyc build (#620)
def test_arbitrary_bytes_after_the_handshake_give_events_or_a_connection_error(
    garbage: bytes,
) -> None:
    srv = ready_server()
    code = None
    try:
        events = srv.receive(garbage)
    except H2ConnectionError as exc:
        code = exc.code
    else:
        assert isinstance(events, list)
    frames = parse(srv.data_to_send())  # whatever it queued is whole frames
    if code is not None:
        assert goaway(frames)[1] == code


@settings(max_examples=300, deadline=None)
@given(_frames, st.lists(st.integers(min_value=0, max_value=600), max_size=4), st.booleans())
@example([(f.HEADERS, f.END_HEADERS, 1, b"\x82\xbf")], [], False)
def test_arbitrary_frames_in_any_cut_give_events_or_one_connection_error(
    frames: list[tuple[int, int, int, bytes]], cuts: list[int], client: bool
) -> None:
    conn = client_with_stream() if client else ready_server()
    wire = b"".join(f.frame(t, fl, sid, payload) for t, fl, sid, payload in frames)
    last = 0
    code = None
    for cut in [*sorted(cuts), len(wire)]:
        try:
            conn.receive(wire[last:cut])
        except H2ConnectionError as exc:
            code = exc.code
            break
        last = max(last, cut)
    queued = parse(conn.data_to_send())
    if code is not None:
        assert goaway(queued)[1] == code
        with pytest.raises(H2ConnectionError):
            conn.receive(b"")


# --- regressions: bugs found while writing these tests, fixed since ----------------------


def test_a_content_length_too_long_to_parse_is_a_stream_error_not_a_crash() -> None:
    srv = ready_server()
    enc = hpack.Encoder()
    assert srv.receive(hdrs(enc, 1, [*POST, (b"content-length", b"1" * 5000)])) == []
    assert parse(srv.data_to_send()) == [rst(1, ErrorCode.PROTOCOL_ERROR)]


def test_a_request_with_crlf_in_its_path_is_reset_without_an_event() -> None:
    srv = ready_server()
    enc = hpack.Encoder()
    bad = [(b":method", b"GET"), (b":scheme", b"http"), (b":path", b"/a HTTP/1.1\r\nx-evil: 1")]
    assert srv.receive(hdrs(enc, 1, bad, end=True)) == []
    assert parse(srv.data_to_send()) == [rst(1, ErrorCode.PROTOCOL_ERROR)]


def test_a_small_connection_window_still_admits_the_rfc_initial_65535_bytes() -> None:
    srv = ready_server(conn_window=16_384)
    enc = hpack.Encoder()
    srv.receive(hdrs(enc, 1, POST))
    got = 0
    for piece in chunks(b"x" * WINDOW):
        got += sum(ev.flow for ev in only(srv.receive(data(1, piece)), DataReceived))
    assert got == WINDOW


def test_data_sent_before_the_peer_saw_our_smaller_stream_window_is_accepted() -> None:
    srv = codec(client_side=False, stream_window=16_384)
    srv.initiate()
    enc = hpack.Encoder()
    wire = f.PREFACE + settings_frame({}) + hdrs(enc, 1, POST)
    wire += data(1, b"x" * 16_384) + data(1, b"y" * 1000, end=True)
    events = srv.receive(wire)
    assert [ev.flow for ev in only(events, DataReceived)] == [16_384, 1000]
    assert not only(events, StreamReset)


def test_settings_that_shrink_the_stream_windows_yield_no_window_updated() -> None:
    cli = ready_client()
    sid = cli.open_stream(POST, end=False)
    assert cli.receive(settings_frame({f.INITIAL_WINDOW_SIZE: 1000})) == []
    assert cli.window(sid) == 1000


def test_a_smaller_stream_window_holds_once_the_peer_acknowledges_our_settings() -> None:
    srv = codec(client_side=False, stream_window=16_384)
    srv.initiate()
    enc = hpack.Encoder()
    srv.receive(f.PREFACE + settings_frame({}) + hdrs(enc, 1, POST))
    assert only(srv.receive(data(1, b"x" * 16_384) + data(1, b"y" * 3_616)), DataReceived)
    srv.data_to_send()
    assert srv.receive(f.frame(f.SETTINGS, f.ACK, 0)) == []
    # stream 1 had 65,535 - 20,000 left; the ACK takes 49,151 off it: -3,616, nothing more
    assert srv.receive(data(1, b"!")) == [StreamReset(1, ErrorCode.FLOW_CONTROL_ERROR)]
    srv.receive(hdrs(enc, 3, POST))
    assert only(srv.receive(data(3, b"z" * 16_384)), DataReceived)  # a new stream: 16,384
    assert srv.receive(data(3, b"!")) == [StreamReset(3, ErrorCode.FLOW_CONTROL_ERROR)]


def test_a_stream_opened_before_the_ack_gets_back_exactly_what_it_is_owed() -> None:
    srv = codec(client_side=False, stream_window=16_384, conn_window=1 << 20)
    srv.initiate()
    enc = hpack.Encoder()
    srv.receive(f.PREFACE + settings_frame({}) + hdrs(enc, 1, POST) + data(1, b"x" * 16_384))
    srv.receive(data(1, b"y" * 3_616) + f.frame(f.SETTINGS, f.ACK, 0))
    srv.data_to_send()
    srv.acknowledge(1, 20_000)
    assert increments(parse(srv.data_to_send()), 1) == [20_000]  # -3,616 + 20,000 = 16,384
    assert only(srv.receive(data(1, b"z" * 16_384)), DataReceived)
    assert srv.receive(data(1, b"!")) == [StreamReset(1, ErrorCode.FLOW_CONTROL_ERROR)]


def test_the_h2_handshake_yields_no_events_when_no_window_grew() -> None:
    ours = codec(client_side=True)
    ours.initiate()
    theirs = h2_peer(client_side=False)  # its SETTINGS repeat INITIAL_WINDOW_SIZE 65,535
    mine, _ = pump(ours, theirs)
    assert mine == []


def test_settings_that_grow_the_stream_windows_yield_window_updated() -> None:
    cli = ready_client()
    sid = cli.open_stream(POST, end=False)
    assert cli.receive(settings_frame({f.INITIAL_WINDOW_SIZE: 1000})) == []
    assert cli.receive(settings_frame({f.INITIAL_WINDOW_SIZE: 2000})) == [WindowUpdated()]
    assert cli.window(sid) == 2000


@pytest.mark.parametrize(
    ("headers", "bodiless"),
    [
        ([(b":method", b"HEAD"), (b":path", b"/"), (b"accept", b"*/*")], True),
        ([(b":scheme", b"http"), (b":method", b"HEAD"), (b":path", b"/")], True),
        ([(b":method", b"GET"), (b":path", b"/"), (b"x-method", b"HEAD")], False),
        ([(b":path", b"/"), (b"accept", b"*/*"), (b":method", b"HEAD")], False),  # misplaced
        ([], False),
    ],
)
def test_a_head_request_is_known_from_its_pseudo_header_fields(headers, bodiless):
    cli = codec(client_side=True)
    cli.initiate()
    sid = cli.open_stream(headers, end=True)
    assert cli._streams[sid].bodiless is bodiless  # what the response may carry
