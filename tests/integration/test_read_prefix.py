"""agent.proxy.plane.read_prefix on real sockets: a verdict from bytes that come later,
or None when they do not come before the deadline, and the transport left paused."""

from __future__ import annotations

import asyncio
import socket
import time
from typing import TYPE_CHECKING

from agent import aio
from agent.proxy.detect import NEED_MORE, NeedMore
from agent.proxy.plane import read_prefix

if TYPE_CHECKING:
    from collections.abc import Callable


def _needs(n: int) -> Callable[[bytes, bool], bytes | NeedMore]:
    """A `decide` that wants `n` bytes (or an EOF) before it answers with what it saw."""

    def decide(buf: bytes, eof: bool) -> bytes | NeedMore:
        return buf if len(buf) >= n or eof else NEED_MORE

    return decide


async def _paused(sock: socket.socket) -> asyncio.Transport:
    tr, _ = await asyncio.get_running_loop().create_connection(asyncio.Protocol, sock=sock)
    tr.pause_reading()
    return tr


def test_bytes_that_come_in_later_reads_make_the_verdict() -> None:
    async def main() -> tuple[object, bytes, bool, bool]:
        ours, theirs = socket.socketpair()
        with ours, theirs:
            tr = await _paused(ours)
            loop = asyncio.get_running_loop()
            loop.call_later(0.05, theirs.send, b"GET ")
            loop.call_later(0.1, theirs.send, b"/ HTTP/1.1\r\n")
            verdict, buf, eof = await read_prefix(
                tr, b"", eof=False, decide=_needs(16), timeout=5.0, loop=loop
            )
            reading = tr.is_reading()
            tr.close()
            return verdict, buf, eof, reading

    verdict, buf, eof, reading = aio.run(main())
    assert verdict == b"GET / HTTP/1.1\r\n"
    assert buf == b"GET / HTTP/1.1\r\n"
    assert not eof
    assert not reading


def test_no_verdict_by_the_deadline_is_none_with_what_came() -> None:
    async def main() -> tuple[object, bytes, bool, float, bool]:
        ours, theirs = socket.socketpair()
        with ours, theirs:
            tr = await _paused(ours)
            theirs.send(b"abc")
            start = time.monotonic()
            verdict, buf, eof = await read_prefix(
                tr, b"", eof=False, decide=_needs(16), timeout=0.3
            )
            took = time.monotonic() - start
            reading = tr.is_reading()
            tr.close()
            return verdict, buf, eof, took, reading

    verdict, buf, eof, took, reading = aio.run(main())
    assert verdict is None
    assert buf == b"abc"
    assert not eof
    assert 0.25 <= took < 2.0
    assert not reading


def test_an_eof_decides_and_a_lost_connection_raises() -> None:
    async def main() -> tuple[object, bool, str]:
        ours, theirs = socket.socketpair()
        with ours, theirs:
            tr = await _paused(ours)
            theirs.send(b"ab")
            theirs.shutdown(socket.SHUT_WR)
            verdict, _, eof = await read_prefix(tr, b"", eof=False, decide=_needs(16), timeout=5.0)
            tr.close()
        a, b = socket.socketpair()
        with a, b:
            tr2 = await _paused(a)
            asyncio.get_running_loop().call_later(0.05, tr2.abort)
            try:
                await read_prefix(tr2, b"", eof=False, decide=_needs(16), timeout=5.0)
            except ConnectionError as exc:
                return verdict, eof, str(exc)
            return verdict, eof, "no error"

    verdict, eof, error = aio.run(main())
    assert verdict == b"ab"
    assert eof
    assert "lost" in error
