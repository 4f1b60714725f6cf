"""Find a pod's network namespace and cgroup from its UID, as Kubernetes mode will.

Convention (what the sandbox and tests must do, and what kubelet does):
    Every process of a pod runs in a cgroup whose path, as `/proc/PID/cgroup`
    shows it in any hierarchy, has a component containing `pod<UID>`, where
    UID is the pod's `metadata.uid` with its dashes kept or turned into
    underscores, right after the start of a component or a `-`, and followed
    by the end of the component, `.` or `-`. Examples that match UID
    `6d0f4c1e-2b7a-4f44-9d3e-0a1b2c3d4e5f`:
        /kubepods/besteffort/pod6d0f4c1e-2b7a-4f44-9d3e-0a1b2c3d4e5f/<container>
        /kubepods.slice/kubepods-burstable.slice/
            kubepods-burstable-pod6d0f4c1e_2b7a_4f44_9d3e_0a1b2c3d4e5f.slice/cri-containerd-...
        /meshagent/t1a2b3c-pod6d0f4c1e-2b7a-4f44-9d3e-0a1b2c3d4e5f   (agent.netlab pods
            named `pod<UID>`)
    The pod's network namespace is that of any such process that is not in
    the host namespace, and it must hold the pod IP on one of its interfaces.
    The pod's cgroup v2 directory (eBPF mode) is the unified-hierarchy path
    (`0::` line) of that process, under the cgroup2 mount.

Rules:
1. Parsing (`parse_cgroup`, `uid_in_path`, `pod_cgroup_path`) is pure.
2. `discover` never raises for a pod that is simply not there yet: it returns
   a `NotFound(reason, retry=True)`, so the supervisor retries on its next
   pass. Only a pod whose netns exists but lacks its IP gets `retry=True` too
   (the CNI may still be configuring it).
3. A found netns is kept alive by a bind mount of `/proc/PID/ns/net` at
   `<netns_dir>/<uid>` (as `ip netns` does), so the path in capture specs and
   in the redirect registry survives the pod's first process and this agent.
   `release` unmounts it. A mount already there for the same namespace
   (`NetnsId`) is reused: a restarted agent finds its pods again.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import os
import re
import socket
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from agent.redirect import netns

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping

    from agent.redirect.netns import NetnsId

logger = logging.getLogger(__name__)

NETNS_DIR = Path("/run/meshagent/netns")
PROC = Path("/proc")
MS_BIND = 4096
MNT_DETACH = 2

_libc = ctypes.CDLL(None, use_errno=True)


# --- pure: cgroup text -----------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class CgroupLine:
    """One line of /proc/PID/cgroup: `hierarchy-id:controllers:path`."""

    hierarchy: int
    controllers: str
    path: str

    @property
    def unified(self) -> bool:
        """The cgroup v2 line (`0::/path`)."""
        return self.hierarchy == 0 and self.controllers == ""


def parse_cgroup(text: str) -> list[CgroupLine]:
    """Parse /proc/PID/cgroup; malformed lines are skipped."""
    out: list[CgroupLine] = []
    for line in text.splitlines():
        hier, sep1, rest = line.partition(":")
        controllers, sep2, path = rest.partition(":")
        if not (sep1 and sep2) or not hier.isdigit():
            continue
        out.append(CgroupLine(hierarchy=int(hier), controllers=controllers, path=path))
    return out


def uid_variants(uid: str) -> tuple[str, ...]:
    """The spellings of a pod UID in cgroup paths: as is, and with `_` for `-`."""
    low = uid.lower()
    return tuple(dict.fromkeys((low, low.replace("-", "_"))))


@functools.lru_cache(maxsize=4096)
def _uid_pattern(uid: str) -> re.Pattern[str]:
    """One compiled pattern for every spelling of `uid` (`uid_in_path`): built once per
    UID, since a /proc scan asks it of every process for every pod it looks for."""
    spellings = "|".join(re.escape(v) for v in uid_variants(uid))
    return re.compile(rf"(?:^|/|-)pod(?:{spellings})(?:$|/|\.|-)")


def uid_in_path(path: str, uid: str) -> bool:
    """Whether some component of `path` names pod `uid` (module convention)."""
    if not uid:
        return False
    low = path.lower()
    return "pod" in low and _uid_pattern(uid).search(low) is not None


def pod_cgroup_path(lines: Iterable[CgroupLine], uid: str) -> str | None:
    """The unified (v2) path when it names `uid`; else None."""
    for line in lines:
        if line.unified and uid_in_path(line.path, uid):
            return line.path
    return None


def names_pod(lines: Iterable[CgroupLine], uid: str) -> bool:
    """Whether any hierarchy's path names `uid`."""
    return any(uid_in_path(line.path, uid) for line in lines)


