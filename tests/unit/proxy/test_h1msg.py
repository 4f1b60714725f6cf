"""agent.proxy.h1msg: hop-by-hop and l5d headers, heads as bytes, the proxy's own answers.

Serialized heads and answers are read back with the real parser (agent.proxy.http1).
"""

from __future__ import annotations

import pytest

from agent.proxy.h1msg import (
    dst_override,
    error_response,
    get_header,
    grpc_error_headers,
    grpc_error_response,
    request_head_bytes,
    response_head_bytes,
    set_client_id,
    strip_hop_by_hop,
)
from agent.proxy.http1 import (
    BodyData,
    Framing,
    MessageEnd,
    RequestHead,
    RequestParser,
    ResponseParser,
)


def test_strip_hop_by_hop_removes_standard_proxy_and_connection_named_headers():
    headers = [
        (b"Host", b"a"),
        (b"Connection", b"keep-alive, X-Trace"),
        (b"Keep-Alive", b"timeout=5"),
        (b"X-Trace", b"1"),
        (b"Proxy-Authorization", b"x"),
        (b"TE", b"trailers"),
        (b"Trailer", b"x"),
        (b"Transfer-Encoding", b"chunked"),
        (b"Upgrade", b"h2c"),
        (b"Accept", b"*/*"),
    ]
    assert strip_hop_by_hop(headers) == [(b"Host", b"a"), (b"Accept", b"*/*")]
    kept = strip_hop_by_hop(headers, keep=frozenset({b"transfer-encoding", b"proxy-authorization"}))
    assert (b"Transfer-Encoding", b"chunked") in kept
    assert (b"Proxy-Authorization", b"x") in kept


def test_client_id_from_the_client_is_replaced_by_the_verified_one():
    headers = [(b"L5d-Client-Id", b"forged"), (b"Host", b"a")]
    assert set_client_id(headers, "web.ns.serviceaccount.identity.linkerd.cluster.local") == [
        (b"Host", b"a"),
        (b"l5d-client-id", b"web.ns.serviceaccount.identity.linkerd.cluster.local"),
    ]
    assert set_client_id(headers, None) == [(b"Host", b"a")]


def test_dst_override_and_get_header():
    headers = [(b"L5D-Dst-Override", b"web.shop.svc.cluster.local:80")]
    assert dst_override(headers) == "web.shop.svc.cluster.local:80"
    assert dst_override([(b"l5d-dst-override", b"\xff")]) is None
    assert dst_override([]) is None
    # HTTP/1 and HTTP/2 alike: surrounding whitespace is not part of the value.
    assert dst_override([(b"l5d-dst-override", b" web.shop:80 \t")]) == "web.shop:80"
    assert dst_override([(b"l5d-dst-override", b"  ")]) is None
    assert get_header(headers, b"l5d-dst-override") == b"web.shop.svc.cluster.local:80"
    assert get_header(headers, b"host") is None


def test_serialized_heads_parse_back_to_the_same_facts():
    wire = request_head_bytes(b"POST", b"/p", [(b"Host", b"a"), (b"Content-Length", b"2")]) + b"hi"
    head, body, end = RequestParser().feed(wire)
    assert isinstance(head, RequestHead)
    assert (head.method, head.target, head.framing, head.keep_alive) == (
        b"POST",
        b"/p",
        Framing.CONTENT_LENGTH,
        True,
    )
    assert isinstance(body, BodyData)
    assert bytes(body.data) == b"hi"
    assert isinstance(end, MessageEnd)
    rsp = response_head_bytes(200, [(b"Content-Length", b"0")])
    assert rsp == b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"
    assert response_head_bytes(299, [], reason=b"Odd").startswith(b"HTTP/1.1 299 Odd\r\n")


@pytest.mark.parametrize("status", [403, 502, 503, 504])
def test_error_responses_carry_l5d_proxy_error_and_parse(status):
    wire = error_response(status, "bad\r\nthing", close=True)
    parser = ResponseParser()
    parser.expect(b"GET")
    (head, end) = parser.feed(wire)
    assert head.status == status
    assert get_header(head.headers, b"l5d-proxy-error") == b"bad  thing"
    assert get_header(head.headers, b"l5d-proxy-connection") == b"close"
    assert head.keep_alive is False
    assert isinstance(end, MessageEnd)


def test_grpc_deny_is_http_200_with_grpc_status_7_and_no_body():
    headers = grpc_error_headers(7, "unauthorized 100%")
    assert (b"grpc-status", b"7") in headers
    assert (b"grpc-message", b"unauthorized 100%25") in headers
    parser = ResponseParser()
    parser.expect(b"POST")
    (head, end) = parser.feed(grpc_error_response(7, "denié"))
    assert head.status == 200
    assert get_header(head.headers, b"grpc-message") == b"deni%C3%A9"
    assert get_header(head.headers, b"content-type") == b"application/grpc"
    assert isinstance(end, MessageEnd)


def test_error_response_without_close_keeps_the_connection():
    assert error_response(503, "no endpoints") == (
        b"HTTP/1.1 503 Service Unavailable\r\n"
        b"l5d-proxy-error: no endpoints\r\ncontent-length: 0\r\n\r\n"
    )


def test_strip_hop_by_hop_returns_the_same_list_only_when_nothing_goes() -> None:
    clean = [(b"Host", b"a"), (b"Accept", b"*/*"), (b"Content-Length", b"2")]
    assert strip_hop_by_hop(clean) is clean
    dirty = [(b"Host", b"a"), (b"Proxy-Authorization", b"x"), (b"Pragma", b"no-cache")]
    assert strip_hop_by_hop(dirty) == [(b"Host", b"a"), (b"Pragma", b"no-cache")]
    named = [(b"Connection", b"x-hop"), (b"X-Hop", b"1"), (b"Host", b"a")]
    assert strip_hop_by_hop(named) == [(b"Host", b"a")]
