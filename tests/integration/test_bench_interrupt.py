"""A `meshagent bench` stopped with SIGTERM leaves nothing running: its node agents
(also one still starting), their workers, the load and the lab's namespaces go."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import psutil
import pytest

pytestmark = [pytest.mark.privileged, pytest.mark.timeout(150)]


def _netns() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    return {line.split()[0] for line in out.stdout.splitlines() if line.strip()}


def _descendants(proc: psutil.Process) -> dict[int, str]:
    out = {}
    for child in proc.children(recursive=True):
        try:
            out[child.pid] = " ".join(child.cmdline())
        except psutil.Error:
            continue
    return out


def _alive(pid: int, cmdline: str) -> bool:
    """Whether `pid` still runs the same program (not a reused pid, not a zombie)."""
    try:
        p = psutil.Process(pid)
        return p.status() != psutil.STATUS_ZOMBIE and " ".join(p.cmdline()) == cmdline
    except psutil.Error:
        return False


@pytest.mark.parametrize("when", ["agent starting", "load running"])
def test_sigterm_stops_every_process_and_removes_the_lab(tmp_path, when):
    before = _netns()
    argv = [sys.executable, "-m", "agent", "bench", "--setups", "meshagent-iptables"]
    argv += ["--loads", "http1-rate-1000", "--duration", "60", "--out", str(tmp_path)]
    errors = tmp_path / "stderr"
    with errors.open("wb") as err:
        bench = subprocess.Popen(
            argv, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True
        )
    try:
        me = psutil.Process(bench.pid)
        seen: dict[int, str] = {}

        def wait_for(wanted: str, *, new_after: set[int]) -> None:
            deadline = time.monotonic() + 90
            while not any(wanted in c for p, c in seen.items() if p not in new_after):
                assert bench.poll() is None, errors.read_text()[-2000:]
                assert time.monotonic() < deadline, f"never saw {wanted!r}: {seen}"
                seen.update(_descendants(me))
                time.sleep(0.05)

        wait_for(" --redirect ", new_after=set())  # the node agent, starting
        if when == "load running":  # a load started after the agent: not the warm-up's
            wait_for("agent.bench.loadgen", new_after=set(seen))
            time.sleep(1.0)
        seen |= _descendants(me)
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(timeout=60) == 130, errors.read_text()[-2000:]  # as after Ctrl-C
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait()
    left = {pid: c for pid, c in seen.items() if _alive(pid, c)}
    assert left == {}
    assert _netns() - before == set()
