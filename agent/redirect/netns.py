"""Network namespaces: the one way meshagent enters them.

Rules:
1. `setns(2)` changes only the calling thread, so namespace work runs on a
   dedicated worker thread (never the event loop's), and that thread is put
   back into its own namespace in `finally`, whatever happened.
2. A namespace is identified by `(st_dev, st_ino)` of its nsfs file, never by
   a name or path: a path can be reused by a new namespace.
3. A socket created inside a namespace stays bound to it whichever process or
   thread later uses it; that is how in-pod listeners and upstream sockets work.

Python 3.11 has no `os.setns`, so this calls libc through ctypes.
"""

from __future__ import annotations

import ctypes
import os
import socket
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from agent.errors import AgentError

if TYPE_CHECKING:
    from collections.abc import Callable

T = TypeVar("T")

CLONE_NEWNET = 0x40000000
NETNS_RUN_DIR = Path("/run/netns")

_libc = ctypes.CDLL(None, use_errno=True)
_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="netns")
_lock = threading.Lock()


class NetnsError(AgentError):
    """A namespace could not be opened or entered."""

    def __init__(self, path: str, reason: str) -> None:
        self.path = path
        self.reason = reason
        super().__init__(f"netns {path}: {reason}")


@dataclass(frozen=True, slots=True, kw_only=True)
class NetnsId:
    """The identity of a network namespace: its nsfs inode."""

    dev: int
    ino: int

    @classmethod
    def of(cls, path: str | Path) -> NetnsId:
        """Stat `path` (e.g. `/run/netns/x` or `/proc/PID/ns/net`).

        Raises:
            NetnsError: the path does not exist or cannot be read.
        """
        try:
            st = Path(path).stat()
        except OSError as exc:
            raise NetnsError(str(path), exc.strerror or str(exc)) from exc
        return cls(dev=st.st_dev, ino=st.st_ino)

    def __str__(self) -> str:
        return f"net:[{self.ino}]"


def host_netns() -> NetnsId:
    """The namespace of this process's main thread."""
    return NetnsId.of(f"/proc/{os.getpid()}/ns/net")


def named_path(name: str) -> Path:
    """Where `ip netns add NAME` puts a namespace."""
    return NETNS_RUN_DIR / name


def _setns(fd: int, path: str) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise NetnsError(path, f"setns: {os.strerror(err)}")


def _run_inside(path: str, fn: Callable[[], T]) -> T:
    # The worker thread's own namespace, to come back to.
    home = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    try:
        try:
            target = os.open(path, os.O_RDONLY)
        except OSError as exc:
            raise NetnsError(path, exc.strerror or str(exc)) from exc
        try:
            _setns(target, path)
        finally:
            os.close(target)
        try:
            return fn()
        finally:
            _setns(home, "/proc/thread-self/ns/net")
    finally:
        os.close(home)


def run_in(path: str | Path, fn: Callable[[], T]) -> T:
    """Call `fn()` inside the namespace at `path`, on the dedicated netns thread.

    Blocks the caller until done; from asyncio use `run_in_async`.

    Raises:
        NetnsError: the namespace cannot be opened or entered.
        Whatever `fn` raises.
    """
    return _executor.submit(_run_inside, str(path), fn).result()


async def run_in_async(path: str | Path, fn: Callable[[], T]) -> T:
    """`run_in` without blocking the event loop."""
    import asyncio  # noqa: PLC0415 - keep the module importable without a loop

    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(_executor, _run_inside, str(path), fn)


def socket_in(
    path: str | Path,
    family: int = socket.AF_INET,
    type_: int = socket.SOCK_STREAM,
    proto: int = 0,
) -> socket.socket:
    """A new socket that belongs to the namespace at `path`."""
    return run_in(path, lambda: socket.socket(family, type_, proto))


def exec_argv(path: str | Path) -> list[str]:
    """argv prefix that runs a command inside the namespace at `path`."""
    return ["nsenter", f"--net={path}", "--"]
