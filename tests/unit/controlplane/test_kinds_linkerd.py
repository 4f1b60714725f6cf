"""Small behaviours of the Linkerd kinds."""

from __future__ import annotations

from agent.controlplane import kinds_linkerd as l5d
from agent.controlplane import resources as r


def test_network_contains_respects_except_and_ip_version():
    net = l5d.Network(cidr=r.parse_network("10.0.0.0/8"), except_=(r.parse_network("10.1.0.0/16"),))
    assert net.contains("10.2.0.1")
    assert not net.contains("10.1.0.1")
    assert not net.contains("192.168.0.1")
    assert not net.contains("::1")
    assert r.parse_network("10.0.0.7").prefixlen == 32
