"""Original destinations of connections the eBPF mode redirected, from the map.

The `cgroup/getsockopt` program already answers `SO_ORIGINAL_DST` for these
connections, so `agent.redirect.orig_dst.original_dst(sock)` works unchanged in
both modes. `lookup` reads the same map entry directly, for a caller that wants
no getsockopt hook in its path (or whose listener sockets were created outside
the agent's cgroup): pass it as `original_dst(sock, lookup=lookup)`.

Rules:
1. The key is what the accepted socket knows: its netns cookie and its peer's
   (ip, port), the client end that sockops filed at connect time.
2. No entry, or no pinned map (eBPF mode not installed), is None: the caller
   falls back to SO_ORIGINAL_DST, which serves iptables mode.
3. Pure lookups: nothing is deleted here; the map is LRU.
"""

from __future__ import annotations

import functools
import socket
from pathlib import Path

from agent.redirect import maps
from agent.redirect.orig_dst import Lookup
from agent.redirect.orig_dst import original_dst as _original_dst

MAPS_DIR = Path("/sys/fs/bpf/meshagent/maps")


def conn_key(sock: socket.socket) -> maps.ConnKeyC:
    """The map key of an accepted IPv4 socket.

    Raises:
        OSError: the socket is not connected.
    """
    ip, port = sock.getpeername()[:2]
    return maps.ConnKeyC(netns=maps.netns_cookie(sock), ip=maps.ip_be(ip), port=port)


def lookup(sock: socket.socket, *, maps_dir: Path = MAPS_DIR) -> tuple[str, int] | None:
    """The original (ip, port) the eBPF mode filed for `sock`'s peer, or None."""
    if sock.family != socket.AF_INET:
        return None
    try:
        key = conn_key(sock)
        with maps.PinnedMap.open(maps_dir, maps.ORIG_DST) as m:
            found = m.lookup(key)
    except (OSError, maps.BpfError):
        return None
    return None if found is None else maps.orig_dst_addr(found)


def lookup_in(maps_dir: Path) -> Lookup:
    """`lookup` bound to another pin root's maps directory (tests, custom roots)."""
    return functools.partial(lookup, maps_dir=maps_dir)


def original_dst(sock: socket.socket, *, maps_dir: Path = MAPS_DIR) -> tuple[str, int]:
    """The original destination in either mode: the eBPF map first, then SO_ORIGINAL_DST.

    Raises:
        OriginalDstError: neither knows it.
    """
    return _original_dst(sock, lookup=lookup_in(maps_dir))