# --- shell: /proc scan -------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Candidate:
    """A process of a pod, and its cgroup lines."""

    pid: int
    lines: tuple[CgroupLine, ...]


def scan_proc(uids: Iterable[str], proc: Path = PROC) -> dict[str, list[Candidate]]:
    """Processes per pod UID, by reading every /proc/PID/cgroup once."""
    wanted = [u for u in uids if u]
    found: dict[str, list[Candidate]] = {u: [] for u in wanted}
    if not wanted:
        return found
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            text = (entry / "cgroup").read_text()
        except OSError:
            continue  # gone, or not readable
        lines = parse_cgroup(text)
        for uid in wanted:
            if names_pod(lines, uid):
                found[uid].append(Candidate(pid=int(entry.name), lines=tuple(lines)))
    return found


# --- shell: results -----------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class PodNetwork:
    """Where a pod lives: its (held) netns path and identity, and its cgroup v2 dir."""

    uid: str
    netns: Path
    netns_id: NetnsId
    cgroup: Path | None
    pid: int


@dataclass(frozen=True, slots=True, kw_only=True)
class NotFound:
    """Why a pod's network could not be found; `retry`: it may appear later."""

    reason: str
    retry: bool = True


def cgroup2_mount(mounts: str | None = None) -> Path | None:
    """Where the unified cgroup hierarchy is mounted."""
    if mounts is None:
        try:
            mounts = Path("/proc/mounts").read_text()
        except OSError:
            return None
    for line in mounts.splitlines():
        parts = line.split()
        if len(parts) >= 3 and parts[2] == "cgroup2":
            return Path(parts[1])
    return None


def _has_ip(path: str | Path, ip: str) -> bool:
    return netns.run_in(path, lambda: ip in local_addresses())


_RTM_NEWADDR, _RTM_GETADDR = 20, 22
_NLMSG_ERROR, _NLMSG_DONE = 2, 3
_NLM_F_REQUEST, _NLM_F_DUMP = 0x1, 0x300
_IFA_ADDRESS, _IFA_LOCAL = 1, 2
_NLMSGHDR = struct.Struct("=IHHII")  # len, type, flags, seq, pid
_IFADDRMSG = struct.Struct("=BBBBI")  # family, prefixlen, flags, scope, index
_RTATTR = struct.Struct("=HH")  # len, type


def local_addresses() -> set[str]:
    """Every address (IFA_ADDRESS and IFA_LOCAL) of the calling thread's network
    namespace, from one rtnetlink RTM_GETADDR dump (stdlib only: no pyroute2).

    Raises:
        OSError: the dump failed.
    """
    req = _NLMSGHDR.pack(
        _NLMSGHDR.size + _IFADDRMSG.size, _RTM_GETADDR, _NLM_F_REQUEST | _NLM_F_DUMP, 1, 0
    ) + _IFADDRMSG.pack(socket.AF_UNSPEC, 0, 0, 0, 0)
    out: set[str] = set()
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, socket.NETLINK_ROUTE) as sock:
        sock.sendall(req)
        while True:
            data = sock.recv(1 << 16)
            if not data:
                return out
            if _parse_addresses(data, out):
                return out


