"""h2msg: proxy answers, gRPC status reading, client-id rewriting for HTTP/2 streams."""

from __future__ import annotations

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
    head = h2msg.request_head(GRPC_REQ)
    assert (head.method, head.target) == (b"POST", b"/t.T/Echo?x=1")
    assert (b"host", b"svc:50051") in head.headers
    assert all(not k.startswith(b":") for k, _ in head.headers)
