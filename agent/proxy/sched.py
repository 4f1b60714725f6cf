"""The worker's scheduler slice: a request's wake-up runs the worker before the apps' turns end.

Linux's fair scheduler (EEVDF, 6.6 and later) gives each task a slice, by default a few
milliseconds, and sets its virtual deadline one slice after its start. Since 6.12 a task
may ask for its own slice (`sched_setattr` with `sched_runtime`, clamped to 0.1-100 ms),
and a woken task whose slice is shorter than the running one's may preempt it at once
(`PREEMPT_SHORT`). A proxy worker wakes for every read of every meshed pod's traffic and
runs for tens of microseconds each time; with the kernel's slice, when an app or the
load it serves holds the CPU, the woken worker waits in the run queue, and with it the
request of every pod behind it.

Rules:
1. `request(slice_s)`, called once as a worker starts (agent.proxy.worker rule 12),
   asks for `slice_s` on the worker's main thread, the one that runs the loop (a
   thread the worker starts keeps the kernel's slice). The slice is only a request:
   it changes neither the worker's weight (nice) nor its policy, so a busy worker
   still gets no more than its fair share; it is preempted sooner and preempts sooner.
2. `parse_slice` accepts `off` (the kernel's slice, nothing is asked) or a duration
   within `MIN_SLICE_S`-`MAX_SLICE_S`, the kernel's clamp, written as
   `agent.config.parse_seconds` reads it (`100us`, `0.5ms`); anything else is an
   error that says what it accepts.
3. A kernel that refuses the call (seccomp, no `sched_setattr`) is logged once and the
   worker runs on the kernel's slice; a kernel older than 6.12 accepts the call and
   ignores the slice (`slice_of` then reads no `se.slice`).
4. `attr(slice_ns)` is pure: the `struct sched_attr` bytes (version 1, 56 bytes:
   SCHED_OTHER, nice 0, no flags, `sched_runtime` the slice).
5. Opt-in (`DEFAULT` is off): measured side by side with HAProxy on this machine's
   two shared CPUs (bench/RESULTS.md, sixtieth pass), a short slice took 7-11% off the
   mesh's p50 at 2,000 requests/s, where two requests share the load generator's
   millisecond tick and the CPUs are contended, and added 2-9% at 1,000, where the
   worker mostly wakes on an idle CPU; the p99 moved within its noise either way.
"""

from __future__ import annotations

import ctypes
import logging
import os
import struct
from pathlib import Path
from typing import Final

from agent import config

logger = logging.getLogger(__name__)

MIN_SLICE_S: Final = 0.0001  # the kernel's clamp (kernel/sched/syscalls.c)
MAX_SLICE_S: Final = 0.1
OFF: Final = "off"
DEFAULT: Final = OFF  # `meshagent run --worker-slice` (agent.supervisor.settings), rule 5

SYS_SCHED_SETATTR: Final = {"x86_64": 314, "aarch64": 274}
SCHED_OTHER: Final = 0
ATTR_SIZE: Final = 56  # SCHED_ATTR_SIZE_VER1
_ATTR: Final = struct.Struct("=IIQiIQQQII")


def parse_slice(raw: str) -> float | None:
    """Rule 2: None for `off`, else the slice in seconds."""
    text = raw.strip().lower()
    if text == OFF:
        return None
    try:
        value = config.parse_seconds(text)
    except ValueError:
        value = -1.0
    if not MIN_SLICE_S <= value <= MAX_SLICE_S:
        raise ValueError(f"expected {OFF} or a duration from 100us to 100ms (examples: 100us, 1ms)")
    return value


def attr(slice_ns: int) -> bytes:
    """Rule 4: `struct sched_attr` asking SCHED_OTHER for a slice of `slice_ns`."""
    return _ATTR.pack(ATTR_SIZE, SCHED_OTHER, 0, 0, 0, slice_ns, 0, 0, 0, 0)


def request(slice_s: float) -> bool:
    """Rule 1: ask for `slice_s` on the calling thread; False (logged) where the kernel
    refuses (rule 3)."""
    number = SYS_SCHED_SETATTR.get(os.uname().machine)
    if number is None:
        logger.info("no sched_setattr number for this machine; the worker keeps the kernel's slice")
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    buf = ctypes.create_string_buffer(attr(round(slice_s * 1e9)), ATTR_SIZE)
    if libc.syscall(number, 0, buf, 0) != 0:
        err = ctypes.get_errno()
        logger.warning(
            "the kernel refused the worker's scheduler slice; it keeps the kernel's",
            extra={"slice_us": round(slice_s * 1e6), "reason": os.strerror(err)},
        )
        return False
    return True


def slice_of(pid: int) -> int | None:
    """A task's slice in nanoseconds as the kernel reports it (`se.slice` in
    /proc/PID/sched, Linux 6.12 and later), or None where it reports none."""
    try:
        text = Path(f"/proc/{pid}/sched").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        name, sep, value = line.partition(":")
        if sep and name.strip() == "se.slice":
            return int(value.strip())
    return None
