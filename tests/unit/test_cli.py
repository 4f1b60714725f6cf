"""agent.cli: the top-level `--log-level` (or MESHAGENT_LOG_LEVEL) is refused when it
names no level, instead of quietly logging at info."""

from __future__ import annotations

import logging

from agent import cli


def test_a_bad_log_level_is_refused_naming_the_flag(capsys):
    assert cli.main(["--log-level", "loud", "certs", "inspect", "/nonexistent"]) == 2
    err = capsys.readouterr().err
    assert "meshagent: error: --log-level='loud': must be one of debug, info, warning, error" in err


def test_a_bad_log_level_variable_is_refused_by_its_name(capsys, monkeypatch):
    monkeypatch.setenv(cli.ENV_LOG_LEVEL, "chatty")
    assert cli.main(["certs", "inspect", "/nonexistent"]) == 2
    assert f"{cli.ENV_LOG_LEVEL}='chatty': must be one of" in capsys.readouterr().err


def test_the_flag_wins_over_the_variable_and_case_does_not_matter(capsys, monkeypatch):
    monkeypatch.setenv(cli.ENV_LOG_LEVEL, "chatty")
    root = logging.getLogger()
    before = root.level
    try:
        assert cli.main(["--log-level", "WARNING", "certs", "inspect", "/nonexistent"]) == 2
        assert "/nonexistent: missing" in capsys.readouterr().err  # the command ran
        assert root.level == logging.WARNING
    finally:
        root.setLevel(before)
