"""Instructions per request of the HTTP/1 callback path, counted by callgrind.

`python -m agent.bench.icount` runs itself twice under `valgrind --tool=callgrind`
(`--requests 2000,6000`) and prints the difference of the two instruction totals over the
difference of the requests: the user-space instructions one request costs, start-up and
imports cancelled out. One process, one uvloop loop: `--connections` client connections
send the same keep-alive GET one after another to an `HttpConn` (agent.proxy.httpproxy)
whose router sends it to an in-loop server's pooled connection, so after the first request
each one is served by the callback path (module rule 7), as a worker serves wrk.

Why: the lab's rates swing by 10-25% between minutes on a shared machine, which hides a
change of a few percent; an instruction count does not move (the same build counted
twice differs by less than 0.05%). It counts user space only (the kernel's share of a
request is outside it) and runs the proxy with a plain router, so it prices the HTTP/1
machinery, not routing or policy. `--recorder observe` records into the workers' real
recorder (agent.admin.observe's `Observer`, on a stand-in worker with an empty state)
instead of the no-op one, pricing the metrics too.

`--run N` (what the two valgrind runs execute) serves N requests and prints how many the
callback path answered.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import subprocess
import sys
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import uvloop

from agent import native
from agent.proxy import httpproxy
from agent.proxy.upstream import ConnPool

if TYPE_CHECKING:
    from collections.abc import Callable

    from agent.proxy.http1 import RequestHead

HOST = "127.0.0.1"
REQUEST = b"GET /hi HTTP/1.1\r\nHost: api.shop.svc.cluster.local:8080\r\nUser-Agent: icount\r\n\r\n"
RESPONSE = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Type: text/plain\r\n\r\nok"
_COLLECTED = re.compile(r"Collected\s*:\s*([\d,]+)")


class _Server(asyncio.Protocol):
    """Answers every request head it reads with RESPONSE."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        assert self.transport is not None  # noqa: S101 - connected
        self.transport.write(RESPONSE * data.count(b"\r\n\r\n"))


class _Router:
    """Every request to the server (agent.proxy.h1plan's Router)."""

    direction = "outbound"

    def __init__(self, port: int) -> None:
        async def opener(factory: Any) -> tuple[asyncio.Transport, Any]:
            return await asyncio.get_running_loop().create_connection(factory, HOST, port)

        labels = {"direction": "outbound", "authority": "icount"}
        target = httpproxy.Target(key=("icount", port), open=opener, labels=labels)
        self.plan_ = httpproxy.Plan(choose=lambda _attempt: target, labels=labels)

    def plan_now(self, head: RequestHead) -> httpproxy.Plan:  # noqa: ARG002 - Router API
        return self.plan_

    async def plan(self, head: RequestHead) -> httpproxy.Plan:  # noqa: ARG002 - Router API
        return self.plan_

    def close(self) -> None:
        pass


class _Client(asyncio.Protocol):
    """Sends REQUEST, then again on each response, `left` times."""

    def __init__(self, left: int, done: asyncio.Future[None]) -> None:
        self.left = left
        self.done = done
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        tr: asyncio.Transport = transport  # type: ignore[assignment]
        self.transport = tr
        tr.write(REQUEST)

    def data_received(self, data: bytes) -> None:
        assert self.transport is not None  # noqa: S101 - connected
        self.left -= data.count(b"HTTP/1.1 200 ")
        if self.left > 0:
            self.transport.write(REQUEST)
        elif not self.done.done():
            self.done.set_result(None)


def _client_factory(left: int, done: asyncio.Future[None]) -> Callable[[], _Client]:
    return lambda: _Client(left, done)


def observe() -> Callable[[], int]:
    """Record into the workers' `Observer` (on a stand-in worker) from now on; returns a
    function that tells how many requests it has counted (`request_total`)."""
    from agent.admin.observe import Observer  # noqa: PLC0415 - only when asked
    from agent.proxy import record  # noqa: PLC0415
    from agent.proxy.worker import WorkerState  # noqa: PLC0415

    worker = SimpleNamespace(worker_id=0, state=WorkerState(lambda _need: None))
    observer = Observer(worker)  # type: ignore[arg-type]
    record.RECORDER = observer

    def counted() -> int:
        samples = observer.m.snapshot().families.get("request_total", {})
        return int(sum(v for v in samples.values() if isinstance(v, (int, float))))

    return counted


async def serve(requests: int, connections: int) -> tuple[int, int]:
    """Serve `requests` (split over `connections`); (requests answered, by callbacks)."""
    loop = asyncio.get_running_loop()
    server = await loop.create_server(_Server, HOST, 0)
    router = _Router(server.sockets[0].getsockname()[1])
    pool = ConnPool()
    conns: list[httpproxy.HttpConn] = []
    tasks: list[asyncio.Task[None]] = []

    class _Accept(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            conn = httpproxy.HttpConn(transport, router, pool)  # type: ignore[arg-type]
            conn.attach(b"")
            conns.append(conn)
            tasks.append(loop.create_task(conn.serve()))

    proxy = await loop.create_server(_Accept, HOST, 0)
    port = proxy.sockets[0].getsockname()[1]
    each = max(1, requests // connections)
    dones: list[asyncio.Future[None]] = []
    clients: list[asyncio.Transport] = []
    try:
        for _ in range(connections):
            done = loop.create_future()
            dones.append(done)
            tr, _ = await loop.create_connection(_client_factory(each, done), HOST, port)
            clients.append(tr)
        await asyncio.wait_for(asyncio.gather(*dones), 120)
    finally:
        for tr in clients:
            tr.close()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        pool.close()
        proxy.close()
        server.close()
    return sum(c.requests for c in conns), sum(c.callback_requests for c in conns)


def count(requests: int, connections: int, recorder: str) -> int:
    """Instructions callgrind counted for one `--run requests` process."""
    argv = ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null"]
    argv += [sys.executable, "-m", "agent.bench.icount", "--run", str(requests)]
    argv += ["--connections", str(connections), "--recorder", recorder]
    done = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=900)
    found = _COLLECTED.search(done.stderr)
    if done.returncode != 0 or found is None:
        raise SystemExit(f"icount: callgrind run failed ({done.returncode}): {done.stderr[-800:]}")
    return int(found.group(1).replace(",", ""))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m agent.bench.icount", description=__doc__)
    ap.add_argument("--requests", default="2000,6000", help="two request counts, a,b (a < b)")
    ap.add_argument("--connections", type=int, default=4)
    ap.add_argument("--run", type=int, default=0, help="serve N requests, no callgrind")
    ap.add_argument("--recorder", choices=("none", "observe"), default="none")
    args = ap.parse_args(argv)
    if args.connections < 1:
        ap.error("--connections must be at least 1")
    if args.run:
        counted = observe() if args.recorder == "observe" else None
        answered, fast = uvloop.run(serve(args.run, args.connections))
        line = f"native={native.STATE} requests={answered} callback_path={fast}"
        if counted is not None:
            line += f" recorded={counted()}"
        sys.stdout.write(line + "\n")
        return 0
    try:
        low, high = (int(x) for x in args.requests.split(","))
    except ValueError:
        ap.error(f"--requests: two counts a,b, not {args.requests!r}")
    if not 0 < low < high:
        ap.error(f"--requests: need 0 < a < b, got {low},{high}")
    a = count(low, args.connections, args.recorder)
    b = count(high, args.connections, args.recorder)
    per = (b - a) / (high - low)
    sys.stdout.write(
        f"native={native.STATE} instructions per request: {per:,.0f}"
        f" ({a:,} at {low} requests, {b:,} at {high})\n"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
