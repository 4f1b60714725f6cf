"""The redirect tests' shared capture spec and recorded iptables-save text."""

from __future__ import annotations

import ipaddress
from collections.abc import Callable
from pathlib import Path

import pytest

from agent.redirect.model import CaptureSpec, PortRange, PortSet

SpecOf = Callable[..., CaptureSpec]


@pytest.fixture
def spec() -> SpecOf:
    """A capture spec for pod shop/web; keyword arguments set its other fields."""

    def make(**kw) -> CaptureSpec:
        return CaptureSpec(pod="shop/web", netns=Path("/run/netns/web"), pod_ip="10.0.0.5", **kw)

    return make


@pytest.fixture
def recorded() -> str:
    """Recorded with iptables-nft-save -c (v1.8.9) after enrolling a pod with
    skip-outbound-ports=22,1000-2000 and skip-subnets=10.9.0.0/16 (`recorded_spec`)."""
    return (Path(__file__).parent / "recorded-nft-save.txt").read_text()


@pytest.fixture
def recorded_spec(spec: SpecOf) -> CaptureSpec:
    """The spec `recorded` was captured with."""
    return spec(
        skip_outbound_ports=PortSet((PortRange(22, 22), PortRange(1000, 2000))),
        skip_subnets=(ipaddress.ip_network("10.9.0.0/16"),),
    )
