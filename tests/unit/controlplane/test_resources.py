"""Value parsers and FrozenMap, the base of the resource model."""

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


def test_frozen_map_is_immutable_hashable_and_picklable():
    m = r.FrozenMap({"a": "1"})
    assert m == {"a": "1"}
    assert hash(m) == hash(r.FrozenMap({"a": "1"}))
    with pytest.raises(TypeError):
        m["b"] = "2"  # type: ignore[index]
    assert pickle.loads(pickle.dumps(m)) == m


@given(st.lists(st.integers(min_value=1, max_value=65535), min_size=1, max_size=5))
def test_port_list_round_trips_numbers(ports):
    parsed = r.parse_port_list(",".join(str(p) for p in ports))
    assert [item.first for item in parsed if isinstance(item, r.PortRange)] == ports
