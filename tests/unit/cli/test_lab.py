"""agent.cli.lab: `meshagent bench` refuses bad flags and variables before it runs; a
SIGTERM becomes an interrupt even where Python would drop it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from agent import cli
from agent.cli import lab


def _bench(*argv: str) -> int:
    return cli.main(["bench", "--setups", "direct", "--loads", "http1-rr", *argv])


@pytest.mark.parametrize(
    ("value", "why"),
    [
        ("-1", "duration must not be negative"),
        ("0", "must be positive"),
        ("nan", "not a finite duration"),
        ("inf", "not a finite duration"),
        ("abc", "not a duration"),
    ],
)
def test_a_bad_duration_is_refused_naming_the_flag_and_value(tmp_path, capsys, value, why):
    assert _bench("--out", str(tmp_path), "--duration", value) == 2
    err = capsys.readouterr().err
    assert f"meshagent: error: --duration={value!r}: {why}" in err


@pytest.mark.parametrize(
    ("value", "why"), [("-1", "duration must not be negative"), ("abc", "not a duration")]
)
def test_a_bad_warmup_is_refused_naming_the_flag_and_value(tmp_path, capsys, value, why):
    assert _bench("--out", str(tmp_path), "--warmup", value) == 2
    err = capsys.readouterr().err
    assert f"meshagent: error: --warmup={value!r}: {why}" in err


def test_a_bad_variable_is_refused_by_its_name(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv(lab.ENV_DURATION, "soon")
    assert _bench("--out", str(tmp_path)) == 2
    assert f"{lab.ENV_DURATION}='soon': not a duration" in capsys.readouterr().err
    monkeypatch.delenv(lab.ENV_DURATION)
    monkeypatch.setenv(lab.ENV_PLACEMENT, "everywhere")
    assert _bench("--out", str(tmp_path)) == 2
    assert f"{lab.ENV_PLACEMENT}='everywhere': --placement must be" in capsys.readouterr().err


def test_a_bad_variable_does_not_break_the_other_commands(monkeypatch):
    monkeypatch.setenv(lab.ENV_DURATION, "soon")
    args = cli.build_parser().parse_args(["redirects", "list"])
    assert args.handler is not None


def test_an_unusable_out_is_refused_before_the_run(tmp_path, capsys):
    a_file = tmp_path / "bench.json"
    a_file.write_text("{}")
    assert _bench("--out", str(a_file)) == 2
    assert f"--out={str(a_file)!r}: not a directory" in capsys.readouterr().err
    assert _bench("--out", "/proc/meshagent-bench") == 2
    assert "--out='/proc/meshagent-bench': No such file or directory" in capsys.readouterr().err


def test_a_refused_flag_makes_no_out(tmp_path, capsys):
    out = tmp_path / "a" / "b"
    assert _bench("--out", str(out), "--duration", "-1") == 2
    assert "--duration='-1'" in capsys.readouterr().err
    assert not (tmp_path / "a").exists()


# A SIGTERM handled inside a `__del__` (as inside logging's fork hook, where CI lost one
# while the sandbox forked an agent): Python can only print the KeyboardInterrupt there.
_LOST_THERE = """
import os, signal, sys, time
from agent.cli.lab import _terminate_as_interrupt

class Dropped:
    def __del__(self):
        os.kill(os.getpid(), signal.SIGTERM)

with _terminate_as_interrupt():
    try:
        Dropped()
        end = time.monotonic() + 10
        while time.monotonic() < end:
            time.sleep(0.01)
    except KeyboardInterrupt:
        sys.exit(130)
print("ran on")
"""


def test_a_sigterm_dropped_where_python_only_prints_it_interrupts_again():
    repo = Path(__file__).resolve().parents[3]
    done = subprocess.run(
        [sys.executable, "-c", _LOST_THERE],
        cwd=repo,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 130, done.stdout + done.stderr
    assert "Exception ignored" not in done.stderr
