"""Destination protobuf -> domain: every field that matters, located errors.

Inbound policy conversion is tested in test_convert_policy.py.
"""

from __future__ import annotations

import ipaddress

import pytest
from google.protobuf import duration_pb2

from agent._proto import (
    destination_pb2 as dpb,
)
from agent._proto import (
    http_types_pb2,
    net_pb2,
)
from agent.control import convert
from agent.errors import InvalidResource
from agent.proxy import model as xm

WEB_ID = "web.shop.serviceaccount.identity.linkerd.cluster.local"
API_ID = "api.shop.serviceaccount.identity.linkerd.cluster.local"


def ip4(text: str) -> net_pb2.IPAddress:
    return net_pb2.IPAddress(ipv4=int(ipaddress.IPv4Address(text)))


def ip6(text: str) -> net_pb2.IPAddress:
    v = int(ipaddress.IPv6Address(text))
    return net_pb2.IPAddress(ipv6=net_pb2.IPv6(first=v >> 64, last=v & (2**64 - 1)))


def tcp(ip: net_pb2.IPAddress, port: int) -> net_pb2.TcpAddress:
    return net_pb2.TcpAddress(ip=ip, port=port)


def dur(seconds: float) -> duration_pb2.Duration:
    d = duration_pb2.Duration()
    d.FromNanoseconds(round(seconds * 1e9))
    return d


def full_addr() -> dpb.WeightedAddr:
    return dpb.WeightedAddr(
        addr=tcp(ip4("10.1.2.3"), 8080),
        weight=7,
        metric_labels={"pod": "web-1", "namespace": "override"},
        tls_identity=dpb.TlsIdentity(
            dns_like_identity=dpb.TlsIdentity.DnsLikeIdentity(name=WEB_ID),
            server_name=dpb.TlsIdentity.DnsLikeIdentity(name=WEB_ID),
        ),
        protocol_hint=dpb.ProtocolHint(
            h2=dpb.ProtocolHint.H2(),
            opaque_transport=dpb.ProtocolHint.OpaqueTransport(inbound_port=4143),
        ),
        authority_override=dpb.AuthorityOverride(authority_override="web.shop.svc:8080"),
    )


# --- endpoints -----------------------------------------------------------------------


def test_add_converts_every_endpoint_field_and_merges_set_labels():
    update = dpb.Update(
        add=dpb.WeightedAddrSet(
            addrs=[full_addr()], metric_labels={"namespace": "shop", "service": "web"}
        )
    )
    out = convert.endpoints_from_update(update, name="web.shop.svc.cluster.local:8080")
    assert out.removed == ()
    assert out.no_endpoints is None
    assert out.rejected == ()
    (ep,) = out.added
    assert ep.addr == ("10.1.2.3", 8080)
    assert ep.weight == 7
    assert dict(ep.labels) == {"namespace": "override", "service": "web", "pod": "web-1"}
    assert ep.tls_identity == WEB_ID
    assert ep.protocol_hint is xm.ProtocolHint.H2
    assert ep.opaque_transport_port == 4143
    assert ep.authority_override == "web.shop.svc:8080"


def test_add_converts_ipv6_opaque_endpoint_without_identity():
    wa = dpb.WeightedAddr(
        addr=tcp(ip6("fd00::1:2"), 9090),
        weight=10000,
        protocol_hint=dpb.ProtocolHint(opaque=dpb.ProtocolHint.Opaque()),
    )
    (ep,) = convert.endpoints_from_update(dpb.Update(add=dpb.WeightedAddrSet(addrs=[wa]))).added
    assert ep.addr == ("fd00::1:2", 9090)
    assert ep.protocol_hint is xm.ProtocolHint.OPAQUE
    assert ep.tls_identity is None
    assert ep.opaque_transport_port is None
    assert ep.authority_override is None


def test_endpoint_without_protocol_hint_has_none():
    wa = dpb.WeightedAddr(addr=tcp(ip4("10.0.0.1"), 80), weight=1)
    (ep,) = convert.endpoints_from_update(dpb.Update(add=dpb.WeightedAddrSet(addrs=[wa]))).added
    assert ep.protocol_hint is None


