"""agent.proxy.writes on real sockets: held writes leave at the end of the loop's batch."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import socket
import time
from typing import TYPE_CHECKING

from agent import aio
from agent.proxy import uring, writes
from tests.integration.test_uring import tcp_pairs

if TYPE_CHECKING:
    from collections.abc import Iterator

    import pytest

    from tests.integration.conftest import Run


@contextlib.contextmanager
def _pairs(n: int) -> Iterator[list[tuple[socket.socket, socket.socket]]]:
    pairs = [socket.socketpair() for _ in range(n)]
    try:
        for _, theirs in pairs:
            theirs.setblocking(False)
        yield pairs
    finally:
        for ours, theirs in pairs:
            ours.close()
            theirs.close()


def _pending(sock: socket.socket) -> bytes:
    """What arrived on `sock` so far (b"" when nothing did)."""
    try:
        return sock.recv(65536)
    except BlockingIOError:
        return b""


def _busy(batch: writes.WriteBatch) -> writes.WriteBatch:
    """`batch` as a busy loop's: its next hold is held, not written at once (rule 8)."""
    batch.last_n = uring.MIN_SENDS
    return batch


async def _transport(sock: socket.socket) -> asyncio.Transport:
    tr, _ = await asyncio.get_running_loop().create_connection(asyncio.Protocol, sock=sock)
    return tr


def test_held_writes_leave_in_order_once_the_callbacks_of_the_batch_ran() -> None:
    async def main() -> None:
        with _pairs(2) as pairs:
            (a, a_peer), (b, b_peer) = pairs
            ta, tb = await _transport(a), await _transport(b)
            batch = _busy(writes.batch_for(asyncio.get_running_loop()))
            batch.hold(ta, b"GET /1 ")
            batch.hold(tb, b"to b")
            batch.hold(ta, memoryview(b"GET /2"))
            assert _pending(a_peer) == b""  # held while this callback runs
            await asyncio.sleep(0)  # the loop runs its ready callbacks: the flush among them
            assert batch.items == []
            assert _pending(a_peer) == b"GET /1 GET /2"
            assert _pending(b_peer) == b"to b"
            ta.close()
            tb.close()

    aio.run(main())


def test_flush_puts_what_is_held_before_a_direct_write() -> None:
    async def main() -> None:
        with _pairs(1) as [(a, peer)]:
            tr = await _transport(a)
            batch = _busy(writes.batch_for(asyncio.get_running_loop()))
            batch.hold(tr, b"first ")
            batch.flush()  # what every other write of the HTTP/1 path does first
            tr.write(b"second")
            assert _pending(peer) == b"first second"
            batch.flush()  # nothing held: a no-op
            await asyncio.sleep(0)  # the scheduled flush finds nothing either
            assert _pending(peer) == b""
            tr.close()

    aio.run(main())


