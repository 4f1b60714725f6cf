"""The eBPF capture's kernel ABI: ctypes mirrors of bpf/include/meshagent.h,
the map names and types, and the CaptureSpec -> pod config translation.

No I/O: plain conversions between Python values and the bytes the programs
read. (It stays outside the import-linter "redirect cores are pure" contract
only because it uses `socket`'s address helpers, `inet_aton`/`inet_ntoa`/
`ntohs`, which open nothing.) `agent.redirect.maps` reads and writes the
pinned maps with these types.

Rules:
1. Every struct here mirrors one in meshagent.h field for field; a test checks
   each size against the key and leaf sizes bcc gives the maps. Change both
   together.
2. Addresses are stored as the kernel hands them over (network order), so an
   IPv4 address is the u32 whose memory holds its four bytes: `ip_be`/`ip_str`
   convert. Ports are host order, except `OrigDst.port_be`.
3. `pod_config` refuses (ValueError) a spec with more port ranges or subnets
   than the programs check, rather than truncating it.
"""

from __future__ import annotations

import ctypes
import ipaddress
import socket
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Mapping

    from agent.redirect.model import CaptureSpec, PortSet

MAX_PORT_RANGES = 16
MAX_SUBNETS = 16
F_OUTBOUND = 1
F_INBOUND = 2
F_ACCEL = 4
ACCEL_ACTIVE = 1
ACCEL_OFF = 2
AF_INET = 2
AF_INET6 = 10

# Map names, as declared in meshagent.h and pinned under <root>/maps/.
CFG_BY_NETNS = "ma_cfg_netns"
CFG_BY_IP = "ma_cfg_ip"
PENDING = "ma_pending"
ORIG_DST = "ma_orig_dst"
LISTENERS = "ma_listeners"
ACCEL_SOCKS = "ma_accel_socks"
ACCEL_STATE = "ma_accel_state"
ACCEL_SENT = "ma_accel_sent"
ACCEL_BURST = "ma_accel_burst"  # declared in bpf/sk_msg.c (sk_msg's own)
ACCEL_STATS = "ma_accel_stats"  # declared in bpf/sk_msg.c
PAIR_CTL = "ma_pair_ctl"
PAIR_STATE = "ma_pair_state"
PAIR_MOVED = "ma_pair_moved"
PAIR_WORKER = 0  # ma_pair_state.mode, meshagent.h's MA_PAIR_*
PAIR_DIRECT = 1
PAIR_BROKEN = 2

# ma_accel_stats slots, as bpf/sk_msg.c's MA_STAT_* number them
ACCEL_STAT_NAMES = (
    "redirected_msgs",
    "redirected_bytes",
    "passed_msgs",
    "off_size",
    "off_burst",
    "off_no_peer",
    "off_config",
    "off_full",
    "returned",  # written by the agent (agent.redirect.accel_sweep), not by sk_msg
    "paired_msgs",  # sent by a paired app end straight to the other leg
)
ACCEL_STATS_SLOTS = 10
ACCEL_STAT_RETURNED = ACCEL_STAT_NAMES.index("returned")


class PortRangeC(ctypes.Structure):
    _fields_ = (("first", ctypes.c_uint16), ("last", ctypes.c_uint16))


class Subnet4C(ctypes.Structure):
    _fields_ = (("addr", ctypes.c_uint32), ("mask", ctypes.c_uint32))


class PodConfigC(ctypes.Structure):
    _fields_ = (
        ("pod_ip", ctypes.c_uint32),
        ("mark", ctypes.c_uint32),
        ("outbound_port", ctypes.c_uint16),
        ("inbound_port", ctypes.c_uint16),
        ("flags", ctypes.c_uint16),
        ("n_skip_out", ctypes.c_uint16),
        ("n_skip_in", ctypes.c_uint16),
        ("n_subnets", ctypes.c_uint16),
        ("accel_max_msg", ctypes.c_uint32),
        ("skip_out", PortRangeC * MAX_PORT_RANGES),
        ("skip_in", PortRangeC * MAX_PORT_RANGES),
        ("subnets", Subnet4C * MAX_SUBNETS),
        ("n_skip_accel", ctypes.c_uint16),
        ("_pad", ctypes.c_uint16),
        ("skip_accel", PortRangeC * MAX_PORT_RANGES),
    )


class OrigDstC(ctypes.Structure):
    _fields_ = (("ip", ctypes.c_uint32), ("port_be", ctypes.c_uint16), ("family", ctypes.c_uint16))


class ConnKeyC(ctypes.Structure):
    _fields_ = (("netns", ctypes.c_uint64), ("ip", ctypes.c_uint32), ("port", ctypes.c_uint32))


class SockKeyC(ctypes.Structure):
    _fields_ = (
        ("netns", ctypes.c_uint64),
        ("local_ip", ctypes.c_uint32),
        ("remote_ip", ctypes.c_uint32),
        ("local_port", ctypes.c_uint32),
        ("remote_port", ctypes.c_uint32),
    )


