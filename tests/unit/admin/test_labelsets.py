"""Label sets resolve into the right series and pod labels (agent.admin.labelsets)."""

from __future__ import annotations

from typing import Any

import pytest

from agent.admin.labelsets import LabelSets, _ref, _service_dst, parse_addr
from agent.admin.metrics import PodMeta, Ref
from agent.proxy import channel as ch
from agent.proxy.state import POD, POD_IP, PodInfo
from agent.proxy.worker import Worker


def _pod(name: str, ip: str, **extra: Any) -> PodInfo:
    return PodInfo(
        namespace="ns", name=name, ip=ip, netns="/x", identity=f"{name}.ns.serviceaccount", **extra
    )


@pytest.fixture
def sets() -> LabelSets:
    worker = Worker(worker_id=0)
    worker.state.apply(ch.StateUpdate(key=(POD, "ns/web"), value=_pod("web", "10.0.0.5")))
    return LabelSets(worker)


def _put(sets: LabelSets, key: Any, value: Any) -> None:
    sets.worker.state.apply(ch.StateUpdate(key=key, value=value))


def test_parse_addr_reads_host_and_port_and_refuses_anything_else() -> None:
    assert parse_addr("10.0.0.1:80") == ("10.0.0.1", 80)
    assert parse_addr("[fd00::1]:443") == ("fd00::1", 443)
    assert parse_addr("web:http") is None
    assert parse_addr(":80") is None


def test_a_service_authority_names_its_namespace_and_service() -> None:
    assert _service_dst("web.shop.svc.cluster.local:80") == {"namespace": "shop", "service": "web"}
    assert _service_dst("10.0.0.1:80") == {}
    assert _service_dst("") == {}


def test_a_policy_ref_needs_its_kind() -> None:
    labels = {"srv_kind": "server", "srv_name": "web-http", "authz_name": "x"}
    assert _ref(labels, "srv") == Ref(group="", kind="server", name="web-http")
    assert _ref(labels, "authz") is None


def test_pod_meta_names_the_owner_and_follows_a_changed_pod_info(sets: LabelSets) -> None:
    owned = _pod("web", "10.0.0.5", owner_labels={"pod-template-hash": "x", "deployment": "web"})
    _put(sets, (POD, "ns/web"), owned)
    meta = sets.pod_meta("ns/web")
    assert (meta.owner_kind, meta.owner_name) == ("deployment", "web")
    assert sets.pod_meta("ns/web") is meta  # the same PodInfo: cached
    _put(sets, (POD, "ns/web"), _pod("web", "10.0.0.5", service_account="api"))
    assert sets.pod_meta("ns/web").serviceaccount == "api"


def test_a_pod_without_pod_info_is_named_by_its_key(sets: LabelSets) -> None:
    assert sets.pod_meta("ns/gone") == PodMeta(namespace="ns", pod="gone")


def test_forget_departed_drops_only_departed_pods_and_moves_gen_once(sets: LabelSets) -> None:
    sets.pod_meta("ns/web")
    sets.pod_meta("ns/gone")
    assert sets.forget_departed() == ["ns/gone"]
    assert sets.gen == 1
    assert sets.forget_departed() == []
    assert sets.gen == 1


def test_a_same_node_request_is_also_the_called_pods_inbound_series(sets: LabelSets) -> None:
    _put(sets, (POD, "ns/api"), _pod("api", "10.0.0.6"))
    _put(sets, (POD_IP, "10.0.0.6"), "ns/api")
    labels = {"authority": "api.ns.svc.cluster.local:80", "dst_addr": "10.0.0.6:80", "hop": "local"}
    outbound, inbound = sets._new_http("ns/web", "outbound", labels)
    outbound.requests.value += 1
    inbound.requests.value += 1
    found = [dict(k) for k in sets.m.snapshot().families["request_total"]]
    by_direction = {f["direction"]: f for f in found}
    assert by_direction["outbound"]["pod"] == "web"
    assert by_direction["outbound"]["server_id"] == "api.ns.serviceaccount"
    assert by_direction["inbound"]["pod"] == "api"
    assert by_direction["inbound"]["client_id"] == "web.ns.serviceaccount"
    assert by_direction["inbound"]["tls"] == "true"
