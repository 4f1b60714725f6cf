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
   (its address from `id`, CPython's layout, checked at import), held by the
   caller's list; anything else is copied to bytes first and held here.
5. The ring's memory is the kernel's (`mmap` of the ring fd); one ring per
   event loop (agent.proxy.writes), its fd closed by `close` or when the ring
   goes (`__del__`).
6. The call's own cost stays small (compiled, agent.native; bench/RESULTS.md,
   thirty-fifth pass): SQE `i` keeps opcode, flags, `msg_flags` and
   `user_data = i` from the ring's opening (the kernel only reads SQEs), so a send writes its fd,
   address and length in one `pack_into`; the ring's head and
   tail counts are ours, kept as ints; `io_uring_enter` goes through the
   untyped `syscall` with `c_long` arguments made once (a prototype's argument
   conversion cost more than the call's kernel side).
"""

from __future__ import annotations

import asyncio.selector_events
import ctypes
import errno
import mmap
import os
import struct
from typing import TYPE_CHECKING, Any, Final

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
# struct io_uring_sqe, 64 bytes = 8 words: word 0 = opcode, flags, ioprio (16 bits), fd
# (32 bits, high half); word 1 = off; word 2 = addr; word 3 = len, msg_flags (high half);
# word 4 = user_data; the rest stays zero as mapped (rule 6)
_SQE_WORDS: Final = 8
_SQE_SIZE: Final = 64
# what a send writes (rule 6): fd, off (left 0), addr, len, from byte 4 of its SQE; fd and
# len are small ints, which convert faster than 64-bit words
_SEND_FIELDS: Final[Any] = struct.Struct("=i8xQI")
_NO_RESULT: Final = -errno.EIO  # a send whose completion did not come
_CQE_INTS: Final = 4  # struct io_uring_cqe: user_data (two 32-bit words), res, flags
_PARAMS: Final = 120  # sizeof(struct io_uring_params)

# glibc's syscall(). io_uring_setup takes our prototype (once per ring); io_uring_enter
# goes through the untyped function with `c_long` arguments (rule 6): it takes its
# integer arguments in registers either way on x86-64 and arm64 Linux. ctypes, not
# cffi: cffi's declarations import its C parser, 4 MB more in each worker.
_libc: Final[Any] = ctypes.CDLL(None, use_errno=True)
_setup: Final[Any] = ctypes.CFUNCTYPE(
    ctypes.c_long, ctypes.c_long, ctypes.c_uint, ctypes.c_void_p, use_errno=True
)(("syscall", _libc))
_enter: Final[Any] = _libc["syscall"]  # a function object of our own, not the CDLL's cached one
_enter.restype = ctypes.c_long
_ENTER_NR: Final[Any] = ctypes.c_long(_NR_ENTER)
_ENTER_FLAGS: Final[Any] = ctypes.c_long(_ENTER_GETEVENTS)
_ZERO: Final[Any] = ctypes.c_long(0)
_COUNTS: Final[tuple[Any, ...]] = tuple(ctypes.c_long(n) for n in range(ENTRIES + 1))


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

    def __init__(self, entries: int = ENTRIES) -> None:
        self._closed = True  # until there is an fd to close
        params = ctypes.create_string_buffer(_PARAMS)
        fd = _setup(_NR_SETUP, entries, params)
        if fd < 0:
            code = ctypes.get_errno()
            raise OSError(code, os.strerror(code))
        self._fd: int = fd
        self._fd_arg: Any = ctypes.c_long(fd)
        self._closed = False
        self.calls = 0  # io_uring_enter calls made with sends, and the sends they carried
        self.sends = 0
        try:
            self._map(params.raw)
        except BaseException:
            self.close()
            raise

    def _map(self, params: bytes) -> None:
        # struct io_uring_params as 32-bit words: sq_entries, cq_entries, ..., features (5);
        # io_sqring_offsets from word 10 (head, tail, ring_mask, .., array = 16) and
        # io_cqring_offsets from word 20 (head, tail, ring_mask, .., cqes = 25)
        words = memoryview(params).cast("I")
        sq_entries, cq_entries, features = words[0], words[1], words[5]
        sq_tail, sq_mask, sq_array = words[11], words[12], words[16]
        cq_head, cq_tail, cq_mask, cqes = words[20], words[21], words[22], words[25]
        words.release()
        sq_size = sq_array + sq_entries * 4
        cq_size = cqes + cq_entries * _CQE_INTS * 4
        rw = mmap.PROT_READ | mmap.PROT_WRITE
        self._maps: list[mmap.mmap] = []
        if features & _FEAT_SINGLE_MMAP:
            sq = cq = mmap.mmap(self._fd, max(sq_size, cq_size), mmap.MAP_SHARED, rw)
            self._maps.append(sq)
        else:
            sq = mmap.mmap(self._fd, sq_size, mmap.MAP_SHARED, rw)
            self._maps.append(sq)
            cq = mmap.mmap(self._fd, cq_size, mmap.MAP_SHARED, rw, offset=_OFF_CQ_RING)
            self._maps.append(cq)
        sqes = mmap.mmap(
            self._fd, sq_entries * _SQE_WORDS * 8, mmap.MAP_SHARED, rw, offset=_OFF_SQES
        )
        self._maps.append(sqes)
        self._sqes = sqes
        # the rings as 32-bit words (head, tail, mask, array, CQEs); released before the
        # maps close
        self._sq_ints = memoryview(sq).cast("I")
        self._cq_ints = memoryview(cq).cast("i")
        self._sq_tail_at: int = sq_tail // 4
        self._cq_head_at: int = cq_head // 4
        self._cq_tail_at: int = cq_tail // 4
        self._cqes_at: int = cqes // 4
        self._sq_mask: int = self._sq_ints[sq_mask // 4]
        self._cq_mask: int = self._cq_ints[cq_mask // 4]
        self._tail: int = self._sq_ints[self._sq_tail_at]  # rule 6: ours to count
        self._head: int = self._cq_ints[self._cq_head_at] & 0xFFFFFFFF
        sqe_words = memoryview(sqes).cast("Q")
        for i in range(sq_entries):  # slot i always names SQE i, whose user_data is i
            self._sq_ints[sq_array // 4 + i] = i
            sqe_words[i * _SQE_WORDS] = _OP_SEND  # flags, ioprio 0; fd per send
            sqe_words[i * _SQE_WORDS + 3] = _MSG_FLAGS << 32  # len per send
            sqe_words[i * _SQE_WORDS + 4] = i
        sqe_words.release()

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
        """Unmap the rings and close the fd now (otherwise when the ring goes, rule 5)."""
        if self._closed:
            return
        self._closed = True
        for name in ("_sq_ints", "_cq_ints"):
            view = getattr(self, name, None)
            if view is not None:
                view.release()
        for m in getattr(self, "_maps", []):
            m.close()
        os.close(self._fd)

    def __del__(self) -> None:
        self.close()

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
        sqes = self._sqes
        pack = _SEND_FIELDS.pack_into
        mask = self._sq_mask
        first = self._tail
        copies: list[bytes] = []  # rule 4: views copied, used again after the call
        for i, (fd, data) in enumerate(items):
            if type(data) is bytes:
                whole = data
            else:
                whole = bytes(data)
                copies.append(whole)
            at = ((first + i) & mask) * _SQE_SIZE
            pack(sqes, at + 4, fd, id(whole) + _BYTES_DATA, len(whole))
        tail = (first + n) & 0xFFFFFFFF
        self._tail = tail
        self.calls += 1
        self.sends += n
        self._sq_ints[self._sq_tail_at] = tail
        count = _COUNTS[n]
        submit = count
        while _enter(_ENTER_NR, self._fd_arg, submit, count, _ENTER_FLAGS, _ZERO, _ZERO) < 0:
            code = ctypes.get_errno()
            if code != errno.EINTR:
                raise OSError(code, os.strerror(code))
            submit = _ZERO  # submitted; wait for the completions again
        results = [_NO_RESULT] * n
        cq = self._cq_ints
        cmask = self._cq_mask
        cqes = self._cqes_at
        head = self._head
        end = cq[self._cq_tail_at] & 0xFFFFFFFF
        while head != end:
            at = cqes + (head & cmask) * _CQE_INTS
            results[(cq[at] - first) & mask] = cq[at + 2]
            head = (head + 1) & 0xFFFFFFFF
        self._head = head
        cq[self._cq_head_at] = head if head < 0x80000000 else head - 0x100000000
        # rule 4: a use after the call, so that compiled code (which frees a local after
        # its last use) keeps the copies alive through it
        copies.clear()
        return results
