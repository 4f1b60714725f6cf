"""The eBPF capture's shared maps, opened by pin path; the node's sk_msg counters.

`PinnedMap` reads and writes one map typed by `MAP_TYPES`; `accel_stats` reads
the node's sk_msg counters; `netns_cookie` gives the key of per-netns entries.
The kernel ABI (structs, map names, conversions) lives in
`agent.redirect.maps_abi`, the libbpf calls and links in
`agent.redirect.bpf_objects`; both are re-exported here (`__all__`), so
`maps.PodConfigC`, `maps.BpfError`, `maps.ensure_link`, ... keep working.

Rules:
1. Maps are opened by their pin path (`PinnedMap.open`), never through a bcc
   object, so a CLI process or a worker can read them without compiling.
2. A missing entry is None (`lookup`) or False (`delete`), not an error; any
   other failure raises `BpfError` naming the call and the map.
3. A map that was never pinned reads as all zero counters (`accel_stats`):
   sk_msg is optional.
"""

from __future__ import annotations

import ctypes
import errno
import os
import socket
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

from agent.redirect.bpf_objects import (
    LINK_CGROUP,
    LINK_NETNS,
    BpfError,
    LinkInfo,
    check,
    ensure_link,
    fd_by_id,
    libbpf,
    link_infos,
    obj_get,
    obj_id,
    obj_info,
    obj_pin,
    object_ids,
    pinned,
    remove_link,
)
from agent.redirect.maps_abi import (
    ACCEL_ACTIVE,
    ACCEL_BURST,
    ACCEL_OFF,
    ACCEL_SENT,
    ACCEL_SOCKS,
    ACCEL_STAT_NAMES,
    ACCEL_STAT_RETURNED,
    ACCEL_STATE,
    ACCEL_STATS,
    ACCEL_STATS_SLOTS,
    AF_INET,
    AF_INET6,
    CFG_BY_IP,
    CFG_BY_NETNS,
    F_ACCEL,
    F_INBOUND,
    F_OUTBOUND,
    LISTENERS,
    MAP_TYPES,
    MAX_PORT_RANGES,
    MAX_SUBNETS,
    ORIG_DST,
    PAIR_BROKEN,
    PAIR_CTL,
    PAIR_DIRECT,
    PAIR_MOVED,
    PAIR_STATE,
    PAIR_WORKER,
    PENDING,
    ConnKeyC,
    OrigDstC,
    PairCtlC,
    PairStateC,
    PodConfigC,
    PortRangeC,
    SockKeyC,
    Subnet4C,
    abi_mismatches,
    ip_be,
    ip_str,
    orig_dst_addr,
    pod_config,
)

if TYPE_CHECKING:
    from collections.abc import Iterator

__all__ = [
    "ACCEL_ACTIVE",
    "ACCEL_BURST",
    "ACCEL_OFF",
    "ACCEL_SENT",
    "ACCEL_SOCKS",
    "ACCEL_STATE",
    "ACCEL_STATS",
    "ACCEL_STATS_SLOTS",
    "ACCEL_STAT_NAMES",
    "ACCEL_STAT_RETURNED",
    "AF_INET",
    "AF_INET6",
    "CFG_BY_IP",
    "CFG_BY_NETNS",
    "F_ACCEL",
    "F_INBOUND",
    "F_OUTBOUND",
    "LINK_CGROUP",
    "LINK_NETNS",
    "LISTENERS",
    "MAP_TYPES",
    "MAX_PORT_RANGES",
    "MAX_SUBNETS",
    "ORIG_DST",
    "PAIR_BROKEN",
    "PAIR_CTL",
    "PAIR_DIRECT",
    "PAIR_MOVED",
    "PAIR_STATE",
    "PAIR_WORKER",
    "PENDING",
    "SO_NETNS_COOKIE",
    "BpfError",
    "ConnKeyC",
    "LinkInfo",
    "OrigDstC",
    "PairCtlC",
    "PairStateC",
    "PinnedMap",
    "PodConfigC",
    "PortRangeC",
    "SockKeyC",
    "Subnet4C",
    "abi_mismatches",
    "accel_stats",
    "check",
    "ensure_link",
    "fd_by_id",
    "ip_be",
    "ip_str",
    "libbpf",
    "link_infos",
    "netns_cookie",
    "obj_get",
    "obj_id",
    "obj_info",
    "obj_pin",
    "object_ids",
    "orig_dst_addr",
    "pinned",
    "pod_config",
    "remove_link",
]

