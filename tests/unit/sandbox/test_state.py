"""agent.sandbox.state: a process `spawn` started is recorded, or, when the spawn is
interrupted before it could be, killed (rule 2): `down` finds only what was recorded."""

from __future__ import annotations

import signal

import psutil
import pytest

from agent.sandbox import state
from agent.sandbox.state import SandboxError


@pytest.fixture
def recorded(tmp_path, monkeypatch):
    monkeypatch.setattr(state, "SANDBOX_DIR", tmp_path)
    monkeypatch.setattr(state, "STATE_FILE", tmp_path / "state.json")
    return state.State({})


# `sleep 60` is exec'd half a second after the spawn: the spawn waits for it
LATE_EXEC = ["sh", "-c", 'sleep 0.5; exec "$@"', "sh"]


def _spawn_late(recorded: state.State, tmp_path):
    return state.spawn(
        recorded,
        ["sleep", "60"],
        role="app",
        name="a",
        log=tmp_path / "a.log",
        netns_argv=LATE_EXEC,
    )


def test_a_spawned_process_is_recorded_with_its_final_command_line(recorded, tmp_path):
    proc = _spawn_late(recorded, tmp_path)
    try:
        (rec,) = recorded.data["procs"]
        assert rec["pid"] == proc.pid
        assert rec["argv"] == ["sleep", "60"]
        assert state.ours(rec)
    finally:
        assert state.kill_recorded(recorded.data["procs"]) == []
    assert proc.poll() is not None


def test_a_spawn_interrupted_before_the_record_kills_what_it_started(recorded, tmp_path):
    me = psutil.Process()
    before = {p.pid for p in me.children()}

    def interrupt(_signum, _frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.2)  # while the spawn waits for the exec
        with pytest.raises(KeyboardInterrupt):
            _spawn_late(recorded, tmp_path)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert "procs" not in recorded.data
    assert {p.pid for p in me.children()} == before  # killed and reaped, not left running


@pytest.mark.parametrize("text", ["[1, 2]", "{not json"])
def test_a_record_that_is_not_one_is_an_error_naming_the_file(recorded, text):
    state.STATE_FILE.write_text(text)
    with pytest.raises(SandboxError) as err:
        state.load_state()
    assert str(state.STATE_FILE) in str(err.value)
    assert state.STATE_FILE.read_text() == text  # left for the user to look at


def test_each_sandbox_logs_afresh_and_keeps_the_last_ones_logs(recorded):
    logs = state.logs_dir()
    assert logs == state.SANDBOX_DIR / "logs"
    state.rotate_logs()  # nothing logged yet: nothing to move
    assert not logs.exists()
    for run in ("first", "second"):
        proc = state.spawn(recorded, ["echo", run], role="app", name="a", log=logs / "a.log")
        proc.wait()
        state.rotate_logs()
        assert not logs.exists()
        assert (logs.with_name("logs.previous") / "a.log").read_text() == f"{run}\n"


def test_logs_that_cannot_be_moved_aside_are_an_error_naming_them(recorded):
    logs = state.logs_dir()
    logs.mkdir()
    logs.with_name("logs.previous").write_text("a file where the folder goes")
    with pytest.raises(SandboxError) as err:
        state.rotate_logs()
    assert str(logs) in str(err.value)
    assert logs.is_dir()  # left as it was
