"""agent.proxy.worker (its pure helpers): the original destination is asked once per connection."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from agent.proxy import worker


def test_target_of_asks_resolve_target_once_per_connection(monkeypatch: pytest.MonkeyPatch):
    asked: list[object] = []

    def resolve(conn: object) -> tuple[str, int]:
        asked.append(conn)
        return ("10.0.0.7", 8080)

    monkeypatch.setattr(worker, "resolve_target", resolve)
    one, two = SimpleNamespace(target=None), SimpleNamespace(target=None)
    assert worker.target_of(one) == ("10.0.0.7", 8080)  # type: ignore[arg-type]
    assert worker.target_of(one) == ("10.0.0.7", 8080)  # type: ignore[arg-type]
    assert worker.target_of(two) == ("10.0.0.7", 8080)  # type: ignore[arg-type]
    assert asked == [one, two]


def test_a_failed_resolution_is_not_remembered(monkeypatch: pytest.MonkeyPatch):
    answers: list[object] = [OSError("getsockopt: bad file descriptor"), ("10.0.0.8", 80)]

    def resolve(conn: object) -> tuple[str, int]:
        got = answers.pop(0)
        if isinstance(got, Exception):
            raise got
        return got  # type: ignore[return-value]

    monkeypatch.setattr(worker, "resolve_target", resolve)
    conn = SimpleNamespace(target=None)
    with pytest.raises(OSError, match="bad file descriptor"):
        worker.target_of(conn)  # type: ignore[arg-type]
    assert worker.target_of(conn) == ("10.0.0.8", 80)  # type: ignore[arg-type]
    assert answers == []


def test_h2_lanes_flag_defaults_to_several_and_refuses_zero(capsys: pytest.CaptureFixture[str]):
    base = ["--channel-fd=3", "--worker-id=0"]
    assert worker.parse_args(base).h2_lanes == 4
    assert worker.parse_args([*base, "--h2-lanes=1"]).h2_lanes == 1
    with pytest.raises(SystemExit):
        worker.parse_args([*base, "--h2-lanes=0"])
    assert "--h2-lanes" in capsys.readouterr().err
