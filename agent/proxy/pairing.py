"""The paired relay: an opaque relay between two accelerated app ends hands its bytes
to the kernel (bpf/include/meshagent.h, "paired relay").

On a same-node hop (agent.proxy.outbound's "local" kind) the worker relays app A's
connection to its outbound listener into its own connection to app B, both plain
TCP inside pods on this node. With eBPF sockmap acceleration, sockops records both
app ends; pairing writes, for each, which worker socket is on the other leg and
how many of its bytes the worker has read and written on there (`ma_pair_ctl`).
Once the worker has caught up with an app end, sk_msg sends that end's next
messages out of the other leg's socket itself: a request/response exchange then
wakes neither the worker nor its loop.

Rules:
1. Only relays the outbound's local hop opens, in a worker started with
   `--pair-maps DIR` (the supervisor passes it in eBPF mode with acceleration),
   once the maps are pinned there (at the first enrollment; looked for again at
   most once a second). Anything else, or any map error, leaves the relay as it
   was: pairing is a fast path, never needed for a byte to arrive (an error is
   logged once per worker and pairing stays off in it).
2. `consumed` for an app end is what the worker read from that end's leg, and is
   written only when the worker's write buffer on the other leg is empty: every
   byte counted is in the kernel, ahead of what sk_msg will add after it.
3. The kernel's counts (`ma_pair_state.moved`, or `ma_pair_moved` for an app end
   that closed first) are read when the relay ends: its byte counts, and so its
   metrics, include what went past the worker. The idle check counts them too.
   The worker deletes its `ma_pair_ctl` and `ma_pair_moved` entries then.
4. Pure logic (`keys_for`) takes addresses and netns cookies; the shell reads
   them from the transports' sockets.
5. Only a worker given `--pair-maps` imports this module (and with it the maps'
   ctypes mirrors): the others stay as light as before.
6. A relay is paired only when sockops recorded both app ends (their
   `ma_pair_state` entries exist when the worker accepts): connections of pods
   without acceleration, or to ports they skip (skip-accel-ports), cost nothing.
"""

from __future__ import annotations

import logging
import socket
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from agent.redirect import maps

if TYPE_CHECKING:
    from agent.proxy.tcp import Relay

logger = logging.getLogger(__name__)

Addr = tuple[str, int]


@dataclass(frozen=True, slots=True)
class Leg:
    """One of the worker's sockets: its netns cookie and addresses."""

    netns: int
    local: Addr
    remote: Addr


@dataclass(frozen=True, slots=True)
class PairKeys:
    """The two app ends' keys and the worker sockets their messages go out of."""

    app_a: Any  # maps.SockKeyC: A's end of the downstream leg
    to_upstream: Any  # the worker's upstream socket, B's netns
    app_b: Any  # B's end of the upstream leg
    to_downstream: Any  # the worker's accepted socket, A's netns


def sock_key(netns: int, local: Addr, remote: Addr) -> Any:
    """The kernel's key of a socket end (meshagent.h `struct ma_sock_key`)."""
    return maps.SockKeyC(netns, maps.ip_be(local[0]), maps.ip_be(remote[0]), local[1], remote[1])


def keys_for(down: Leg, up: Leg) -> PairKeys:
    """Each app end is its leg's worker socket seen from the other side (rule 4)."""
    return PairKeys(
        app_a=sock_key(down.netns, down.remote, down.local),
        to_upstream=sock_key(up.netns, up.local, up.remote),
        app_b=sock_key(up.netns, up.remote, up.local),
        to_downstream=sock_key(down.netns, down.local, down.remote),
    )


def _leg(transport: Any) -> Leg:
    sock = transport.get_extra_info("socket")
    cookie = sock.getsockopt(socket.SOL_SOCKET, maps.SO_NETNS_COOKIE, 8)
    local, remote = sock.getsockname(), sock.getpeername()
    return Leg(int.from_bytes(cookie, "little"), (local[0], local[1]), (remote[0], remote[1]))


