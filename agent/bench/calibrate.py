"""How fast this machine runs the interpreter, and how fast C, during a bench run.

On this kind of shared machine the speed of Python code against C code moves from one
hour to the next: in the twenty-third pass the Python TLS floor, unchanged, fell from
0.89 to 0.58 of HAProxy's rate. The calibration is recorded in the run's `machine`
dict, so that runs from different hours can be told apart before their ratios are
compared.

Rules:
1. `measure` times two fixed workloads, each the best of `ROUNDS` runs (the best, as
   a run can only be slowed by the machine, never sped up):
   - `python_ms`: an interpreted loop of the kinds of work the request path does in
     the interpreter (attribute and method lookups, calls, small dicts, bytes made and
     freed), `PY_ITERATIONS` times;
   - `c_ms`: SHA-256 (OpenSSL, as TLS's crypto) over `C_BYTES`.
   Lower is faster.
2. `python_over_c` is `python_ms / c_ms`. Two runs whose values are near ran on a
   machine in the same state; a run with a higher value was slower at Python
   against C, which lowers every Python-over-C ratio the run reports.
3. The harness measures at the start of a run (before the lab's first load) and at
   its end (`machine.calibration.start` and `.end`), in its own process, with the
   lab idle.
4. Steal: on a virtual machine the hypervisor runs other guests on this one's CPUs,
   and the kernel counts the time it was kept off them (`steal`, the eighth number
   of /proc/stat's `cpu` line). `steal_pct(before, after)` is the share of all CPU
   time between two `cpu_times()` readings that was stolen, in percent; the harness
   puts it on every row (`steal_pct`), so a slow row on a busy host shows as one.
   None where the kernel counts no steal (fewer than eight numbers).
5. Idle: `idle_pct(before, after)` is the share of the CPU time between two
   `idle_times()` readings that no task used (idle and iowait), for the whole machine
   first, then for each CPU. With each simulated node on its own CPUs
   (agent.bench.topology rule 5), a proxy that leaves its node's CPU idle while the
   load waits shows here: the convoy of the cross-node h2 lane (bench/RESULTS.md,
   twenty-eighth pass). The harness puts them on every row (`idle_pct`,
   `idle_pct_cpus`).
6. Drift: when python/C at the end differs from the start by more than `DRIFT`
   (relative), `describe` says so: the machine changed under the run (in the
   fifty-first pass's full run Python slowed 44% while C did not), and one round's
   ratios of setups run far apart carry that change.
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from collections.abc import Callable

ROUNDS: Final = 5
PY_ITERATIONS: Final = 100_000
C_BYTES: Final = 32 << 20
DRIFT: Final = 0.15  # rule 6: python/C moved more than this, relative, during a run
PROC_STAT: Final = Path("/proc/stat")
_STEAL: Final = 7  # index of steal among the cpu line's numbers (proc(5))
_GUEST: Final = 8  # guest and guest_nice are counted in user and nice already
_IDLE: Final = 3  # idle, then iowait (proc(5))
_CHUNK: Final = bytes(range(256)) * 4096  # 1 MiB
_KEYS: Final = (
    b"host",
    b"user-agent",
    b"accept",
    b"content-length",
    b"x-a",
    b"x-b",
    b"x-c",
    b"x-d",
)


class _Conn:
    """A stand-in for a connection's state: a buffer, a count, methods called by name."""

    __slots__ = ("buf", "seen")

    def __init__(self) -> None:
        self.buf: list[bytes] = []
        self.seen = 0

    def feed(self, data: bytes) -> int:
        self.buf.append(data)
        self.seen += len(data)
        if len(self.buf) > 32:
            self.buf.clear()
        return self.seen


def _python_work(iterations: int) -> int:
    conn = _Conn()
    headers: dict[bytes, int] = {}
    total = 0
    for i in range(iterations):
        key = _KEYS[i & 7]
        headers[key] = headers.get(key, 0) + 1
        total += conn.feed(key + b": " * (i & 3))
        if i & 63 == 0:
            headers = {}
    return total


