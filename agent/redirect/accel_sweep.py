"""Switched-off accelerated socket ends taken back to plain TCP (opt-in acceleration).

sk_msg switches a socket end to the TCP path for good once it sends a big
message or a long one-way burst (bpf/sk_msg.c), but the end stays in
ma_accel_socks: each of its sends still runs tcp_bpf's sendmsg (a copy into a
scatterlist, the program, a push page by page) and each read tcp_bpf's
recvmsg. A bulk sender so moves about half of what plain TCP moves. Taking the
end out of the sockhash gives it plain TCP back, but also frees the queue of
bytes its peer redirected into it and it has not read yet: those would be lost.

Rules:
1. An end X is taken out only when the sweep sees, at two ticks at least
   `TICK_S` apart, that X is switched off (MA_ACCEL_OFF), that its peer Y is
   in the sockhash as the same socket (cookie) and switched off, and that Y has
   no record in ma_accel_sent (read before Y's cookie): Y never redirected into
   X, so X's queue is empty, and being switched off Y never will. A peer that
   is not switched off yet is switched off by the sweep at the first tick; the
   second tick's fresh read of Y's record covers a send of Y that was past its
   state check when that happened (sk_msg records before it redirects).
2. An end whose peer is gone from the sockhash, or has a record, stays where it
   is for its life: nothing the agent can see says its queue is empty. So a
   connection that carried requests and answers both ways before one side
   turned to bulk keeps tcp_bpf's path; a stream whose receiving side never
   sent (iperf3's data connection, a download's request leg) gets plain TCP.
3. The decisions are pure (`Sweep.step`); `Sweeper.tick` reads the maps (each
   call a blocking bpf syscall: run it off the event loop), applies them and
   adds the ends it took out to the `returned` counter of ma_accel_stats. It
   reads the maps only when a switch-off counter moved or an end waits for its
   second tick.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from agent.redirect import maps

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping
    from pathlib import Path

logger = logging.getLogger(__name__)

TICK_S = 0.2  # the agent's sweep period; rule 1's two ticks are at least this far apart
OFF_COUNTERS = ("off_size", "off_burst", "off_no_peer", "off_config", "off_full")

Key = tuple[int, int, int, int, int]  # (netns, local ip, remote ip, local port, remote port)


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


@dataclass(frozen=True, slots=True)
class Decision:
    switch_off: tuple[Key, ...]  # peers to mark MA_ACCEL_OFF
    remove: tuple[Key, ...]  # ends to take out of ma_accel_socks


class Sweep:
    """Rule 1 and 2's bookkeeping across ticks; no I/O."""

    def __init__(self) -> None:
        self._first: dict[int, int] = {}  # end's cookie -> its peer's cookie at the first tick
        self._settled: set[int] = set()  # ends' cookies decided for good

    @property
    def waiting(self) -> bool:
        """Whether an end waits for its second tick."""
        return bool(self._first)

    def step(self, off: Iterable[Key], views: Mapping[Key, EndView]) -> Decision:
        """One tick over the switched-off ends `off`; `views` has each of them and its peer."""
        switch_off: list[Key] = []
        remove: list[Key] = []
        live: set[int] = set()
        for key in off:
            end = views[key]
            if end.cookie is None:
                continue
            live.add(end.cookie)
            if end.cookie in self._settled:
                continue
            peer_key = peer_of(key)
            peer = views[peer_key]
            if peer.cookie is None or peer.sent:
                self._settled.add(end.cookie)  # rule 2
                self._first.pop(end.cookie, None)
                continue
            if peer.off and self._first.get(end.cookie) == peer.cookie:
                remove.append(key)
                self._settled.add(end.cookie)
                del self._first[end.cookie]
                continue
            self._first[end.cookie] = peer.cookie
            if not peer.off:
                switch_off.append(peer_key)
        self._first = {c: p for c, p in self._first.items() if c in live}
        self._settled &= live
        return Decision(tuple(switch_off), tuple(remove))


def key_of(c: maps.SockKeyC) -> Key:
    return (c.netns, c.local_ip, c.remote_ip, c.local_port, c.remote_port)


def sock_key(key: Key) -> maps.SockKeyC:
    return maps.SockKeyC(*key)


class Sweeper:
    """Rule 3's shell over the pinned maps of one node."""

    def __init__(self, maps_dir: str | Path) -> None:
        self.maps_dir = maps_dir
        self.sweep = Sweep()
        self.returned = 0  # ends this sweeper took out
        self._seen_offs = 0  # no switch-off yet: nothing to read

    def tick(self) -> int:
        """One sweep; the number of ends taken out.

        Raises:
            BpfError: a map is not pinned or a call on it failed.
        """
        stats = maps.accel_stats(self.maps_dir)
        offs = sum(stats[name] for name in OFF_COUNTERS)
        if offs == self._seen_offs and not self.sweep.waiting:
            return 0
        self._seen_offs = offs
        with (
            maps.PinnedMap.open(self.maps_dir, maps.ACCEL_STATE) as state,
            maps.PinnedMap.open(self.maps_dir, maps.ACCEL_SOCKS) as socks,
            maps.PinnedMap.open(self.maps_dir, maps.ACCEL_SENT) as sent,
        ):
            off = [key_of(k) for k, v in state.items() if v.value == maps.ACCEL_OFF]
            views: dict[Key, EndView] = {}
            for key in off:
                for k in (key, peer_of(key)):
                    if k not in views:
                        views[k] = _view(k, state, socks, sent)
            decision = self.sweep.step(off, views)
            for k in decision.switch_off:
                state.update(sock_key(k), ctypes.c_uint32(maps.ACCEL_OFF))
            taken = sum(socks.delete(sock_key(k)) for k in decision.remove)
        if taken:
            self.returned += taken
            _add_returned(self.maps_dir, taken)
        return taken


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
