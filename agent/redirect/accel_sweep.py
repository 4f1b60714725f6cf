"""Switched-off accelerated socket ends taken back to plain TCP (opt-in acceleration).

sk_msg switches a socket end to the TCP path for good once it sends a big
message or a long one-way burst (bpf/sk_msg.c), but the end stays in
ma_accel_socks: each of its sends still runs tcp_bpf's sendmsg (a copy into a
scatterlist, the program, a push page by page) and each read tcp_bpf's
recvmsg. A bulk sender so moves about half of what plain TCP moves. Taking the
end out of the sockhash gives it plain TCP back, but also frees the queue of
bytes its peer redirected into it and it has not read yet: those would be lost.

Rules:
1. An end X is looked at twice, at ticks at least `TICK_S` apart, while it is
   switched off (MA_ACCEL_OFF) and in the sockhash as the same socket
   (cookie). At the first look the sweep switches X's peer Y off if it is not
   yet (no redirect into X can start after that) and notes Y's cookie, or that
   Y is gone from the sockhash (a socket out of the sockhash redirects
   nothing). At the second look Y must be as it was (the same cookie and
   switched off) or gone: any send of Y that was past its state check at the
   first look has redirected by now.
2. Then X is taken out when its queue of redirected bytes is empty: Y is in
   the sockhash and has no record in ma_accel_sent (read before Y's cookie;
   sk_msg records before it redirects), or FIONREAD on X says 0
   (`agent.redirect.sockqueue`, on kernels that count the sockmap queue).
   Bytes waiting there are read by X's owner sooner or later: the sweep looks
   again at later ticks, up to `QUEUE_TRIES` times.
3. An end it cannot tell about (its queue unreadable, Y changed between the
   looks, `QUEUE_TRIES` used up) stays in the sockhash for its life, where
   tcp_bpf's path still carries its bytes correctly.
4. The decisions are pure (`Sweep.step`); `Sweeper.tick` reads the maps (each
   call a blocking bpf syscall: run it off the event loop) and the queues,
   applies the decisions and adds the ends it took out to the `returned`
   counter of ma_accel_stats. It reads the maps only when a switch-off counter
   moved or an end waits for a look.
"""

from __future__ import annotations

import asyncio
import ctypes
import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from agent.redirect import maps, sockqueue

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping
    from pathlib import Path

logger = logging.getLogger(__name__)

TICK_S = 0.2  # the agent's sweep period; rule 1's two looks are at least this far apart
QUEUE_TRIES = 25  # rule 2: looks at a non-empty queue before the end is left alone
OFF_COUNTERS = ("off_size", "off_burst", "off_no_peer", "off_config", "off_full")

Key = sockqueue.Key  # (netns, local ip, remote ip, local port, remote port)


def peer_of(key: Key) -> Key:
    """The key of the connection's other end (same netns, addresses swapped)."""
    netns, local_ip, remote_ip, local_port, remote_port = key
    return (netns, remote_ip, local_ip, remote_port, local_port)


@dataclass(frozen=True, slots=True)
class EndView:
    """What the maps say about one socket end."""

    cookie: int | None  # its socket's cookie in ma_accel_socks; None: not there
    off: bool  # MA_ACCEL_OFF in ma_accel_state
    sent: bool  # a record in ma_accel_sent: it redirected at least once
    queued: int | None = None  # redirected bytes it has not read (read when asked); None: unknown


@dataclass(frozen=True, slots=True)
class Decision:
    switch_off: tuple[Key, ...]  # peers to mark MA_ACCEL_OFF
    remove: tuple[Key, ...]  # ends to take out of ma_accel_socks


_GONE = -1  # the peer's "cookie" at the first look when it was not in the sockhash


class Sweep:
    """Rules 1 to 3's bookkeeping across ticks; no I/O."""

    def __init__(self) -> None:
        self._first: dict[int, int] = {}  # end's cookie -> its peer's cookie (or _GONE) at look 1
        self._tries: dict[int, int] = {}  # end's cookie -> looks at a non-empty queue
        self._settled: set[int] = set()  # ends' cookies decided for good

    @property
    def waiting(self) -> bool:
        """Whether an end waits for another look."""
        return bool(self._first)

    def wants_queue(self, end: EndView, peer: EndView) -> bool:
        """Whether the next look at this end needs its queue (`EndView.queued`): it waits
        for a look, and `_verdict`'s first case (a peer that never sent) does not apply."""
        return end.cookie in self._first and not _never_sent(peer)

    def step(self, off: Iterable[Key], views: Mapping[Key, EndView]) -> Decision:
        """One tick over the switched-off ends `off`; `views` has each of them and its peer."""
        switch_off: list[Key] = []
        remove: list[Key] = []
        live: set[int] = set()
        for key in off:
            end = views[key]
            if end.cookie is None:
                continue
            c = end.cookie
            live.add(c)
            if c in self._settled:
                continue
            peer_key = peer_of(key)
            peer = views[peer_key]
            now = _GONE if peer.cookie is None else peer.cookie
            first = self._first.get(c)
            if first is not None and now not in (first, _GONE):
                self._settle(c)  # rule 3: another socket on the peer's addresses
                continue
            if first is None or (peer.cookie is not None and not peer.off):
                self._first[c] = now  # look 1 (again, if the peer's mark was lost meanwhile)
                if peer.cookie is not None and not peer.off:
                    switch_off.append(peer_key)
                continue
            verdict = self._verdict(c, peer, end)  # look 2 or later
            if verdict is not None:
                self._settle(c)
                if verdict:
                    remove.append(key)
        self._first = {c: p for c, p in self._first.items() if c in live}
        self._tries = {c: n for c, n in self._tries.items() if c in live}
        self._settled &= live
        return Decision(tuple(switch_off), tuple(remove))

    def _verdict(self, c: int, peer: EndView, end: EndView) -> bool | None:
        """True: take it out; False: leave it for good; None: look again (rule 2)."""
        if _never_sent(peer):
            return True
        if end.queued is None:
            return False
        if end.queued == 0:
            return True
        self._tries[c] = self._tries.get(c, 0) + 1
        return False if self._tries[c] >= QUEUE_TRIES else None

    def _settle(self, c: int) -> None:
        self._settled.add(c)
        self._first.pop(c, None)
        self._tries.pop(c, None)