def _c_work(size: int) -> bytes:
    h = hashlib.sha256()
    chunks, rest = divmod(size, len(_CHUNK))
    for _ in range(chunks):
        h.update(_CHUNK)
    h.update(_CHUNK[:rest])
    return h.digest()


def _best_ms(work: Callable[[int], object], arg: int, rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        work(arg)
        best = min(best, time.perf_counter() - t0)
    return best * 1000.0


def measure(*, rounds: int = ROUNDS, scale: float = 1.0) -> dict[str, float]:
    """Rule 1 and 2's numbers; `scale` shrinks both workloads alike (for tests)."""
    python_ms = _best_ms(_python_work, max(1, int(PY_ITERATIONS * scale)), rounds)
    c_ms = _best_ms(_c_work, max(1, int(C_BYTES * scale)), rounds)
    return {
        "python_ms": round(python_ms, 3),
        "c_ms": round(c_ms, 3),
        "python_over_c": round(python_ms / c_ms, 3),
    }


def describe(start: dict[str, float], end: dict[str, float]) -> str:
    """A run's note: the calibration at its start and end (rule 3), and a warning when
    python/C moved by more than `DRIFT` between them (rule 6)."""
    text = (
        f"calibration (agent.bench.calibrate): python/C {start['python_over_c']} at the start, "
        f"{end['python_over_c']} at the end (python {start['python_ms']} / {end['python_ms']} ms, "
        f"C {start['c_ms']} / {end['c_ms']} ms)"
    )
    moved = end["python_over_c"] / start["python_over_c"] - 1.0
    if abs(moved) > DRIFT:
        text += (
            f"; python/C moved {moved:+.0%} during the run: a ratio of a Python setup to a C"
            " peer measured minutes apart may be off by that much (--repeat takes ratios"
            " within rounds)"
        )
    return text


def _cpu_ticks(text: str) -> list[list[int]]:
    """The numbers of /proc/stat's `cpu` lines: the machine's first, then each CPU's."""
    return [[int(x) for x in ln.split()[1:]] for ln in text.splitlines() if ln.startswith("cpu")]


def parse_cpu_times(text: str) -> tuple[int, int] | None:
    """(steal, total) clock ticks from /proc/stat's text (rule 4), None without steal."""
    lines = _cpu_ticks(text)
    if not lines or len(lines[0]) <= _STEAL:
        return None
    return lines[0][_STEAL], sum(lines[0][:_GUEST])


def cpu_times() -> tuple[int, int] | None:
    """This machine's (steal, total) ticks now; None where unreadable or not counted."""
    try:
        return parse_cpu_times(PROC_STAT.read_text())
    except OSError:
        return None


def steal_pct(before: tuple[int, int] | None, after: tuple[int, int] | None) -> float | None:
    """Rule 4: percent of the CPU time between the readings that was stolen."""
    if before is None or after is None or after[1] <= before[1]:
        return None
    return round(100.0 * (after[0] - before[0]) / (after[1] - before[1]), 1)


def parse_idle(text: str) -> list[tuple[int, int]]:
    """(idle, total) clock ticks of the machine, then of each CPU in order, from /proc/stat's
    text (rule 5); idle counts iowait too."""
    return [(t[_IDLE] + t[_IDLE + 1], sum(t[:_GUEST])) for t in _cpu_ticks(text)]


def idle_times() -> list[tuple[int, int]] | None:
    """This machine's idle and total ticks now, whole and per CPU; None where unreadable."""
    try:
        return parse_idle(PROC_STAT.read_text())
    except OSError:
        return None


def idle_pct(
    before: list[tuple[int, int]] | None, after: list[tuple[int, int]] | None
) -> list[float] | None:
    """Rule 5: percent of each entry's CPU time between the readings that was idle."""
    if not before or not after or len(before) != len(after):
        return None
    out = []
    for (idle0, total0), (idle1, total1) in zip(before, after, strict=True):
        if total1 <= total0:
            return None
        out.append(round(100.0 * (idle1 - idle0) / (total1 - total0), 1))
    return out
