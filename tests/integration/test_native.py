"""The compiled request path is what runs (agent.native); MESHAGENT_NATIVE=0 runs the sources."""

from __future__ import annotations

import os
import subprocess
import sys

from agent import native
from agent.proxy import h1fast, http1, httpproxy

_PROBE = "import agent.native as n, agent.proxy.httpproxy as m; print(n.STATE, m.__file__)"


def test_the_build_is_current_and_loaded_in_this_process():
    assert native.state() == "active", "stale or missing build: run `bash scripts/setup`"
    for mod in (h1fast, http1, httpproxy):
        assert mod.__file__ is not None
        assert mod.__file__.endswith(".so"), mod.__file__


def _probe(**env: str) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-c", _PROBE],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    return out.stdout.split()


def test_a_new_process_loads_it_and_the_switch_falls_back_to_the_sources():
    state, path = _probe()
    assert state == "active"
    assert path.endswith(".so")
    state, path = _probe(**{native.ENV: "0"})
    assert state == "off"
    assert path.endswith("agent/proxy/httpproxy.py")
