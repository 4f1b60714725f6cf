"""The bench's loads: each runs inside the client pod, stops itself, returns numbers.

    http1-rate-N     agent.bench.loadgen, constant N req/s, 16 keep-alive connections
    http1-saturate   wrk, 64 connections, 2 threads
    http1-post-saturate
                     the same with POSTs of `POST_BODY_BYTES` (1 KiB; by name
                     only): requests with a body, which the proxies serve on
                     another path than bodiless ones
    h2-saturate      h2load (h2c prior knowledge), 4 connections x 16 streams
    tcp-throughput   iperf3, one stream, the client pod sends
    tcp-reverse      iperf3 -R, one stream, the server pod sends (a download)
    conn-rate        agent.bench.loadgen --mode conn, 16 loops of connect/request/close
    http1-rr         agent.bench.loadgen --mode rr, 1 keep-alive connection, closed
                     loop: the bare small request/response latency of the path
    http1-side-N     agent.bench.loadgen --mode side: http1-rate-N over several
                     paths taking turns in 1 s slices (`http1_side`)
    tcp-side-N       the same with --proto echo: N requests/s of 64 bytes of
                     opaque TCP that the server echoes (`tcp_side`, netperf
                     TCP_RR-like), to each path's echo port
    saturate-side    http1-saturate's wrk over several paths taking turns in
                     `SATURATE_SLICE_S` slices (`saturate_side`, rule 3)

Rules:
1. A load returns a `Measured`: requests (or bytes) done, errors, elapsed
   seconds and, when it measured them, latency percentiles in ms.
2. Output parsers are pure functions (tested on recorded output); a load
   whose tool fails raises `LoadError` with the tool's stderr.
3. `saturate-side` runs wrk (http1-saturate's: 64 connections) on each path in turn,
   from the path's own client pod, `SATURATE_SLICE_S` seconds a turn, in the order
   `turns` gives (ABBA: each path as often early as late in a cycle), after one
   unmeasured turn each (its requests the path's `warmup_requests`). A path's numbers
   are its turns' summed (`merged`): the
   machine's speed drifts from minute to minute by more than the goals' margins
   (haproxy-tls 22.6k-27.5k requests/s between rounds of the same run, bench/RESULTS.md
   fifty-fifth pass), and turns of seconds give every path the same minutes. wrk
   reconnects at each turn: 64 connections a turn, on every path alike.
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from agent.bench.hist import Histogram
from agent.bench.report import SATURATE_SIDE
from agent.errors import AgentError

if TYPE_CHECKING:
    from collections.abc import Callable

    from agent.bench.setups import Target

_T = TypeVar("_T")

SATURATING = ("http1-saturate", "http1-post-saturate", "h2-saturate")  # warmed up first
RATE_CONNECTIONS = 16
SATURATE_CONNECTIONS = 64
POST_BODY_BYTES = 1024  # http1-post-saturate's request bodies
CONN_LOOPS = 16
RR_CONNECTIONS = 1
SIDE_SLICE_S = 1.0
SATURATE_SLICE_S = 2  # saturate-side's turns (rule 3), whole seconds: wrk's -d
ECHO_SIZE = 64  # bytes per tcp-side request (agent.bench.loadgen rule 6)


class LoadError(AgentError):
    """A load tool failed or printed what we cannot read."""

    def __init__(self, load: str, reason: str) -> None:
        self.load = load
        self.reason = reason
        super().__init__(f"load {load}: {reason}")


@dataclass(frozen=True, slots=True, kw_only=True)
class Measured:
    """What one load run measured."""

    requests: int = 0
    errors: int = 0
    error_kinds: dict[str, int] = field(default_factory=dict)  # what the errors were, if known
    elapsed_s: float = 0.0
    bytes: int = 0
    p50_ms: float | None = None
    p99_ms: float | None = None
    p999_ms: float | None = None
    warmup_requests: int = 0  # done before recording began (side by side: its warm-up turns)

    @property
    def rps(self) -> float:
        return self.requests / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def gbps(self) -> float:
        return self.bytes * 8 / self.elapsed_s / 1e9 if self.elapsed_s > 0 else 0.0


# --- parsers (pure) ---------------------------------------------------------------


def from_loadgen(text: str) -> Measured:
    """Raises: ValueError: not the loadgen's JSON."""
    return _measured(json.loads(text))


