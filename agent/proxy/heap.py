"""The worker's heap: buffers of a bulk stream reused, not faulted in again per read.

A bulk stream moves up to 256 KiB per read (uvloop's read buffer), and each read makes
a few blocks that size: the bytes read, and across nodes the TLS records OpenSSL writes
for them into its memory BIO and the bytes read back out of it. glibc's malloc serves a
block that big from the top of its heap once its dynamic mmap threshold has risen past
it (the first such block freed raises it), and when the free top grows past the trim
threshold (twice the mmap threshold) it gives the top back to the kernel. So with a few
such blocks per read the top went back and forth: `brk` calls (34,566 in 6 s on the
encrypting worker of a cross-node iperf3) and, for every block, fresh zeroed pages
faulted in again.

Rules:
1. `tune()`, called once as a worker starts, fixes glibc's mmap threshold at
   `MMAP_THRESHOLD` and its trim threshold at `TRIM_THRESHOLD` (`mallopt`; fixing
   either stops glibc's own adjustment). A block up to 1 MiB comes from the heap, and
   a free top of up to 4 MiB stays: a worker holds at most that much free heap more
   than before, against about 1.45x cross-node mTLS throughput (bench/RESULTS.md,
   forty-second pass).
2. A C library without `mallopt` (musl) or one that refuses the values: nothing is
   changed, `tune()` returns False and the worker runs as before.
3. An operator's own malloc settings win: with `MALLOC_MMAP_THRESHOLD_` or
   `MALLOC_TRIM_THRESHOLD_` in the environment, or `GLIBC_TUNABLES` naming any
   `glibc.malloc.` tunable, `tune()` changes nothing and returns False. Other tunables
   (`glibc.pthread.rseq=0`, which some container runtimes set) do not count.
"""

from __future__ import annotations

import ctypes
import logging
import os
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from collections.abc import Mapping

logger = logging.getLogger(__name__)

# glibc's malloc.h parameter numbers for mallopt.
M_TRIM_THRESHOLD: Final = -1
M_MMAP_THRESHOLD: Final = -3

MMAP_THRESHOLD: Final = 1024 * 1024
TRIM_THRESHOLD: Final = 4 * 1024 * 1024
OPERATOR_SETTINGS: Final = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")
MALLOC_TUNABLES: Final = "glibc.malloc."  # in GLIBC_TUNABLES (rule 3)


def operator_set(environ: Mapping[str, str]) -> bool:
    """Rule 3: the environment carries the operator's own malloc settings."""
    if any(name in environ for name in OPERATOR_SETTINGS):
        return True
    return MALLOC_TUNABLES in environ.get("GLIBC_TUNABLES", "")


def tune(mmap_threshold: int = MMAP_THRESHOLD, trim_threshold: int = TRIM_THRESHOLD) -> bool:
    """Rule 1: fix malloc's thresholds; False when the environment has its own (rule 3)
    or this C library will not (rule 2, logged)."""
    if operator_set(os.environ):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        logger.info("no mallopt in this C library; the heap keeps its defaults")
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    mmap_set: int = mallopt(M_MMAP_THRESHOLD, mmap_threshold)
    trim_set: int = mallopt(M_TRIM_THRESHOLD, trim_threshold)
    done = mmap_set == 1 and trim_set == 1
    if not done:
        logger.warning(
            "malloc refused the heap's thresholds",
            extra={"mmap_threshold": mmap_threshold, "trim_threshold": trim_threshold},
        )
    return done