@pytest.mark.parametrize(
    ("bad", "field"),
    [
        (dpb.WeightedAddr(weight=1), "add.addrs[1].addr"),
        (dpb.WeightedAddr(addr=net_pb2.TcpAddress(port=80)), "add.addrs[1].addr"),
        (dpb.WeightedAddr(addr=tcp(ip4("10.0.0.9"), 0)), "add.addrs[1].addr"),
        (dpb.WeightedAddr(addr=tcp(ip4("10.0.0.9"), 70000)), "add.addrs[1].addr"),
        (
            dpb.WeightedAddr(
                addr=tcp(ip4("10.0.0.9"), 80),
                tls_identity=dpb.TlsIdentity(
                    uri_like_identity=dpb.TlsIdentity.UriLikeIdentity(uri="spiffe://x/y")
                ),
            ),
            "add.addrs[1].tls_identity.uri_like_identity",
        ),
        (
            dpb.WeightedAddr(addr=tcp(ip4("10.0.0.9"), 80), tls_identity=dpb.TlsIdentity()),
            "add.addrs[1].tls_identity.strategy",
        ),
        (
            dpb.WeightedAddr(
                addr=tcp(ip4("10.0.0.9"), 80),
                protocol_hint=dpb.ProtocolHint(
                    opaque_transport=dpb.ProtocolHint.OpaqueTransport(inbound_port=0)
                ),
            ),
            "add.addrs[1].protocol_hint.opaque_transport.inbound_port",
        ),
    ],
)
def test_a_bad_endpoint_rejects_only_itself_with_its_location(bad, field):
    good = dpb.WeightedAddr(addr=tcp(ip4("10.0.0.1"), 80), weight=1)
    update = dpb.Update(add=dpb.WeightedAddrSet(addrs=[good, bad]))
    out = convert.endpoints_from_update(update, name="web:80")
    assert [e.addr for e in out.added] == [("10.0.0.1", 80)]
    (err,) = out.rejected
    assert (err.kind, err.name, err.field) == ("Endpoint", "web:80", field)


def test_remove_converts_addresses():
    update = dpb.Update(remove=dpb.AddrSet(addrs=[tcp(ip4("10.0.0.1"), 80), tcp(ip6("::1"), 81)]))
    out = convert.endpoints_from_update(update)
    assert out.removed == (("10.0.0.1", 80), ("::1", 81))
    assert out.added == ()
    assert out.no_endpoints is None


def test_malformed_remove_raises_located_error():
    update = dpb.Update(
        remove=dpb.AddrSet(addrs=[tcp(ip4("10.0.0.1"), 80), tcp(ip4("1.1.1.1"), 0)])
    )
    with pytest.raises(InvalidResource) as info:
        convert.endpoints_from_update(update, name="web:80")
    assert (info.value.kind, info.value.field) == ("Update", "remove.addrs[1]")
    assert "web:80" in str(info.value)


@pytest.mark.parametrize("exists", [True, False])
def test_no_endpoints_carries_exists(exists):
    update = dpb.Update(no_endpoints=dpb.NoEndpoints(exists=exists))
    assert convert.endpoints_from_update(update).no_endpoints is exists


def test_empty_update_raises():
    with pytest.raises(InvalidResource) as info:
        convert.endpoints_from_update(dpb.Update(), name="x:1")
    assert info.value.field == "update"


# --- profiles ------------------------------------------------------------------------


def req(**kw) -> dpb.RequestMatch:
    return dpb.RequestMatch(**kw)


def method(name: str) -> http_types_pb2.HttpMethod:
    return http_types_pb2.HttpMethod(registered=getattr(http_types_pb2.HttpMethod, name))


def full_profile() -> dpb.DestinationProfile:
    negated = dpb.RequestMatch()
    getattr(negated, "not").CopyFrom(req(method=method("DELETE")))
    condition = req(
        all=dpb.RequestMatch.Seq(
            matches=[
                req(path=dpb.PathMatch(regex=" /books/\\d+ ")),
                req(
                    any=dpb.RequestMatch.Seq(
                        matches=[
                            req(method=method("GET")),
                            req(method=http_types_pb2.HttpMethod(unregistered="PROPFIND")),
                        ]
                    )
                ),
                negated,
            ]
        )
    )
    not_5xx = dpb.ResponseMatch()
    getattr(not_5xx, "not").CopyFrom(
        dpb.ResponseMatch(status=dpb.HttpStatusRange(min=500, max=599))
    )
    route = dpb.Route(
        condition=condition,
        response_classes=[
            dpb.ResponseClass(
                condition=dpb.ResponseMatch(
                    any=dpb.ResponseMatch.Seq(
                        matches=[
                            dpb.ResponseMatch(status=dpb.HttpStatusRange(min=500, max=599)),
                            dpb.ResponseMatch(status=dpb.HttpStatusRange(min=429)),
                        ]
                    )
                ),
                is_failure=True,
            ),
            dpb.ResponseClass(
                condition=dpb.ResponseMatch(all=dpb.ResponseMatch.Seq(matches=[not_5xx]))
            ),
        ],
        metrics_labels={"route": "GET /books/{id}"},
        is_retryable=True,
        timeout=dur(1.5),
    )
    return dpb.DestinationProfile(
        fully_qualified_name="books.shop.svc.cluster.local",
        opaque_protocol=True,
        routes=[route, dpb.Route(condition=req(path=dpb.PathMatch(regex="/.*")))],
        retry_budget=dpb.RetryBudget(retry_ratio=0.25, min_retries_per_second=5, ttl=dur(12)),
        dst_overrides=[
            dpb.WeightedDst(authority="books-v1.shop.svc.cluster.local:80", weight=900),
            dpb.WeightedDst(authority="books-v2.shop.svc.cluster.local:80", weight=100),
            dpb.WeightedDst(authority="books-v3.shop.svc.cluster.local:80", weight=0),
        ],
        endpoint=dpb.WeightedAddr(addr=tcp(ip4("10.9.8.7"), 80), weight=10000),
    )