def _measured(data: dict[str, Any]) -> Measured:
    """One run's object of the loadgen's JSON (agent.bench.loadgen rule 3) as `Measured`.

    Raises:
        KeyError: a field is missing.
    """
    hist = Histogram.from_dict(data["hist"])
    return Measured(
        requests=int(data["requests"]),
        errors=int(data["errors"]),
        error_kinds={str(k): int(v) for k, v in data.get("error_kinds", {}).items()},
        elapsed_s=float(data["elapsed_s"]),
        p50_ms=hist.percentile(50) / 1000,
        p99_ms=hist.percentile(99) / 1000,
        p999_ms=hist.percentile(99.9) / 1000,
        warmup_requests=int(data.get("warmup_requests", 0)),
    )


_WRK_TOTAL = re.compile(r"(\d+) requests in ([\d.]+)(us|ms|s|m)")
_WRK_PCT = re.compile(r"^\s*(50|99)(?:\.000)?%\s+([\d.]+)(us|ms|s)\s*$", re.MULTILINE)
_WRK_ERR = re.compile(
    r"Non-2xx or 3xx responses: (\d+)|Socket errors: connect (\d+), read (\d+), "
    r"write (\d+), timeout (\d+)"
)
_UNIT_S = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0}


def from_wrk(text: str) -> Measured:
    """wrk's text output (with --latency).

    Raises:
        ValueError: no request total in it.
    """
    total = _WRK_TOTAL.search(text)
    if total is None:
        raise ValueError("no 'N requests in T' line in wrk output")
    pct = {m[0]: float(m[1]) * _UNIT_S[m[2]] * 1000 for m in _WRK_PCT.findall(text)}
    errors = 0
    for m in _WRK_ERR.finditer(text):
        errors += sum(int(g) for g in m.groups() if g)
    return Measured(
        requests=int(total[1]),
        errors=errors,
        elapsed_s=float(total[2]) * _UNIT_S[total[3]],
        p50_ms=pct.get("50"),
        p99_ms=pct.get("99"),
    )


_H2_FINISHED = re.compile(r"finished in ([\d.]+)(us|ms|s),")
_H2_REQS = re.compile(
    r"requests: (\d+) total, \d+ started, \d+ done, (\d+) succeeded, (\d+) failed"
)


def from_h2load(text: str) -> Measured:
    """h2load's text output.

    Raises:
        ValueError: no summary in it.
    """
    fin = _H2_FINISHED.search(text)
    reqs = _H2_REQS.search(text)
    if fin is None or reqs is None:
        raise ValueError("no 'finished in' / 'requests:' lines in h2load output")
    return Measured(
        requests=int(reqs[2]),
        errors=int(reqs[3]),
        elapsed_s=float(fin[1]) * _UNIT_S[fin[2]],
    )


def from_iperf3(text: str) -> Measured:
    """iperf3 -J output.

    Raises:
        ValueError: no end summary (iperf3 reports its own errors in "error").
    """
    data = json.loads(text)
    if "error" in data:
        raise ValueError(f"iperf3: {data['error']}")
    received = data["end"]["sum_received"]
    return Measured(bytes=int(received["bytes"]), elapsed_s=float(received["seconds"]))


# --- runners ----------------------------------------------------------------------


def _run(target: Target, load: str, argv: list[str], timeout: float) -> str:
    from agent.netlab import LabError  # noqa: PLC0415 - lab only when running

    try:
        done = target.client.run(argv, timeout=timeout)
    except LabError as exc:
        raise LoadError(load, exc.reason[-1500:]) from exc
    return done.stdout


def _parse(load: str, parse: Callable[[str], _T], text: str) -> _T:
    try:
        return parse(text)
    except (ValueError, KeyError) as exc:
        raise LoadError(load, f"{exc}: {text[-500:]!r}") from exc


