"""`meshagent sandbox up` in the foreground, stopped with SIGTERM (as `timeout`, systemd
or a container runtime stop it), takes the sandbox down as Ctrl-C does: while it is
building and once it drives traffic."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.privileged, pytest.mark.timeout(240)]

REPO = Path(__file__).resolve().parents[2]
STATE = Path("/run/meshagent/sandbox/state.json")
CLI = [sys.executable, "-m", "agent"]


def _sandbox_netns() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    return [n for n in out.stdout.split() if n.startswith("sb-")]


@pytest.mark.parametrize(
    ("when", "line", "status"),
    [
        ("building", "control plane: starting", 130),  # as after Ctrl-C there
        ("driving traffic", "meshagent sandbox view", 0),  # the foreground's own end
    ],
)
def test_sigterm_takes_the_sandbox_down(tmp_path, when, line, status):
    assert not STATE.exists(), "a sandbox is up already"
    argv = [*CLI, "sandbox", "up", "--nodes", "1"]
    argv += ["--redirect", "iptables"]
    out = tmp_path / "stdout"
    env = {**os.environ, "PYTHONFAULTHANDLER": "1"}  # SIGABRT prints every thread's stack
    with out.open("wb") as sink:
        up = subprocess.Popen(argv, stdout=sink, stderr=subprocess.STDOUT, cwd=REPO, env=env)
    try:
        deadline = time.monotonic() + 180
        while line not in out.read_text():
            assert up.poll() is None, out.read_text()[-3000:]
            assert time.monotonic() < deadline, f"never saw {line!r} ({when})"
            time.sleep(0.05)
        assert _sandbox_netns()
        up.send_signal(signal.SIGTERM)
        try:
            code = up.wait(timeout=120)
        except subprocess.TimeoutExpired:  # seen once in CI: where it hung goes into `out`
            up.send_signal(signal.SIGABRT)
            up.wait(timeout=30)
            pytest.fail(f"still up 120 s after SIGTERM ({when}):\n{out.read_text()[-8000:]}")
        assert code == status, out.read_text()[-3000:]
        left = (_sandbox_netns(), STATE.exists())
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
        if STATE.exists() or _sandbox_netns():  # what the command failed to remove
            subprocess.run([*CLI, "sandbox", "down"], cwd=REPO, check=False, capture_output=True)
    assert left == ([], False)
