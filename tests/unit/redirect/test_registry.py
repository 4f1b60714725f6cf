"""The registry's spec <-> JSON conversions (agent.redirect.registry); pure."""

from __future__ import annotations

import ipaddress
from pathlib import Path

import pytest

from agent.errors import RegistryError
from agent.redirect.model import CaptureSpec, Mode, PortRange, PortSet
from agent.redirect.registry import Enrollment, Registry, spec_from_json, spec_to_json


def test_a_spec_survives_json_with_every_field():
    spec = CaptureSpec(
        pod="shop/web",
        netns=Path("/run/netns/web"),
        pod_ip="10.0.0.5",
        cgroup=Path("/sys/fs/cgroup/meshagent/web"),
        skip_inbound_ports=PortSet((PortRange(22, 22),)),
        skip_outbound_ports=PortSet((PortRange(3306, 3306),)),
        skip_subnets=(ipaddress.ip_network("10.96.0.0/12"),),
        opaque_ports=PortSet((PortRange(4222, 4222),)),
        skip_accel_ports=PortSet((PortRange(5201, 5201), PortRange(9000, 9010))),
        mark=0x1234,
    )
    assert spec_from_json(spec_to_json(spec)) == spec


def test_an_entry_written_before_skip_accel_ports_reads_as_none_skipped():
    doc = spec_to_json(CaptureSpec(pod="shop/web", netns=Path("/x"), pod_ip="10.0.0.5"))
    del doc["skip_accel_ports"]
    assert spec_from_json(doc).skip_accel_ports == PortSet()


def _entry(pod: str) -> Enrollment:
    spec = CaptureSpec(
        pod=pod, netns=Path(f"/run/netns/{pod.replace('/', '-')}"), pod_ip="10.0.0.5"
    )
    return Enrollment(spec=spec, mode=Mode.IPTABLES, backend="nft")


def test_entries_are_put_read_and_removed_and_a_missing_file_is_empty(tmp_path):
    registry = Registry(tmp_path / "enrolled.json")
    assert registry.load() == {}
    registry.put(_entry("shop/web"))
    registry.put(_entry("shop/api"))
    assert sorted(registry.load()) == ["shop/api", "shop/web"]
    assert registry.remove("shop/web")
    assert not registry.remove("shop/web")
    assert list(registry.load()) == ["shop/api"]


@pytest.mark.parametrize("text", ["root:x:0:0:root:/root:/bin/bash\n", "[1, 2]", '{"shop/web": '])
def test_a_file_that_is_not_a_registry_is_neither_read_as_empty_nor_replaced(tmp_path, text):
    path = tmp_path / "passwd"
    path.write_text(text)
    registry = Registry(path)
    for act in (
        registry.load,
        lambda: registry.put(_entry("shop/web")),
        lambda: registry.remove("x"),
    ):
        with pytest.raises(RegistryError, match="not a registry of enrolled pods") as err:
            act()
        assert str(path) in str(err.value)
    assert path.read_text() == text  # nothing lost