SO_NETNS_COOKIE = 71  # <asm-generic/socket.h>, level SOL_SOCKET (Linux 5.14+)


def netns_cookie(sock: socket.socket) -> int:
    """The cookie of the network namespace `sock` belongs to."""
    return int.from_bytes(sock.getsockopt(socket.SOL_SOCKET, SO_NETNS_COOKIE, 8), "little")


class PinnedMap:
    """A map opened by its pin path; typed by `MAP_TYPES`. Close it (or use `with`)."""

    def __init__(self, name: str, fd: int) -> None:
        self.name = name
        self.fd = fd
        self.key_type, self.leaf_type = MAP_TYPES[name]

    @classmethod
    def open(cls, maps_dir: str | Path, name: str) -> PinnedMap:
        """Raises: BpfError: the map is not pinned there."""
        return cls(name, obj_get(Path(maps_dir) / name))

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def lookup(self, key: Any) -> Any | None:
        """The leaf for `key`, or None (for a sockhash: the socket cookie)."""
        leaf = self.leaf_type()
        ret = libbpf().bpf_map_lookup_elem(self.fd, ctypes.byref(key), ctypes.byref(leaf))
        if ret < 0:
            if -ret == errno.ENOENT:
                return None
            check(ret, "bpf_map_lookup_elem", self.name)
        return leaf

    def update(self, key: Any, leaf: Any) -> None:
        """Raises: BpfError: the update failed (a sockhash takes a socket fd as leaf)."""
        ret = libbpf().bpf_map_update_elem(self.fd, ctypes.byref(key), ctypes.byref(leaf), 0)
        check(ret, "bpf_map_update_elem", self.name)

    def delete(self, key: Any) -> bool:
        """Whether an entry was there."""
        ret: int = libbpf().bpf_map_delete_elem(self.fd, ctypes.byref(key))
        if ret < 0 and -ret != errno.ENOENT:
            check(ret, "bpf_map_delete_elem", self.name)
        return ret == 0

    def key_list(self) -> list[Any]:
        """Every key, as a snapshot."""
        out: list[Any] = []
        nxt = self.key_type()
        prev = None
        while (
            libbpf().bpf_map_get_next_key(
                self.fd, None if prev is None else ctypes.byref(prev), ctypes.byref(nxt)
            )
            == 0
        ):
            out.append(nxt)
            prev, nxt = nxt, self.key_type()
        return out

    def items(self) -> Iterator[tuple[Any, Any]]:
        """(key, leaf) pairs; entries deleted meanwhile are skipped."""
        for key in self.key_list():
            leaf = self.lookup(key)
            if leaf is not None:
                yield key, leaf


def accel_stats(maps_dir: str | Path) -> dict[str, int]:
    """The node's sk_msg counters (`ACCEL_STAT_NAMES`); all zero when sk_msg never loaded.

    Raises:
        BpfError: the map is pinned but cannot be read.
    """
    try:
        m = PinnedMap.open(maps_dir, ACCEL_STATS)
    except BpfError as exc:
        if exc.errno != errno.ENOENT:
            raise
        return dict.fromkeys(ACCEL_STAT_NAMES, 0)
    with m:
        out = {}
        for slot, name in enumerate(ACCEL_STAT_NAMES):
            leaf = m.lookup(ctypes.c_uint32(slot))
            out[name] = int(leaf.value) if leaf is not None else 0
    return out
