"""Many sends in one system call: an io_uring submission queue for the held writes.

Why (bench/RESULTS.md, thirty-first pass): on a CPU the worker shares with the
readers it writes to (the app, a client), each `send()` wakes its reader, and a
reader that slept has the scheduler's precedence over a worker that ran more
than its share: it preempts the worker as the send returns, handles that one
message and sleeps again. A batch of N writes costs N preemptions and N
wake-ups of the reader. One `io_uring_enter` with N sends returns to user mode
once: the worker is preempted at most once, and each reader, woken by the
first message, finds the rest already there.

Rules:
1. `SendRing.open()` is None where io_uring is not available (an old kernel,
   `kernel.io_uring_disabled`, a seccomp profile that refuses it, as
   container runtimes' defaults do) or switched off (`switch(False)`, the
   worker's `--io-uring off`, `meshagent run --io-uring off`): the caller
   writes through its transports, as it did before.
2. Sends are non-blocking (`MSG_DONTWAIT`: io_uring returns -EAGAIN instead of
   waiting for room), so every send has completed when `io_uring_enter`
   returns; `send` answers each item's result: bytes sent, or -errno. What a
   send did not take is the caller's to write.
3. The caller sends to a socket at most once per call and only when nothing
   is queued before it (agent.proxy.writes rule 6): sends of one call run
   in order, but a short one would not stop the next to the same socket.
4. The data is held until the call returns: the kernel reads it during
   `io_uring_enter`, not later. A bytes object's data is sent where it lies
   (its address from `id`, CPython's layout, checked at import); anything else
   is copied to bytes first.
5. The ring's memory is the kernel's (`mmap` of the ring fd); one ring per
   event loop (agent.proxy.writes), its fd closed when the ring goes.
"""

from __future__ import annotations

import asyncio.selector_events
import ctypes
import errno
import mmap
import os
import struct
import weakref
from typing import TYPE_CHECKING, Final

import uvloop.loop

if TYPE_CHECKING:
    from collections.abc import Sequence

# transports whose socket may take a send when nothing is queued in them (rule 3): TCP
# and Unix stream sockets of both loops, never TLS
PLAIN_TRANSPORTS: Final[tuple[type, ...]] = (
    uvloop.loop.TCPTransport,  # type: ignore[attr-defined]
    uvloop.loop.UnixTransport,  # type: ignore[attr-defined]
    asyncio.selector_events._SelectorSocketTransport,  # type: ignore[attr-defined]  # noqa: SLF001
)
# Fewer sends go one by one: a call costs about 2 us more than a send() in the kernel
# and our Python (bench/RESULTS.md, thirty-first pass), more than it saves for 2 or 3.
MIN_SENDS: Final = 4
ENTRIES: Final = 64  # sends per call at most (more are sent in further calls)

_NR_SETUP: Final = 425  # x86_64 and arm64 share io_uring's numbers (generic table)
_NR_ENTER: Final = 426
_OP_SEND: Final = 26  # IORING_OP_SEND, Linux 5.6
_ENTER_GETEVENTS: Final = 1
_FEAT_SINGLE_MMAP: Final = 1
_OFF_CQ_RING: Final = 0x8000000
_OFF_SQES: Final = 0x10000000
_MSG_FLAGS: Final = 0x40 | 0x4000  # MSG_DONTWAIT | MSG_NOSIGNAL (rule 2)
# struct io_uring_sqe (64 bytes) up to user_data: opcode, flags, ioprio, fd, off, addr, len,
# msg_flags, user_data; the rest stays zero as mapped
_SQE: Final = struct.Struct("=BBHiQQIIQ")
_SQE_SIZE: Final = 64
_CQE: Final = struct.Struct("=QiI")  # struct io_uring_cqe, 16 bytes
_U32: Final = struct.Struct("=I")
_PARAMS: Final = 120  # sizeof(struct io_uring_params)

# glibc's syscall(), through prototypes of our own: it takes its integer arguments in
# registers either way on x86-64 and arm64 Linux. ctypes, not cffi: cffi's declarations
# import its C parser, 4 MB more in each worker.
_libc: Final = ctypes.CDLL(None, use_errno=True)
_setup: Final = ctypes.CFUNCTYPE(
    ctypes.c_long, ctypes.c_long, ctypes.c_uint, ctypes.c_void_p, use_errno=True
)(("syscall", _libc))
_enter: Final = ctypes.CFUNCTYPE(
    ctypes.c_long,
    ctypes.c_long,
    ctypes.c_int,
    ctypes.c_uint,
    ctypes.c_uint,
    ctypes.c_uint,
    ctypes.c_void_p,
    ctypes.c_size_t,
    use_errno=True,
)(("syscall", _libc))


def _bytes_data_offset() -> int:
    """Where a bytes object's data starts, from its address (CPython's layout, checked)."""
    probe = b"meshagent"
    address = ctypes.cast(ctypes.c_char_p(probe), ctypes.c_void_p).value
    offset = (address or 0) - id(probe)
    if not 0 < offset < 64:
        raise RuntimeError(f"BUG: bytes data at {offset} from the object")
    return offset


_BYTES_DATA: Final = _bytes_data_offset()


_ENABLED = [True]  # rule 1: `switch`


def switch(on: bool) -> None:
    """Allow (the default) or refuse rings from now on in this process (rule 1)."""
    _ENABLED[0] = on