class PairCtlC(ctypes.Structure):
    _fields_ = (("owner", SockKeyC), ("target", SockKeyC), ("consumed", ctypes.c_uint64))


class PairStateC(ctypes.Structure):
    _fields_ = (
        ("target", SockKeyC),
        ("passed", ctypes.c_uint64),
        ("moved", ctypes.c_uint64),
        ("mode", ctypes.c_uint32),
        ("_pad", ctypes.c_uint32),
    )


# map name -> (key type, leaf type), the mirrors of the declarations in meshagent.h
MAP_TYPES: dict[str, tuple[Any, Any]] = {
    CFG_BY_NETNS: (ctypes.c_uint64, PodConfigC),
    CFG_BY_IP: (ctypes.c_uint32, PodConfigC),
    PENDING: (ctypes.c_uint64, OrigDstC),
    ORIG_DST: (ConnKeyC, OrigDstC),
    LISTENERS: (ctypes.c_uint32, ctypes.c_uint64),
    ACCEL_SOCKS: (SockKeyC, ctypes.c_uint64),
    ACCEL_STATE: (SockKeyC, ctypes.c_uint32),
    ACCEL_SENT: (SockKeyC, ctypes.c_uint32),
    ACCEL_BURST: (SockKeyC, ctypes.c_uint32),
    ACCEL_STATS: (ctypes.c_uint32, ctypes.c_uint64),
    PAIR_CTL: (SockKeyC, PairCtlC),
    PAIR_STATE: (SockKeyC, PairStateC),
    PAIR_MOVED: (SockKeyC, ctypes.c_uint64),
}


def abi_mismatches(sizes: Mapping[str, tuple[int, int]]) -> list[str]:
    """Of pinned maps' (key size, value size) by name, those these mirrors (and so this
    version's programs) do not fit, one line each; names it does not know are not judged."""
    out = []
    for name, (key, value) in sorted(sizes.items()):
        if name not in MAP_TYPES:
            continue
        want = tuple(ctypes.sizeof(t) for t in MAP_TYPES[name])
        if (key, value) != want:
            out.append(f"{name}: key/value {key}/{value} bytes, this version's {want[0]}/{want[1]}")
    return out


# --- pure conversions ------------------------------------------------------------------


def ip_be(addr: str) -> int:
    """The u32 whose memory holds the IPv4 address in network order."""
    return int.from_bytes(socket.inet_aton(addr), "little")


def ip_str(value: int) -> str:
    """Inverse of `ip_be`."""
    return socket.inet_ntoa(int(value).to_bytes(4, "little"))


def orig_dst_addr(dst: OrigDstC) -> tuple[str, int]:
    """(ip, port) of a map entry."""
    return ip_str(dst.ip), socket.ntohs(dst.port_be)


def _ranges(ports: PortSet, extra: tuple[int, ...], what: str) -> list[tuple[int, int]]:
    out = [(p, p) for p in extra] + [(r.first, r.last) for r in ports.ranges]
    if len(out) > MAX_PORT_RANGES:
        raise ValueError(f"{what}: {len(out)} port ranges, at most {MAX_PORT_RANGES} fit")
    return out


def pod_config(
    spec: CaptureSpec,
    *,
    outbound: bool = True,
    inbound: bool = True,
    accel: bool = False,
    accel_max_msg: int = 0,
) -> PodConfigC:
    """The kernel's view of a pod's capture; IPv6 skip-subnets are ignored (IPv4 capture).

    Raises:
        ValueError: more port ranges or subnets than the programs check.
    """
    cfg = PodConfigC()
    cfg.pod_ip = ip_be(spec.pod_ip)
    cfg.mark = spec.mark
    cfg.outbound_port = spec.outbound_port
    cfg.inbound_port = spec.inbound_port
    cfg.flags = (F_OUTBOUND * outbound) | (F_INBOUND * inbound) | (F_ACCEL * accel)
    cfg.accel_max_msg = accel_max_msg
    for field, ports, extra, what in (
        ("skip_out", spec.skip_outbound_ports, (), "skip-outbound-ports"),
        ("skip_in", spec.skip_inbound_ports, spec.proxy_ports, "skip-inbound-ports"),
        ("skip_accel", spec.skip_accel_ports, (), "skip-accel-ports"),
    ):
        ranges = _ranges(ports, extra, what)
        setattr(cfg, "n_" + field, len(ranges))
        for i, (first, last) in enumerate(ranges):
            getattr(cfg, field)[i] = PortRangeC(first, last)
    nets = [n for n in spec.skip_subnets if isinstance(n, ipaddress.IPv4Network)]
    if len(nets) > MAX_SUBNETS:
        raise ValueError(f"skip-subnets: {len(nets)} IPv4 subnets, at most {MAX_SUBNETS} fit")
    cfg.n_subnets = len(nets)
    for i, net in enumerate(nets):
        cfg.subnets[i] = Subnet4C(ip_be(str(net.network_address)), ip_be(str(net.netmask)))
    return cfg
