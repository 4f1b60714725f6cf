"""Fixtures shared by the identity unit tests: a fixed `now` and a PKI made with it."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from agent.identity import pki as pki_files


@pytest.fixture
def now():
    return datetime.now(UTC)


@pytest.fixture
def pki(tmp_path, now):
    """A trust anchor in tmp_path/root and an issuer signed by it in tmp_path/issuer."""
    pki_files.create_root(tmp_path / "root", now=now)
    pki_files.create_issuer(tmp_path / "issuer", tmp_path / "root", now=now)
    return tmp_path
