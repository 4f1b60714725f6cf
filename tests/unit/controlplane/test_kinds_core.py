"""Small behaviours of the Kubernetes kinds."""

from __future__ import annotations

import pytest

from agent.controlplane import kinds_core as k8s
from agent.controlplane import resources as r


def test_objects_are_frozen_hashable_and_source_does_not_count():
    a = k8s.Pod(name="p", namespace="shop", source=r.Source(file="a.yaml", index=0))
    b = k8s.Pod(name="p", namespace="shop", source=r.Source(file="b.yaml", index=3))
    assert a == b
    assert hash(a) == hash(b)
    assert a.key == ("Pod", "shop", "p")
    assert a.ref == "shop/p"
    with pytest.raises(AttributeError):
        a.name = "q"  # type: ignore[misc]


def test_service_port_lookup_by_number_and_protocol():
    svc = k8s.Service(
        name="dns",
        ports=(
            k8s.ServicePort(port=53, target_port=53, name="udp", protocol="UDP"),
            k8s.ServicePort(port=53, target_port=53, name="tcp"),
        ),
    )
    tcp = svc.port(53)
    assert tcp is not None
    assert tcp.name == "tcp"
    assert svc.port(54) is None
