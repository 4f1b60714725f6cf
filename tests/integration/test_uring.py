"""agent.proxy.uring on real TCP sockets: many non-blocking sends in one io_uring call."""

from __future__ import annotations

import contextlib
import errno
import gc
import os
import socket
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from agent.proxy import uring
from agent.proxy.uring import ENTRIES, SendRing

if TYPE_CHECKING:
    from collections.abc import Iterator


@contextlib.contextmanager
def tcp_pairs(n: int, *, sndbuf: int = 0) -> Iterator[list[tuple[socket.socket, socket.socket]]]:
    """`n` connected (ours, theirs) TCP sockets on loopback, ours non-blocking (also
    used by test_writes)."""
    listener = socket.create_server(("127.0.0.1", 0), backlog=n)
    pairs: list[tuple[socket.socket, socket.socket]] = []
    try:
        for _ in range(n):
            ours = socket.socket()
            if sndbuf:
                ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
            ours.connect(listener.getsockname())
            theirs, _ = listener.accept()
            ours.setblocking(False)
            pairs.append((ours, theirs))
        yield pairs
    finally:
        listener.close()
        for ours, theirs in pairs:
            ours.close()
            theirs.close()


def _read(sock: socket.socket, size: int) -> bytes:
    sock.settimeout(5)
    got = b""
    while len(got) < size:
        chunk = sock.recv(size - len(got))
        if not chunk:
            break
        got += chunk
    return got


@pytest.fixture
def ring() -> Iterator[SendRing]:
    opened = SendRing.open()
    assert opened is not None, "io_uring is available on this machine (kernel.io_uring_disabled=0)"
    yield opened
    opened.close()


def test_one_call_sends_to_every_socket_from_bytes_and_memoryviews(ring):
    with tcp_pairs(3) as pairs:
        view = memoryview(bytearray(b"--a slice of a bytearray--"))[2:-2]
        items = [
            (pairs[0][0].fileno(), b"GET / HTTP/1.1\r\n\r\n"),
            (pairs[1][0].fileno(), view),
            (pairs[2][0].fileno(), memoryview(b"read-only view")),
        ]
        assert ring.send(items) == [18, len(view), 14]
        assert _read(pairs[0][1], 18) == b"GET / HTTP/1.1\r\n\r\n"
        assert _read(pairs[1][1], len(view)) == b"a slice of a bytearray"
        assert _read(pairs[2][1], 14) == b"read-only view"


def test_more_sends_than_the_ring_holds_go_in_further_calls(ring):
    with tcp_pairs(ENTRIES + 6) as pairs:
        items = [(ours.fileno(), b"%05d" % i) for i, (ours, _) in enumerate(pairs)]
        assert ring.send(items) == [5] * len(items)
        assert [_read(theirs, 5) for _, theirs in pairs] == [b"%05d" % i for i in range(len(pairs))]


def test_a_full_socket_takes_part_then_nothing_and_a_reset_one_answers_its_error(ring):
    big = os.urandom(4 << 20)
    with tcp_pairs(3, sndbuf=4096) as pairs:
        (full, full_peer), (ok, ok_peer), (reset, reset_peer) = pairs
        reset_peer.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\0\0\0\0\0\0\0")
        reset_peer.close()  # an RST: the next send fails
        with contextlib.suppress(OSError):
            reset.recv(1)
        first = ring.send([(full.fileno(), big), (ok.fileno(), b"fine"), (reset.fileno(), b"x")])
        assert 0 < first[0] < len(big)  # non-blocking: what the buffers took
        assert first[1] == 4
        assert first[2] in (-errno.ECONNRESET, -errno.EPIPE)
        sent = first[0]
        while (took := ring.send([(full.fileno(), memoryview(big)[sent:])])[0]) > 0:
            sent += took
            assert sent < len(big), "a peer that reads nothing took 4 MiB"
        assert took == -errno.EAGAIN  # never waits for room
        assert _read(ok_peer, 4) == b"fine"
        assert _read(full_peer, sent) == big[:sent]  # what it took, intact and in order


def test_switched_off_there_is_no_ring():
    uring.switch(False)
    try:
        assert SendRing.open() is None
    finally:
        uring.switch(True)
    opened = SendRing.open()
    assert opened is not None
    opened.close()


def _open_fds() -> int:
    return len(list(Path("/proc/self/fd").iterdir()))


def test_a_ring_closes_its_fds_when_closed_or_when_it_goes():
    before = _open_fds()
    closed = SendRing()
    assert _open_fds() > before  # the ring's and its mappings' (mmap keeps a dup)
    closed.close()
    assert _open_fds() == before
    dropped = SendRing()
    assert _open_fds() > before
    del dropped
    gc.collect()
    assert _open_fds() == before
