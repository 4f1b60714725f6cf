"""Protocol detection and TLS ClientHello/SNI parsing on connection prefixes."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.proxy.detect import (
    H2_PREFACE,
    NEED_MORE,
    Protocol,
    detect,
    is_tls_client_hello,
    parse_sni,
)


@pytest.mark.parametrize(
    ("prefix", "expected"),
    [
        (b"GET / HTTP/1.1\r\nHost: a\r\n\r\n", Protocol.HTTP1),
        (b"POST /x HTTP/1.0\r\n", Protocol.HTTP1),
        (b"CONNECT h:443 HTTP/1.1\r\n", Protocol.HTTP1),
        (H2_PREFACE, Protocol.HTTP2),
        (H2_PREFACE + b"\x00\x00\x12\x04", Protocol.HTTP2),
        (b"SSH-2.0-OpenSSH_9.2\r\n", Protocol.OPAQUE),
        (b"\x16\x03\x01\x02\x00\x01", Protocol.OPAQUE),
        (b"FOO / HTTP/1.1\r\n", Protocol.OPAQUE),
        (b"GET / HTTP/1.1 extra\r\n", Protocol.OPAQUE),
        (b"GET / HTTP/2.0\r\n", Protocol.OPAQUE),
        (b"GET  HTTP/1.1\r\n", Protocol.OPAQUE),
        (b"GET /\x01 HTTP/1.1\r\n", Protocol.OPAQUE),
        (b"GET /a b c", Protocol.OPAQUE),
        (b"GET /\x00", Protocol.OPAQUE),
        (b"PRX", Protocol.OPAQUE),
        (b"GETTING", Protocol.OPAQUE),
    ],
)
def test_complete_prefixes_are_classified(prefix, expected):
    assert detect(prefix, eof=False) == expected


@pytest.mark.parametrize(
    "prefix", [b"", b"G", b"GE", b"GET", b"GET /", b"GET / HTTP/1.1", b"P", b"PRI * HTTP/2"]
)
def test_partial_prefixes_need_more_unless_eof(prefix):
    assert detect(prefix, eof=False) is NEED_MORE
    assert detect(prefix, eof=True) is Protocol.OPAQUE


def test_request_line_longer_than_the_limit_is_opaque():
    assert detect(b"GET /" + b"a" * 100, eof=False, max_len=64) is Protocol.OPAQUE
    assert detect(b"GET", eof=False, max_len=3) is Protocol.OPAQUE


@settings(max_examples=500)
@given(st.binary(max_size=200), st.booleans())
def test_detect_never_raises_and_decides_at_eof(data, eof):
    result = detect(data, eof=eof)
    if eof:
        assert isinstance(result, Protocol)


@given(st.binary(max_size=64))
def test_known_prefix_plus_anything_keeps_its_protocol(tail):
    assert detect(H2_PREFACE + tail, eof=False) is Protocol.HTTP2
    assert detect(b"GET / HTTP/1.1\r\n" + tail, eof=False) is Protocol.HTTP1


# --- TLS -------------------------------------------------------------------------


def vec(width, payload):
    return len(payload).to_bytes(width, "big") + payload


def client_hello(sni=None, *, extra_ext=b"", record_split=None):
    exts = extra_ext
    if sni is not None:
        name = b"\x00" + vec(2, sni.encode())
        exts += struct.pack(">H", 0) + vec(2, vec(2, name))
    body = (
        b"\x03\x03" + b"r" * 32 + vec(1, b"s" * 32) + vec(2, b"\x13\x01\x13\x02") + vec(1, b"\x00")
    )
    body += vec(2, exts)
    handshake = b"\x01" + len(body).to_bytes(3, "big") + body
    if record_split is None:
        return b"\x16\x03\x01" + vec(2, handshake)
    a, b = handshake[:record_split], handshake[record_split:]
    return b"\x16\x03\x01" + vec(2, a) + b"\x16\x03\x01" + vec(2, b)


def test_sni_is_read_from_a_client_hello():
    hello = client_hello(
        "Web.NS.serviceaccount.identity.linkerd.cluster.local",
        extra_ext=b"\x00\x0b\x00\x02\x01\x00",
    )
    assert is_tls_client_hello(hello) is True
    assert parse_sni(hello) == "web.ns.serviceaccount.identity.linkerd.cluster.local"


def test_hello_without_sni_gives_none():
    assert parse_sni(client_hello()) is None
    no_ext = b"\x03\x03" + b"r" * 32 + b"\x00" + vec(2, b"\x13\x01") + vec(1, b"\x00")
    assert parse_sni(b"\x16\x03\x01" + vec(2, b"\x01" + vec(3, no_ext))) is None


def test_sni_in_a_hello_spread_over_two_records_is_found():
    assert parse_sni(client_hello("a.example", record_split=10)) == "a.example"
    assert parse_sni(client_hello("a.example", record_split=2)) == "a.example"


def test_every_truncation_of_a_hello_needs_more():
    hello = client_hello("a.example", record_split=20)
    for cut in range(len(hello)):
        assert parse_sni(hello[:cut]) is NEED_MORE, cut


@pytest.mark.parametrize(
    ("prefix", "expected"),
    [
        (b"", NEED_MORE),
        (b"\x16", NEED_MORE),
        (b"\x16\x03", NEED_MORE),
        (b"\x16\x03\x01\x00", NEED_MORE),
        (b"\x17\x03\x01\x00\x10\x01", False),
        (b"\x16\x02\x01\x00\x10\x01", False),
        (b"\x16\x03\x05\x00\x10\x01", False),
        (b"\x16\x03\x01\x00\x10\x02", False),
        (b"\x16\x03\x01\x00\x00\x01", False),
        (b"GET / HTTP/1.1\r\n", False),
    ],
)
def test_client_hello_recognition(prefix, expected):
    assert is_tls_client_hello(prefix) is expected


@pytest.mark.parametrize(
    "bad",
    [
        b"\x17\x03\x01\x00\x05hello",  # not a handshake record
        b"\x16\x03\x01\x00\x00",  # empty record
        b"\x16\x03\x01\x00\x04\x02\x00\x00\x00",  # ServerHello
        b"\x16\x03\x01\x00\x04\x01\xff\xff\xff",  # absurd length
        b"\x16\x03\x01\x00\x06\x01\x00\x00\x02\x03\x03",  # hello too short for random
    ],
)
def test_malformed_hellos_give_none(bad):
    assert parse_sni(bad) is None


def test_malformed_extensions_give_none():
    broken_name = struct.pack(">H", 0) + vec(2, vec(2, b"\x00\x00\x10ab"))
    assert parse_sni(client_hello(extra_ext=broken_name)) is None
    assert parse_sni(client_hello(extra_ext=b"\x00\x0b\x00\x09")) is None
    assert parse_sni(client_hello(extra_ext=b"\x00")) is None
    ctl_name = struct.pack(">H", 0) + vec(2, vec(2, b"\x00" + vec(2, b"a\x01b")))
    assert parse_sni(client_hello(extra_ext=ctl_name)) is None
    other_type = struct.pack(">H", 0) + vec(2, vec(2, b"\x01" + vec(2, b"x")))
    assert parse_sni(client_hello(extra_ext=other_type)) is None
    short_entry = struct.pack(">H", 0) + vec(2, vec(2, b"\x00\x00"))
    assert parse_sni(client_hello(extra_ext=short_entry)) is None


@settings(max_examples=500)
@given(st.binary(max_size=300))
def test_tls_parsers_never_raise(data):
    for prefix in (data, b"\x16\x03\x01" + data, client_hello("x.y")[:60] + data):
        assert is_tls_client_hello(prefix) in (True, False, NEED_MORE)
        result = parse_sni(prefix)
        assert result is None or result is NEED_MORE or isinstance(result, str)


def hello_with_extensions_area(area):
    """A ClientHello whose extensions area (length prefix included) is given raw."""
    body = b"\x03\x03" + b"r" * 32 + vec(1, b"") + vec(2, b"\x13\x01") + vec(1, b"\x00") + area
    return b"\x16\x03\x03" + vec(2, b"\x01" + vec(3, body))


@pytest.mark.parametrize(
    "area",
    [
        # an extension whose data runs past the end of the extensions list
        b"\x00\x04" + b"\x00\x0b\x00\x05" + b"12345",
        # server_name list shorter than the extension data
        b"\x00\x09" + b"\x00\x00\x00\x05" + b"\x00\x01\x00" + b"zz",
        # host name running past the server_name list into the next extension
        b"\x00\x0e" + b"\x00\x00\x00\x05" + b"\x00\x03\x00\x00\x05" + b"\x00\x0b\x00\x01\x00",
    ],
)
def test_inconsistent_extension_lengths_give_none(area):
    assert parse_sni(hello_with_extensions_area(area)) is None


def test_extensions_area_with_sni_after_another_extension():
    sni = b"\x00\x00" + vec(2, vec(2, b"\x00" + vec(2, b"b.example")))
    area = vec(2, b"\x00\x0b\x00\x02\x01\x00" + sni)
    assert parse_sni(hello_with_extensions_area(area)) == "b.example"