def test_a_closed_or_failing_transport_loses_only_its_own_write(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def main() -> None:
        with _pairs(3) as pairs:
            (a, a_peer), (b, b_peer), (c, c_peer) = pairs
            closed, broken, fine = await _transport(a), await _transport(b), await _transport(c)
            batch = _busy(writes.batch_for(asyncio.get_running_loop()))
            batch.hold(closed, b"to a")
            batch.hold(broken, b"to b")
            batch.hold(fine, b"to c")
            closed.close()
            broken.write_eof()  # a write after it raises
            await asyncio.sleep(0.01)
            assert _pending(a_peer) == b""  # closed before the flush: skipped, no error
            assert broken.is_closing()  # aborted, its peer sees the end
            assert _pending(b_peer) == b""
            assert _pending(c_peer) == b"to c"
            fine.close()

    with caplog.at_level(logging.WARNING, logger="agent.proxy.writes"):
        aio.run(main())
    message = "held write failed, aborting its connection"
    failed = [r for r in caplog.records if r.message == message]
    assert len(failed) == 1
    assert failed[0].exc_info is not None
    assert isinstance(failed[0].exc_info[1], RuntimeError)


async def _held_to_each(
    pairs: list[tuple[socket.socket, socket.socket]], form: bytes, *, lane: bool
) -> tuple[list[asyncio.Transport], list[socket.socket], writes.WriteBatch]:
    """A transport on each pair's first socket, `form % i` held for the i-th; the
    transports, the peers and the batch."""
    trs = [await _transport(ours) for ours, _ in pairs]
    batch = _busy(writes.batch_for(asyncio.get_running_loop()))
    for i, tr in enumerate(trs):
        batch.hold(tr, form % i, lane=lane)
    return trs, [theirs for _, theirs in pairs], batch


def _arrived(peers: list[socket.socket], got: list[bytes]) -> int:
    """Read what arrived on each of `peers` into `got`; how many have something."""
    for i, peer in enumerate(peers):
        got[i] += _pending(peer)
    return sum(1 for g in got if g)


def test_a_lanes_responses_leave_in_parts_with_a_poll_between_and_others_at_once() -> None:
    """Rule 5: 20 responses that came over a lane leave 8, 8 and 4, one part per loop
    iteration; 20 others leave in one."""
    n = 20

    async def main() -> None:
        with _pairs(n) as pairs:
            trs, peers, batch = await _held_to_each(pairs, b"lane %d", lane=True)
            got = [b""] * n
            parts = []
            for _ in range(4):
                await asyncio.sleep(0)  # one loop iteration
                parts.append(_arrived(peers, got))
            assert parts == [writes.LANE_PART, 2 * writes.LANE_PART, n, n]
            assert got == [b"lane %d" % i for i in range(n)]
            got = [b""] * n
            for i, tr in enumerate(trs):
                batch.hold(tr, b"plain %d" % i)
            await asyncio.sleep(0)
            assert _arrived(peers, got) == n
            assert got == [b"plain %d" % i for i in range(n)]
            for tr in trs:
                tr.close()

    aio.run(main())


def test_flush_writes_the_rest_of_a_lanes_parts_before_a_direct_write() -> None:
    """Rule 2 holds in parts too: a write of the path flushes all that is still held."""
    n = 12

    async def main() -> None:
        with _pairs(n) as pairs:
            trs, peers, batch = await _held_to_each(pairs, b"r%d ", lane=True)
            await asyncio.sleep(0)
            got = [b""] * n
            assert _arrived(peers, got) == writes.LANE_PART
            batch.flush()
            trs[-1].write(b"after")
            assert _arrived(peers, got) == n
            assert got[-1] == b"r%d after" % (n - 1)
            assert not batch.lane
            for tr in trs:
                tr.close()

    aio.run(main())


def test_an_idle_loop_writes_at_once_and_a_busy_one_holds() -> None:
    async def main() -> None:
        with _pairs(2) as pairs:
            (a, a_peer), (b, b_peer) = pairs
            ta, tb = await _transport(a), await _transport(b)
            batch = writes.batch_for(asyncio.get_running_loop())
            batch.last_n = 0
            before = time.perf_counter_ns()
            batch.wrote_at = before - 2 * writes.IDLE_NS
            batch.hold(ta, b"first")  # nothing left for IDLE_NS: written here and then
            assert _pending(a_peer) == b"first"
            assert batch.items == []
            assert batch.wrote_at >= before  # the write counts as the loop's last
            batch.wrote_at += 10**12  # (a slow machine may take IDLE_NS between two lines)
            batch.hold(tb, b"second")  # the loop just wrote: held to the batch's end
            assert _pending(b_peer) == b""
            await asyncio.sleep(0)
            assert _pending(b_peer) == b"second"
            # the last flush wrote MIN_SENDS writes: a busy loop holds, however long ago
            for _ in range(uring.MIN_SENDS):
                batch.hold(ta, b".")
            batch.flush()
            assert _pending(a_peer) == b"." * uring.MIN_SENDS
            batch.wrote_at -= 2 * writes.IDLE_NS
            batch.hold(ta, b"held")
            assert _pending(a_peer) == b""
            batch.flush()
            assert batch.last_n == 1
            batch.wrote_at -= 2 * writes.IDLE_NS
            batch.hold(ta, b"lane", lane=True)  # a lane's responses are always held (rule 5)
            assert _pending(a_peer) == b"held"
            await asyncio.sleep(0)
            assert _pending(a_peer) == b"lane"
            ta.close()
            tb.close()

    aio.run(main())


def test_each_loop_has_one_batch_which_goes_with_it() -> None:
    async def batch_of_this_loop() -> tuple[int, int]:
        loop = asyncio.get_running_loop()
        return id(writes.batch_for(loop)), id(writes.batch_for(loop))

    first, again = aio.run(batch_of_this_loop())
    assert first == again
    loop = asyncio.new_event_loop()
    try:
        other = writes.batch_for(loop)
        assert other is writes.batch_for(loop)
        assert len([b for b in writes._BATCHES.values() if b is other]) == 1
    finally:
        loop.close()
    gc.collect()  # loops earlier tests left for the collector go first
    before = len(writes._BATCHES)
    del loop, other
    gc.collect()
    assert len(writes._BATCHES) == before - 1


def _read_all(sock: socket.socket, size: int) -> bytes:
    sock.settimeout(10)
    got = bytearray()
    while len(got) < size and (chunk := sock.recv(size - len(got))):
        got += chunk
    return bytes(got)


def test_a_flush_of_many_writes_goes_in_one_ring_call_and_each_connection_keeps_its_order(
    run: Run,
) -> None:
    """Rule 6: each transport's first held write goes to the ring, its later ones after;
    fewer than MIN_SENDS transports are written one by one."""
    n = uring.MIN_SENDS

    async def body() -> None:
        with tcp_pairs(n) as pairs:
            trs = [await _transport(ours) for ours, _ in pairs]
            batch = _busy(writes.batch_for(asyncio.get_running_loop()))
            batch.hold(trs[0], b"first ")
            for i, tr in enumerate(trs):
                batch.hold(tr, memoryview(b"to %d" % i) if i % 2 else b"to %d" % i)
            await asyncio.sleep(0)
            ring = batch.ring  # opened by this flush: a new loop has a new batch
            assert ring is not None
            assert (ring.calls, ring.sends) == (1, n)
            assert _read_all(pairs[0][1], 10) == b"first to 0"
            for i, (_, theirs) in enumerate(pairs[1:], 1):
                assert _read_all(theirs, 4) == b"to %d" % i
            for tr in trs[: n - 1]:
                batch.hold(tr, b"few")
            await asyncio.sleep(0)
            assert (ring.calls, ring.sends) == (1, n)  # one by one
            assert [_read_all(theirs, 3) for _, theirs in pairs[: n - 1]] == [b"few"] * (n - 1)
            for tr in trs:
                tr.close()

    run(body)


def test_what_the_ring_did_not_take_its_transport_writes_before_anything_later(run: Run) -> None:
    """A short send leaves the rest to the transport; a transport with bytes queued is
    not given to the ring, so its later writes stay behind them."""
    big = os.urandom(1 << 20)
    n = uring.MIN_SENDS

    async def body() -> None:
        with tcp_pairs(n + 1, sndbuf=4096) as pairs:
            (x, x_peer), others = pairs[0], pairs[1:]
            tx = await _transport(x)
            trs = [await _transport(ours) for ours, _ in others]
            batch = _busy(writes.batch_for(asyncio.get_running_loop()))
            batch.hold(tx, big)
            for tr in trs[: n - 1]:
                batch.hold(tr, b"1")
            await asyncio.sleep(0)
            ring = batch.ring
            assert ring is not None
            assert (ring.calls, ring.sends) == (1, n)  # x and n - 1 others
            assert tx.get_write_buffer_size() > 0  # the rest, queued in the transport
            batch.hold(tx, b"tail")
            for tr in trs:
                batch.hold(tr, b"2")
            await asyncio.sleep(0)
            assert (ring.calls, ring.sends) == (2, 2 * n)  # the n others, not x: bytes queued
            reader = asyncio.get_running_loop().run_in_executor(
                None, _read_all, x_peer, len(big) + 4
            )
            assert await reader == big + b"tail"
            got = [_read_all(theirs, 2 if i < n - 1 else 1) for i, (_, theirs) in enumerate(others)]
            assert got == [b"12"] * (n - 1) + [b"2"]
            for tr in (tx, *trs):
                tr.close()

    run(body)


def test_without_a_ring_the_transports_write(run: Run) -> None:
    """Rule 6: io_uring switched off (or unavailable), a flush writes one by one."""
    n = uring.MIN_SENDS

    async def body() -> None:
        with tcp_pairs(n) as pairs:
            trs = [await _transport(ours) for ours, _ in pairs]
            batch = _busy(writes.batch_for(asyncio.get_running_loop()))
            for i, tr in enumerate(trs):
                batch.hold(tr, b"%d" % i)
            await asyncio.sleep(0)
            assert batch.ring is None
            assert [_read_all(theirs, 1) for _, theirs in pairs] == [b"%d" % i for i in range(n)]
            for tr in trs:
                tr.close()

    uring.switch(False)
    try:
        run(body)
    finally:
        uring.switch(True)


def test_a_socket_number_is_asked_once_and_a_closed_transports_is_never_used_for_another(
    run: Run,
) -> None:
    """Rule 7: the batch keeps each transport's socket number; after a transport closes
    and a new socket takes its number, the new transport's writes reach its own peer and
    the closed one's held write is skipped."""
    n = uring.MIN_SENDS

    async def body() -> None:
        loop = asyncio.get_running_loop()
        with tcp_pairs(n) as pairs, tcp_pairs(1) as later:
            trs = [await _transport(ours) for ours, _ in pairs]
            batch = _busy(writes.batch_for(loop))
            for tr in trs:
                batch.hold(tr, b"one")
            await asyncio.sleep(0)
            assert batch.fds == {tr: tr.get_extra_info("socket").fileno() for tr in trs}
            assert [_read_all(theirs, 3) for _, theirs in pairs] == [b"one"] * n
            gone = trs[0]
            number = batch.fds[gone]
            gone.close()
            for _ in range(3):
                await asyncio.sleep(0)  # the loop closes its socket
            with contextlib.suppress(OSError):
                os.fstat(number)
                raise AssertionError(f"socket {number} still open after its transport closed")
            other, other_peer = later[0]
            os.dup2(other.fileno(), number)  # a newer connection under the closed one's number
            taker = socket.socket(fileno=number)
            fresh = await _transport(taker)
            batch.hold(gone, b"lost")
            for tr in (fresh, *trs[1:]):
                batch.hold(tr, b"two")
            await asyncio.sleep(0)
            ring = batch.ring
            assert ring is not None
            assert (ring.calls, ring.sends) == (2, 2 * n)  # n, then fresh and n - 1 others
            assert batch.fds[fresh] == number
            assert _read_all(other_peer, 3) == b"two"
            assert [_read_all(theirs, 3) for _, theirs in pairs[1:]] == [b"two"] * (n - 1)
            for tr in (fresh, *trs[1:]):
                tr.close()

    run(body)


def test_pruning_drops_the_closing_transports_or_all_when_most_are_open(run: Run) -> None:
    """Rule 7's bound: `_prune` keeps the open transports when at least half are closing,
    and clears the lot otherwise."""

    async def body() -> None:
        with tcp_pairs(4) as pairs:
            trs = [await _transport(ours) for ours, _ in pairs]
            fds = {tr: tr.get_extra_info("socket").fileno() for tr in trs}
            trs[0].close()
            writes._prune(fds)
            assert set(fds) == set()  # 1 of 4 closing: all dropped
            fds = {tr: tr.get_extra_info("socket").fileno() for tr in trs[1:]}
            trs[1].close()
            trs[2].close()
            writes._prune(fds)
            assert set(fds) == {trs[3]}
            trs[3].close()

    run(body)
