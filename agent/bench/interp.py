"""`meshagent bench --interp`: the interpreted Python calls the node agents' workers make.

The request path is compiled with mypyc (agent.native); a function the
interpreter still runs per request costs a frame, argument parsing and the
eval loop, and cProfile cannot point at it (it sees no compiled function, and
`--profile` runs everything interpreted). While a meshagent setup runs with
`--interp`, its agents (and so their workers) get `MESHAGENT_INTERP_DIR` =
`<out>/interp/<setup>`; each worker counts the calls of every interpreted
function and writes `worker-<id>-<pid>.tsv` when it exits (agent.proxy.worker
rule 8). `summarize` merges a setup's files into `<out>/interp/<setup>.txt`:
the functions by calls, each with its calls per request.

Rules:
1. Only the workers count (the data path); the supervisor does not.
2. The counts include start-up, warm-up and shutdown, the requests only what
   the loads measured: calls per request are an upper bound, and a function
   called once per request shows about 1.0 or more. Below `PER_REQUEST_FLOOR`
   a function is start-up or periodic work, not the request path.
3. The environment variable is set only while a setup runs and restored after.
4. Agents run the compiled build when it is current (`machine.native` in the
   JSON); with it stale every function is interpreted and the counts say so.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

from agent.bench import profile

if TYPE_CHECKING:
    from collections.abc import Iterable, Iterator
    from pathlib import Path

ENV = "MESHAGENT_INTERP_DIR"  # agent.proxy.worker.INTERP_ENV (the proxy stays out of the bench)
PER_REQUEST_FLOOR = 0.05  # rule 2
TOP = 30


@dataclass(frozen=True, slots=True, kw_only=True)
class Summary:
    """A setup's merged counts: `per_request` of the functions at or above the floor."""

    workers: int
    requests: int
    calls: dict[tuple[str, str], int]  # (file:line, function) -> calls, all workers

    def per_request(self) -> float:
        """Interpreted calls per request of the functions at or above `PER_REQUEST_FLOOR`."""
        return sum(r for _, _, r in self.hot())

    def hot(self) -> list[tuple[str, str, float]]:
        """(file:line, function, calls per request) at or above the floor, most first."""
        per = max(self.requests, 1)
        rows = [(where, name, n / per) for (where, name), n in self.calls.items()]
        rows = [r for r in rows if r[2] >= PER_REQUEST_FLOOR]
        return sorted(rows, key=lambda r: -r[2])


@contextlib.contextmanager
def counting(directory: Path | None) -> Iterator[None]:
    """Agents started inside count their workers' interpreted calls into `directory`."""
    if directory is None:
        yield
        return
    directory.mkdir(parents=True, exist_ok=True)
    with profile.environment({ENV: str(directory)}):
        yield


def parse(lines: Iterable[str], *, source: str = "?") -> dict[tuple[str, str], int]:
    """One worker's `calls<TAB>file:line<TAB>function` lines (agent.proxy.worker rule 8).

    Raises:
        ValueError: a line that is not three tab-separated fields with a count first,
            naming `source` and the line number.
    """
    out: dict[tuple[str, str], int] = {}
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        fields = line.rstrip("\n").split("\t")
        if len(fields) != 3 or not fields[0].isdigit():
            raise ValueError(f"{source}:{number}: not calls<TAB>file:line<TAB>function: {line!r}")
        key = (fields[1], fields[2])
        out[key] = out.get(key, 0) + int(fields[0])
    return out


def merge(counts: Iterable[dict[tuple[str, str], int]]) -> dict[tuple[str, str], int]:
    """The sum of several workers' counts."""
    total: dict[tuple[str, str], int] = {}
    for one in counts:
        for key, n in one.items():
            total[key] = total.get(key, 0) + n
    return total


def render(summary: Summary, *, name: str) -> str:
    """The most-called functions with their calls per request."""
    per = max(summary.requests, 1)
    head = (
        f"interpreted calls of {summary.workers} worker(s) of {name}: {summary.requests} "
        f"requests, {summary.per_request():.3f} calls per request in functions at or above "
        f"{PER_REQUEST_FLOOR} per request"
    )
    lines = [head, "", f"{'calls':>10}  {'per req':>8}  function"]
    ranked = sorted(summary.calls.items(), key=lambda kv: -kv[1])[:TOP]
    lines += [f"{n:>10}  {n / per:>8.3f}  {fn}  {where}" for (where, fn), n in ranked]
    return "\n".join(lines) + "\n"


def summarize(directory: Path, requests: int) -> tuple[Path, Summary] | None:
    """Merge `directory`'s worker counts into `<directory>.txt`; None when there are none.

    Raises:
        ValueError: a worker's file is malformed (`parse`).
    """
    files = sorted(directory.glob("worker-*.tsv"))
    if not files:
        return None
    counts = [parse(f.read_text().splitlines(), source=str(f)) for f in files]
    summary = Summary(workers=len(files), requests=requests, calls=merge(counts))
    out = directory.with_suffix(".txt")
    out.write_text(render(summary, name=directory.name))
    return out, summary
