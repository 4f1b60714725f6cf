"""h2frame: the frame layout and the checks of received header lists (RFC 9113 8.2, 8.3)."""

from __future__ import annotations

import struct
from typing import TYPE_CHECKING

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent.proxy import h2frame as f
from agent.proxy.h2frame import ErrorCode

if TYPE_CHECKING:
    from agent.proxy.h2events import Headers

GET: Headers = [(b":method", b"GET"), (b":scheme", b"https"), (b":path", b"/a?b=c")]


# --- frame layout ------------------------------------------------------------------------


def test_frame_is_a_nine_byte_header_then_the_payload() -> None:
    out = f.frame(f.DATA, f.END_STREAM, 5, b"abc")
    assert out == b"\x00\x00\x03" + b"\x00" + b"\x01" + b"\x00\x00\x00\x05" + b"abc"
    assert f.HEADER.size == f.HEADER_SIZE == 9


def test_frame_length_is_24_bits_and_the_stream_id_31() -> None:
    out = f.frame(f.HEADERS, f.END_HEADERS | f.PADDED, f.SID_MASK, b"x" * 70000)
    assert out[:3] == (70000).to_bytes(3, "big")
    assert (out[3], out[4]) == (f.HEADERS, 0x0C)
    assert out[5:9] == b"\x7f\xff\xff\xff"
    assert len(out) == 9 + 70000
    hi, lo, ftype, flags, sid = f.HEADER.unpack_from(out)
    assert ((hi << 8) | lo, ftype, flags, sid) == (70000, f.HEADERS, 0x0C, f.SID_MASK)


def test_frame_without_payload_is_the_header_alone() -> None:
    assert f.frame(f.SETTINGS, f.ACK, 0) == b"\x00\x00\x00\x04\x01\x00\x00\x00\x00"


def test_settings_payload_is_six_bytes_per_setting_in_order() -> None:
    out = f.settings_payload({f.INITIAL_WINDOW_SIZE: 1 << 20, f.ENABLE_PUSH: 0})
    assert out == b"\x00\x04\x00\x10\x00\x00" + b"\x00\x02\x00\x00\x00\x00"
    assert list(f.SETTING.iter_unpack(out)) == [(4, 1 << 20), (2, 0)]


def test_wire_constants_are_the_rfc_values() -> None:
    assert f.PREFACE == b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
    assert (f.DEFAULT_WINDOW, f.DEFAULT_MAX_FRAME, f.MAX_FRAME_LIMIT) == (65535, 16384, 16777215)
    assert f.MAX_WINDOW == f.SID_MASK == 2**31 - 1
    types = (f.DATA, f.HEADERS, f.PRIORITY, f.RST_STREAM, f.SETTINGS, f.PUSH_PROMISE)
    assert (*types, f.PING, f.GOAWAY, f.WINDOW_UPDATE, f.CONTINUATION) == tuple(range(10))
    assert [int(c) for c in ErrorCode] == list(range(14))
    assert (int(ErrorCode.REFUSED_STREAM), int(ErrorCode.COMPRESSION_ERROR)) == (7, 9)


# --- check_request ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "headers",
    [
        pytest.param(GET, id="plain-get"),
        pytest.param([*GET, (b":authority", b"a:80")], id="authority"),
        pytest.param([*GET, (b":authority", b"a"), (b"host", b"a")], id="host-agrees"),
        pytest.param([*GET, (b"host", b"a")], id="host-without-authority"),
        pytest.param([*GET, (b"te", b"trailers")], id="te-trailers"),
        pytest.param([*GET, (b"x-empty", b"")], id="empty-value"),
        pytest.param([*GET, (b"x-a", b"in ner\tvalue")], id="inner-whitespace"),
        pytest.param([*GET, (b"x-a", b"\x80\xff")], id="obs-text-value"),
        pytest.param([*GET, (b"x-a", b"1"), (b"x-a", b"2")], id="repeated-field"),
        pytest.param([(b":path", b"/"), (b":method", b"GET"), (b":scheme", b"h")], id="any-order"),
        pytest.param(
            [(b":method", b"OPTIONS"), (b":scheme", b"http"), (b":path", b"*")], id="star"
        ),
        pytest.param([(b":method", b"CONNECT"), (b":authority", b"db:5432")], id="connect"),
        pytest.param([*GET, (b"x!#$%&'*+-.^_`|~09", b"v")], id="token-chars"),
    ],
)
def test_well_formed_requests_pass(headers: Headers) -> None:
    assert f.check_request(headers) is None


