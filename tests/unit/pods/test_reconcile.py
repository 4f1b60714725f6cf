"""`agent.pods.reconcile.plan`: desired vs enrolled pods -> ordered steps."""

from __future__ import annotations

import pytest

from agent.pods.model import PodSpec, pairs
from agent.pods.reconcile import Enroll, Unenroll, Update, plan


def pod(name: str, *, uid: str = "", ip: str = "10.0.0.1", **kw: object) -> PodSpec:
    return PodSpec(namespace="shop", name=name, uid=uid or f"uid-{name}", ip=ip, **kw)  # type: ignore[arg-type]


def test_nothing_to_do_when_desired_equals_enrolled() -> None:
    pods = {pod("a"), pod("b")}
    assert plan(pods, pods) == []


def test_new_pod_is_enrolled_and_departed_pod_unenrolled() -> None:
    a, b = pod("a"), pod("b")
    assert plan({b}, {a}) == [Unenroll(pod=a), Enroll(pod=b)]


def test_recreated_pod_with_new_uid_is_unenrolled_then_enrolled() -> None:
    old, new = pod("a", uid="1"), pod("a", uid="2")
    assert plan({new}, {old}) == [Unenroll(pod=old), Enroll(pod=new)]


def test_new_ip_means_new_incarnation() -> None:
    old, new = pod("a", ip="10.0.0.1"), pod("a", ip="10.0.0.2")
    assert plan([new], [old]) == [Unenroll(pod=old), Enroll(pod=new)]


def test_changed_annotations_are_an_update_not_a_reenroll() -> None:
    old = pod("a")
    new = pod("a", annotations=pairs({"config.linkerd.io/skip-inbound-ports": "9090"}))
    assert plan([new], [old]) == [Update(old=old, new=new)]


def test_changed_service_account_is_an_update() -> None:
    old, new = pod("a"), pod("a", service_account="web")
    assert plan([new], [old]) == [Update(old=old, new=new)]


def test_plan_orders_unenrolls_then_updates_then_enrolls_by_key() -> None:
    gone_b, gone_a = pod("gone-b"), pod("gone-a")
    upd_old, upd_new = pod("upd"), pod("upd", container_ports=(80,))
    new_z, new_c = pod("z"), pod("c")
    steps = plan([upd_new, new_z, new_c], [gone_b, upd_old, gone_a])
    assert steps == [
        Unenroll(pod=gone_a),
        Unenroll(pod=gone_b),
        Update(old=upd_old, new=upd_new),
        Enroll(pod=new_c),
        Enroll(pod=new_z),
    ]


def test_two_different_desired_pods_with_one_key_are_refused() -> None:
    with pytest.raises(ValueError, match="shop/a"):
        plan([pod("a", uid="1"), pod("a", uid="2")], [])
