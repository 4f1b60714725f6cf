"""h2msg: proxy answers, gRPC status reading, client-id rewriting for HTTP/2 streams."""

from __future__ import annotations

import h2.config
import h2.connection
import h2.events
from hpack import NeverIndexedHeaderTuple
from hypothesis import given
from hypothesis import strategies as st

from agent.proxy import h2msg

GRPC_REQ = [
    (b":method", b"POST"),
    (b":path", b"/t.T/Echo?x=1"),
    (b":authority", b"svc:50051"),
    (b"content-type", b"application/grpc+proto"),
]


def test_grpc_request_is_recognised_and_method_path_drop_the_query():
    assert h2msg.is_grpc(GRPC_REQ)
    assert not h2msg.is_grpc([(b":method", b"GET"), (b"content-type", b"text/plain")])
    assert h2msg.method_path(GRPC_REQ) == ("POST", "/t.T/Echo")


def test_client_id_is_replaced_by_the_verified_identity_or_dropped():
    forged = [*GRPC_REQ, (b"l5d-client-id", b"admin")]
    out = h2msg.with_client_id(forged, "alpha.shop")
    assert [v for k, v in out if k == b"l5d-client-id"] == [b"alpha.shop"]
    assert [k for k, _ in h2msg.with_client_id(forged, None)].count(b"l5d-client-id") == 0


def test_grpc_answers_are_trailers_only_with_the_mapped_status():
    deny = h2msg.answer_for(403, "no", grpc=True)
    assert deny.grpc == h2msg.GRPC_PERMISSION_DENIED
    assert h2msg.answer_for(504, "slow", grpc=True).grpc == h2msg.GRPC_DEADLINE_EXCEEDED
    assert h2msg.answer_for(502, "down", grpc=True).grpc == h2msg.GRPC_UNAVAILABLE
    headers = h2msg.answer_headers(h2msg.answer_for(504, "request timed out", grpc=True))
    assert headers[0] == (b":status", b"200")
    assert h2msg.grpc_status(headers) == 4
    assert h2msg.header(headers, b"l5d-proxy-error") == b"request timed out"
    assert h2msg.answer_outcome(deny) == (200, True)


def test_plain_answers_carry_the_http_status_and_the_proxy_error():
    answer = h2msg.answer_for(503, "no endpoints\r\nfor x", grpc=False)
    headers = h2msg.answer_headers(answer)
    assert h2msg.status_of(headers) == 503
    assert h2msg.header(headers, b"l5d-proxy-error") == b"no endpoints  for x"
    assert h2msg.grpc_status(headers) is None
    assert h2msg.answer_outcome(answer) == (503, True)
    assert h2msg.answer_outcome(h2msg.answer_for(403, "no", grpc=False)) == (403, False)


def test_unparsable_statuses_read_as_unknown():
    assert h2msg.status_of([(b":status", b"abc")]) == 0
    assert h2msg.grpc_status([(b"grpc-status", b"x")]) is None
    assert h2msg.grpc_status([(b"grpc-status", b"13")]) == 13


def test_request_head_for_the_recorder_names_method_path_and_host():
    head = h2msg.RequestHead(GRPC_REQ)
    assert (head.method, head.target) == (b"POST", b"/t.T/Echo?x=1")
    assert (b"host", b"svc:50051") in head.headers
    assert all(not k.startswith(b":") for k, _ in head.headers)


def test_credentials_and_short_cookies_are_marked_never_indexed_and_nothing_else():
    headers = [
        (b":method", b"GET"),
        (b"authorization", b"Bearer t"),
        (b"proxy-authorization", b"Basic x"),
        (b"cookie", b"short=1"),
        (b"cookie", b"long=" + b"x" * 40),
        (b"x-other", b"v"),
    ]
    out = h2msg.protect(headers)
    never = [isinstance(h, NeverIndexedHeaderTuple) for h in out]
    assert never == [False, True, True, True, False, False]
    assert [tuple(h) for h in out] == headers  # same names and values, same order
    assert not isinstance(headers[1], NeverIndexedHeaderTuple)  # the input is left alone


def test_protect_returns_the_same_list_when_nothing_needs_marking():
    plain = [(b":status", b"200"), (b"content-type", b"text/plain")]
    assert h2msg.protect(plain) is plain
    marked = [NeverIndexedHeaderTuple(b"authorization", b"x")]
    assert h2msg.protect(marked) is marked


