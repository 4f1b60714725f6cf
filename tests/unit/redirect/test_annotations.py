"""Annotations -> capture settings: Linkerd's port/range/CIDR syntax, pod over namespace."""

from __future__ import annotations

import ipaddress
from pathlib import Path

import pytest

from agent.errors import AnnotationError
from agent.redirect import annotations as ann
from agent.redirect.model import PortRange, PortSet


def ps(*pairs: tuple[int, int]) -> PortSet:
    return PortSet(tuple(PortRange(a, b) for a, b in pairs))


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("", ps()),
        ("   ", ps()),
        ("8080", ps((8080, 8080))),
        ("22,8080", ps((22, 22), (8080, 8080))),
        (" 22 , 8080 ", ps((22, 22), (8080, 8080))),
        ("1000-2000", ps((1000, 2000))),
        ("23-23", ps((23, 23))),
        ("25,587,1000-2000,", ps((25, 25), (587, 587), (1000, 2000))),
        ("0-65535", ps((1, 65535))),
        ("65535", ps((65535, 65535))),
    ],
)
def test_port_lists_parse_as_linkerd_writes_them(value, expected):
    assert ann.parse_port_set(value) == expected


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        ("notanumber", "not a valid lower bound"),
        ("not-number", "not a valid lower bound"),
        ("-23-25", "ranges are written"),
        ("-23", "not a valid lower bound"),
        ("25-23", "upper bound must be greater"),
        ("65536-65539", "not a valid lower bound"),
        ("23-notanumber", "not a valid upper bound"),
        ("70000", "not a valid lower bound"),
        ("0", "port 0 is not a TCP destination"),
        ("22,,80", "empty item"),
        ("22;80", "not a valid lower bound"),
        ("1.5", "not a valid lower bound"),
        ("+80", "not a valid lower bound"),
    ],
)
def test_malformed_port_lists_say_why(value, reason):
    with pytest.raises(ValueError, match=reason):
        ann.parse_port_set(value)


def test_opaque_ports_resolve_named_container_ports():
    assert ann.parse_port_set("mysql,8080", {"mysql": 3306}) == ps((3306, 3306), (8080, 8080))
    with pytest.raises(ValueError, match="named container port"):
        ann.parse_port_set("redis", {"mysql": 3306})


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("", ()),
        ("10.0.0.0/8", ("10.0.0.0/8",)),
        ("10.0.0.0/8, 192.168.1.0/24", ("10.0.0.0/8", "192.168.1.0/24")),
        ("10.1.2.3/16", ("10.1.0.0/16",)),
        ("fd00::/8", ("fd00::/8",)),
    ],
)
def test_skip_subnets_parse_cidrs(value, expected):
    assert tuple(str(s) for s in ann.parse_subnets(value)) == expected


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        ("10.0.0.1", "not a CIDR"),
        ("10.0.0.0/33", "not a valid CIDR"),
        ("banana/8", "not a valid CIDR"),
        ("10.0.0.0/8,,", "empty item"),
    ],
)
def test_malformed_subnets_say_why(value, reason):
    with pytest.raises(ValueError, match=reason):
        ann.parse_subnets(value)


def test_pod_annotation_wins_over_namespace():
    got = ann.parse_annotations(
        "shop/web",
        {ann.SKIP_OUTBOUND_PORTS: "443"},
        {ann.SKIP_OUTBOUND_PORTS: "80", ann.SKIP_INBOUND_PORTS: "9000-9100"},
    )
    assert got.skip_outbound_ports == ps((443, 443))
    assert got.skip_inbound_ports == ps((9000, 9100))


def test_blank_pod_annotation_falls_back_to_namespace():
    got = ann.parse_annotations(
        "shop/web", {ann.SKIP_SUBNETS: " "}, {ann.SKIP_SUBNETS: "10.0.0.0/8"}
    )
    assert got.skip_subnets == (ipaddress.ip_network("10.0.0.0/8"),)


def test_opaque_ports_default_to_linkerds_list():
    got = ann.parse_annotations("shop/web", {})
    assert 3306 in got.opaque_ports
    assert 5432 in got.opaque_ports
    assert 8080 not in got.opaque_ports


@pytest.mark.parametrize(
    ("name", "value"),
    [
        (ann.SKIP_INBOUND_PORTS, "80-"),
        (ann.SKIP_INBOUND_PORTS, "http"),
        (ann.SKIP_OUTBOUND_PORTS, "99999"),
        (ann.SKIP_OUTBOUND_PORTS, "443,,80"),
        (ann.SKIP_SUBNETS, "10.0.0.0"),
        (ann.SKIP_SUBNETS, "10.0.0.0/8,nope/1"),
        (ann.OPAQUE_PORTS, "unknown-name"),
        (ann.OPAQUE_PORTS, "3306-1"),
        (ann.SKIP_ACCEL_PORTS, "5201-5200"),
        (ann.SKIP_ACCEL_PORTS, "iperf"),
    ],
)
def test_malformed_annotation_is_an_annotation_error_naming_pod_and_key(name, value):
    with pytest.raises(AnnotationError) as info:
        ann.build_spec(
            pod="shop/web",
            netns=Path("/run/netns/x"),
            pod_ip="10.0.0.5",
            pod_annotations={name: value},
        )
    err = info.value
    assert (err.pod, err.annotation, err.value) == ("shop/web", name, value)
    assert "shop/web" in str(err)
    assert name in str(err)


def test_malformed_namespace_annotation_is_also_reported_on_the_pod():
    with pytest.raises(AnnotationError, match="shop/web"):
        ann.parse_annotations("shop/web", {}, {ann.SKIP_INBOUND_PORTS: "x"})


def test_build_spec_carries_every_field():
    spec = ann.build_spec(
        pod="shop/web",
        netns=Path("/run/netns/web"),
        pod_ip="10.0.0.5",
        pod_annotations={
            ann.SKIP_INBOUND_PORTS: "22",
            ann.SKIP_OUTBOUND_PORTS: "3306",
            ann.SKIP_SUBNETS: "10.96.0.0/12",
            ann.OPAQUE_PORTS: "4222",
            ann.SKIP_ACCEL_PORTS: "5201, 9000-9010",
        },
        cgroup=Path("/sys/fs/cgroup/unified/x"),
    )
    assert spec.skip_accel_ports == ps((5201, 5201), (9000, 9010))
    assert spec.skip_inbound_ports == ps((22, 22))
    assert spec.skip_outbound_ports == ps((3306, 3306))
    assert spec.skip_subnets == (ipaddress.ip_network("10.96.0.0/12"),)
    assert spec.opaque_ports == ps((4222, 4222))
    assert spec.cgroup == Path("/sys/fs/cgroup/unified/x")