def http1_rate(target: Target, rate: int, duration: float, warmup: float) -> Measured:
    argv = [sys.executable, "-m", "agent.bench.loadgen", "--mode", "rate"]
    argv += [f"--target={target.host}:{target.http_port}", f"--rate={rate}"]
    argv += [f"--connections={RATE_CONNECTIONS}", f"--duration={duration}", f"--warmup={warmup}"]
    load = f"http1-rate-{rate}"
    return _parse(load, from_loadgen, _run(target, load, argv, duration + warmup + 30))


def from_side(text: str) -> dict[str, Measured]:
    """The loadgen's side-by-side JSON: each path's `Measured`, by name.

    Raises:
        ValueError: not that JSON.
    """
    paths = json.loads(text)["paths"]
    return {str(name): _measured(one) for name, one in paths.items()}


def http1_side(
    targets: list[Target], rate: int, duration: float, warmup: float
) -> dict[str, Measured]:
    """`http1-rate-N` over `targets` taking turns in `SIDE_SLICE_S` slices, each target
    `duration` seconds (agent.bench.loadgen rule 5), sent from the first target's client
    pod; each target's numbers by its setup name."""
    paths = [(t.setup, t.host, t.http_port) for t in targets]
    return _side(f"http1-side-{rate}", targets[0], paths, rate, (duration, warmup))


def tcp_side(
    targets: list[Target], rate: int, duration: float, warmup: float
) -> dict[str, Measured]:
    """`http1_side`'s turns with `ECHO_SIZE` bytes of opaque TCP per request to each
    target's echo port, echoed back (agent.bench.loadgen rule 6).

    Raises:
        LoadError: a target has no echo port, or the load generator failed.
    """
    load = f"tcp-side-{rate}"
    missing = [t.setup for t in targets if not t.echo_port]
    if missing:
        raise LoadError(load, f"no echo port on {', '.join(missing)}")
    paths = [(t.setup, t.host, t.echo_port) for t in targets]
    echo = ("--proto=echo", f"--size={ECHO_SIZE}")
    return _side(load, targets[0], paths, rate, (duration, warmup), more=echo)


def _side(  # noqa: PLR0913 - the load, where from and to, and its knobs
    load: str,
    client: Target,
    paths: list[tuple[str, str, int]],
    rate: int,
    times: tuple[float, float],
    *,
    more: tuple[str, ...] = (),
) -> dict[str, Measured]:
    """The load generator's side mode over `paths` (name, host, port) from `client`'s pod,
    each path `times[0]` seconds after a warm-up of `times[1]`; `more` its extra flags."""
    duration, warmup = times
    argv = [sys.executable, "-m", "agent.bench.loadgen", "--mode", "side", f"--rate={rate}"]
    argv += [f"--path={name}={host}:{port}" for name, host, port in paths]
    argv += [f"--connections={RATE_CONNECTIONS}", f"--duration={duration}", f"--warmup={warmup}"]
    argv += [f"--slice={SIDE_SLICE_S}", *more]
    timeout = (duration + warmup) * len(paths) + 30
    return _parse(load, from_side, _run(client, load, argv, timeout))


def turns(paths: int, cycles: int) -> list[int]:
    """Rule 3's order of `paths` turns over `cycles` cycles: forward, then backward
    (ABBA), so no path always goes first or last."""
    out: list[int] = []
    for cycle in range(cycles):
        order = range(paths) if cycle % 2 == 0 else range(paths - 1, -1, -1)
        out.extend(order)
    return out


