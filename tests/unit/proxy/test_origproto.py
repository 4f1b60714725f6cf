"""HTTP/1 over h2 between proxies (`l5d-orig-proto`): the head conversions both ways."""

from __future__ import annotations

import pytest

from agent import aio
from agent.proxy import origproto
from agent.proxy.h2conn import H2Conn
from agent.proxy.h2stream import END, Data, H2Stream, StreamGoneError
from agent.proxy.http1 import RequestHead, RequestParser, ResponseHead, ResponseParser


def _request(raw: bytes) -> RequestHead:
    head = RequestParser().feed(raw)[0]
    assert isinstance(head, RequestHead)
    return head


def _response(raw: bytes, method: bytes = b"GET") -> ResponseHead:
    parser = ResponseParser()
    parser.expect(method)
    head = parser.feed(raw)[0]
    assert isinstance(head, ResponseHead)
    return head


def test_an_origin_form_request_becomes_h2_headers_with_its_mark():
    head = _request(
        b"GET /a?b=1 HTTP/1.1\r\nHost: web.shop:80\r\nX-Trace: 7\r\n"
        b"Connection: keep-alive, x-hop\r\nX-Hop: 1\r\nTE: trailers\r\n"
        b"l5d-orig-proto: HTTP/1.0; absolute-form\r\n\r\n"
    )
    assert origproto.upgradable(head)
    assert origproto.upgrade_request(head, head.headers) == [
        (b":method", b"GET"),
        (b":scheme", b"http"),
        (b":authority", b"web.shop:80"),
        (b":path", b"/a?b=1"),
        (b"x-trace", b"7"),
        (b"l5d-orig-proto", b"HTTP/1.1"),
    ]


def test_an_absolute_form_request_says_so_and_takes_its_authority_from_the_uri():
    head = _request(b"GET http://api.shop:8080 HTTP/1.0\r\nHost: other\r\n\r\n")
    got = origproto.upgrade_request(head, head.headers)
    assert got is not None
    assert dict(got)[b":authority"] == b"api.shop:8080"
    assert dict(got)[b":path"] == b"/"
    assert dict(got)[b"l5d-orig-proto"] == b"HTTP/1.0; absolute-form"
    assert b"host" not in dict(got)


@pytest.mark.parametrize(
    "raw",
    [
        b"GET / HTTP/1.1\r\nHost: a\r\nConnection: upgrade\r\nUpgrade: websocket\r\n\r\n",
        b"CONNECT a:443 HTTP/1.1\r\nHost: a:443\r\n\r\n",
        b"POST / HTTP/1.1\r\nHost: a\r\nExpect: 100-continue\r\nContent-Length: 3\r\n\r\n",
        b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n",
    ],
    ids=["upgrade", "connect", "expect", "chunked"],
)
def test_requests_h2_cannot_carry_stay_http1(raw):
    assert not origproto.upgradable(_request(raw))


@pytest.mark.parametrize(
    "raw",
    [b"GET / HTTP/1.0\r\n\r\n", b"OPTIONS * HTTP/1.1\r\nHost: a\r\n\r\n"],
    ids=["no-authority", "asterisk"],
)
def test_requests_without_an_authority_or_a_path_are_not_converted(raw):
    head = _request(raw)
    assert origproto.upgrade_request(head, head.headers) is None


def test_the_downgrade_restores_the_http1_request_and_drops_the_mark():
    h2 = [
        (b":method", b"POST"),
        (b":scheme", b"http"),
        (b":authority", b"web.shop"),
        (b":path", b"/submit"),
        (b"content-length", b"5"),
        (b"l5d-orig-proto", b"HTTP/1.1"),
        (b"l5d-client-id", b"a.ns.serviceaccount.identity.linkerd.cluster.local"),
    ]
    down = origproto.downgrade_request(h2)
    assert down is not None
    head, chunked = down.head_bytes(end=False)
    assert not chunked
    assert head == (
        b"POST /submit HTTP/1.1\r\nhost: web.shop\r\ncontent-length: 5\r\n"
        b"l5d-client-id: a.ns.serviceaccount.identity.linkerd.cluster.local\r\n\r\n"
    )
    parsed = _request(head)  # our own parser takes it
    assert parsed.content_length == 5


def test_a_body_without_a_length_is_chunked_and_a_bodiless_post_says_zero():
    h2 = [
        (b":method", b"POST"),
        (b":authority", b"a"),
        (b":path", b"/"),
        (b"l5d-orig-proto", b"HTTP/1.0"),
    ]
    down = origproto.downgrade_request(h2)
    assert down is not None
    head, chunked = down.head_bytes(end=False)
    assert chunked
    assert head.startswith(b"POST / HTTP/1.1\r\n")  # chunked needs 1.1
    assert b"transfer-encoding: chunked\r\n" in head
    head, chunked = down.head_bytes(end=True)
    assert not chunked
    assert head.startswith(b"POST / HTTP/1.0\r\n")
    assert b"content-length: 0\r\n" in head


def test_the_absolute_form_comes_back():
    h2 = [
        (b":method", b"GET"),
        (b":scheme", b"http"),
        (b":authority", b"api:8080"),
        (b":path", b"/x"),
        (b"l5d-orig-proto", b"HTTP/1.1; absolute-form"),
    ]
    down = origproto.downgrade_request(h2)
    assert down is not None
    assert down.head_bytes(end=True)[0].startswith(b"GET http://api:8080/x HTTP/1.1\r\n")


