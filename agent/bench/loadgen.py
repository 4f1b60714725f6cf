"""The bench's HTTP/1.1 load generator: constant rate (wrk2-style) or new connections;
side by side, also opaque TCP echo (rule 6).

`python -m agent.bench.loadgen --target IP:PORT --mode rate --rate R
--connections C --duration S` runs inside the client pod (started with
`LabPod.spawn`, so its CPU is not the proxy's) and prints one JSON object:
`{"requests", "errors", "error_kinds", "elapsed_s", "hist"}` (hist:
`agent.bench.hist`; error_kinds: what each error was, counted, rule 4).

Rules:
1. `rate`: request i is due at `t0 + i/R`; connection k of C keep-alive
   connections sends requests k, k+C, k+2C... A connection that is still
   waiting for a response sends its next request late, and that request's
   latency counts from its *due* time (coordinated omission corrected). Timers
   here have about 1 ms resolution, so a request may go out up to `EARLY_S`
   before it is due; its latency then counts from when it was really sent:
   latency = done - min(due, sent).
2. `conn`: C loops each open a connection, send one `Connection: close`
   request, read the whole response and close; latency is connect to response.
   `rr`: C keep-alive connections each send a request as soon as the last
   response arrived (closed loop, no schedule); latency is send to response.
   With C=1 that is the bare request/response latency of the path.
3. The run stops itself after `--duration` seconds (plus at most one response
   timeout); nothing is recorded during `--warmup`.
4. Every error is counted under its kind (`error_kind`): `status N` for a 5xx
   response, `unsent` for requests a stalled connection never sent before the
   end, else the exception's type and message (the connection failed).
5. `side`: rule 1's constant rate over several paths side by side (`--path
   NAME=IP:PORT`, repeated), in slices of `--slice` seconds that take turns
   (`slice_plan`): every cycle gives each path one slice, in an order shuffled
   per cycle (seeded), and no path has two slices in a row. Each path has its
   own C keep-alive connections, open for the whole run, and its own counts;
   only the path whose slice it is sends, at R requests/s. A request still
   owed when its slice ends is sent late and counted from its due time, as in
   rule 1. A first cycle of `--warmup` seconds per path is not recorded. So
   the machine's slow moments fall on every path alike, and one run compares
   the paths' latency without the minutes between separate runs. The JSON is
   `{"paths": {NAME: <rule 3's object> + "warmup_requests"}, "slice_s", "cycles"}`.
6. `--proto echo --size B` (side mode): each request is B bytes of opaque TCP
   (no HTTP) that the server sends back unchanged (agent.bench.server rule 4),
   netperf TCP_RR's exchange; a request is done when all B bytes came back
   (`EchoReader`), its latency counted as rule 1 says. Bytes that differ from
   what was sent, or arrive when nothing is owed, fail the connection (rule 4).
   Everything else (turns, rate, connections, histogram, JSON) is rule 5's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

import httptools

from agent import aio
from agent.bench.hist import Histogram

EARLY_S = 0.001
RESPONSE_TIMEOUT_S = 5.0


def request_bytes(host: str, path: str = "/", *, close: bool = False) -> bytes:
    conn = "Connection: close\r\n" if close else ""
    return f"GET {path} HTTP/1.1\r\nHost: {host}\r\n{conn}\r\n".encode()


class EchoError(Exception):
    """An echo exchange got bytes it did not send, or bytes when nothing was owed."""


class EchoReader:
    """Rule 6's framing of one echo connection, pure: `sent(data)` says what is owed,
    `received(data)` takes what came back and says whether all of it has."""

    def __init__(self) -> None:
        self.owed = b""  # what the server has yet to send back, in order

    def sent(self, data: bytes) -> None:
        self.owed += data

    def received(self, data: bytes) -> bool:
        """Whether `data` completes what is owed.

        Raises:
            EchoError: `data` is not the start of what is owed (wrong bytes, or more
                than was sent).
        """
        if not self.owed.startswith(data):
            what = "more than was sent" if len(data) > len(self.owed) else "other bytes"
            raise EchoError(f"echo returned {what} ({len(data)} bytes, {len(self.owed)} owed)")
        self.owed = self.owed[len(data) :]
        return not self.owed


def echo_payload(size: int) -> bytes:
    """Rule 6's request: `size` bytes of a printable pattern (checked when echoed).

    Raises:
        ValueError: `size` is not positive.
    """
    if size < 1:
        raise ValueError(f"an echo request needs at least one byte, got --size {size}")
    pattern = b"meshagent-bench-echo "
    return (pattern * (size // len(pattern) + 1))[:size]


class _Exchanger(asyncio.Protocol):
    """One keep-alive connection; `ask()` sends a request and awaits its answer, which a
    subclass's `data_received` recognizes (`_answered`)."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.waiter: asyncio.Future[int] | None = None
        self.closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment] # uvloop's is not a subclass

    def failure(self) -> str | None:
        """The last answer's error kind (rule 4), None when it was a good one."""
        return None

    def _answered(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(time.perf_counter_ns())

    def eof_received(self) -> bool:
        self._fail(ConnectionError("closed by peer"))
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(exc or ConnectionError("connection lost"))
        if not self.closed.done():
            self.closed.set_result(None)

    def _fail(self, exc: BaseException) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(exc)

    async def ask(self, data: bytes) -> int:
        """Send `data`, wait for one full answer: its completion time (perf ns)."""
        assert self.transport is not None  # noqa: S101 - after connection_made
        self.waiter = asyncio.get_running_loop().create_future()
        self.transport.write(data)
        async with asyncio.timeout(RESPONSE_TIMEOUT_S):
            return await self.waiter


class _Client(_Exchanger):
    """One HTTP/1.1 connection: a request in, a response back."""

    def __init__(self) -> None:
        super().__init__()
        self.parser = httptools.HttpResponseParser(self)
        self.status = 0

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(exc)

    def on_message_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self._answered()

    def failure(self) -> str | None:
        return f"status {self.status}" if self.status >= 500 or self.status == 0 else None


class _EchoClient(_Exchanger):
    """One opaque TCP connection whose server echoes (rule 6)."""

    def __init__(self) -> None:
        super().__init__()
        self.reader = EchoReader()

    def data_received(self, data: bytes) -> None:
        try:
            done = self.reader.received(data)
        except EchoError as exc:
            self._fail(exc)
            return
        if done:
            self._answered()

    async def ask(self, data: bytes) -> int:
        self.reader.sent(data)
        return await super().ask(data)


Proto = Callable[[], _Exchanger]  # a connection's protocol: `_Client`, `_EchoClient`
PROTOS: Final[dict[str, Proto]] = {"http": _Client, "echo": _EchoClient}
# what may end one exchange (rule 4); anything else is a bug
_EXCHANGE_ERRORS = (OSError, TimeoutError, httptools.HttpParserError, EchoError)


class Run:
    """What one load run counted."""

    def __init__(self) -> None:
        self.hist = Histogram()
        self.requests = 0
        self.errors = 0
        self.kinds: dict[str, int] = {}  # rule 4
        self.record_from = 0  # perf ns; earlier completions are warm-up

    def fail(self, kind: str, n: int = 1) -> None:
        self.errors += n
        self.kinds[kind] = self.kinds.get(kind, 0) + n

    def done(self, due_ns: int, sent_ns: int, done_ns: int, failure: str | None) -> None:
        """One answer, done at `done_ns`; `failure` its error kind (rule 4) if bad."""
        if done_ns < self.record_from:
            return
        if failure is not None:
            self.fail(failure)
            return
        self.requests += 1
        self.hist.record((done_ns - min(due_ns, sent_ns)) // 1000)

    def to_dict(self, elapsed_s: float) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "errors": self.errors,
            "error_kinds": self.kinds,
            "elapsed_s": elapsed_s,
            "hist": self.hist.to_dict(),
        }


async def _connect(host: str, port: int, proto: Proto) -> _Exchanger:
    loop = asyncio.get_running_loop()
    async with asyncio.timeout(RESPONSE_TIMEOUT_S):
        _, client = await loop.create_connection(proto, host, port)
    return client


async def _paced_conn(  # noqa: PLR0913, PLR0917 - one connection's share of the schedule
    host: str,
    port: int,
    req: bytes,
    slices: list[tuple[int, int, Run]],
    first_ns: int,
    step_ns: int,
    end_ns: int,
    proto: Proto = _Client,
) -> None:
    """Connection k's share of a schedule (rules 1 and 5): within each slice (absolute
    perf ns start and end, and the `Run` it records into) a request due `first_ns` after
    its start and every `step_ns` after that; what is still owed when the whole load
    ends (`end_ns`) is unsent (the target stalled). `proto`: HTTP, or echo (rule 6)."""
    client: _Exchanger | None = None
    for start, end, run in slices:
        due = start + first_ns
        while due < end:
            now = time.perf_counter_ns()
            if now > end_ns:
                run.fail("unsent", (end - due) // step_ns + 1)
                break
            if due - now > EARLY_S * 1e9:
                await asyncio.sleep((due - now) / 1e9 - EARLY_S)
            client = await _exchange(run, client, (host, port, proto), req, due_ns=due)
            due += step_ns
    _close(client)


async def _exchange(
    run: Run,
    client: _Exchanger | None,
    where: tuple[str, int, Proto],
    req: bytes,
    *,
    due_ns: int | None,
) -> _Exchanger | None:
    """One request on `client` (connected first to `where`, host, port and protocol, if
    needed), recorded in `run` as due at `due_ns` (None: when sent); the client to use
    next, None after a failure."""
    try:
        if client is None or client.closed.done():
            client = await _connect(*where)
        sent = time.perf_counter_ns()
        done = await client.ask(req)
        run.done(sent if due_ns is None else due_ns, sent, done, client.failure())
    except _EXCHANGE_ERRORS as exc:
        run.fail(error_kind(exc))
        if client is not None and client.transport is not None:
            client.transport.abort()
        return None
    return client


def error_kind(exc: BaseException) -> str:
    """Rule 4: a failed exchange's kind (its exception's type and message, shortened)."""
    text = str(exc)
    return f"{type(exc).__name__}: {text}"[:80] if text else type(exc).__name__


def _close(client: _Exchanger | None) -> None:
    if client is not None and client.transport is not None:
        client.transport.close()


async def run_rate(  # noqa: PLR0913 - the load's knobs
    host: str, port: int, *, rate: float, connections: int, duration: float, warmup: float = 0.0
) -> dict[str, Any]:
    """Constant-rate keep-alive load (module rule 1)."""
    run = Run()
    req = request_bytes(host)
    interval_ns = int(1e9 / rate)
    t0 = time.perf_counter_ns() + 50_000_000  # 50 ms to open the connections
    run.record_from = t0 + int(warmup * 1e9)
    end = run.record_from + int(duration * 1e9)
    tasks = [
        aio.spawn(
            _paced_conn(
                host, port, req, [(t0, end, run)], k * interval_ns, interval_ns * connections, end
            ),
            name=f"conn-{k}",
        )
        for k in range(connections)
    ]
    await asyncio.gather(*tasks)
    elapsed = (time.perf_counter_ns() - run.record_from) / 1e9
    return run.to_dict(min(elapsed, duration) if elapsed > 0 else duration)


async def _conn_loop(run: Run, host: str, port: int, req: bytes, end_ns: int) -> None:
    loop = asyncio.get_running_loop()
    while time.perf_counter_ns() < end_ns:
        start = time.perf_counter_ns()
        try:
            async with asyncio.timeout(RESPONSE_TIMEOUT_S):
                transport, client = await loop.create_connection(_Client, host, port)
            try:
                done = await client.ask(req)
                run.done(start, start, done, client.failure())
            finally:
                transport.close()
        except (OSError, TimeoutError, httptools.HttpParserError) as exc:
            run.fail(error_kind(exc))
            await asyncio.sleep(0.01)


async def run_conn(
    host: str, port: int, *, connections: int, duration: float, warmup: float = 0.0
) -> dict[str, Any]:
    """New-connection load (module rule 2)."""
    run = Run()
    req = request_bytes(host, close=True)
    run.record_from = time.perf_counter_ns() + int(warmup * 1e9)
    end = run.record_from + int(duration * 1e9)
    tasks = [
        aio.spawn(_conn_loop(run, host, port, req, end), name=f"conn-{k}")
        for k in range(connections)
    ]
    await asyncio.gather(*tasks)
    return run.to_dict(duration)


async def _rr_conn(run: Run, host: str, port: int, req: bytes, end_ns: int) -> None:
    client: _Exchanger | None = None
    while time.perf_counter_ns() < end_ns:
        client = await _exchange(run, client, (host, port, _Client), req, due_ns=None)
        if client is None:
            await asyncio.sleep(0.01)
    _close(client)


async def run_rr(
    host: str, port: int, *, connections: int, duration: float, warmup: float = 0.0
) -> dict[str, Any]:
    """Closed-loop keep-alive request/response load (module rule 2, `rr`)."""
    run = Run()
    req = request_bytes(host)
    run.record_from = time.perf_counter_ns() + int(warmup * 1e9)
    end = run.record_from + int(duration * 1e9)
    tasks = [
        aio.spawn(_rr_conn(run, host, port, req, end), name=f"rr-{k}") for k in range(connections)
    ]
    await asyncio.gather(*tasks)
    return run.to_dict(duration)


@dataclass(frozen=True, slots=True)
class Slice:
    """One turn of rule 5: path `path` sends from `start_s` to `end_s` (seconds from the
    run's start); `recorded` False for the warm-up cycle."""

    path: int
    start_s: float
    end_s: float
    recorded: bool


def slice_plan(
    paths: int, *, duration: float, slice_s: float, warmup: float = 0.0, seed: int = 0
) -> list[Slice]:
    """Rule 5's schedule, pure: a warm-up cycle of `warmup` seconds per path (none when
    0), then `ceil(duration / slice_s)` cycles of `slice_s` seconds per path, the last
    slices shortened so each path gets exactly `duration` recorded seconds.

    Raises:
        ValueError: no paths, or a non-positive duration or slice.
    """
    if paths < 1 or duration <= 0 or slice_s <= 0:
        why = f"{paths} paths, {duration}s each in {slice_s}s slices"
        raise ValueError(f"a side-by-side load needs paths, time and slices; got {why}")
    rng = random.Random(seed)  # noqa: S311 - a schedule, not a secret
    plan: list[Slice] = []
    t = 0.0
    last = -1

    def cycle(length: float, *, recorded: bool) -> None:
        nonlocal t, last
        order = list(range(paths))
        rng.shuffle(order)
        if paths > 1 and order[0] == last:  # no path twice in a row
            order[0], order[-1] = order[-1], order[0]
        for path in order:
            plan.append(Slice(path, t, t + length, recorded))
            t += length
        last = order[-1]

    if warmup > 0:
        cycle(warmup, recorded=False)
    cycles = math.ceil(duration / slice_s - 1e-9)
    for n in range(cycles):
        cycle(min(slice_s, duration - n * slice_s), recorded=True)
    return plan


async def run_side(  # noqa: PLR0913 - the load's knobs
    paths: list[tuple[str, str, int]],
    *,
    rate: float,
    connections: int,
    duration: float,
    slice_s: float,
    warmup: float = 0.0,
    seed: int = 0,
    proto: str = "http",
    size: int = 64,
) -> dict[str, Any]:
    """Constant rate over `paths` (name, host, port) taking turns (module rule 5), of
    HTTP/1.1 requests or, with `proto` "echo", `size` bytes echoed (rule 6)."""
    plan = slice_plan(len(paths), duration=duration, slice_s=slice_s, warmup=warmup, seed=seed)
    interval_ns = int(1e9 / rate)
    t0 = time.perf_counter_ns() + 200_000_000  # 200 ms to open every path's connections
    runs = [Run() for _ in paths]
    warms = [Run() for _ in paths]  # the warm-up cycle's counts
    end_all = t0 + round(plan[-1].end_s * 1e9)
    tasks = []
    for i, (name, host, port) in enumerate(paths):
        mine = [
            (
                t0 + round(s.start_s * 1e9),
                t0 + round(s.end_s * 1e9),
                runs[i] if s.recorded else warms[i],
            )
            for s in plan
            if s.path == i
        ]
        req = echo_payload(size) if proto == "echo" else request_bytes(host)
        for k in range(connections):
            step = interval_ns * connections
            conn = _paced_conn(host, port, req, mine, k * interval_ns, step, end_all, PROTOS[proto])
            tasks.append(aio.spawn(conn, name=f"{name}-{k}"))
    await asyncio.gather(*tasks)
    recorded = [s for s in plan if s.recorded]
    seconds = sum(s.end_s - s.start_s for s in recorded) / len(paths)
    out = {name: run.to_dict(seconds) for (name, _, _), run in zip(paths, runs, strict=True)}
    for (name, _, _), warm in zip(paths, warms, strict=True):
        out[name]["warmup_requests"] = warm.requests
    return {"paths": out, "slice_s": slice_s, "cycles": len(recorded) // len(paths)}


def parse_path(text: str) -> tuple[str, str, int]:
    """`NAME=IP:PORT` -> (name, ip, port).

    Raises:
        ValueError: not of that form; the message quotes it.
    """
    name, eq, target = text.partition("=")
    host, colon, port = target.rpartition(":")
    if not eq or not name or not colon or not host or not port.isdigit():
        raise ValueError(f"--path wants NAME=IP:PORT, got {text!r}")
    return name, host, int(port)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m agent.bench.loadgen")
    p.add_argument("--target", metavar="IP:PORT")
    p.add_argument("--path", action="append", default=[], metavar="NAME=IP:PORT")
    p.add_argument("--mode", choices=["rate", "conn", "rr", "side"], default="rate")
    p.add_argument("--rate", type=float, default=1000.0)
    p.add_argument("--connections", type=int, default=16)
    p.add_argument("--duration", type=float, default=5.0)
    p.add_argument("--warmup", type=float, default=0.0)
    p.add_argument("--slice", type=float, default=1.0, help="side: seconds per turn")
    p.add_argument("--seed", type=int, default=0, help="side: the turns' shuffle")
    p.add_argument("--proto", choices=sorted(PROTOS), default="http", help="side: rule 6")
    p.add_argument("--size", type=int, default=64, help="side, echo: bytes per request")
    args = p.parse_args(argv)
    if args.proto != "http" and args.mode != "side":
        p.error(f"--proto {args.proto} runs in --mode side only, got --mode {args.mode}")
    if args.size < 1:
        p.error(f"--size must be at least 1 byte, got {args.size}")
    if args.mode == "side":
        if len(args.path) < 2:
            p.error("--mode side needs two or more --path NAME=IP:PORT")
        try:
            args.paths = [parse_path(x) for x in args.path]
        except ValueError as exc:
            p.error(str(exc))
        if len({name for name, _, _ in args.paths}) != len(args.paths):
            p.error(f"--path names must differ, got {', '.join(args.path)}")
    elif args.target is None:
        p.error(f"--mode {args.mode} needs --target IP:PORT")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.mode == "side":
        side = run_side(
            args.paths,
            rate=args.rate,
            connections=args.connections,
            duration=args.duration,
            slice_s=args.slice,
            warmup=args.warmup,
            seed=args.seed,
            proto=args.proto,
            size=args.size,
        )
        sys.stdout.write(json.dumps(aio.run(side)) + "\n")
        return 0
    host, _, port_text = args.target.rpartition(":")
    port = int(port_text)
    if args.mode == "rate":
        coro = run_rate(
            host,
            port,
            rate=args.rate,
            connections=args.connections,
            duration=args.duration,
            warmup=args.warmup,
        )
    else:
        run = run_conn if args.mode == "conn" else run_rr
        coro = run(
            host, port, connections=args.connections, duration=args.duration, warmup=args.warmup
        )
    result = aio.run(coro)
    sys.stdout.write(json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
