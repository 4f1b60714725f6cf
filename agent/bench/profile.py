"""`meshagent bench --profile`: cProfile of the node agents' workers, per setup.

While a meshagent setup runs, its agents (and so their workers) get
`MESHAGENT_PROFILE_DIR` = `<out>/profile/<setup>` in their environment; each
worker writes `worker-<id>-<pid>.prof` there when it exits
(agent.proxy.worker rule 6). `summarize` then merges a setup's files into
`<out>/profile/<setup>.txt`: the functions with the most own time, each with
its calls per request over the setup's loads.

Rules:
1. Only the workers are profiled (the data path); the supervisor is not.
2. cProfile slows the workers down (its own cost per call): a profiled run's
   rates are not comparable with an unprofiled run's. The summary is for where
   the time goes and how many calls a request takes, not how much time there is.
3. The environment variables are set only while a setup runs and restored after.
4. Profiled agents run the request path as Python source (`MESHAGENT_NATIVE=0`,
   agent.native): cProfile does not see the functions of the compiled build.
"""

from __future__ import annotations

import contextlib
import io
import os
import pstats
from typing import TYPE_CHECKING

from agent import native

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path

ENV = "MESHAGENT_PROFILE_DIR"  # agent.proxy.worker.PROFILE_ENV (the proxy stays out of the bench)
NATIVE_ENV = native.ENV
TOP = 40


@contextlib.contextmanager
def profiling(directory: Path | None) -> Iterator[None]:
    """Agents started inside profile their workers into `directory` (None: no profiling)."""
    if directory is None:
        yield
        return
    directory.mkdir(parents=True, exist_ok=True)
    with environment({ENV: str(directory), NATIVE_ENV: "0"}):
        yield


@contextlib.contextmanager
def environment(settings: dict[str, str]) -> Iterator[None]:
    """`settings` in this process's environment (so in the agents it starts) while inside,
    each variable restored (or removed) after (rule 3; agent.bench.interp rule 3)."""
    before = {k: os.environ.get(k) for k in settings}
    os.environ.update(settings)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def summarize(directory: Path, requests: int) -> Path | None:
    """Merge `directory`'s worker stats into `<directory>.txt`; None when there are none."""
    files = sorted(directory.glob("worker-*.prof"))
    if not files:
        return None
    stats = pstats.Stats(*map(str, files), stream=io.StringIO())
    out = directory.with_suffix(".txt")
    out.write_text(render(stats, requests, name=directory.name, workers=len(files)))
    return out


def render(stats: pstats.Stats, requests: int, *, name: str, workers: int) -> str:
    """The top functions by own time, with their calls per request and shares."""
    table = stats.stats  # type: ignore[attr-defined]  # {(file, line, func): (cc, nc, tt, ct, callers)}
    total_tt = sum(v[2] for v in table.values()) or 1.0
    calls = sum(v[1] for v in table.values())
    per = max(requests, 1)
    head = (
        f"cProfile of {workers} worker(s) of {name}: {requests} requests, "
        f"{calls / per:.1f} calls per request, {total_tt:.2f} s of profiled time"
    )
    lines = [
        head,
        "(wall time: the event loop's own share includes waiting for events; socket writes",
        "made through uvloop count in their caller's own time)",
        f"{'calls/req':>10} {'own %':>6} {'cum %':>6}  function",
    ]
    top = sorted(table.items(), key=lambda kv: kv[1][2], reverse=True)[:TOP]
    for (path, line, func), (_cc, nc, tt, ct, _callers) in top:
        where = f"{_short(path)}:{line}({func})" if line else func
        lines.append(
            f"{nc / per:10.2f} {100 * tt / total_tt:6.1f} {100 * ct / total_tt:6.1f}  {where}"
        )
    return "\n".join(lines) + "\n"


def _short(path: str) -> str:
    """`agent/...` for the project's files, the file name for the rest."""
    marker = "/agent/"
    i = path.rfind(marker)
    return path[i + 1 :] if i >= 0 else path.rsplit("/", 1)[-1]
