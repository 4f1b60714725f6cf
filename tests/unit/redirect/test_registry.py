"""The registry's spec <-> JSON conversions (agent.redirect.registry); pure."""

from __future__ import annotations

import ipaddress
from pathlib import Path

from agent.redirect.model import CaptureSpec, PortRange, PortSet
from agent.redirect.registry import spec_from_json, spec_to_json


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
