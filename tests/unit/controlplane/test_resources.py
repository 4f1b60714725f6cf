"""Value parsers and small behaviours of the domain types."""

from __future__ import annotations

import pickle

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent.controlplane import resources as r


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("300ms", 0.3),
        ("10s", 10.0),
        ("1m30s", 90.0),
        ("1.5h", 5400.0),
        ("100us", 0.0001),
        ("250µs", 0.00025),
        ("0", 0.0),
        (" 2s ", 2.0),
    ],
)
def test_parse_duration_go_syntax(text, seconds):
    assert r.parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "10", "3 seconds", "-1s", "1d", "s", "1.2.3s"])
def test_parse_duration_rejects(text):
    with pytest.raises(ValueError, match="duration"):
        r.parse_duration(text)


def test_parse_port_list_ranges_and_names():
    assert r.parse_port_list("25, 8080-8090,http,") == (
        r.PortRange(25, 25),
        r.PortRange(8080, 8090),
        "http",
    )


@pytest.mark.parametrize("text", ["0", "70000", "90-80", "Bad_Name", "a-very-long-port-name"])
def test_parse_port_list_rejects(text):
    with pytest.raises(ValueError):
        r.parse_port_list(text)


@pytest.mark.parametrize(
    ("raw", "value"), [(1, 1.0), ("500m", 0.5), ("2k", 2000.0), ("1Ki", 1024.0)]
)
def test_parse_quantity(raw, value):
    assert r.parse_quantity(raw) == value


def test_int_or_name():
    assert r.int_or_name("8080") == 8080
    assert r.int_or_name("http") == "http"
    with pytest.raises(ValueError, match="not a valid port name"):
        r.int_or_name("HTTP")
    with pytest.raises(ValueError, match="expected a port"):
        r.int_or_name(True)


def test_network_contains_respects_except_and_ip_version():
    net = r.Network(cidr=r.parse_network("10.0.0.0/8"), except_=(r.parse_network("10.1.0.0/16"),))
    assert net.contains("10.2.0.1")
    assert not net.contains("10.1.0.1")
    assert not net.contains("192.168.0.1")
    assert not net.contains("::1")
    assert r.parse_network("10.0.0.7").prefixlen == 32


def test_frozen_map_is_immutable_hashable_and_picklable():
    m = r.FrozenMap({"a": "1"})
    assert m == {"a": "1"}
    assert hash(m) == hash(r.FrozenMap({"a": "1"}))
    with pytest.raises(TypeError):
        m["b"] = "2"  # type: ignore[index]
    assert pickle.loads(pickle.dumps(m)) == m


def test_objects_are_frozen_hashable_and_source_does_not_count():
    a = r.Pod(name="p", namespace="shop", source=r.Source(file="a.yaml", index=0))
    b = r.Pod(name="p", namespace="shop", source=r.Source(file="b.yaml", index=3))
    assert a == b
    assert hash(a) == hash(b)
    assert a.key == ("Pod", "shop", "p")
    assert a.ref == "shop/p"
    with pytest.raises(AttributeError):
        a.name = "q"  # type: ignore[misc]


def test_service_port_lookup_by_number_and_protocol():
    svc = r.Service(
        name="dns",
        ports=(
            r.ServicePort(port=53, target_port=53, name="udp", protocol="UDP"),
            r.ServicePort(port=53, target_port=53, name="tcp"),
        ),
    )
    tcp = svc.port(53)
    assert tcp is not None
    assert tcp.name == "tcp"
    assert svc.port(54) is None


@given(st.lists(st.integers(min_value=1, max_value=65535), min_size=1, max_size=5))
def test_port_list_round_trips_numbers(ports):
    parsed = r.parse_port_list(",".join(str(p) for p in ports))
    assert [item.first for item in parsed if isinstance(item, r.PortRange)] == ports
