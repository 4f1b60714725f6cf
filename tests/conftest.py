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