class PairMaps:
    """The pinned maps a worker writes and reads, opened on first use: they are pinned
    when the first pod enrolls, after the workers start."""

    RETRY_S = 1.0  # a missing map is looked for again after this long

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.ctl: maps.PinnedMap | None = None
        self.state: maps.PinnedMap | None = None
        self.moved: maps.PinnedMap | None = None
        self.failed = False  # rule 1: off for good in this worker after an error
        self._next_try = 0.0

    def ready(self) -> bool:
        """Whether the maps are open (opening them if it is time to try)."""
        if self.failed:
            return False
        if self.ctl is not None:
            return True
        now = time.monotonic()
        if now < self._next_try:
            return False
        self._next_try = now + self.RETRY_S
        opened: list[maps.PinnedMap] = []
        names = (maps.PAIR_CTL, maps.PAIR_STATE, maps.PAIR_MOVED)
        try:  # extend keeps the maps opened before one that fails, to close them
            opened.extend(maps.PinnedMap.open(self.directory, name) for name in names)
        except maps.BpfError:
            for m in opened:
                m.close()
            return False
        self.ctl, self.state, self.moved = opened
        return True

    def pair(self, relay: Relay) -> Pairing | None:
        """Pair a started relay's app ends (rule 1); None when it cannot be."""
        if not self.ready():
            return None
        down, up = relay.downstream.transport, relay.upstream.transport
        if down is None or up is None or down.is_closing() or up.is_closing():
            return None
        try:
            keys = keys_for(_leg(down), _leg(up))
        except OSError:
            return None  # a side already gone
        if not self._recorded(keys):
            return None
        pairing = Pairing(self, keys)
        relay.pairing = pairing
        # what the relay forwarded before it was paired (its prefix, early bytes)
        pairing.forwarded(relay.downstream.nbytes, up, from_upstream=False)
        pairing.forwarded(relay.upstream.nbytes, down, from_upstream=True)
        return pairing

    def _recorded(self, keys: PairKeys) -> bool:
        """Whether sockops recorded both app ends (rule 6): a pod without acceleration,
        or a port it skips, would otherwise cost a map write per chunk for nothing."""
        state = self.state
        if state is None:
            return False
        try:
            return state.lookup(keys.app_a) is not None and state.lookup(keys.app_b) is not None
        except maps.BpfError as exc:
            self.fail(exc)
            return False

    def fail(self, exc: Exception) -> None:
        if not self.failed:
            self.failed = True
            logger.warning("paired relay off in this worker: %s", exc)


class Pairing:
    """One relay's pairing; the relay calls `forwarded`, `moved` and `finish`. It keeps
    no reference to the relay (worker rule 7: a finished connection leaves no cycle)."""

    __slots__ = ("keys", "maps", "moved_down", "moved_up")

    def __init__(self, pair_maps: PairMaps, keys: PairKeys) -> None:
        self.maps = pair_maps
        self.keys = keys
        self.moved_up = 0  # A's bytes the kernel sent past the worker, last read
        self.moved_down = 0  # B's

    def forwarded(self, nbytes: int, out: Any, *, from_upstream: bool) -> None:
        """The worker wrote what it read from one leg on the other (rule 2)."""
        if self.maps.failed or out.get_write_buffer_size():
            return
        owner, target = (
            (self.keys.app_b, self.keys.to_downstream)
            if from_upstream
            else (self.keys.app_a, self.keys.to_upstream)
        )
        ctl = self.maps.ctl
        if ctl is None:
            return
        try:
            ctl.update(owner, maps.PairCtlC(owner, target, nbytes))
        except maps.BpfError as exc:
            self.maps.fail(exc)

    def moved(self, *, last: bool = False) -> int:
        """Both directions' bytes past the worker, read now (rule 3); `last`: also from
        the counts sockops filed for ends that closed, which it then deletes."""
        pm = self.maps
        for from_upstream, key in ((False, self.keys.app_a), (True, self.keys.app_b)):
            try:
                st = pm.state.lookup(key) if pm.state is not None else None
                count = int(st.moved) if st is not None else 0
                if last and pm.moved is not None:
                    filed = pm.moved.lookup(key)
                    if filed is not None:
                        count = max(count, int(filed.value))
                        pm.moved.delete(key)
            except maps.BpfError:
                continue
            if from_upstream:
                self.moved_down = max(self.moved_down, count)
            else:
                self.moved_up = max(self.moved_up, count)
        return self.moved_up + self.moved_down

    def finish(self) -> None:
        """Read the kernel's counts a last time; delete the worker's entries."""
        self.moved(last=True)
        ctl = self.maps.ctl
        if ctl is None:
            return
        for key in (self.keys.app_a, self.keys.app_b):
            try:
                ctl.delete(key)
            except maps.BpfError as exc:
                self.maps.fail(exc)