@pytest.mark.parametrize(
    ("headers", "why"),
    [
        pytest.param([*GET, (b"X-Up", b"v")], "lowercase", id="uppercase-name"),
        pytest.param([*GET, (b"", b"v")], "lowercase", id="empty-name"),
        pytest.param([*GET, (b"a b", b"v")], "lowercase", id="space-in-name"),
        pytest.param([*GET, (b"a\x7f", b"v")], "lowercase", id="del-in-name"),
        pytest.param([*GET, (b"caf\xe9", b"v")], "lowercase", id="non-ascii-name"),
        pytest.param([*GET, (b"x", b"a\x00b")], "NUL, CR or LF", id="nul-in-value"),
        pytest.param([*GET, (b"x", b"a\rb")], "NUL, CR or LF", id="cr-in-value"),
        pytest.param([*GET, (b"x", b"a\nb")], "NUL, CR or LF", id="lf-in-value"),
        pytest.param([*GET, (b"x", b" a")], "whitespace", id="leading-space"),
        pytest.param([*GET, (b"x", b"a\t")], "whitespace", id="trailing-tab"),
        pytest.param([*GET, (b"connection", b"close")], "connection-specific", id="connection"),
        pytest.param([*GET, (b"keep-alive", b"5")], "connection-specific", id="keep-alive"),
        pytest.param([*GET, (b"proxy-connection", b"x")], "connection-specific", id="proxy-conn"),
        pytest.param(
            [*GET, (b"transfer-encoding", b"chunked")], "connection-specific", id="te-chunked"
        ),
        pytest.param([*GET, (b"upgrade", b"h2c")], "connection-specific", id="upgrade"),
        pytest.param([*GET, (b"te", b"gzip")], "te other than trailers", id="te-gzip"),
        pytest.param([*GET, (b"te", b"trailers, gzip")], "te other", id="te-list"),
        pytest.param(GET[1:], "without :method", id="no-method"),
        pytest.param([(b":method", b""), *GET[1:]], "without :method", id="empty-method"),
        pytest.param([GET[0], GET[2]], "without :scheme", id="no-scheme"),
        pytest.param(GET[:2], "without :path", id="no-path"),
        pytest.param([*GET[:2], (b":path", b"")], "without :path", id="empty-path"),
        pytest.param([GET[0], (b"x", b"1"), *GET[1:]], "after a regular field", id="pseudo-late"),
        pytest.param([*GET, (b":method", b"PUT")], "twice", id="duplicate-method"),
        pytest.param([*GET[:2], (b":path", b"/"), (b":path", b"/")], "twice", id="duplicate-path"),
        pytest.param([*GET, (b":status", b"200")], "not allowed", id="status-in-request"),
        pytest.param([*GET, (b":protocol", b"websocket")], "not allowed", id="unknown-pseudo"),
        pytest.param(
            [*GET, (b":authority", b"a"), (b"host", b"b")], ":authority and host", id="host-differs"
        ),
        pytest.param(
            [*GET, (b":authority", b"a"), (b"host", b"a"), (b"host", b"b")],
            ":authority and host",
            id="second-host-differs",
        ),
        pytest.param(
            [(b":method", b"CONNECT"), (b":authority", b"a:1"), (b":path", b"/")],
            "CONNECT",
            id="connect-with-path",
        ),
        pytest.param(
            [(b":method", b"CONNECT"), (b":authority", b"a:1"), (b":scheme", b"https")],
            "CONNECT",
            id="connect-with-scheme",
        ),
        pytest.param([(b":method", b"CONNECT")], "CONNECT", id="connect-no-authority"),
        pytest.param(
            [(b":method", b"CONNECT"), (b":authority", b"")],
            "CONNECT",
            id="connect-empty-authority",
        ),
    ],
)
def test_malformed_requests_are_named(headers: Headers, why: str) -> None:
    reason = f.check_request(headers)
    assert reason is not None
    assert why in reason


@pytest.mark.parametrize(
    "headers",
    [
        pytest.param([*GET[:2], (b":path", b"/a\r\nx-injected: 1")], id="crlf-in-path"),
        pytest.param([*GET, (b":authority", b"a\x00b")], id="nul-in-authority"),
        pytest.param([(b":method", b"GET\n"), *GET[1:]], id="lf-in-method"),
        pytest.param([*GET, (b"x:y", b"1")], id="colon-in-name"),
        pytest.param([*GET, (b"x-a:", b"1")], id="trailing-colon-in-name"),
    ],
)
def test_forbidden_characters_in_pseudo_values_and_names_are_malformed(headers: Headers) -> None:
    assert f.check_request(headers) is not None


# --- check_response / check_trailers -------------------------------------------------------


@pytest.mark.parametrize(
    "headers",
    [
        [(b":status", b"200")],
        [(b":status", b"100")],
        [(b":status", b"599"), (b"content-type", b"text/plain"), (b"te", b"trailers")],
    ],
)
def test_well_formed_responses_pass(headers: Headers) -> None:
    assert f.check_response(headers) is None


