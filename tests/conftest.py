"""Shared fixtures.

Privileged tests (`@pytest.mark.privileged`) need root, network namespaces,
iptables or bpf. They skip when not root, but fail under CI=true: CI runs as
root, so a skip there would hide a broken test.
"""

from __future__ import annotations

import os

import pytest


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("privileged") is None or os.geteuid() == 0:
        return
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail("privileged test must run as root under CI=true")
    pytest.skip("privileged test needs root")


# --- pod lab (agent.netlab) ----------------------------------------------------


@pytest.fixture
def lab():
    """A fresh `agent.netlab.Lab` (unique prefix), always closed after the test.

    Labs left by crashed runs (owner process gone) are cleaned first.
    """
    import secrets  # noqa: PLC0415

    from agent.netlab import Lab  # noqa: PLC0415

    if os.geteuid() != 0:
        pytest.skip("the pod lab needs root")
    Lab.cleanup_stale()
    lb = Lab("t" + secrets.token_hex(3))
    try:
        yield lb
    finally:
        lb.close()
