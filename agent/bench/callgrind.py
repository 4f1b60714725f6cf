"""`meshagent bench --icount`: instructions per request of the node agents' real workers.

While a meshagent setup runs with `--icount`, its agents start their workers under
`valgrind --tool=callgrind` (agent.proxy.pool rule 6, `MESHAGENT_WORKER_WRAP`), each
worker writing into `<out>/icount/<setup>/`. During each load `during` zeroes every
worker's counters (`callgrind_control -z`) at `ZERO_AT` of the load's duration, once the
load has warmed up, and dumps them (`-d`) at `DUMP_AT`. `parse` reads a dump's
instruction total (`summary:`) and the calls of `MARKER`, which a worker's recorder makes
once for each response it records (agent.admin.observe: `Observer.taps_now`, on the bound
and the unbound path alike). `summarize` turns the workers' dumps into a row's `icount`.

Each node's proxy records a meshed request once: a cross-node request is an exchange
on the outbound worker (node a) and one on the inbound worker (node b); a same-node
request is one exchange whose recording counts both the outbound and the inbound series
(agent.admin.labelsets, a `local` hop), made by the one worker that carried it. A
setup's instructions per request are so `nodes * sum(Ir) / sum(marker calls)` over its
workers, `nodes` being the nodes its workers ran on, and each worker's instructions per
recorded exchange are reported beside it. (Until the thirty-sixth pass the factor was 2
on every path, which doubled the same-node figure.)

Why: on a shared host the rates of the same code swing by 10-30% between minutes, which
hides a change of a few percent; the instructions the real workers spend per request
moved by under 1% between two runs of the same code (bench/RESULTS.md, twenty-fifth pass).

Rules:
1. User space only: the kernel's share of a request is not counted. Under callgrind the
   workers run some 50 times slower, so every batch is full and the per-batch work (a
   write, a wake-up) is spread over more requests than in a real run. The rates, latency
   and CPU of an `--icount` run are not comparable with any other run's.
2. The marker is a compiled function's symbol: the count needs the compiled build
   (`machine.native` in the JSON). A worker running interpreted, or one that recorded
   nothing (a TCP load), has no exchanges, and its setup no per-request figure.
3. The environment variable is set only while a setup runs and restored after
   (agent.bench.profile.environment).
4. A load must last at least `MIN_DURATION_S` for the window to hold requests; with
   `--icount` a load lasts `DURATION_S` unless `--duration` says otherwise.
5. Only the PIDs the node agents started (their children running agent.proxy.worker)
   are signalled, through callgrind_control; nothing is looked up by name.
"""

from __future__ import annotations

import contextlib
import re
import shlex
import subprocess
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import psutil

from agent.bench import profile
from agent.bench.topology import BenchError

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator
    from pathlib import Path

    from agent.bench.mesh import NodeAgent

ENV = "MESHAGENT_WORKER_WRAP"  # agent.proxy.pool.WRAP_ENV (the proxy stays out of the bench)
MARKER = "CPyDef_observe___Observer___taps_now"  # once per recorded response
ZERO_AT = 0.35  # of a load's duration: counters zeroed (rule 4)
DUMP_AT = 0.9  # and dumped
MIN_DURATION_S = 20.0
DURATION_S = 60.0
CONTROL_TIMEOUT_S = 60.0  # a callgrind_control command, answered by a slow worker
WORKER_MODULE = "agent.proxy.worker"

T = TypeVar("T")
_SUMMARY = re.compile(r"^summary:\s*(\d+)", re.MULTILINE)
_NAMED = re.compile(r"^c?fn=\((\d+)\)(?: (.*))?$")


@dataclass(frozen=True, slots=True)
class Dump:
    """One callgrind dump: its instruction total and the calls made to each function."""

    ir: int
    calls: dict[str, int]


class DumpError(ValueError):
    """A callgrind dump that cannot be read."""


def parse(text: str, where: str = "dump") -> Dump:
    """The `summary:` instructions and the calls per called function of a dump in callgrind's
    format (with or without name compression, `fn=(id) name` then `fn=(id)`).

    Raises:
        DumpError: no `summary:` line, or a compressed name used before it was defined.
    """
    found = _SUMMARY.search(text)
    if found is None:
        raise DumpError(f"{where}: no 'summary:' line (not a callgrind dump?)")
    names: dict[str, str] = {}
    calls: dict[str, int] = {}
    callee = ""
    for lineno, line in enumerate(text.splitlines(), 1):
        if line.startswith(("fn=", "cfn=")):
            name = _name(line, names, f"{where}:{lineno}")
            if line.startswith("cfn="):
                callee = name
        elif line.startswith("calls=") and callee:
            count = line[6:].split(" ", 1)[0]
            if not count.isdigit():
                raise DumpError(f"{where}:{lineno}: calls= without a count: {line!r}")
            calls[callee] = calls.get(callee, 0) + int(count)
            callee = ""
    return Dump(ir=int(found.group(1)), calls=calls)


def _name(line: str, names: dict[str, str], where: str) -> str:
    value = line.split("=", 1)[1]
    named = _NAMED.match(line)
    if named is None:
        return value  # no compression
    ident, name = named.groups()
    if name is not None:
        names[ident] = name
        return name
    if ident not in names:
        raise DumpError(f"{where}: function ({ident}) used before it was named")
    return names[ident]