@pytest.mark.parametrize(
    ("headers", "why"),
    [
        pytest.param([], ":status", id="empty"),
        pytest.param([(b"content-type", b"x")], ":status", id="no-status"),
        pytest.param([(b":status", b"20")], ":status", id="two-digits"),
        pytest.param([(b":status", b"2000")], ":status", id="four-digits"),
        pytest.param([(b":status", b"2x0")], ":status", id="not-digits"),
        pytest.param([(b":status", b"")], ":status", id="empty-status"),
        pytest.param([(b":status", b"200"), (b":status", b"204")], "twice", id="duplicate"),
        pytest.param([(b":status", b"200"), (b":path", b"/")], "not allowed", id="path-in-resp"),
        pytest.param([(b"x", b"1"), (b":status", b"200")], "after a regular", id="pseudo-late"),
        pytest.param([(b":status", b"200"), (b"Server", b"x")], "lowercase", id="uppercase"),
        pytest.param([(b":status", b"200"), (b"connection", b"x")], "connection", id="conn"),
        pytest.param([(b":status", b"200"), (b"x", b"a\r\n")], "NUL, CR or LF", id="crlf-value"),
    ],
)
def test_malformed_responses_are_named(headers: Headers, why: str) -> None:
    reason = f.check_response(headers)
    assert reason is not None
    assert why in reason


@pytest.mark.parametrize(
    "headers", [[], [(b"grpc-status", b"0"), (b"grpc-message", b"")], [(b"x", b"1"), (b"x", b"2")]]
)
def test_well_formed_trailers_pass(headers: Headers) -> None:
    assert f.check_trailers(headers) is None


@pytest.mark.parametrize(
    ("headers", "why"),
    [
        pytest.param([(b":status", b"200")], "not allowed", id="status"),
        pytest.param([(b":path", b"/")], "not allowed", id="path"),
        pytest.param([(b"grpc-status", b"0"), (b":status", b"200")], "after", id="late-pseudo"),
        pytest.param([(b"Grpc-Status", b"0")], "lowercase", id="uppercase"),
        pytest.param([(b"transfer-encoding", b"chunked")], "connection", id="connection-field"),
        pytest.param([(b"te", b"deflate")], "te other", id="te"),
        pytest.param([(b"x", b" 1")], "whitespace", id="whitespace"),
    ],
)
def test_malformed_trailers_are_named(headers: Headers, why: str) -> None:
    reason = f.check_trailers(headers)
    assert reason is not None
    assert why in reason


# --- content_length ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        pytest.param([], None, id="absent"),
        pytest.param([(b"content-type", b"x")], None, id="other-fields"),
        pytest.param([(b"content-length", b"0")], 0, id="zero"),
        pytest.param([(b"content-length", b"1234")], 1234, id="number"),
        pytest.param([(b"content-length", b"007")], 7, id="leading-zeros"),
        pytest.param([(b"content-length", b"9" * 18)], 10**18 - 1, id="eighteen-digits"),
        pytest.param([(b"content-length", b"5"), (b"content-length", b"5")], 5, id="same-twice"),
        pytest.param([(b"content-length", b"5"), (b"content-length", b"6")], -1, id="conflict"),
        pytest.param([(b"content-length", b"")], -1, id="empty"),
        pytest.param([(b"content-length", b"-1")], -1, id="negative"),
        pytest.param([(b"content-length", b"+5")], -1, id="plus"),
        pytest.param([(b"content-length", b"1.0")], -1, id="decimal"),
        pytest.param([(b"content-length", b"0x10")], -1, id="hex"),
        pytest.param([(b"content-length", b"5, 5")], -1, id="list"),
        pytest.param([(b"content-length", b"5"), (b"content-length", b"x")], -1, id="bad-second"),
        pytest.param([(b"content-length", b"\xd9\xa3")], -1, id="non-ascii-digit"),
    ],
)
def test_content_length_is_the_declared_length_or_minus_one(
    headers: Headers, expected: int | None
) -> None:
    assert f.content_length(headers) == expected


def test_content_length_of_a_huge_digit_string_does_not_raise() -> None:
    assert f.content_length([(b"content-length", b"9" * 5000)]) == -1  # int() would raise


def test_a_remembered_field_is_still_checked_for_its_place_in_the_list() -> None:
    assert f.check_request([*GET, (b"x-seen", b"1")]) is None
    reason = f.check_request([(b"x-seen", b"1"), *GET])
    assert reason is not None
    assert "after a regular field" in reason
    assert f.check_request([*GET, (b":path", b"/again")]) is not None  # twice, though good


def test_a_malformed_field_is_never_remembered() -> None:
    bad = [*GET, (b"x-bad", b"a\r\nb")]
    assert f.check_request(bad) is not None
    assert f.check_request(bad) is not None


def test_the_memory_of_well_formed_fields_is_bounded() -> None:
    for i in range(f._GOOD_MAX + 10):
        assert f.check_trailers([(b"x-n", b"%d" % i)]) is None
    assert 0 < len(f._GOOD) <= f._GOOD_MAX


@given(
    st.integers(0, 255),
    st.integers(0, 255),
    st.integers(0, (1 << 31) - 1),
    st.binary(max_size=300),
)
def test_a_frame_is_its_nine_byte_header_then_its_payload(ftype, flags, sid, payload):
    size = len(payload)
    want = struct.pack(">HBBBL", size >> 8, size & 0xFF, ftype, flags, sid) + payload
    assert f.frame(ftype, flags, sid, payload) == want
