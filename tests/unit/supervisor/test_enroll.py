"""Which worker `Need`s name a port's policy (agent.supervisor.enroll rule 5)."""

from __future__ import annotations

import pytest

from agent.proxy import state
from agent.supervisor.enroll import policy_need


def test_a_policy_need_names_its_pod_and_port():
    assert policy_need((state.POLICY, "shop/web", 9000)) == ("shop/web", 9000)
    assert policy_need((state.POLICY, "shop/web", 65535)) == ("shop/web", 65535)


@pytest.mark.parametrize(
    "key",
    [
        (state.DST, "web.shop.svc.cluster.local:80"),  # a destination's
        (state.POLICY, "shop/web"),  # no port
        (state.POLICY, "shop/web", 0),
        (state.POLICY, "shop/web", 65536),
        (state.POLICY, "shop/web", "9000"),  # a port is an int
        (state.POLICY, "shop/web", True),
        (state.POLICY, 7, 9000),
        ("policy-not", "shop/web", 9000),
        "policy",
        None,
    ],
)
def test_anything_else_is_not_a_policy_need(key):
    assert policy_need(key) is None
