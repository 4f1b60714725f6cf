"""How many redirected bytes wait in an accelerated socket end's queue, read from outside.

The socket may be any process's: the pod's app or one of the agent's workers.
The agent finds it by its addresses and takes a copy of it from the process
that holds it, then asks the kernel how much its sockmap queue holds.

Rules:
1. `supported()`: only a kernel whose tcp_bpf answers FIONREAD with the
   bytes of the socket's sockmap queue (`tcp_bpf_ioctl` in /proc/kallsyms)
   can be asked; elsewhere FIONREAD counts TCP's queue only, which says
   nothing about redirected bytes, and `Look.queued` is always None.
2. The socket is found in three steps: its inode from the TCP table of its
   network namespace (/proc/<pid>/net/tcp and tcp6, read through a process
   of the pod: `tcp_table` and `table_inode`, pure), the process and fd holding that
   inode (/proc/<pid>/fd of the pod's processes, then the workers'), a copy of
   that fd (pidfd_getfd). The copy is used only if its socket cookie is the
   one the sockhash holds, so a socket closed and replaced meanwhile is never
   measured in its place.
3. Anything not found or refused (the process gone, no permission) is None:
   the caller cannot tell, and keeps the socket where it is.
4. A sweep asks through one `Look` (`Queues.look()`), which reads the pods'
   processes, the workers, each TCP table and each process's fd table once,
   however many ends it asks about: a pod's table and a worker's fds grow with
   its connections, and a sweep may ask about many of them.
   What a look keeps may go stale within it (a socket closed, its fd number
   reused); rule 2's cookie check turns that into None, never into another
   socket's queue.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import os
import socket
import struct
import termios
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from agent.redirect import ebpf_inspect
from agent.redirect.netns import NetnsError

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

Key = tuple[int, int, int, int, int]  # as agent.redirect.accel_sweep's

KALLSYMS = Path("/proc/kallsyms")
SO_COOKIE = 57  # <asm-generic/socket.h>
_SYS_PIDFD_GETFD = 438  # x86_64 and the generic table alike
_V4_MAPPED = "0000000000000000FFFF0000"


def supported(kallsyms: Path = KALLSYMS) -> bool:
    """Rule 1."""
    try:
        with kallsyms.open() as f:
            return any(line.rstrip().endswith(" tcp_bpf_ioctl") for line in f)
    except OSError:
        return False


def _hex_addr(ip: int, port: int, *, v6: bool) -> str:
    """An address as /proc/net/tcp{,6} prints it: the IP's bytes as the kernel's u32 words
    in host order (`ip` is already that u32), the port in host order."""
    return f"{_V4_MAPPED if v6 else ''}{ip:08X}:{port:04X}"


TcpTable = dict[tuple[str, str], int]  # (local, remote) as the table prints them -> inode


def tcp_table(text: str) -> TcpTable:
    """One TCP table's text (/proc/net/tcp or tcp6) by address pair; sockets whose inode
    is 0 (already detached from their file) are left out."""
    table: TcpTable = {}
    for line in text.splitlines()[1:]:
        fields = line.split()
        if len(fields) > 9 and fields[9] != "0":
            table[fields[1], fields[2]] = int(fields[9])
    return table


def table_inode(table: TcpTable, key: Key, *, v6: bool) -> int | None:
    """The inode of the socket with `key`'s local and remote addresses in `table` (tcp6's
    for a v4-mapped socket); None if absent."""
    _, local_ip, remote_ip, local_port, remote_port = key
    return table.get(
        (_hex_addr(local_ip, local_port, v6=v6), _hex_addr(remote_ip, remote_port, v6=v6))
    )


def fd_table(pid: int) -> dict[int, int]:
    """`pid`'s sockets: inode -> fd number (empty when the process is gone or hidden)."""
    fds: dict[int, int] = {}
    with contextlib.suppress(OSError), os.scandir(f"/proc/{pid}/fd") as it:
        for entry in it:
            try:
                target = os.readlink(entry.path)  # noqa: PTH115 - once per fd: no Path each
            except OSError:
                continue  # closed meanwhile
            if target.startswith("socket:["):
                fds[int(target[8:-1])] = int(entry.name)
    return fds


@dataclass(frozen=True, slots=True)
class Place:
    """Where a pod's sockets live: its network namespace and its cgroup (its processes)."""

    netns: Path
    cgroup: Path | None