def test_profile_converts_every_field():
    p = convert.profile_from_proto(full_profile(), name="books.shop.svc.cluster.local:80")
    assert p.fqn == "books.shop.svc.cluster.local"
    assert p.opaque_protocol is True
    assert p.retry_budget == xm.RetryBudget(retry_ratio=0.25, min_retries_per_second=5, ttl_s=12.0)
    assert p.dst_overrides == (
        xm.WeightedDst(authority="books-v1.shop.svc.cluster.local:80", weight=900),
        xm.WeightedDst(authority="books-v2.shop.svc.cluster.local:80", weight=100),
    )
    assert p.endpoint is not None
    assert p.endpoint.addr == ("10.9.8.7", 80)
    first, second = p.routes
    assert first.name == "GET /books/{id}"
    assert dict(first.labels) == {"route": "GET /books/{id}"}
    assert first.is_retryable is True
    assert first.timeout_s == 1.5
    assert first.condition == xm.MatchAll(
        (
            xm.PathRegex("/books/\\d+"),
            xm.MatchAny((xm.MethodIs("GET"), xm.MethodIs("PROPFIND"))),
            xm.MatchNot(xm.MethodIs("DELETE")),
        )
    )
    assert first.response_classes == (
        xm.ResponseClass(
            condition=xm.ResponseAny((xm.StatusRange(500, 599), xm.StatusRange(429, 429))),
            is_failure=True,
        ),
        xm.ResponseClass(
            condition=xm.ResponseAll((xm.ResponseNot(xm.StatusRange(500, 599)),)),
            is_failure=False,
        ),
    )
    assert second.timeout_s is None
    assert second.is_retryable is False
    assert second.name == ""


def test_empty_profile_has_defaults():
    p = convert.profile_from_proto(dpb.DestinationProfile())
    assert p == xm.Profile()


def test_status_range_with_only_max_is_that_status():
    rc = dpb.ResponseClass(condition=dpb.ResponseMatch(status=dpb.HttpStatusRange(max=503)))
    prof = dpb.DestinationProfile(
        routes=[dpb.Route(condition=req(method=method("GET")), response_classes=[rc])]
    )
    (route,) = convert.profile_from_proto(prof).routes
    assert route.response_classes[0].condition == xm.StatusRange(503, 503)


def _bad_profile(mutate) -> InvalidResource:
    msg = full_profile()
    mutate(msg)
    with pytest.raises(InvalidResource) as info:
        convert.profile_from_proto(msg, name="books:80")
    assert info.value.kind == "DestinationProfile"
    assert info.value.name == "books:80"
    return info.value


def test_bad_regex_is_located():
    err = _bad_profile(
        lambda m: m.routes[0].condition.all.matches[0].path.__setattr__("regex", "(")
    )
    assert err.field == "routes[0].condition.all.matches[0].path.regex"


def test_route_without_condition_is_located():
    err = _bad_profile(lambda m: m.routes[1].ClearField("condition"))
    assert err.field == "routes[1].condition"


def test_request_match_with_nothing_set_is_located():
    err = _bad_profile(lambda m: m.routes[0].condition.all.matches.append(dpb.RequestMatch()))
    assert err.field == "routes[0].condition.all.matches[3].match"


def test_bad_status_range_is_located():
    err = _bad_profile(
        lambda m: (
            m.routes[0].response_classes[0].condition.any.matches[0].status.__setattr__("min", 700)
        )
    )
    assert err.field == "routes[0].response_classes[0].condition.any.matches[0].status"


def test_empty_response_any_is_located():
    def mutate(m):
        del m.routes[0].response_classes[0].condition.any.matches[:]

    assert _bad_profile(mutate).field == "routes[0].response_classes[0].condition.any.matches"


def test_retry_budget_out_of_range_is_located():
    err = _bad_profile(lambda m: m.retry_budget.ttl.CopyFrom(dur(120)))
    assert err.field == "retry_budget"
    err = _bad_profile(lambda m: m.retry_budget.ClearField("ttl"))
    assert err.field == "retry_budget.ttl"


def test_dst_override_without_authority_is_located():
    err = _bad_profile(lambda m: m.dst_overrides[1].__setattr__("authority", ""))
    assert err.field == "dst_overrides[1].authority"


def test_bad_profile_endpoint_is_located():
    err = _bad_profile(lambda m: m.endpoint.addr.__setattr__("port", 0))
    assert err.field == "endpoint.addr"
