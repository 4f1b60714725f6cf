"""agent.proxy.h1toh2's per-connection memo of upgraded request headers (rule 4)."""

from __future__ import annotations

from typing import Any

from agent.proxy import h1toh2
from agent.proxy.h1plan import Target
from agent.proxy.http1 import RequestHead, RequestParser


async def _never(_factory: Any) -> Any:
    raise AssertionError("not opened here")


def _head(raw: bytes) -> RequestHead:
    (head, *_) = RequestParser().feed(raw)
    assert isinstance(head, RequestHead)
    return head


def test_equal_header_lists_are_one_shared_list_and_others_their_own() -> None:
    first = [(b":method", b"GET"), (b":path", b"/shared-a")]
    assert h1toh2.shared(first) is first
    assert h1toh2.shared(list(first)) is first
    other = [(b":method", b"GET"), (b":path", b"/shared-b")]
    assert h1toh2.shared(other) is other


def test_two_connections_sending_the_same_request_get_the_same_list() -> None:
    # What lets the lane's HPACK encoder find a repeat by identity (h2hpack rule 5):
    # the connections' heads are parsed apart and their memos made apart.
    raw = b"GET /same HTTP/1.1\r\nHost: web\r\nx-a: 1\r\n\r\n"
    target = Target(key=("up", 1), open=_never)
    one = h1toh2.Memo().headers_for(_head(raw), target)
    two = h1toh2.Memo().headers_for(_head(raw), target)
    assert one is not None
    assert one is two
    assert (b":path", b"/same") in one
    other = h1toh2.Memo().headers_for(_head(raw.replace(b"x-a: 1", b"x-a: 2")), target)
    assert other is not one
    assert other is not None
    assert (b"x-a", b"2") in other


def test_the_shared_lists_are_bounded() -> None:
    for i in range(h1toh2.SHARED_MAX + 5):
        fields = [(b":path", b"/bounded-%d" % i)]
        assert h1toh2.shared(fields) is fields
    assert len(h1toh2._SHARED) <= h1toh2.SHARED_MAX