class SendRing:
    """One io_uring instance used for batches of non-blocking sends."""

    __slots__ = (
        "__weakref__",
        "_closer",
        "_cq",
        "_cq_head",
        "_cq_mask",
        "_cq_tail",
        "_cq_words",
        "_cqes",
        "_fd",
        "_sq",
        "_sq_mask",
        "_sq_tail",
        "_sqes",
    )

    def __init__(self, entries: int = ENTRIES) -> None:
        params = ctypes.create_string_buffer(_PARAMS)
        fd = _setup(_NR_SETUP, entries, params)
        if fd < 0:
            code = ctypes.get_errno()
            raise OSError(code, os.strerror(code))
        self._fd = fd
        self._closer = weakref.finalize(self, os.close, self._fd)  # rule 5
        self._map(params.raw)

    def _map(self, params: bytes) -> None:
        sq_entries, cq_entries, _, _, _, features = struct.unpack_from("=6I", params, 0)
        # io_sqring_offsets / io_cqring_offsets: eight u32 and a u64 each
        _, sq_tail, sq_mask, _, _, _, sq_array, _, _ = struct.unpack_from("=8IQ", params, 40)
        cq_head, cq_tail, cq_mask, _, _, cqes, _, _, _ = struct.unpack_from("=8IQ", params, 80)
        sq_size = sq_array + sq_entries * 4
        cq_size = cqes + cq_entries * _CQE.size
        rw = mmap.PROT_READ | mmap.PROT_WRITE
        if features & _FEAT_SINGLE_MMAP:
            self._sq = self._cq = mmap.mmap(self._fd, max(sq_size, cq_size), mmap.MAP_SHARED, rw)
        else:
            self._sq = mmap.mmap(self._fd, sq_size, mmap.MAP_SHARED, rw)
            self._cq = mmap.mmap(self._fd, cq_size, mmap.MAP_SHARED, rw, offset=_OFF_CQ_RING)
        self._sqes = mmap.mmap(
            self._fd, sq_entries * _SQE_SIZE, mmap.MAP_SHARED, rw, offset=_OFF_SQES
        )
        self._sq_tail = sq_tail
        self._sq_mask = _U32.unpack_from(self._sq, sq_mask)[0]
        self._cq_head = cq_head
        self._cq_tail = cq_tail
        self._cq_mask = _U32.unpack_from(self._cq, cq_mask)[0]
        self._cqes = cqes
        # the CQEs as 32-bit words (`send` reads user_data's low word and res)
        self._cq_words = memoryview(self._cq)[cqes : cqes + cq_entries * _CQE.size].cast("i")
        for i in range(sq_entries):  # slot i always names SQE i
            _U32.pack_into(self._sq, sq_array + 4 * i, i)

    @classmethod
    def open(cls) -> SendRing | None:
        """A ring, or None where io_uring is not available or switched off (rule 1)."""
        if not _ENABLED[0]:
            return None
        try:
            return cls()
        except OSError as exc:
            if exc.errno in (errno.ENOSYS, errno.EPERM, errno.EACCES, errno.ENOMEM, errno.EINVAL):
                return None
            raise

    def close(self) -> None:
        """Unmap the rings and close the fd now (otherwise when the ring goes)."""
        self._cq_words.release()
        for m in {id(x): x for x in (self._sqes, self._sq, self._cq)}.values():
            m.close()
        self._closer()

    def send(self, items: Sequence[tuple[int, bytes | memoryview]]) -> list[int]:
        """Send each `(fd, data)` without blocking; each one's bytes sent or -errno (rule 2)."""
        if len(items) <= ENTRIES:
            return self._send(items)
        results: list[int] = []
        for start in range(0, len(items), ENTRIES):
            results += self._send(items[start : start + ENTRIES])
        return results

    def _send(self, items: Sequence[tuple[int, bytes | memoryview]]) -> list[int]:
        n = len(items)
        sq, sqes, mask = self._sq, self._sqes, self._sq_mask
        tail = _U32.unpack_from(sq, self._sq_tail)[0]
        held = []  # rule 4: what the kernel reads stays alive until the call returns
        pack = _SQE.pack_into
        for i, (fd, data) in enumerate(items):
            whole = data if type(data) is bytes else bytes(data)  # views are rare: copied
            held.append(whole)
            addr, size = id(whole) + _BYTES_DATA, len(whole)
            pack(sqes, ((tail + i) & mask) << 6, _OP_SEND, 0, 0, fd, 0, addr, size, _MSG_FLAGS, i)
        _U32.pack_into(sq, self._sq_tail, (tail + n) & 0xFFFFFFFF)
        submit = n
        while _enter(_NR_ENTER, self._fd, submit, n, _ENTER_GETEVENTS, None, 0) < 0:
            code = ctypes.get_errno()
            if code != errno.EINTR:
                raise OSError(code, os.strerror(code))
            submit = 0  # submitted; wait for the completions again
        results = [-errno.EIO] * n
        cq, words, cmask = self._cq, self._cq_words, self._cq_mask
        head = _U32.unpack_from(cq, self._cq_head)[0]
        end = _U32.unpack_from(cq, self._cq_tail)[0]
        while head != end:
            at = (head & cmask) << 2  # a CQE is four 32-bit words: user_data (2), res, flags
            results[words[at]] = words[at + 2]
            head = (head + 1) & 0xFFFFFFFF
        _U32.pack_into(cq, self._cq_head, head)
        return results
