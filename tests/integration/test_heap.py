"""agent.proxy.heap: glibc's malloc thresholds, read back from the kernel's fault counts.

A fresh interpreter repeats what a bulk stream's read does to the heap: three 256 KiB
buffers made, written and freed, 200 times. With glibc's own thresholds the top of the
heap goes back to the kernel every time and its pages are faulted in again; tuned, they
are reused (rule 1). The operator's own setting wins (rule 3).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROUNDS = 200
PAGES_PER_ROUND = 3 * 256 * 1024 // os.sysconf("SC_PAGE_SIZE")

SCRIPT = f"""
import resource, sys
from agent.proxy import heap
print(heap.tune() if sys.argv[1] == "tuned" else "-")
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
def one_read():
    blocks = [bytearray(256 * 1024) for _ in range(3)]
    del blocks
one_read(); one_read()  # glibc raises its dynamic threshold after the first
before = faults()
for _ in range({ROUNDS}):
    one_read()
print(faults() - before)
"""


def _glibc() -> bool:
    try:
        return bool(os.confstr("CS_GNU_LIBC_VERSION"))
    except (ValueError, OSError):
        return False


pytestmark = pytest.mark.skipif(not _glibc(), reason="glibc's malloc only")


def _run(mode: str, **env: str) -> tuple[str, int]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "GLIBC_"))}
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, mode],
        capture_output=True,
        text=True,
        check=True,
        env={**clean, **env},
        timeout=60,
    ).stdout.split()
    return out[0], int(out[1])


def test_tuned_the_buffers_of_a_read_are_reused_not_faulted_in_again():
    said, faults = _run("tuned")
    assert said == "True"
    assert faults < ROUNDS  # fewer than one page per round: the heap's top stays


def test_with_glibcs_own_thresholds_every_read_faults_its_pages_in_again():
    """What rule 1 is for, and proof that the count above can fail (about half of each
    round's pages here)."""
    _, faults = _run("default")
    assert faults > ROUNDS * PAGES_PER_ROUND // 4


def test_an_operators_own_malloc_setting_wins():
    said, faults = _run("tuned", MALLOC_TRIM_THRESHOLD_="131072")
    assert said == "False"
    assert faults > ROUNDS * PAGES_PER_ROUND // 4  # their (small) trim threshold applies
    said, faults = _run("tuned", GLIBC_TUNABLES="glibc.malloc.trim_threshold=131072")
    assert said == "False"
    assert faults > ROUNDS * PAGES_PER_ROUND // 4


def test_tunables_that_are_not_mallocs_do_not_stop_the_tuning():
    said, faults = _run("tuned", GLIBC_TUNABLES="glibc.pthread.rseq=0")
    assert said == "True"
    assert faults < ROUNDS