def test_a_downgrade_keeps_the_fields_in_order_and_a_host_the_client_sent():
    h2 = [
        (b":method", b"GET"),
        (b":path", b"/a?b"),
        (b"accept", b"*/*"),
        (b"l5d-orig-proto", b"HTTP/1.1"),
        (b"host", b"given"),
        (b":authority", b"ignored-for-host"),
        (b"x-b", b"2"),
        (b":path", b"/second"),
    ]
    down = origproto.downgrade_request(h2)
    assert down is not None
    assert (down.method, down.target, down.version) == (b"GET", b"/a?b", b"1.1")
    assert down.fields == [(b"accept", b"*/*"), (b"host", b"given"), (b"x-b", b"2")]


def test_an_unmarked_stream_is_not_downgraded():
    assert origproto.downgrade_request([(b":method", b"GET"), (b":path", b"/")]) is None


def test_the_apps_response_is_marked_and_loses_its_framing():
    resp = _response(
        b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nTransfer-Encoding: chunked\r\n"
        b"Connection: keep-alive\r\n\r\n"
    )
    assert origproto.upgrade_response(resp) == [
        (b":status", b"200"),
        (b"content-type", b"text/plain"),
        (b"l5d-orig-proto", b"HTTP/1.1"),
    ]


def _keepalive_get(version: bytes = b"1.1") -> RequestHead:
    return _request(b"GET / HTTP/" + version + b"\r\nHost: a\r\n\r\n")


def test_a_response_with_a_length_keeps_it_and_the_mark_is_removed():
    h2 = [(b":status", b"200"), (b"content-length", b"2"), (b"l5d-orig-proto", b"HTTP/1.1")]
    out, chunked, keep = origproto.downgrade_response(h2, _keepalive_get(), end=False)
    assert (chunked, keep) == (False, True)
    assert out == b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n"


def test_a_response_without_a_length_is_chunked_for_http11_and_closed_for_http10():
    h2 = [(b":status", b"200")]
    out, chunked, keep = origproto.downgrade_response(h2, _keepalive_get(), end=False)
    assert (chunked, keep) == (True, True)
    assert b"transfer-encoding: chunked\r\n" in out
    out, chunked, keep = origproto.downgrade_response(h2, _keepalive_get(b"1.0"), end=False)
    assert (chunked, keep) == (False, False)
    assert b"connection: close\r\n" in out


def test_a_response_that_ended_with_its_headers_says_zero_unless_it_has_no_body():
    out, chunked, _ = origproto.downgrade_response(
        [(b":status", b"200")], _keepalive_get(), end=True
    )
    assert b"content-length: 0\r\n" in out
    assert not chunked
    out, _, _ = origproto.downgrade_response([(b":status", b"204")], _keepalive_get(), end=True)
    assert b"content-length" not in out


def test_chunks_and_trailers():
    assert origproto.chunk(b"hello") == b"5\r\nhello\r\n"
    assert origproto.chunk(b"") == b""
    assert origproto.last_chunk() == b"0\r\n\r\n"
    assert origproto.last_chunk([(b"grpc-status", b"0")]) == b"0\r\ngrpc-status: 0\r\n\r\n"


def test_a_chunked_bodys_trailers_become_h2_trailers():
    parser = ResponseParser(decode_chunked=True)
    parser.expect(b"GET")
    events = parser.feed(
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
        b"2\r\nhi\r\n0\r\nX-Digest: abc\r\nConnection: close\r\nServer-Timing: db;dur=3\r\n\r\n"
    )
    trailers = events[-1].trailers
    assert origproto.upgrade_trailers(trailers) == [
        (b"x-digest", b"abc"),  # lowercased; the connection-specific field dropped
        (b"server-timing", b"db;dur=3"),
    ]
    assert origproto.upgrade_trailers([]) == []


# --- take_body (rule 6) -------------------------------------------------------------------

LIMIT = 64 * 1024


def _stream(*items: object) -> H2Stream:
    stream = H2Stream(H2Conn(client_side=False), 1)
    for item in items:
        stream.push(item)  # type: ignore[arg-type]
    return stream


def test_a_body_that_arrived_with_its_end_goes_whole_with_the_head() -> None:
    async def main() -> None:
        stream = _stream(Data(b"ab", 0), Data(b"cd", 0), END)
        parts = [b"HEAD"]
        assert origproto.take_body(stream, parts, chunked=False, limit=LIMIT)
        assert parts == [b"HEAD", b"ab", b"cd"]
        assert stream.next_now() is None

    aio.run(main())


def test_a_chunked_body_is_encoded_and_closed_with_the_last_chunk() -> None:
    async def main() -> None:
        stream = _stream(Data(b"ab", 0), END)
        parts = [b"HEAD"]
        assert origproto.take_body(stream, parts, chunked=True, limit=LIMIT)
        assert parts == [b"HEAD", origproto.chunk(b"ab"), origproto.last_chunk()]

    aio.run(main())


def test_a_body_still_arriving_leaves_the_rest_to_the_stream() -> None:
    async def main() -> None:
        stream = _stream(Data(b"ab", 0))
        parts = [b"HEAD"]
        assert not origproto.take_body(stream, parts, chunked=False, limit=LIMIT)
        assert parts == [b"HEAD", b"ab"]
        big = b"x" * LIMIT
        stream = _stream(Data(big, 0), Data(b"tail", 0), END)
        parts = [b"HEAD"]
        assert not origproto.take_body(stream, parts, chunked=False, limit=LIMIT)  # at most LIMIT
        assert parts == [b"HEAD", big]
        left = stream.next_now()  # what is left stays queued for the body loop
        assert isinstance(left, Data)
        assert left.data == b"tail"
        assert stream.next_now() is END

    aio.run(main())


def test_a_reset_stream_fails_as_the_body_loop_would() -> None:
    async def main() -> None:
        stream = _stream(Data(b"ab", 0))
        stream.peer_reset(8)
        with pytest.raises(StreamGoneError):
            origproto.take_body(stream, [b"HEAD"], chunked=False, limit=LIMIT)

    aio.run(main())
