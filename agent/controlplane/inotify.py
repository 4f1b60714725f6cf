"""Linux inotify for `FolderWatcher`: sleep until a watched folder changes.

`Inotify` is one inotify instance, reached through libc with ctypes (the
standard library has no binding). It says only *that* something changed under
its watches; `FolderWatcher` rescans to find out what, so events are drained,
never parsed.

Rules:
1. `Inotify.open()` returns None where there is no inotify (no such libc call,
   the per-user instance limit reached); the caller then polls.
2. `watch(path)` adds a watch on one directory, or refreshes it when the
   directory already has one. A directory that cannot be watched (gone, not a
   directory, the watch limit reached) returns False, and the caller keeps
   polling. The kernel drops a watch by itself when its directory goes.
3. `wait(timeout)` returns True as soon as events are queued, after draining
   all of them (a queue overflow is an event too); False when `wake()` was
   called or the timeout passed without events. `wake` may be called from any
   thread, also before `wait` starts: that `wait` then returns at once.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import select
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path

logger = logging.getLogger(__name__)

# linux/inotify.h
_IN_MODIFY: Final = 0x2
_IN_ATTRIB: Final = 0x4
_IN_CLOSE_WRITE: Final = 0x8
_IN_MOVED_FROM: Final = 0x40
_IN_MOVED_TO: Final = 0x80
_IN_CREATE: Final = 0x100
_IN_DELETE: Final = 0x200
_IN_DELETE_SELF: Final = 0x400
_IN_MOVE_SELF: Final = 0x800
_IN_ONLYDIR: Final = 0x01000000
# Whatever can change the files under a directory: their contents, their names
# (editors and Kubernetes' ConfigMap volumes rename), their presence, the directory itself.
MASK: Final = (
    _IN_MODIFY
    | _IN_ATTRIB
    | _IN_CLOSE_WRITE
    | _IN_MOVED_FROM
    | _IN_MOVED_TO
    | _IN_CREATE
    | _IN_DELETE
    | _IN_DELETE_SELF
    | _IN_MOVE_SELF
    | _IN_ONLYDIR
)
_READ: Final = 65536


class Inotify:
    """One inotify instance plus an eventfd that wakes its `wait`; see the module rules."""

    def __init__(self, fd: int, wake_fd: int, add_watch: Callable[[int, bytes, int], int]) -> None:
        self._fd = fd
        self._wake_fd = wake_fd
        self._add_watch = add_watch
        self._poll = select.poll()  # not select(): an agent's fds may pass FD_SETSIZE
        self._poll.register(fd, select.POLLIN)
        self._poll.register(wake_fd, select.POLLIN)

    @classmethod
    def open(cls) -> Inotify | None:
        """A new instance, or None where inotify is not available (rule 1)."""
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            init, add_watch = libc.inotify_init1, libc.inotify_add_watch
        except (OSError, AttributeError):
            return None
        init.argtypes, init.restype = [ctypes.c_int], ctypes.c_int
        add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
        add_watch.restype = ctypes.c_int
        fd = init(os.O_NONBLOCK | os.O_CLOEXEC)
        if fd < 0:
            logger.warning(
                "inotify unavailable, polling instead",
                extra={"error": os.strerror(ctypes.get_errno())},
            )
            return None
        return cls(fd, os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC), add_watch)

    def watch(self, path: Path) -> bool:
        """Watch the directory `path` (rule 2); False if it cannot be watched."""
        return self._add_watch(self._fd, os.fsencode(path), MASK) >= 0

    def wait(self, timeout: float) -> bool:
        """Block up to `timeout` seconds; True if events came (all drained, rule 3)."""
        ready = {fd for fd, _ in self._poll.poll(max(timeout, 0.0) * 1000.0)}
        if self._wake_fd in ready:
            with contextlib.suppress(BlockingIOError):
                os.eventfd_read(self._wake_fd)
        if self._fd not in ready:
            return False
        with contextlib.suppress(BlockingIOError):
            while os.read(self._fd, _READ):
                pass
        return True

    def wake(self) -> None:
        """End the current (or next) `wait` early (rule 3)."""
        os.eventfd_write(self._wake_fd, 1)

    def close(self) -> None:
        """Close both descriptors; the watches go with the instance."""
        for fd in (self._fd, self._wake_fd):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fd = self._wake_fd = -1