def _never_sent(peer: EndView) -> bool:
    """The peer is in the sockhash and never redirected: the end's queue is empty."""
    return peer.cookie is not None and not peer.sent


def key_of(c: maps.SockKeyC) -> Key:
    return (c.netns, c.local_ip, c.remote_ip, c.local_port, c.remote_port)


def sock_key(key: Key) -> maps.SockKeyC:
    return maps.SockKeyC(*key)


class Sweeper:
    """Rule 4's shell over the pinned maps of one node; `queues` reads queues (rule 2)."""

    def __init__(self, maps_dir: str | Path, queues: sockqueue.Queues | None = None) -> None:
        self.maps_dir = maps_dir
        self.queues = queues
        self.sweep = Sweep()
        self._seen_offs = 0  # no switch-off yet: nothing to read
        self._last = -TICK_S  # when the maps were last read

    def tick(self) -> int:
        """One sweep; the number of ends taken out.

        Raises:
            BpfError: a map is not pinned or a call on it failed.
        """
        now = time.monotonic()
        if now - self._last < TICK_S:
            return 0  # rule 1's looks stay TICK_S apart however often this is called
        stats = maps.accel_stats(self.maps_dir)
        offs = sum(stats[name] for name in OFF_COUNTERS)
        if offs == self._seen_offs and not self.sweep.waiting:
            return 0
        self._seen_offs = offs
        self._last = now
        with (
            maps.PinnedMap.open(self.maps_dir, maps.ACCEL_STATE) as state,
            maps.PinnedMap.open(self.maps_dir, maps.ACCEL_SOCKS) as socks,
            maps.PinnedMap.open(self.maps_dir, maps.ACCEL_SENT) as sent,
        ):
            off = [key_of(k) for k, v in state.items() if v.value == maps.ACCEL_OFF]
            views: dict[Key, EndView] = {}
            for key in off:
                for k in (peer_of(key), key):
                    if k not in views:
                        views[k] = _view(k, state, socks, sent)
            look = None if self.queues is None else self.queues.look()  # sockqueue rule 4
            for key in off:
                _read_queue(self.sweep, look, key, views)
            decision = self.sweep.step(off, views)
            for k in decision.switch_off:
                state.update(sock_key(k), ctypes.c_uint32(maps.ACCEL_OFF))
            taken = sum(socks.delete(sock_key(k)) for k in decision.remove)
        if taken:
            _add_returned(self.maps_dir, taken)
        return taken


def _read_queue(
    sweep: Sweep, look: sockqueue.Look | None, key: Key, views: dict[Key, EndView]
) -> None:
    """The end's queue, when its next look needs it: its peer sent, or is gone."""
    end, peer = views[key], views[peer_of(key)]
    if look is None or end.cookie is None or not sweep.wants_queue(end, peer):
        return
    views[key] = dataclasses.replace(end, queued=look.queued(key, end.cookie))


def _view(key: Key, state: maps.PinnedMap, socks: maps.PinnedMap, sent: maps.PinnedMap) -> EndView:
    c = sock_key(key)
    was_sent = sent.lookup(c) is not None  # before the cookie (rule 1)
    cookie = socks.lookup(c)
    st = state.lookup(c)
    return EndView(
        cookie=None if cookie is None else int(cookie.value),
        off=st is not None and st.value == maps.ACCEL_OFF,
        sent=was_sent,
    )


def _add_returned(maps_dir: str | Path, n: int) -> None:
    slot = ctypes.c_uint32(maps.ACCEL_STAT_RETURNED)
    with maps.PinnedMap.open(maps_dir, maps.ACCEL_STATS) as m:
        leaf = m.lookup(slot)
        total = (int(leaf.value) if leaf is not None else 0) + n
        m.update(slot, ctypes.c_uint64(total))


async def run(sweeper: Sweeper, tick_s: float = TICK_S) -> None:
    """Tick until cancelled, each tick in a thread; a failed tick is logged (once per
    message) and the next one tries again."""
    last_error = ""
    while True:
        await asyncio.sleep(tick_s)
        try:
            taken = await asyncio.to_thread(sweeper.tick)
        except maps.BpfError as exc:
            if str(exc) != last_error:
                last_error = str(exc)
                logger.warning("accelerated-socket sweep failed", extra={"error": last_error})
            continue
        last_error = ""
        if taken:
            logger.debug("socket ends back to plain TCP", extra={"ends": taken})
