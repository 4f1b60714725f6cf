"""Shared fixtures.

Privileged tests (`@pytest.mark.privileged`) need root, network namespaces,
iptables or bpf. They skip when not root, but fail under CI=true: CI runs as
root, so a skip there would hide a broken test.

The run keeps compiled eBPF programs (agent.redirect.ebpf_cache) in a
directory of its own, removed at the end, unless MESHAGENT_BPF_CACHE names
one: every redirector and agent the tests start after the first compile loads
them from there, and nothing is left in /var/cache.
"""

from __future__ import annotations

import contextlib
import gc
import os
import secrets
import shutil
import tempfile
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

    from agent.netlab import Lab


_BPF_CACHE = "MESHAGENT_BPF_CACHE"
_own_bpf_cache: list[str] = []


def pytest_configure(config: pytest.Config) -> None:
    if _BPF_CACHE not in os.environ:
        _own_bpf_cache.append(tempfile.mkdtemp(prefix="meshagent-test-bpf-cache-"))
        os.environ[_BPF_CACHE] = _own_bpf_cache[-1]


def pytest_unconfigure(config: pytest.Config) -> None:
    for path in _own_bpf_cache:
        shutil.rmtree(path, ignore_errors=True)
        if os.environ.get(_BPF_CACHE) == path:
            del os.environ[_BPF_CACHE]
    _own_bpf_cache.clear()


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("privileged") is None or os.geteuid() == 0:
        return
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail("privileged test must run as root under CI=true")
    pytest.skip("privileged test needs root")


# --- pod lab (agent.netlab) ----------------------------------------------------


@contextlib.contextmanager
def _fresh_lab(prefix: str) -> Iterator[Lab]:
    """A new `agent.netlab.Lab` with a unique prefix, closed afterwards, also on failure.

    Labs left by crashed runs (owner process gone) are cleaned first.
    """
    from agent.netlab import Lab  # noqa: PLC0415

    if os.geteuid() != 0:
        pytest.skip("the pod lab needs root")
    Lab.cleanup_stale()
    lb = Lab(prefix + secrets.token_hex(3))
    try:
        yield lb
    finally:
        lb.close()


@pytest.fixture
def lab() -> Iterator[Lab]:
    """A fresh lab for one test."""
    with _fresh_lab("t") as lb:
        yield lb


@pytest.fixture(scope="module")
def module_lab() -> Iterator[Lab]:
    """A fresh lab shared by one module's tests (for worlds built once per module)."""
    with _fresh_lab("m") as lb:
        yield lb


# --- reference cycles (agent.proxy.worker rule 7) --------------------------------


@pytest.fixture
def cycles() -> Iterator[Callable[[tuple[type, ...]], int]]:
    """The collector off for the test; yields `count(kinds)`: how many objects of those
    types are garbage only the collector could free (kept, counted, then dropped)."""
    gc.collect()
    gc.disable()

    def count(kinds: tuple[type, ...]) -> int:
        gc.set_debug(gc.DEBUG_SAVEALL)
        try:
            gc.collect()
            return sum(isinstance(o, kinds) for o in gc.garbage)
        finally:
            gc.set_debug(0)
            gc.garbage.clear()

    try:
        yield count
    finally:
        gc.enable()
