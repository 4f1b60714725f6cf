"""When a mypyc build of the request path may be used (agent.native): stamps, state, activation."""

from __future__ import annotations

import shutil
import sys

import pytest

from agent import native


@pytest.fixture
def package(tmp_path):
    """A copy of the compiled modules' sources laid out as a package directory."""
    pkg = tmp_path / "agent"
    for (sub, _), src in zip(native.MODULES, native.sources(), strict=True):
        (pkg / sub).mkdir(parents=True, exist_ok=True)
        shutil.copy(src, pkg / sub / src.name)
    return pkg


def _source(package, index: int):
    sub, name = native.MODULES[index]
    return package / sub / f"{name}.py"


@pytest.fixture
def no_env(monkeypatch):
    monkeypatch.delenv(native.ENV, raising=False)


def test_the_digest_is_the_sources_digest_and_moves_with_any_one_of_them(package):
    assert native.digest(package) == native.digest()
    before = native.digest(package)
    last = _source(package, -1)
    last.write_text(last.read_text() + "\n# edited\n")
    assert native.digest(package) != before


def test_state_absent_without_a_build_stale_for_other_sources_active_when_matching(
    tmp_path, package, no_env
):
    build = tmp_path / "native"
    assert native.state(build, package) == "absent"
    build.mkdir()
    (build / native.STAMP).write_text(native.digest(package) + "\n")
    assert native.state(build, package) == "active"
    first = _source(package, 0)
    first.write_text(first.read_text() + "\nX = 1\n")
    assert native.state(build, package) == "stale"


def test_the_environment_switch_turns_a_current_build_off(tmp_path, package, monkeypatch):
    build = tmp_path / "native"
    build.mkdir()
    (build / native.STAMP).write_text(native.digest(package))
    monkeypatch.setenv(native.ENV, "0")
    assert native.state(build, package) == "off"
    monkeypatch.setenv(native.ENV, "1")
    assert native.state(build, package) == "active"


def test_activate_puts_a_current_build_first_and_leaves_a_stale_one_out(
    tmp_path, no_env, monkeypatch
):
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setattr(native, "STATE", native.STATE)
    build = tmp_path / "native"
    build.mkdir()
    (build / native.STAMP).write_text("not the digest\n")
    path = ["/src/agent/proxy"]
    assert native.activate(path, "proxy", build) == "stale"
    assert path == ["/src/agent/proxy"]
    assert str(build / "lib") not in sys.path

    (build / native.STAMP).write_text(native.digest() + "\n")
    assert native.activate(path, "proxy", build) == "active"
    assert path == [str(build / "proxy"), "/src/agent/proxy"]
    assert str(build / "lib") in sys.path
    assert native.STATE == "active"


def test_a_failed_build_raises_with_the_compilers_words_and_removes_the_old_build(
    tmp_path, package
):
    bad = package / "proxy" / "accrual.py"
    bad.write_text(bad.read_text() + "\ndef broken(:\n")
    build = tmp_path / "native"
    (build / "proxy").mkdir(parents=True)
    (build / native.STAMP).write_text("an older build\n")
    with pytest.raises(native.NativeBuildError, match=r"(?s)mypyc build failed.*accrual\.py"):
        native.build(build, package_dir=package)
    assert not build.exists()


def test_a_current_build_is_not_redone(tmp_path, package):
    build = tmp_path / "native"
    build.mkdir()
    (build / native.STAMP).write_text(native.digest(package) + "\n")
    assert native.build(build, package_dir=package) is False
