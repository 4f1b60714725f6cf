"""`agent.supervisor.resolve`: control-plane answers -> the Destination pushed to workers."""

from __future__ import annotations

from agent.control.cache import EndpointSet
from agent.proxy.model import Endpoint, Profile
from agent.supervisor.resolve import destination, is_ip_target, streams_for

EP = Endpoint(addr=("10.0.0.7", 8080))


def test_ip_target_follows_the_service_its_profile_names() -> None:
    plan = streams_for("10.96.0.20:80", Profile(fqn="web.shop.svc.cluster.local"))
    assert plan.authority == "web.shop.svc.cluster.local:80"


def test_ip_target_waits_for_its_profile() -> None:
    assert streams_for("10.96.0.20:80", None).authority is None
    assert destination("10.96.0.20:80", None, None, profile_seen=False) is None


def test_service_destination_waits_for_endpoints_then_carries_them() -> None:
    prof = Profile(fqn="web.shop.svc.cluster.local")
    assert destination("10.96.0.20:80", prof, None, profile_seen=True) is None
    dst = destination(
        "10.96.0.20:80", prof, EndpointSet(endpoints=(EP,), exists=True), profile_seen=True
    )
    assert dst is not None
    assert dst.exists
    assert dst.endpoints == (EP,)
    assert dst.authority == "web.shop.svc.cluster.local:80"


def test_pod_ip_profile_endpoint_is_the_single_endpoint() -> None:
    dst = destination("10.0.0.7:8080", Profile(endpoint=EP), None, profile_seen=True)
    assert dst is not None
    assert dst.exists
    assert dst.endpoints == (EP,)


def test_unknown_ip_is_not_a_mesh_destination() -> None:
    dst = destination("192.0.2.1:443", Profile(), None, profile_seen=True)
    assert dst is not None
    assert not dst.exists


def test_authority_target_follows_get_directly_and_keeps_opaque_flag() -> None:
    assert not is_ip_target("web.shop.svc.cluster.local:80")
    assert streams_for("web.shop.svc.cluster.local:80", None).authority == (
        "web.shop.svc.cluster.local:80"
    )
    dst = destination(
        "web.shop.svc.cluster.local:80",
        Profile(opaque_protocol=True),
        EndpointSet(endpoints=(), exists=True),
        profile_seen=True,
    )
    assert dst is not None
    assert dst.opaque
    assert dst.endpoints == ()