def _parse_addresses(data: bytes, out: set[str]) -> bool:
    """Add the addresses of one rtnetlink datagram to `out`; True once NLMSG_DONE is seen."""
    off = 0
    while off + _NLMSGHDR.size <= len(data):
        length, kind, _, _, _ = _NLMSGHDR.unpack_from(data, off)
        if length < _NLMSGHDR.size:
            return True  # malformed: stop rather than loop
        if kind == _NLMSG_DONE:
            return True
        if kind == _NLMSG_ERROR:
            (err,) = struct.unpack_from("=i", data, off + _NLMSGHDR.size)
            raise OSError(-err, f"RTM_GETADDR: {os.strerror(-err)}")
        if kind == _RTM_NEWADDR:
            family = data[off + _NLMSGHDR.size]
            attr, end = off + _NLMSGHDR.size + _IFADDRMSG.size, off + length
            while attr + _RTATTR.size <= end:
                alen, atype = _RTATTR.unpack_from(data, attr)
                if alen < _RTATTR.size:
                    break
                if atype in (_IFA_ADDRESS, _IFA_LOCAL):
                    out.add(socket.inet_ntop(family, data[attr + _RTATTR.size : attr + alen]))
                attr += (alen + 3) & ~3
        off += (length + 3) & ~3
    return False


def _mount_bind(src: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    target.touch(exist_ok=True)
    if _libc.mount(src.encode(), str(target).encode(), None, MS_BIND, None) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount --bind {src} {target}: {os.strerror(err)}")


def _umount(target: Path) -> None:
    if _libc.umount2(str(target).encode(), MNT_DETACH) != 0:
        err = ctypes.get_errno()
        if err not in (22, 2):  # EINVAL: not a mount point; ENOENT: gone
            raise OSError(err, f"umount {target}: {os.strerror(err)}")
    with contextlib.suppress(FileNotFoundError):
        target.unlink()


def hold_netns(pid: int, uid: str, netns_dir: Path = NETNS_DIR) -> tuple[Path, netns.NetnsId]:
    """Bind-mount the netns of `pid` at `netns_dir/uid` (rule 3); reuse a mount of the same one.

    Raises:
        OSError: the namespace or the mount point cannot be used.
    """
    src = f"/proc/{pid}/ns/net"
    want = netns.NetnsId.of(src)
    target = netns_dir / uid
    if target.exists():
        with contextlib.suppress(netns.NetnsError):
            if netns.NetnsId.of(target) == want:
                return target, want
        _umount(target)
    _mount_bind(src, target)
    got = netns.NetnsId.of(target)
    if got != want:
        _umount(target)
        raise OSError(f"BUG: bind mount at {target} holds {got}, expected {want}")
    return target, want


def release(uid: str, netns_dir: Path = NETNS_DIR) -> None:
    """Unmount the held netns of pod `uid` (nothing if none)."""
    target = netns_dir / uid
    if target.exists():
        _umount(target)


def discover(
    uid: str,
    ip: str,
    *,
    candidates: Mapping[str, list[Candidate]] | None = None,
    netns_dir: Path = NETNS_DIR,
    proc: Path = PROC,
) -> PodNetwork | NotFound:
    """Find, hold and check pod `uid`'s namespace (module convention and rules)."""
    if candidates is None:
        candidates = scan_proc([uid], proc)
    procs = candidates.get(uid, [])
    if not procs:
        return NotFound(reason=f"no process in a cgroup named pod{uid} (not started yet?)")
    host = netns.host_netns()
    for cand in procs:
        try:
            ns_id = netns.NetnsId.of(proc / str(cand.pid) / "ns" / "net")
        except netns.NetnsError:
            continue  # exited meanwhile
        if ns_id == host:
            continue
        try:
            path, ns_id = hold_netns(cand.pid, uid, netns_dir)
        except (OSError, netns.NetnsError) as exc:
            return NotFound(reason=f"cannot hold netns of pid {cand.pid}: {exc}")
        if not _has_ip(path, ip):
            release(uid, netns_dir)
            return NotFound(reason=f"netns of pid {cand.pid} ({ns_id}) has no address {ip}")
        root = cgroup2_mount()
        rel = pod_cgroup_path(cand.lines, uid)
        cgroup = root / rel.lstrip("/") if root is not None and rel is not None else None
        return PodNetwork(uid=uid, netns=path, netns_id=ns_id, cgroup=cgroup, pid=cand.pid)
    return NotFound(reason=f"every process of pod{uid} is in the host network namespace")
