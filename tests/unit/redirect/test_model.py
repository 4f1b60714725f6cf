"""CaptureSpec.skipped_text: what `meshagent redirects` shows a capture lets through; pure."""

from __future__ import annotations

import ipaddress
from pathlib import Path

from agent.redirect.model import CaptureSpec, PortRange, PortSet


def _spec(**kw) -> CaptureSpec:
    return CaptureSpec(pod="shop/web", netns=Path("/run/netns/web"), pod_ip="10.0.0.5", **kw)


def test_the_proxy_ports_are_always_skipped_inbound_and_the_rest_only_when_set():
    assert _spec().skipped_text(accel=True) == "in:4190,4191"


def test_every_skip_in_order_and_accel_only_for_a_mode_that_accelerates():
    spec = _spec(
        skip_inbound_ports=PortSet((PortRange(22, 22),)),
        skip_outbound_ports=PortSet((PortRange(3306, 3306), PortRange(9000, 9100))),
        skip_subnets=(ipaddress.ip_network("10.96.0.0/12"),),
        skip_accel_ports=PortSet((PortRange(5201, 5201),)),
    )
    plain = "in:4190,4191,22 out:3306,9000-9100 subnets:10.96.0.0/12"
    assert spec.skipped_text(accel=False) == plain
    assert spec.skipped_text(accel=True) == plain + " accel:5201"
