"""The eBPF capture's shared data: ctypes mirrors of bpf/include/meshagent.h,
the CaptureSpec -> pod config translation, and pinned objects through libbpf.

Rules:
1. Every struct here mirrors one in meshagent.h field for field; a test checks
   each size against the key and leaf sizes bcc gives the maps. Change both
   together.
2. Addresses are stored as the kernel hands them over (network order), so an
   IPv4 address is the u32 whose memory holds its four bytes: `ip_be`/`ip_str`
   convert. Ports are host order, except `OrigDst.port_be`.
3. Maps are opened by their pin path (`PinnedMap.open`), never through a bcc
   object, so a CLI process or a worker can read them without compiling.
4. libbpf (1.x) returns -errno; every failure here raises `BpfError` naming the
   call and the object.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import ipaddress
import os
import socket
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

from agent.errors import AgentError

if TYPE_CHECKING:
    from collections.abc import Iterator

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
ACCEL_BURST = "ma_accel_burst"  # declared in bpf/sk_msg.c (sk_msg's own)
ACCEL_STATS = "ma_accel_stats"  # declared in bpf/sk_msg.c

# ma_accel_stats slots, as bpf/sk_msg.c's MA_STAT_* number them
ACCEL_STAT_NAMES = (
    "redirected_msgs",
    "redirected_bytes",
    "passed_msgs",
    "off_size",
    "off_burst",
    "off_no_peer",
    "off_config",
)
ACCEL_STATS_SLOTS = 8

# <linux/bpf.h> link types, as bpf_link_info reports them
LINK_CGROUP = 3
LINK_NETNS = 5

SO_NETNS_COOKIE = 71  # <asm-generic/socket.h>, level SOL_SOCKET (Linux 5.14+)


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


# map name -> (key type, leaf type), the mirrors of the declarations in meshagent.h
MAP_TYPES: dict[str, tuple[Any, Any]] = {
    CFG_BY_NETNS: (ctypes.c_uint64, PodConfigC),
    CFG_BY_IP: (ctypes.c_uint32, PodConfigC),
    PENDING: (ctypes.c_uint64, OrigDstC),
    ORIG_DST: (ConnKeyC, OrigDstC),
    LISTENERS: (ctypes.c_uint32, ctypes.c_uint64),
    ACCEL_SOCKS: (SockKeyC, ctypes.c_uint64),
    ACCEL_STATE: (SockKeyC, ctypes.c_uint32),
    ACCEL_BURST: (SockKeyC, ctypes.c_uint32),
    ACCEL_STATS: (ctypes.c_uint32, ctypes.c_uint64),
}


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


# --- libbpf -------------------------------------------------------------------------


class BpfError(AgentError):
    """A bpf(2) call through libbpf failed."""

    def __init__(self, call: str, what: str, err: int) -> None:
        self.call = call
        self.what = what
        self.errno = err
        super().__init__(f"{call} {what}: {os.strerror(err)}")


def _load_libbpf() -> Any:
    lib = ctypes.CDLL("libbpf.so.1", use_errno=True)
    c_int, c_void_p, c_char_p, c_uint = (
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_char_p,
        ctypes.c_uint,
    )
    sigs: dict[str, list[Any]] = {
        "bpf_obj_get": [c_char_p],
        "bpf_obj_pin": [c_int, c_char_p],
        "bpf_map_lookup_elem": [c_int, c_void_p, c_void_p],
        "bpf_map_update_elem": [c_int, c_void_p, c_void_p, ctypes.c_uint64],
        "bpf_map_delete_elem": [c_int, c_void_p],
        "bpf_map_get_next_key": [c_int, c_void_p, c_void_p],
        "bpf_link_create": [c_int, c_int, c_int, c_void_p],
        "bpf_link_update": [c_int, c_int, c_void_p],
        "bpf_link_detach": [c_int],
        "bpf_prog_attach": [c_int, c_int, c_int, c_uint],
        "bpf_prog_detach2": [c_int, c_int, c_int],
        "bpf_obj_get_info_by_fd": [c_int, c_void_p, ctypes.POINTER(ctypes.c_uint32)],
        "bpf_prog_load": [c_int, c_char_p, c_char_p, c_void_p, ctypes.c_size_t, c_void_p],
    }
    for kind in ("prog", "map", "link"):
        sigs[f"bpf_{kind}_get_next_id"] = [ctypes.c_uint32, ctypes.POINTER(ctypes.c_uint32)]
        sigs[f"bpf_{kind}_get_fd_by_id"] = [ctypes.c_uint32]
    for name, argtypes in sigs.items():
        fn = getattr(lib, name)
        fn.argtypes = argtypes
        fn.restype = c_int
    return lib


_lib: Any = None


def libbpf() -> Any:
    """libbpf.so.1 with the signatures used here (loaded on first use).

    Raises:
        OSError: libbpf is not installed.
    """
    global _lib  # noqa: PLW0603 - one handle per process
    if _lib is None:
        _lib = _load_libbpf()
    return _lib


def check(ret: int, call: str, what: str) -> int:
    """`ret` if it is not an error, else raise `BpfError`."""
    if ret < 0:
        raise BpfError(call, what, -ret)
    return ret


def obj_get(path: str | Path) -> int:
    """A new fd for the pinned object at `path`.

    Raises:
        BpfError: nothing pinned there (ENOENT), or not permitted.
    """
    return check(libbpf().bpf_obj_get(str(path).encode()), "bpf_obj_get", str(path))


def obj_pin(fd: int, path: str | Path) -> None:
    """Pin `fd` at `path`, replacing what was pinned there.

    Raises:
        BpfError: the pin failed.
    """
    Path(path).unlink(missing_ok=True)
    check(libbpf().bpf_obj_pin(fd, str(path).encode()), "bpf_obj_pin", str(path))


def obj_info(fd: int) -> bytes:
    """The raw `bpf_*_info` the kernel returns for a prog, map or link fd.

    Raises:
        BpfError: the call failed.
    """
    buf = ctypes.create_string_buffer(256)
    size = ctypes.c_uint32(256)
    check(libbpf().bpf_obj_get_info_by_fd(fd, buf, ctypes.byref(size)), "bpf_obj_get_info", str(fd))
    return buf.raw[: size.value]


def object_ids(kind: str) -> list[int]:
    """Ids of every loaded object of `kind` ("prog", "map" or "link")."""
    get_next = getattr(libbpf(), f"bpf_{kind}_get_next_id")
    ids: list[int] = []
    cur = ctypes.c_uint32(0)
    while get_next(cur.value, ctypes.byref(cur)) == 0:
        ids.append(cur.value)
    return ids


def fd_by_id(kind: str, obj_id: int) -> int:
    """A new fd for the object `kind`/`obj_id`.

    Raises:
        BpfError: it is gone.
    """
    fn = getattr(libbpf(), f"bpf_{kind}_get_fd_by_id")
    return check(fn(obj_id), f"bpf_{kind}_get_fd_by_id", str(obj_id))


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


# --- links ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class LinkInfo:
    """What a pinned link is: its id, program and target."""

    id: int
    prog_id: int
    kind: int
    target: int  # cgroup id, or netns inode
    attach_type: int

    @classmethod
    def of(cls, fd: int) -> LinkInfo:
        raw = obj_info(fd)
        kind, link_id, prog_id = struct.unpack_from("<III", raw, 0)
        if kind == LINK_CGROUP:
            target, attach = struct.unpack_from("<QI", raw, 16)
        else:
            target, attach = struct.unpack_from("<II", raw, 16)
        return cls(id=link_id, prog_id=prog_id, kind=kind, target=target, attach_type=attach)


def prog_id(fd: int) -> int:
    return int(struct.unpack_from("<I", obj_info(fd), 4)[0])


@contextlib.contextmanager
def _open_fd(path: str | Path, flags: int = os.O_RDONLY) -> Iterator[int]:
    fd = os.open(path, flags)
    try:
        yield fd
    finally:
        os.close(fd)


@contextlib.contextmanager
def pinned(path: Path) -> Iterator[int | None]:
    """An fd for what is pinned at `path`, or None."""
    try:
        fd = obj_get(path)
    except BpfError:
        yield None
        return
    try:
        yield fd
    finally:
        os.close(fd)


def ensure_link(pin: Path, prog_fd: int, target: Path, attach_type: int) -> None:
    """A link from `prog_fd` to `target` (cgroup dir or netns file), pinned at `pin`.

    A pinned link already on that target is moved to `prog_fd`; one on another
    target is replaced.

    Raises:
        BpfError: the kernel refused.
    """
    want_target = target.stat().st_ino
    with pinned(pin) as fd:
        if fd is not None:
            info = LinkInfo.of(fd)
            if info.target == want_target and info.attach_type == attach_type:
                if info.prog_id != prog_id(prog_fd):
                    check(libbpf().bpf_link_update(fd, prog_fd, None), "bpf_link_update", str(pin))
                return
            remove_link(pin)
    with _open_fd(target) as target_fd:
        link = check(
            libbpf().bpf_link_create(prog_fd, target_fd, attach_type, None),
            "bpf_link_create",
            f"{pin.name} -> {target}",
        )
    try:
        obj_pin(link, pin)
    finally:
        os.close(link)


def remove_link(pin: Path) -> bool:
    """Detach the link pinned at `pin` and remove the pin; whether one was there."""
    with pinned(pin) as fd:
        if fd is None:
            return False
        libbpf().bpf_link_detach(fd)
    with contextlib.suppress(FileNotFoundError):
        pin.unlink()
    return True


def link_infos(directory: Path) -> dict[str, LinkInfo]:
    """Every link pinned in `directory`, by pin name."""
    out = {}
    if directory.is_dir():
        for pin in sorted(directory.iterdir()):
            with pinned(pin) as fd:
                if fd is not None:
                    out[pin.name] = LinkInfo.of(fd)
    return out
