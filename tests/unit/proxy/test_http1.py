"""The sans-I/O HTTP/1.1 framing core: playbooks, pipelining, splits, malformed input."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.proxy.http1 import (
    BodyData,
    Framing,
    MessageEnd,
    ProtocolError,
    RequestHead,
    RequestParser,
    ResponseHead,
    ResponseParser,
    Upgraded,
)


def summarize(events):
    """Events as comparable tuples; body pieces joined per message."""
    out = []
    for ev in events:
        if isinstance(ev, RequestHead):
            out.append(("req", ev.method, ev.target, ev.framing, ev.keep_alive))
        elif isinstance(ev, ResponseHead):
            out.append(("rsp", ev.status, ev.framing, ev.keep_alive))
        elif isinstance(ev, BodyData):
            if out and out[-1][0] == "body":
                out[-1] = ("body", out[-1][1] + bytes(ev.data))
            else:
                out.append(("body", bytes(ev.data)))
        elif isinstance(ev, MessageEnd):
            out.append(("end", ev.trailers))
        elif isinstance(ev, ProtocolError):
            out.append(("error", ev.status))
        elif isinstance(ev, Upgraded):
            out.append(("upgraded", ev.data))
    return out


def feed_all(parser, pieces, eof=False):
    events = []
    for piece in pieces:
        events += parser.feed(piece)
    if eof:
        events += parser.feed_eof()
    return events


def split_at(data, cuts):
    cuts = sorted({c for c in cuts if 0 < c < len(data)})
    bounds = [0, *cuts, len(data)]
    return [data[a:b] for a, b in itertools.pairwise(bounds)]


PIPELINE = (
    b"GET /a HTTP/1.1\r\nHost: x\r\n\r\n"
    b"POST /b HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello"
    b"PUT /c HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"3;ext=1\r\nabc\r\n2\r\nde\r\n0\r\nX-Sum: 5\r\n\r\n"
    b"GET /d HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
)
RAW_CHUNKED = b"3;ext=1\r\nabc\r\n2\r\nde\r\n0\r\nX-Sum: 5\r\n\r\n"
PIPELINE_EXPECTED = [
    ("req", b"GET", b"/a", Framing.NONE, True),
    ("end", None),
    ("req", b"POST", b"/b", Framing.CONTENT_LENGTH, True),
    ("body", b"hello"),
    ("end", None),
    ("req", b"PUT", b"/c", Framing.CHUNKED, True),
    ("body", RAW_CHUNKED),
    ("end", None),
    ("req", b"GET", b"/d", Framing.NONE, False),
    ("end", None),
]


def test_pipelined_requests_in_one_buffer_come_out_in_order():
    assert summarize(RequestParser().feed(PIPELINE)) == PIPELINE_EXPECTED


@given(st.lists(st.integers(min_value=1, max_value=len(PIPELINE) - 1), max_size=12))
def test_pipelined_requests_split_anywhere_give_the_same_events(cuts):
    events = feed_all(RequestParser(), split_at(PIPELINE, cuts))
    assert summarize(events) == PIPELINE_EXPECTED


def test_every_single_byte_split_of_a_chunked_body_passes_raw_bytes_through():
    head = b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"
    for cut in range(1, len(RAW_CHUNKED)):
        events = feed_all(RequestParser(), [head + RAW_CHUNKED[:cut], RAW_CHUNKED[cut:]])
        assert summarize(events)[1:] == [("body", RAW_CHUNKED), ("end", None)], cut


def test_byte_by_byte_feeding_matches_one_shot_feeding():
    events = feed_all(RequestParser(), [bytes([b]) for b in PIPELINE])
    assert summarize(events) == PIPELINE_EXPECTED


@given(
    chunks=st.lists(st.binary(min_size=1, max_size=40), min_size=1, max_size=6),
    cuts=st.lists(st.integers(min_value=1, max_value=400), max_size=10),
)
def test_decoded_chunked_body_equals_payload_for_any_split(chunks, cuts):
    wire = b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"
    wire += b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in chunks) + b"0\r\nA: b\r\n\r\n"
    events = feed_all(RequestParser(decode_chunked=True), split_at(wire, cuts))
    assert summarize(events) == [
        ("req", b"POST", b"/", Framing.CHUNKED, True),
        ("body", b"".join(chunks)),
        ("end", [(b"A", b"b")]),
    ]


def test_content_length_body_is_a_zero_copy_view_of_the_input():
    parser = RequestParser()
    parser.feed(b"POST / HTTP/1.1\r\nContent-Length: 10\r\n\r\n")
    data = b"0123456789"
    (body, end) = parser.feed(data)
    assert body.data is data
    assert isinstance(end, MessageEnd)


def test_second_request_bytes_wait_while_first_body_is_incomplete():
    parser = RequestParser()
    first = parser.feed(b"POST / HTTP/1.1\r\nContent-Length: 4\r\n\r\nab")
    assert summarize(first)[-1] == ("body", b"ab")
    rest = parser.feed(b"cdGET /next HTTP/1.1\r\n\r\n")
    assert summarize(rest) == [
        ("body", b"cd"),
        ("end", None),
        ("req", b"GET", b"/next", Framing.NONE, True),
        ("end", None),
    ]


def test_request_head_facts():
    (head, _) = RequestParser().feed(
        b"GET /x?y=1 HTTP/1.0\r\nHost: a\r\nConnection: keep-alive\r\nExpect: 100-continue\r\n\r\n"
    )
    assert head.version == b"1.0"
    assert head.keep_alive is True
    assert head.expect_continue is True
    assert head.headers == [
        (b"Host", b"a"),
        (b"Connection", b"keep-alive"),
        (b"Expect", b"100-continue"),
    ]


def test_http10_request_without_keep_alive_closes_and_ignores_later_bytes():
    parser = RequestParser()
    events = parser.feed(b"GET / HTTP/1.0\r\n\r\nGET /ignored HTTP/1.0\r\n\r\n")
    assert summarize(events) == [("req", b"GET", b"/", Framing.NONE, False), ("end", None)]
    assert parser.state == "closed"
    assert parser.feed(b"more") == []


def test_blank_lines_before_a_request_are_tolerated():
    events = RequestParser().feed(b"\r\n\r\nGET / HTTP/1.1\r\n\r\n")
    assert summarize(events)[0][:3] == ("req", b"GET", b"/")


@pytest.mark.parametrize(
    ("wire", "status"),
    [
        (b"GET / HTTP/1.1\r\nContent-Length: 1\r\nTransfer-Encoding: chunked\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\nContent-Length: -1\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\nTransfer-Encoding: gzip\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\nTransfer-Encoding: chunked, gzip\r\n\r\n", 400),
        (b"GET / HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\nX: a\r\n folded\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\nBad Name: a\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\nX: a\nY: b\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\nX: a\x00\r\n\r\n", 400),
        (b"GET /\x01 HTTP/1.1\r\n\r\n", 400),
        (b"GET / HTTP/2.0\r\n\r\n", 505),
        (b"GET / FOO/1.1\r\n\r\n", 400),
        (b"GET  / HTTP/1.1\r\n\r\n", 400),
        (b"G(T / HTTP/1.1\r\n\r\n", 400),
        (b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", 400),
        (b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n1\r\nabc", 400),
        (b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n0\r\nBad Trailer\r\n\r\n", 400),
    ],
)
def test_malformed_requests_become_one_protocol_error_and_stop(wire, status):
    parser = RequestParser()
    events = parser.feed(wire)
    assert isinstance(events[-1], ProtocolError)
    assert events[-1].status == status
    assert parser.state == "error"
    assert parser.feed(b"GET / HTTP/1.1\r\n\r\n") == []
    assert parser.feed_eof() == []


def test_oversized_head_is_431_even_before_it_ends():
    parser = RequestParser(max_head=64)
    events = parser.feed(b"GET / HTTP/1.1\r\n" + b"X: " + b"a" * 100)
    assert events == [ProtocolError(431, "message head too large")]


def test_oversized_complete_head_is_431():
    events = RequestParser(max_head=64).feed(b"GET / HTTP/1.1\r\nX: " + b"a" * 100 + b"\r\n\r\n")
    assert events[0].status == 431


def test_long_chunk_size_line_is_rejected():
    parser = RequestParser()
    parser.feed(b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n")
    assert parser.feed(b"1" * 5000)[-1].status == 400


def test_eof_mid_body_is_an_error_and_clean_eof_is_not():
    parser = RequestParser()
    parser.feed(b"POST / HTTP/1.1\r\nContent-Length: 5\r\n\r\nab")
    assert parser.feed_eof() == [ProtocolError(400, "connection closed in body")]
    assert RequestParser().feed_eof() == []
    partial = RequestParser()
    partial.feed(b"GET / HT")
    assert partial.feed_eof()[0].status == 400


def test_upgrade_request_pauses_until_the_shell_knows_the_answer():
    parser = RequestParser()
    events = parser.feed(
        b"GET /ws HTTP/1.1\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\nframe-bytes"
    )
    assert events[0].upgrade == b"websocket"
    assert isinstance(events[-1], MessageEnd)
    assert parser.state == "paused"
    assert parser.feed(b"-more") == []
    assert parser.upgrade_accepted() == b"frame-bytes-more"
    assert parser.feed(b"x") == []


def test_declined_upgrade_resumes_parsing_buffered_requests():
    parser = RequestParser()
    parser.feed(
        b"GET / HTTP/1.1\r\nConnection: upgrade\r\nUpgrade: h2c\r\n\r\nGET /2 HTTP/1.1\r\n\r\n"
    )
    assert summarize(parser.upgrade_declined()) == [
        ("req", b"GET", b"/2", Framing.NONE, True),
        ("end", None),
    ]
    assert parser.upgrade_declined() == []


def test_declined_upgrade_with_nothing_buffered_returns_no_events():
    parser = RequestParser()
    parser.feed(b"CONNECT h:443 HTTP/1.1\r\n\r\n")
    assert parser.state == "paused"
    assert parser.feed_eof() == []
    assert parser.upgrade_declined() == []
    assert parser.state == "head"


def test_upgrade_header_without_connection_upgrade_is_not_an_upgrade():
    (head, _) = RequestParser().feed(b"GET / HTTP/1.1\r\nUpgrade: websocket\r\n\r\n")
    assert head.upgrade is None


# --- responses ------------------------------------------------------------------


def response_events(wire, *requests, eof=False, decode=False):
    parser = ResponseParser(decode_chunked=decode)
    for method, upgrade in requests:
        parser.expect(method, upgrade=upgrade)
    return summarize(feed_all(parser, [wire], eof=eof)), parser


@pytest.mark.parametrize(
    ("method", "status"),
    [(b"HEAD", 200), (b"GET", 204), (b"GET", 304), (b"HEAD", 404)],
)
def test_bodiless_responses_end_at_the_head_whatever_their_length_headers(method, status):
    wire = b"HTTP/1.1 %d X\r\nContent-Length: 10\r\n\r\n" % status
    got, parser = response_events(
        wire + b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\n\r\nz", (method, False), (b"GET", False)
    )
    assert got == [
        ("rsp", status, Framing.NONE, True),
        ("end", None),
        ("rsp", 200, Framing.CONTENT_LENGTH, True),
        ("body", b"z"),
        ("end", None),
    ]
    assert parser.state == "head"


def test_interim_100_continue_precedes_the_final_response():
    got, _ = response_events(
        b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok",
        (b"POST", False),
    )
    assert got == [
        ("rsp", 100, Framing.NONE, True),
        ("end", None),
        ("rsp", 200, Framing.CONTENT_LENGTH, True),
        ("body", b"ok"),
        ("end", None),
    ]


def test_response_without_length_runs_until_close():
    got, parser = response_events(b"HTTP/1.1 200 OK\r\n\r\nabc", (b"GET", False), eof=True)
    assert got == [("rsp", 200, Framing.UNTIL_CLOSE, False), ("body", b"abc"), ("end", None)]
    assert parser.state == "closed"


def test_response_with_unknown_transfer_coding_runs_until_close():
    got, _ = response_events(
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\nContent-Length: 1\r\n\r\nabc",
        (b"GET", False),
    )
    assert got[0] == ("rsp", 200, Framing.UNTIL_CLOSE, False)


def test_chunked_response_with_trailers_decoded():
    got, _ = response_events(
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"4\r\ndata\r\n0\r\ngrpc-status: 0\r\n\r\n",
        (b"POST", False),
        decode=True,
    )
    assert got == [
        ("rsp", 200, Framing.CHUNKED, True),
        ("body", b"data"),
        ("end", [(b"grpc-status", b"0")]),
    ]


def test_101_to_an_upgrade_request_switches_to_opaque():
    got, parser = response_events(
        b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n\r\n\x81\x00", (b"GET", True)
    )
    assert got == [("rsp", 101, Framing.NONE, True), ("end", None), ("upgraded", b"\x81\x00")]
    assert parser.state == "switched"
    assert parser.feed(b"more") == []


def test_2xx_to_connect_switches_to_opaque():
    got, _ = response_events(b"HTTP/1.1 200 OK\r\n\r\ntunnel", (b"CONNECT", False))
    assert got[-1] == ("upgraded", b"tunnel")


def test_101_without_upgrade_request_is_a_bad_gateway():
    got, _ = response_events(b"HTTP/1.1 101 Switching\r\n\r\n", (b"GET", False))
    assert got == [("error", 502)]


def test_unsolicited_response_is_a_bad_gateway():
    got, _ = response_events(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
    assert got == [("error", 502)]


@pytest.mark.parametrize(
    "wire",
    [
        b"HTTP/1.1 20 OK\r\n\r\n",
        b"HTTP/1.1 abc OK\r\n\r\n",
        b"HTTP/1.1 099 OK\r\n\r\n",
        b"HTTP/3.0 200 OK\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: x\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nab",
    ],
)
def test_malformed_responses_are_bad_gateway(wire):
    got, _ = response_events(wire, (b"GET", False), eof=True)
    assert got[-1] == ("error", 502)


def test_pipelined_responses_pair_with_their_requests():
    wire = (
        b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\nabc"
        b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\n"
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
    )
    got, _ = response_events(wire, (b"GET", False), (b"HEAD", False), (b"GET", False))
    assert [g[0] for g in got] == ["rsp", "body", "end", "rsp", "end", "rsp", "body", "end"]
    assert got[-2] == ("body", b"0\r\n\r\n")


def test_response_status_line_without_reason_is_accepted():
    got, _ = response_events(b"HTTP/1.0 200\r\nContent-Length: 0\r\n\r\n", (b"GET", False))
    assert got == [("rsp", 200, Framing.CONTENT_LENGTH, False), ("end", None)]


@settings(max_examples=300)
@given(st.binary(max_size=300), st.lists(st.integers(min_value=1, max_value=300), max_size=5))
def test_request_parser_never_raises_on_arbitrary_bytes(data, cuts):
    parser = RequestParser()
    events = feed_all(parser, split_at(data, cuts), eof=True)
    errors = [e for e in events if isinstance(e, ProtocolError)]
    assert len(errors) <= 1
    if errors:
        assert events[-1] is errors[0]


@settings(max_examples=300)
@given(st.binary(max_size=300), st.sampled_from([b"GET", b"HEAD", b"CONNECT"]), st.booleans())
def test_response_parser_never_raises_on_arbitrary_bytes(data, method, upgrade):
    parser = ResponseParser(decode_chunked=upgrade)
    parser.expect(method, upgrade=upgrade)
    events = parser.feed(b"HTTP/1.1 200 OK\r\n" + data) + parser.feed_eof()
    assert all(not isinstance(e, ProtocolError) or e.status == 502 for e in events)


# --- header helpers -----------------------------------------------------------


def test_bytearray_and_memoryview_input_are_accepted():
    parser = RequestParser()
    events = parser.feed(bytearray(b"GET / HTTP/1.1\r\n\r\n")) + parser.feed(
        memoryview(b"GET /2 HTTP/1.1\r\n\r\n")
    )
    assert [e.target for e in events if isinstance(e, RequestHead)] == [b"/", b"/2"]


def test_oversized_trailers_are_rejected():
    parser = RequestParser(max_head=50)
    parser.feed(b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n")
    assert parser.feed(b"X: " + b"a" * 64)[-1] == ProtocolError(400, "trailers too large")


def test_input_of_only_blank_lines_waits_quietly_and_closes_cleanly():
    parser = RequestParser()
    assert parser.feed(b"\r\n\r\n") == []
    assert parser.state == "head"
    assert parser.feed_eof() == []


# --- fast paths (head cache, whole-message feeds) give what the full parser gives ---

GET = b"GET /fast HTTP/1.1\r\nHost: fastpath.test\r\nAccept: */*\r\n\r\n"
OK = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 5\r\n\r\nhello"


def _bytes(ev: object) -> bytes:
    assert isinstance(ev, BodyData)
    return bytes(ev.data)


def test_repeated_request_parses_like_the_first_and_shares_the_cached_head() -> None:
    parser = RequestParser()
    first = parser.feed(GET)
    second = parser.feed(GET)  # the head is cached now: the fast path answers
    for events in (first, second):
        assert len(events) == 2
        head, end = events
        assert isinstance(head, RequestHead)
        assert isinstance(end, MessageEnd)
        assert (head.method, head.target, head.framing, head.keep_alive) == (
            b"GET",
            b"/fast",
            Framing.NONE,
            True,
        )
    head1, head2 = first[0], second[0]
    assert isinstance(head1, RequestHead)
    assert isinstance(head2, RequestHead)
    assert head1.headers == head2.headers
    # Heads are immutable by contract, so the cache hands out one object, not copies.
    assert parser.feed(GET)[0] is head2
    assert parser.state == "head"


def test_cached_request_with_connection_close_ends_the_parser() -> None:
    close = b"GET /bye HTTP/1.1\r\nHost: fastpath.test\r\nConnection: close\r\n\r\n"
    RequestParser().feed(close)  # cache it
    parser = RequestParser()
    events = parser.feed(close)
    head = events[0]
    assert isinstance(head, RequestHead)
    assert head.keep_alive is False
    assert parser.state == "closed"
    assert parser.feed(GET) == []  # later input is ignored


def test_cached_head_over_a_smaller_parser_limit_is_still_rejected() -> None:
    big = b"GET / HTTP/1.1\r\nHost: fastpath.test\r\nX-Pad: " + b"a" * 300 + b"\r\n\r\n"
    RequestParser().feed(big)  # cached by a parser with the default limit
    events = RequestParser(max_head=100).feed(big)
    assert len(events) == 1
    assert isinstance(events[0], ProtocolError)
    assert events[0].status == 431


def test_repeated_response_keeps_its_body_and_a_head_request_gets_none() -> None:
    parser = ResponseParser()
    for _ in range(3):
        parser.expect(b"GET")
        head, body, end = parser.feed(OK)
        assert isinstance(head, ResponseHead)
        assert (head.status, head.framing, head.content_length) == (200, Framing.CONTENT_LENGTH, 5)
        assert _bytes(body) == b"hello"
        assert isinstance(end, MessageEnd)
    parser.expect(b"HEAD")
    head_only = OK[: -len(b"hello")]
    events = parser.feed(head_only)
    assert len(events) == 2
    assert isinstance(events[0], ResponseHead)
    assert events[0].framing is Framing.NONE
    assert isinstance(events[1], MessageEnd)
    assert parser.state == "head"


def test_cached_response_split_or_followed_by_more_bytes_takes_the_full_parser() -> None:
    parser = ResponseParser()
    parser.expect(b"GET")
    parser.feed(OK)  # cache the head
    parser.expect(b"GET")
    parser.expect(b"GET")
    events = parser.feed(OK + OK[:20])  # one whole response and the start of the next
    assert [type(e) for e in events] == [ResponseHead, BodyData, MessageEnd]
    assert _bytes(events[1]) == b"hello"
    rest = parser.feed(OK[20:])
    assert [type(e) for e in rest] == [ResponseHead, BodyData, MessageEnd]
    assert _bytes(rest[1]) == b"hello"


def test_response_without_a_request_is_an_error_even_when_cached() -> None:
    warm = ResponseParser()
    warm.expect(b"GET")
    warm.feed(OK)
    events = ResponseParser().feed(OK)
    assert len(events) == 1
    assert isinstance(events[0], ProtocolError)
    assert events[0].status == 502


def test_response_head_keeps_its_received_bytes_for_unchanged_forwarding() -> None:
    block = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nX-A:  b\r\n"
    for _ in range(2):  # parsed, then from the head cache (fast path)
        p = ResponseParser()
        p.expect(b"GET")
        evs = p.feed(block + b"\r\nhi")
        head = evs[0]
        assert isinstance(head, ResponseHead)
        assert head.raw == block[:-2]


def test_request_head_keeps_its_bytes_as_received_also_when_cached():
    block = b"GET /raw-kept HTTP/1.1\r\nHost: a\r\nX-Odd:   spaced\r\n"
    for _ in range(2):  # parsed, then from the head cache
        p = RequestParser()
        head = p.feed(block + b"\r\n")[0]
        assert isinstance(head, RequestHead)
        assert head.raw == block.removesuffix(b"\r\n")


def test_request_whole_takes_only_a_lone_cached_request_with_all_of_its_body() -> None:
    post = b"POST /w HTTP/1.1\r\nHost: whole.test\r\nContent-Length: 2\r\n\r\nhi"
    get = b"GET /whole HTTP/1.1\r\nHost: whole.test\r\n\r\n"
    parser = RequestParser()
    assert parser.whole(get) is None  # not seen before: nothing consumed
    assert parser.state == "head"
    first = parser.feed(get)[0]
    assert parser.whole(get) is first  # the cached head; the parser moved past it
    assert parser.state == "head"
    assert parser.whole(get + get) is None  # more than one message
    assert parser.whole(get[:-2]) is None  # not all of it
    assert parser.whole(post) is None  # not seen before
    posted = parser.feed(post)
    head = parser.whole(post)  # a body, all of it here
    assert head is posted[0]
    assert post[len(head.raw) + 4 :] == b"hi"  # where the body starts
    assert parser.whole(post[:-1]) is None  # not all of the body
    assert parser.whole(post + b"x") is None  # more than the body
    assert parser.whole(post + get) is None  # and the next request
    # Its events are the full parser's, the body a view of what was read.
    fast = parser.feed(post)
    assert [type(e) for e in fast] == [RequestHead, BodyData, MessageEnd]
    assert fast[0] is head
    assert _bytes(fast[1]) == b"hi"
    empty = b"POST /w HTTP/1.1\r\nHost: whole.test\r\nContent-Length: 0\r\n\r\n"
    parser.feed(empty)
    assert [type(e) for e in parser.feed(empty)] == [RequestHead, MessageEnd]
    chunked = b"POST /w HTTP/1.1\r\nHost: whole.test\r\nTransfer-Encoding: chunked\r\n\r\n"
    chunked += b"2\r\nhi\r\n0\r\n\r\n"
    parser.feed(chunked)
    assert parser.whole(chunked) is None  # chunked: the full parser's
    connect = b"CONNECT a.test:443 HTTP/1.1\r\nHost: a.test:443\r\n\r\n"
    RequestParser().feed(connect)
    assert RequestParser().whole(connect) is None  # may switch protocols: never
    # What `whole` declined is still parsed in full by `feed`, in order.
    events = parser.feed(get + get[:10])
    assert [type(e) for e in events] == [RequestHead, MessageEnd]
    assert parser.whole(get[10:]) is None  # the parser holds a partial head
    assert [type(e) for e in parser.feed(get[10:])] == [RequestHead, MessageEnd]
    close = b"GET /whole-close HTTP/1.1\r\nHost: whole.test\r\nConnection: close\r\n\r\n"
    RequestParser().feed(close)
    closing = RequestParser()
    head = closing.whole(close)
    assert head is not None
    assert head.keep_alive is False
    assert closing.state == "closed"


def test_response_whole_needs_its_request_a_cached_head_and_exactly_the_body() -> None:
    ok = b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nX-Whole: 1\r\n\r\nhello"
    parser = ResponseParser()
    assert parser.whole(ok) is None  # no request sent
    parser.expect(b"GET")
    assert parser.whole(ok) is None  # head not seen before: nothing consumed
    first = parser.feed(ok)[0]
    assert isinstance(first, ResponseHead)
    parser.expect(b"GET")
    head = parser.whole(ok)
    assert head is first
    assert ok[len(head.raw) + 4 :] == b"hello"  # where the body starts
    parser.expect(b"GET")
    assert parser.whole(ok[:-1]) is None  # body not all here
    assert parser.whole(ok + b"x") is None  # more than the body
    assert [type(e) for e in parser.feed(ok)] == [ResponseHead, BodyData, MessageEnd]
    parser.expect(b"HEAD")  # the same bytes answer a HEAD without a body: another table
    assert parser.whole(ok[: -len(b"hello")]) is None
    parser.feed(ok[: -len(b"hello")])
    parser.expect(b"HEAD")
    head_only = parser.whole(ok[: -len(b"hello")])
    assert head_only is not None
    assert head_only.framing is Framing.NONE
    parser.expect(b"CONNECT")  # may switch protocols: never the shortcut
    assert parser.whole(ok) is None
    assert parser.state == "head"


def test_whole_knows_a_repeated_message_by_its_last_head_and_everything_else_as_before() -> None:
    a = b"GET /a HTTP/1.1\r\nHost: repeat.test\r\n\r\n"
    b = b"GET /b HTTP/1.1\r\nHost: repeat.test\r\n\r\n"
    unseen = b"GET /unseen-repeat HTTP/1.1\r\nHost: repeat.test\r\n\r\n"
    parser = RequestParser()
    head_a, head_b = parser.feed(a)[0], parser.feed(b)[0]
    assert [parser.whole(x) for x in (a, a, b, a)] == [head_a, head_a, head_b, head_a]
    assert parser.whole(a + b"\r\n") is None  # the last head's bytes and more: not whole
    assert parser.whole(unseen) is None
    assert [type(e) for e in parser.feed(unseen)] == [RequestHead, MessageEnd]
    assert parser.whole(a) is head_a

    ok = b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n"
    longer = b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nX-More: 1\r\n\r\n"  # ok's head is its prefix
    resp = ResponseParser()
    resp.expect(b"GET")
    first = resp.feed(ok + b"hello")[0]
    for body in (b"hello", b"world"):  # the same head, another body of its length
        resp.expect(b"GET")
        assert resp.whole(ok + body) is first
    resp.expect(b"GET")
    assert resp.whole(ok + b"hello" + ok) is None  # a second response behind it
    assert resp.whole(longer + b"hello") is None  # another head, not seen before
    assert resp.whole(ok[:-2]) is None
    events = resp.feed(longer + b"hello")
    assert isinstance(events[0], ResponseHead)
    assert events[0].headers[-1] == (b"X-More", b"1")
    resp.expect(b"HEAD")  # the same bytes as the last head answer HEAD from the other table
    assert resp.whole(longer) is None
