"""Pure helpers of agent.proxy.inbound: TLS sniff verdicts, request paths, deny answers."""

from __future__ import annotations

import ssl

import pytest

from agent.policy.authorize import Decision, Reason
from agent.policy.model import Meta
from agent.proxy import http1
from agent.proxy.detect import NEED_MORE
from agent.proxy.inbound import _PLAIN, _sniff_tls, deny_answer, path_of


def _client_hello(sni: str | None) -> bytes:
    """A real ClientHello, produced by OpenSSL through memory BIOs."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    out = ssl.MemoryBIO()
    obj = ctx.wrap_bio(ssl.MemoryBIO(), out, server_hostname=sni)
    with pytest.raises(ssl.SSLWantReadError):
        obj.do_handshake()
    return out.read()


def test_sniff_returns_the_sni_of_a_client_hello():
    assert _sniff_tls(
        _client_hello("web.shop.serviceaccount.identity.linkerd.cluster.local"), False
    ) == ("web.shop.serviceaccount.identity.linkerd.cluster.local")


def test_sniff_waits_for_the_rest_of_a_partial_hello_and_gives_up_at_eof():
    hello = _client_hello("a.b")
    assert _sniff_tls(hello[:3], False) is NEED_MORE
    assert _sniff_tls(hello[:40], False) is NEED_MORE
    assert _sniff_tls(hello[:40], True) is None  # TLS, but no name known: passed through


def test_sniff_says_plain_for_http_and_for_an_empty_eof():
    assert _sniff_tls(b"GET / HTTP/1.1\r\n", False) is _PLAIN
    assert _sniff_tls(b"", True) is _PLAIN


@pytest.mark.parametrize(
    ("target", "path"),
    [
        (b"/a/b?x=1", "/a/b"),
        (b"http://web.shop:80/a?q", "/a"),
        (b"http://web.shop", "/"),
        (b"*", "*"),
    ],
)
def test_path_of_drops_authority_and_query(target, path):
    assert path_of(target) == path


def _denied(reason=Reason.UNAUTHORIZED) -> Decision:
    return Decision(allowed=False, reason=reason, server=Meta(name="web"))


def test_deny_is_403_with_proxy_error_header():
    answer = deny_answer(_denied(), [(b"host", b"x")])
    assert answer.status == 403
    assert answer.response.startswith(b"HTTP/1.1 403 Forbidden\r\n")
    assert b"l5d-proxy-error: unauthorized request on server web" in answer.response


def test_deny_for_grpc_is_status_7_with_http_200():
    answer = deny_answer(_denied(), [(b"Content-Type", b"application/grpc+proto")])
    parser = http1.ResponseParser()
    parser.expect(b"POST")
    head = parser.feed(answer.response)[0]
    assert head.status == 200
    assert http1.get_header(head.headers, b"grpc-status") == b"7"


def test_deny_without_a_route_is_404():
    assert deny_answer(_denied(Reason.NO_ROUTE), []).status == 404
