"""agent.config: the duration parsers every command's flags and variables go through."""

from __future__ import annotations

import pytest

from agent.config import parse_dir_path, parse_positive_seconds, parse_seconds


@pytest.mark.parametrize(
    ("raw", "seconds"),
    [
        ("30", 30.0),
        ("1.5", 1.5),
        ("30s", 30.0),
        ("500ms", 0.5),
        ("250us", 0.00025),
        ("2m", 120.0),
        ("1h", 3600.0),
    ],
)
def test_a_duration_reads_in_seconds_with_or_without_a_unit(raw, seconds):
    assert parse_seconds(raw) == seconds


@pytest.mark.parametrize(
    ("raw", "why"),
    [
        ("soon", "not a duration"),
        ("-1s", "must not be negative"),
        ("nan", "not a finite duration"),
        ("inf", "not a finite duration"),
        ("-infms", "not a finite duration"),
    ],
)
def test_a_bad_duration_says_why(raw, why):
    with pytest.raises(ValueError, match=why):
        parse_seconds(raw)


def test_a_positive_duration_refuses_zero():
    assert parse_positive_seconds("0.2") == 0.2
    with pytest.raises(ValueError, match="must be positive"):
        parse_positive_seconds("0")


def test_a_directory_path_may_be_new_but_not_a_file(tmp_path):
    assert parse_dir_path(str(tmp_path)) == tmp_path
    assert parse_dir_path(str(tmp_path / "new")) == tmp_path / "new"
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="not a directory"):
        parse_dir_path(str(tmp_path / "file"))