def _h2_pair() -> tuple[h2.connection.H2Connection, h2.connection.H2Connection, int]:
    """A client and a server h2 connection (both validating) with one open request stream."""
    client = h2.connection.H2Connection(h2.config.H2Configuration(header_encoding=None))
    server = h2.connection.H2Connection(
        h2.config.H2Configuration(client_side=False, header_encoding=None)
    )
    client.initiate_connection()
    server.initiate_connection()
    request = [(b":method", b"GET"), (b":path", b"/"), (b":scheme", b"http"), (b":authority", b"a")]
    client.send_headers(1, request, end_stream=True)
    server.receive_data(client.data_to_send())
    client.receive_data(server.data_to_send())
    return client, server, 1


@given(
    status=st.sampled_from([403, 502, 503, 504]),
    message=st.text(max_size=60),
    grpc=st.booleans(),
)
def test_answers_pass_h2_validation_on_both_sides_whatever_the_message(status, message, grpc):
    client, server, sid = _h2_pair()
    headers = h2msg.answer_headers(h2msg.answer_for(status, message, grpc=grpc))
    server.send_headers(sid, headers, end_stream=True)  # h2's outbound checks are on here
    events = client.receive_data(server.data_to_send())  # and its inbound ones
    got = next(e for e in events if isinstance(e, h2.events.ResponseReceived))
    assert h2msg.status_of(list(got.headers)) == (200 if grpc else status)


def test_routing_facts_are_what_routing_reads_in_one_pass() -> None:
    headers = [
        (b":method", b"POST"),
        (b":path", b"/t.T/Echo?x=1"),
        (b"content-type", b"application/grpc+proto"),
        (b"grpc-timeout", b"99m"),
        (b"l5d-dst-override", b"web.shop.svc.cluster.local:80"),
        (b":path", b"/second"),  # only the first of each counts
    ]
    facts = h2msg.routing_facts(headers)
    assert facts == (
        b"POST",
        b"/t.T/Echo",
        b"web.shop.svc.cluster.local:80",
        b"application/grpc+proto",
    )
    assert h2msg.is_grpc_type(facts[3])
    # Another timeout or query: the same facts; another method or path: not.
    other = [(b"grpc-timeout", b"12m") if k == b"grpc-timeout" else (k, v) for k, v in headers]
    assert h2msg.routing_facts(other) == facts
    assert h2msg.routing_facts([(b":method", b"GET"), *headers[1:]]) != facts
    assert h2msg.routing_facts([]) == (None, None, None, None)
    for path, plain in ((b"/plain", b"/plain"), (b"/?", b"/"), (b"?q", b"")):
        assert h2msg.routing_facts([(b":path", path)])[1] == plain
    assert not h2msg.is_grpc_type(None)
    assert not h2msg.is_grpc_type(b"text/plain")


@given(st.binary(max_size=5))
def test_status_of_reads_any_digits_and_gives_0_for_what_is_not_a_number(raw):
    want = int(raw) if raw.isdigit() else 0
    assert h2msg.status_of([(b":status", raw), (b"content-length", b"2")]) == want


def test_status_of_every_three_digit_code_and_a_missing_status():
    assert [h2msg.status_of([(b":status", b"%d" % c)]) for c in (100, 200, 404, 599)] == [
        100,
        200,
        404,
        599,
    ]
    assert h2msg.status_of([(b":status", b"0200")]) == 200
    assert h2msg.status_of([(b"content-length", b"0")]) == 0


_NAMES = st.sampled_from(
    [b"authorization", b"authorizatioX", b"proxy-authorization", b"cookie", b"cookiX",
     b"l5d-client-id", b"l5d-client-iX", b":path", b"x-other"]
)  # fmt: skip
_FIELDS = st.lists(
    st.tuples(_NAMES, st.binary(max_size=30)).map(
        lambda kv: NeverIndexedHeaderTuple(*kv) if kv[1][:1] == b"n" else kv
    ),
    max_size=8,
)


@given(_FIELDS)
def test_protect_marks_exactly_the_credentials_and_short_cookies_not_yet_marked(headers):
    out = h2msg.protect(headers)
    for before, after in zip(headers, out, strict=True):
        key, value = before
        secret = key in (b"authorization", b"proxy-authorization")
        wanted = secret or (key == b"cookie" and len(value) < 20)
        assert tuple(after) == tuple(before)
        assert isinstance(after, NeverIndexedHeaderTuple) == (
            wanted or isinstance(before, NeverIndexedHeaderTuple)
        )


@given(_FIELDS, st.sampled_from([None, "web.shop"]))
def test_with_client_id_drops_only_that_name_and_adds_the_identity(headers, identity):
    out = h2msg.with_client_id(headers, identity)
    kept = [h for h in headers if h[0] != b"l5d-client-id"]
    added = [] if identity is None else [(b"l5d-client-id", b"web.shop")]
    assert [tuple(h) for h in out] == [tuple(h) for h in kept] + added
