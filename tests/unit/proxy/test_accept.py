"""agent.proxy.accept: the original destination is asked once per connection."""

from __future__ import annotations

from typing import Any

import pytest

from agent.proxy import accept
from agent.proxy.accept import Accepted, Conn
from agent.proxy.listener import ListenerKind
from agent.proxy.worker import ListenerInfo


def bare_conn(listener: ListenerInfo, *, peer: tuple[str, int] = ("10.0.0.9", 5555)) -> Conn:
    """A `Conn` with no socket, loop or worker, for code that reads only its listener, its
    addresses and its records (compiled, `Conn.__new__(Conn)` runs `__init__`)."""
    none: Any = None
    return Conn(
        worker=none,
        listener=listener,
        held=Accepted(none),
        loop=none,
        transport=none,
        peer=peer,
        local=("127.0.0.1", 4140),
    )


def _conn() -> Conn:
    """A connection whose target is not known yet (`target_of` needs no socket)."""
    return bare_conn(
        ListenerInfo(listener_id="out", pod="ns/a", kind=ListenerKind.OUTBOUND, netns="/x")
    )


def test_target_of_asks_resolve_target_once_per_connection(monkeypatch: pytest.MonkeyPatch):
    asked: list[object] = []

    def resolve(conn: Conn) -> tuple[str, int]:
        asked.append(conn)
        return ("10.0.0.7", 8080)

    monkeypatch.setattr(accept, "resolve_target", resolve)
    one, two = _conn(), _conn()
    assert accept.target_of(one) == ("10.0.0.7", 8080)
    assert accept.target_of(one) == ("10.0.0.7", 8080)
    assert accept.target_of(two) == ("10.0.0.7", 8080)
    assert asked == [one, two]


def test_a_failed_resolution_is_not_remembered(monkeypatch: pytest.MonkeyPatch):
    answers: list[object] = [OSError("getsockopt: bad file descriptor"), ("10.0.0.8", 80)]

    def resolve(conn: Conn) -> tuple[str, int]:
        got = answers.pop(0)
        if isinstance(got, Exception):
            raise got
        return got  # type: ignore[return-value]

    monkeypatch.setattr(accept, "resolve_target", resolve)
    conn = _conn()
    with pytest.raises(OSError, match="bad file descriptor"):
        accept.target_of(conn)
    assert accept.target_of(conn) == ("10.0.0.8", 80)
    assert answers == []
