"""agent.identity.files: a PEM file's directory that cannot be made is a PKIError
naming it (rule 3), not an OSError."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.errors import PKIError
from agent.identity.files import KEY_MODE, write_file


def test_the_directory_is_made_and_the_file_written_with_its_mode(tmp_path):
    path = tmp_path / "a" / "b" / "ca.key"
    write_file(path, b"key", mode=KEY_MODE)
    assert path.read_bytes() == b"key"
    assert path.stat().st_mode & 0o777 == KEY_MODE


def test_a_file_where_the_directory_should_be_is_named(tmp_path):
    where = tmp_path / "taken"
    where.write_text("")
    with pytest.raises(PKIError, match="not a directory") as got:
        write_file(where / "ca.crt", b"cert", mode=0o644)
    assert str(where) in str(got.value)


def test_a_directory_that_cannot_be_made_is_named():
    with pytest.raises(PKIError, match="cannot make the directory") as got:
        write_file(Path("/proc/meshagent-pki/ca.crt"), b"x", mode=0o644)
    assert "/proc/meshagent-pki" in str(got.value)
