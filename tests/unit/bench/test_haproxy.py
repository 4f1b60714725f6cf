"""HAProxy config rendering for the bench's peer setups."""

from __future__ import annotations

import pytest

from agent.bench.haproxy import Route, TlsFiles, render


def test_http_route_renders_mode_bind_and_server():
    cfg = render([Route(name="web", bind="127.0.0.1:18080", target="10.0.0.3:8080", mode="http")])
    assert "listen web\n    mode http\n    bind 127.0.0.1:18080\n" in cfg
    assert "    server s1 10.0.0.3:8080\n" in cfg
    assert "nbthread 2" in cfg


def test_tls_routes_are_mutual_and_tls13_on_both_sides():
    tls = TlsFiles(cert="/c.pem", ca="/ca.crt")
    out = Route(name="o", bind="127.0.0.1:1", target="10.0.0.3:18443", target_tls=tls, sni="s.x")
    inb = Route(name="i", bind="0.0.0.0:18443", target="127.0.0.1:8080", bind_tls=tls)
    cfg = render([out, inb])
    assert (
        "server s1 10.0.0.3:18443 ssl crt /c.pem ca-file /ca.crt verify required "
        "ssl-min-ver TLSv1.3 sni str(s.x) verifyhost s.x"
    ) in cfg
    assert "bind 0.0.0.0:18443 ssl crt /c.pem ca-file /ca.crt verify required" in cfg


def test_http_mode_over_tls_keeps_its_connections_and_offers_alpn_on_the_tls_sides():
    tls = TlsFiles(cert="/c.pem", ca="/ca.crt")
    out = Route(
        name="o",
        bind="127.0.0.1:1",
        target="10.0.0.3:18443",
        mode="http",
        target_tls=tls,
        sni="s.x",
        alpn="h2",
    )
    inb = Route(name="i", bind="0.0.0.0:18443", target="127.0.0.1:8080", bind_tls=tls, alpn="h2")
    cfg = render([out, inb])
    assert (
        "listen o\n    mode http\n    bind 127.0.0.1:1\n    option httplog\n    http-reuse always\n"
        in cfg
    )
    assert "server s1 10.0.0.3:18443 ssl crt /c.pem" in cfg
    assert "verifyhost s.x alpn h2\n" in cfg
    # a clear upstream
    assert "ssl-min-ver TLSv1.3 alpn h2\n    option tcplog\n    server s1 127.0.0.1:8080\n" in cfg
    with pytest.raises(ValueError, match="alpn needs a TLS side"):
        Route(name="x", bind="a:1", target="b:2", mode="http", alpn="h2")


def test_bad_mode_and_duplicate_names_are_refused():
    with pytest.raises(ValueError, match="mode"):
        Route(name="x", bind="a:1", target="b:2", mode="udp")
    r = Route(name="x", bind="a:1", target="b:2")
    with pytest.raises(ValueError, match="unique"):
        render([r, r])
    with pytest.raises(ValueError, match="at least one"):
        render([])


def test_only_abnormal_connections_are_logged_to_stderr_in_each_modes_format():
    cfg = render(
        [
            Route(name="web", bind="127.0.0.1:1", target="10.0.0.3:8080", mode="http"),
            Route(name="raw", bind="127.0.0.1:2", target="10.0.0.3:8080"),
        ]
    )
    assert "    log stderr format raw local0\n" in cfg
    assert "    log global\n    option dontlog-normal\n" in cfg
    assert "listen web\n    mode http\n    bind 127.0.0.1:1\n    option httplog\n" in cfg
    assert "listen raw\n    mode tcp\n    bind 127.0.0.1:2\n    option tcplog\n" in cfg