def summarize(dumps: list[tuple[str, int, Dump]]) -> dict[str, Any]:
    """A row's `icount` from each worker's (node, pid, dump): per worker its instructions,
    exchanges (marker calls) and instructions per exchange; per request `nodes * sum(Ir) /
    sum(exchanges)`, `nodes` the distinct nodes of `dumps` (module docstring), or None when
    no worker recorded an exchange."""
    workers = []
    total_ex = 0
    for node, pid, dump in dumps:
        exchanges = dump.calls.get(MARKER, 0)
        total_ex += exchanges
        workers.append(
            {
                "node": node,
                "pid": pid,
                "ir": dump.ir,
                "exchanges": exchanges,
                "ir_per_exchange": round(dump.ir / exchanges) if exchanges else None,
            }
        )
    total_ir = sum(d.ir for _, _, d in dumps)
    nodes = len({node for node, _, _ in dumps})
    per = round(nodes * total_ir / total_ex) if total_ex else None
    return {"ir_per_request": per, "workers": workers}


def wrap_command(directory: Path) -> str:
    """The `MESHAGENT_WORKER_WRAP` value that runs each worker under callgrind into
    `directory` (`cg.<pid>`, each dump `cg.<pid>.<n>`)."""
    out = f"--callgrind-out-file={directory / 'cg.%p'}"
    return shlex.join(["valgrind", "--tool=callgrind", out])


@contextlib.contextmanager
def counting(directory: Path | None) -> Iterator[None]:
    """Agents started inside run their workers under callgrind into `directory` (None:
    not at all); rule 3."""
    if directory is None:
        yield
        return
    directory.mkdir(parents=True, exist_ok=True)
    with profile.environment({ENV: wrap_command(directory)}):
        yield


def worker_pids(agents: list[NodeAgent]) -> list[tuple[str, int]]:
    """(node, pid) of each worker the agents started (rule 5)."""
    found = []
    for agent in agents:
        for pid in agent.worker_pids():
            with contextlib.suppress(psutil.Error):
                if WORKER_MODULE in psutil.Process(pid).cmdline():
                    found.append((agent.name, pid))
    return found


def control(pid: int, command: str) -> None:
    """`callgrind_control <command> <pid>` (`-z` zero, `-d` dump).

    Raises:
        BenchError: it failed or found no callgrind run with that PID.
    """
    argv = ["callgrind_control", command, str(pid)]
    try:
        done = subprocess.run(
            argv, capture_output=True, text=True, check=False, timeout=CONTROL_TIMEOUT_S
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise BenchError("icount", f"{shlex.join(argv)}: {exc}") from None
    if done.returncode != 0 or "OK." not in done.stdout:
        said = (done.stdout + done.stderr).strip()[-300:]
        raise BenchError("icount", f"{shlex.join(argv)} failed ({done.returncode}): {said}")


def newest_dump(directory: Path, pid: int) -> Path:
    """The last dump callgrind wrote for `pid` in `directory` (`cg.<pid>.<n>`, largest n).

    Raises:
        BenchError: there is none.
    """
    dumps = [p for p in directory.glob(f"cg.{pid}.*") if p.suffix[1:].isdigit()]
    if not dumps:
        raise BenchError("icount", f"no callgrind dump of worker {pid} in {directory}")
    return max(dumps, key=lambda p: int(p.suffix[1:]))


def during(
    run: Callable[[], T], duration_s: float, agents: list[NodeAgent], directory: Path
) -> tuple[T, dict[str, Any]]:
    """Run one load (`run`, lasting about `duration_s`) while counting its window in every
    worker of `agents`; the load's result and the row's `icount` (`summarize`).

    Raises:
        BenchError: too short a load (rule 4), no workers, or a callgrind command or dump
            that failed.
    """
    if duration_s < MIN_DURATION_S:
        why = f"a load of {duration_s:g}s is too short: at least {MIN_DURATION_S:g}s (--duration)"
        raise BenchError("icount", why)
    pids = worker_pids(agents)
    if not pids:
        raise BenchError("icount", "the node agents run no workers")
    got: list[T] = []
    failed: list[BaseException] = []

    def load() -> None:
        try:
            got.append(run())
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            failed.append(exc)

    thread = threading.Thread(target=load, name="icount-load", daemon=True)
    thread.start()
    try:
        _window([pid for _, pid in pids], duration_s, thread)
    finally:
        thread.join()
    if failed:
        raise failed[0]
    if not got:
        raise BenchError("icount", "the load returned nothing")
    return got[0], summarize(_read(directory, pids))


def _window(pids: list[int], duration_s: float, thread: threading.Thread) -> None:
    """Zero every worker at `ZERO_AT` of the load, dump each at `DUMP_AT` (earlier if the
    load ended: the window is then shorter, and still counted right)."""
    t0 = time.monotonic()
    for command, at in (("-z", ZERO_AT), ("-d", DUMP_AT)):
        thread.join(max(0.0, t0 + at * duration_s - time.monotonic()))
        for pid in pids:
            control(pid, command)


def _read(directory: Path, pids: list[tuple[str, int]]) -> list[tuple[str, int, Dump]]:
    """(node, pid, its newest dump) for each worker.

    Raises:
        BenchError: a worker without a dump, or one that cannot be read.
    """
    dumps = []
    for node, pid in pids:
        path = newest_dump(directory, pid)
        try:
            dumps.append((node, pid, parse(path.read_text(errors="replace"), str(path))))
        except DumpError as exc:
            raise BenchError("icount", str(exc)) from None
    return dumps
