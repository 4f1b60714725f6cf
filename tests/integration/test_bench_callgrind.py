"""agent.bench.callgrind against a real process under callgrind: zero, a known number of
calls of the marker (the compiled `Observer.taps_now`), dump, parse."""

from __future__ import annotations

import shlex
import subprocess
import sys
import time

import pytest

from agent.bench import callgrind

CALLS = 2500
# Spins (not sleeps) between steps: callgrind reads its commands while the program runs.
PROGRAM = f"""
import pathlib, sys
from agent.bench import icount
from agent.proxy import record
icount.observe()
observer = record.RECORDER
go, done = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
ready = pathlib.Path(sys.argv[3])
observer.taps_now()
ready.write_text("")
while not go.exists():
    pass
for _ in range({CALLS}):
    observer.taps_now()
done.write_text("")
while True:
    go.exists()
"""


def _wait_for(path, proc, within):
    deadline = time.monotonic() + within
    while not path.exists():
        assert proc.poll() is None, f"the program exited: {proc.stderr.read()[-800:]}"
        assert time.monotonic() < deadline, f"no {path.name} after {within}s"
        time.sleep(0.1)


@pytest.fixture
def counted(tmp_path):
    argv = [
        *shlex.split(callgrind.wrap_command(tmp_path)),
        sys.executable,
        "-c",
        PROGRAM,
        *(str(tmp_path / n) for n in ("go", "done", "ready")),
    ]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        yield tmp_path, proc
    finally:
        proc.kill()
        proc.wait(timeout=30)
        proc.stderr.close()


def test_the_window_between_zero_and_dump_holds_exactly_the_marker_calls_made_in_it(counted):
    directory, proc = counted
    _wait_for(directory / "ready", proc, 300)
    callgrind.control(proc.pid, "-z")
    (directory / "go").write_text("")
    _wait_for(directory / "done", proc, 300)
    callgrind.control(proc.pid, "-d")
    dump = callgrind.parse(callgrind.newest_dump(directory, proc.pid).read_text())
    assert dump.calls.get(callgrind.MARKER) == CALLS
    # Each call is a compiled method's few dozen instructions, the spinning around it more.
    assert dump.ir > CALLS * 20


def test_a_command_to_a_pid_callgrind_does_not_run_is_an_error_that_names_it():
    with subprocess.Popen(["sleep", "30"]) as proc:
        try:
            with pytest.raises(callgrind.BenchError, match=f"callgrind_control -z {proc.pid}"):
                callgrind.control(proc.pid, "-z")
        finally:
            proc.kill()


def test_bench_refuses_icount_loads_too_short_to_count_before_building_anything():
    argv = [sys.executable, "-m", "agent", "bench", "--icount", "--duration", "5"]
    done = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=60)
    assert done.returncode == 2
    assert "--duration='5'" in done.stderr
    assert "--icount needs loads of at least 20s" in done.stderr
