"""`python -m agent.bench.icount`: the in-process HTTP/1 loop it counts, and its flags.

Benchmarks report, tests assert behaviour: here, that the loop serves every request it
is asked for on the callback path (so a count prices that path), that callgrind's totals
are read into a positive per-request figure, and that bad flags are refused by name.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys

import pytest


def _icount(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "agent.bench.icount", *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)


def test_the_loop_serves_every_request_and_all_but_the_first_per_connection_on_callbacks():
    done = _icount("--run", "400", "--connections", "4")
    assert done.returncode == 0, done.stderr[-2000:]
    found = re.search(r"requests=(\d+) callback_path=(\d+)", done.stdout)
    assert found is not None, done.stdout
    answered, fast = int(found.group(1)), int(found.group(2))
    assert answered == 400
    assert fast >= 400 - 4  # a connection's first request may open the pooled upstream


@pytest.mark.skipif(shutil.which("valgrind") is None, reason="valgrind not installed")
def test_callgrind_totals_become_instructions_per_request():
    done = _icount("--requests", "20,60", "--connections", "2", timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    found = re.search(
        r"instructions per request: ([\d,]+) \(([\d,]+) at 20 requests, ([\d,]+) at 60\)",
        done.stdout,
    )
    assert found is not None, done.stdout
    per, low, high = (int(g.replace(",", "")) for g in found.groups())
    assert high > low > 0
    assert per == round((high - low) / 40)


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--requests", "5"], "--requests: two counts a,b"),
        (["--requests", "60,20"], "need 0 < a < b"),
        (["--connections", "0"], "--connections must be at least 1"),
    ],
)
def test_bad_flags_are_refused_by_name(args: list[str], says: str):
    done = _icount(*args)
    assert done.returncode == 2
    assert says in done.stderr


def test_with_the_workers_recorder_every_request_is_counted_in_request_total():
    done = _icount("--run", "200", "--connections", "2", "--recorder", "observe")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "requests=200 " in done.stdout
    assert "recorded=200" in done.stdout


def test_with_tls_every_request_crosses_one_mtls_session_per_connection():
    done = _icount("--run", "200", "--connections", "2", "--tls")
    assert done.returncode == 0, done.stderr[-2000:]
    found = re.search(r"requests=(\d+) callback_path=(\d+) tls_sessions=(\d+)", done.stdout)
    assert found is not None, done.stdout
    answered, fast, sessions = (int(g) for g in found.groups())
    assert answered == 200
    assert fast >= 200 - 2
    assert sessions == 2  # the pool keeps one upstream per connection, each one handshake