def merged(parts: list[Measured]) -> Measured:
    """Rule 3: one path's turns as one `Measured`: counts and times summed, latency the
    median of the turns' percentiles (wrk reports percentiles, not its histogram)."""

    def median(values: list[float | None]) -> float | None:
        known = sorted(v for v in values if v is not None)
        return known[len(known) // 2] if known else None

    return Measured(
        requests=sum(p.requests for p in parts),
        errors=sum(p.errors for p in parts),
        elapsed_s=sum(p.elapsed_s for p in parts),
        p50_ms=median([p.p50_ms for p in parts]),
        p99_ms=median([p.p99_ms for p in parts]),
    )


def saturate_side(targets: list[Target], duration: float, warmup: float) -> dict[str, Measured]:
    """`http1-saturate` over `targets` taking turns (rule 3), each target about
    `duration` seconds after one unmeasured turn of `warmup` (when at least 1 s), each
    from its own client pod; each target's numbers by its setup name.

    Raises:
        LoadError: wrk failed or printed what we cannot read.
    """
    load = SATURATE_SIDE
    warm = {t.setup: _wrk(t, load, warmup, []).requests if warmup >= 1 else 0 for t in targets}
    cycles = max(1, round(duration / SATURATE_SLICE_S))
    got: dict[str, list[Measured]] = {t.setup: [] for t in targets}
    for i in turns(len(targets), cycles):
        got[targets[i].setup].append(_wrk(targets[i], load, SATURATE_SLICE_S, []))
    return {
        name: dataclasses.replace(merged(parts), warmup_requests=warm[name])
        for name, parts in got.items()
    }


def conn_rate(target: Target, duration: float, warmup: float) -> Measured:
    argv = [sys.executable, "-m", "agent.bench.loadgen", "--mode", "conn"]
    argv += [f"--target={target.host}:{target.http_port}", f"--connections={CONN_LOOPS}"]
    argv += [f"--duration={duration}", f"--warmup={warmup}"]
    return _parse("conn-rate", from_loadgen, _run(target, "conn-rate", argv, duration + 30))


def http1_rr(target: Target, duration: float, warmup: float) -> Measured:
    argv = [sys.executable, "-m", "agent.bench.loadgen", "--mode", "rr"]
    argv += [f"--target={target.host}:{target.http_port}", f"--connections={RR_CONNECTIONS}"]
    argv += [f"--duration={duration}", f"--warmup={warmup}"]
    return _parse("http1-rr", from_loadgen, _run(target, "http1-rr", argv, duration + warmup + 30))


def http1_saturate(target: Target, duration: float) -> Measured:
    return _wrk(target, "http1-saturate", duration, [])


def post_script(size: int) -> str:
    """wrk's Lua script for POSTs of `size` bytes (http1-post-saturate)."""
    return (
        'wrk.method = "POST"\n'
        f'wrk.body = string.rep("x", {size})\n'
        'wrk.headers["Content-Type"] = "application/octet-stream"\n'
    )


def http1_post_saturate(target: Target, duration: float) -> Measured:
    with tempfile.TemporaryDirectory(prefix="meshagent-bench-post-") as tmp:
        script = Path(tmp) / "post.lua"  # the pod shares the file system
        script.write_text(post_script(POST_BODY_BYTES))
        return _wrk(target, "http1-post-saturate", duration, ["-s", str(script)])


def _wrk(target: Target, load: str, duration: float, extra: list[str]) -> Measured:
    argv = ["wrk", "-t2", f"-c{SATURATE_CONNECTIONS}", f"-d{max(1, round(duration))}s"]
    argv += ["--latency", *extra, f"http://{target.host}:{target.http_port}/"]
    return _parse(load, from_wrk, _run(target, load, argv, duration + 30))


def h2_saturate(target: Target, duration: float) -> Measured:
    argv = ["h2load", "-c4", "-m16", "-t1", f"-D{max(1, round(duration))}"]
    argv += [f"http://{target.host}:{target.http_port}/"]
    return _parse("h2-saturate", from_h2load, _run(target, "h2-saturate", argv, duration + 30))


def tcp_throughput(target: Target, duration: float, *, reverse: bool = False) -> Measured:
    name = "tcp-reverse" if reverse else "tcp-throughput"
    argv = ["iperf3", "-c", target.host, "-p", str(target.iperf_port), "-J"]
    argv += ["-t", str(max(1, round(duration))), *(["-R"] if reverse else [])]
    return _parse(name, from_iperf3, _run(target, name, argv, duration + 30))