class Queues:
    """Rules 2 and 3 over the pods `places()` lists and the worker pids `workers()` gives;
    each sweep asks through a `look()` of its own (rule 4)."""

    def __init__(
        self,
        places: Callable[[], Iterable[Place]],
        workers: Callable[[], Iterable[int]],
        *,
        enabled: bool | None = None,
    ) -> None:
        self._places = places
        self._workers = workers
        self.enabled = supported() if enabled is None else enabled
        self._cookies: dict[Path, int] = {}  # netns path -> its cookie, across looks

    def look(self) -> Look:
        """A new look (rule 4): it reads what it needs once, when first asked."""
        return Look(self)

    def worker_pids(self) -> tuple[int, ...]:
        return tuple(self._workers())

    def place_of(self, netns_cookie: int) -> Place | None:
        """The pod whose network namespace has `netns_cookie` (cookies kept across looks)."""
        places = list(self._places())
        current = {p.netns for p in places}
        self._cookies = {k: v for k, v in self._cookies.items() if k in current}  # pods gone
        for place in places:
            cookie = self._cookies.get(place.netns)
            if cookie is None:
                try:
                    cookie = ebpf_inspect.netns_cookie_of(place.netns)
                except (NetnsError, OSError):
                    continue
                self._cookies[place.netns] = cookie
            if cookie == netns_cookie:
                return place
        return None


class Look:
    """One look's questions (rule 4): the pods' processes, the workers, each TCP table and
    each process's fd table are read once, at their first use."""

    def __init__(self, queues: Queues) -> None:
        self._queues = queues
        self._places: dict[int, Place | None] = {}  # netns cookie -> the pod's place
        self._pids: dict[Path, list[int]] = {}  # cgroup -> its processes
        self._workers: tuple[int, ...] | None = None
        self._tables: dict[tuple[int, str], TcpTable | None] = {}
        self._fds: dict[int, dict[int, int]] = {}  # pid -> inode -> fd

    def queued(self, key: Key, cookie: int) -> int | None:
        """Bytes in the sockmap queue of the socket end `key` whose cookie is `cookie`."""
        if not self._queues.enabled:
            return None
        if key[0] not in self._places:
            self._places[key[0]] = self._queues.place_of(key[0])
        place = self._places[key[0]]
        if place is None or place.cgroup is None:
            return None
        pids = self._pids.get(place.cgroup)
        if pids is None:
            pids = self._pids[place.cgroup] = _cgroup_pids(place.cgroup)
        inode = self._inode(pids, key)
        if inode is None:
            return None
        if self._workers is None:
            self._workers = self._queues.worker_pids()
        for pid in (*pids, *self._workers):
            fds = self._fds.get(pid)
            if fds is None:
                fds = self._fds[pid] = fd_table(pid)
            fd = fds.get(inode)
            if fd is not None:
                return _fionread(pid, fd, cookie)
        return None

    def _inode(self, pids: list[int], key: Key) -> int | None:
        for pid in pids[:1]:  # any process of the pod sees the pod's tables
            for name, v6 in (("tcp", False), ("tcp6", True)):
                table = self._table(pid, name)
                if table is None:
                    return None
                inode = table_inode(table, key, v6=v6)
                if inode is not None:
                    return inode
        return None

    def _table(self, pid: int, name: str) -> TcpTable | None:
        if (pid, name) not in self._tables:
            try:
                table: TcpTable | None = tcp_table(Path(f"/proc/{pid}/net/{name}").read_text())
            except OSError:
                table = None  # the process is gone
            self._tables[pid, name] = table
        return self._tables[pid, name]


def _cgroup_pids(cgroup: Path) -> list[int]:
    """The processes of the pod's cgroup and of every cgroup under it (a Kubernetes pod's
    containers are child cgroups of the pod's)."""
    pids: list[int] = []
    for procs in (cgroup / "cgroup.procs", *sorted(cgroup.glob("**/*/cgroup.procs"))):
        with contextlib.suppress(OSError, ValueError):
            pids += [int(x) for x in procs.read_text().split()]
    return pids


_libc = ctypes.CDLL(None, use_errno=True)


def _fionread(pid: int, fd: int, cookie: int) -> int | None:
    """FIONREAD on a copy of `pid`'s `fd`, if that socket's cookie is `cookie`. The copy is
    used as a bare fd: a Python socket object over it could set O_NONBLOCK (a default
    timeout) on the open file the app shares with it."""
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:
        return None
    try:
        copy = _libc.syscall(_SYS_PIDFD_GETFD, pidfd, fd, 0)
        if copy < 0:
            return None
        try:
            if _socket_cookie(copy) != cookie:
                return None
            raw = fcntl.ioctl(copy, termios.FIONREAD, b"\0\0\0\0")
            return int(struct.unpack("i", raw)[0])
        finally:
            os.close(copy)
    except OSError:
        return None
    finally:
        os.close(pidfd)


def _socket_cookie(fd: int) -> int | None:
    value = ctypes.c_uint64(0)
    size = ctypes.c_uint32(ctypes.sizeof(value))
    ret = _libc.getsockopt(
        fd, socket.SOL_SOCKET, SO_COOKIE, ctypes.byref(value), ctypes.byref(size)
    )
    return int(value.value) if ret == 0 else None
