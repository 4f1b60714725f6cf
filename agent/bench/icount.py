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

`--tls` puts mutual TLS on the hop between the proxy and the server, both ends on
agent.proxy.tlsio as in a cross-node hop: the proxy's pooled connection is opened by
`upstream.open_transport` (the outbound side), the server terminates with `TlsTransport`
as inbound does. The count then prices the record layer's Python and OpenSSL's work for
both ends of one hop.

`--run N` (what the two valgrind runs execute) serves N requests and prints how many the
callback path answered.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import socket
import subprocess
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import uvloop

from agent import native
from agent.proxy import httpproxy, upstream
from agent.proxy.h1plan import Router
from agent.proxy.tlsio import TlsTransport
from agent.proxy.upstream import ConnPool

if TYPE_CHECKING:
    import ssl
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


class _TlsAccept(asyncio.Protocol):
    """Terminates mTLS as inbound does (`TlsTransport`, server side), then serves `_Server`."""

    sessions = 0  # handshakes completed, in this process

    def __init__(self, ctx: ssl.SSLContext, tasks: list[asyncio.Task[None]]) -> None:
        self.ctx = ctx
        self.tasks = tasks

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        tlsx = TlsTransport(transport, self.ctx, server_side=True)  # type: ignore[arg-type]
        self.tasks.append(asyncio.get_running_loop().create_task(self._serve(tlsx)))

    @staticmethod
    async def _serve(tlsx: TlsTransport) -> None:
        await tlsx.handshake(10)
        _TlsAccept.sessions += 1
        proto = _Server()
        tlsx.set_protocol(proto)
        proto.connection_made(tlsx)
        tlsx.resume_reading()


class _Upstreams:
    """The worker's upstream sockets (agent.proxy.worker), for `open_transport`."""

    @staticmethod
    async def get(_netns: str) -> socket.socket:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)  # noqa: FBT003 - the socket API
        return sock


def tls_contexts(directory: Path) -> tuple[ssl.SSLContext, ssl.SSLContext, str]:
    """Client and server mTLS contexts from a fresh mesh CA in `directory`, and the
    server's identity (what the client expects)."""
    from agent.identity import ca  # noqa: PLC0415 - only with --tls
    from agent.identity.names import Identity  # noqa: PLC0415
    from agent.identity.tls import client_context, server_context  # noqa: PLC0415

    now = datetime.now(UTC)
    issuer = ca.create_mesh(directory, now=now)
    made: list[ssl.SSLContext] = []
    server = Identity(sa="api", ns="shop")
    sides = ((Identity(sa="web", ns="shop"), client_context), (server, server_context))
    for identity, context in sides:
        chain, key, _ = issuer.workload(identity, now=now)
        made.append(context(chain, key, issuer.bundle.pem))
    return made[0], made[1], server.dns_name


class _Router(Router):
    """Every request to the server (agent.proxy.h1plan's Router, subclassed in Python)."""

    def __init__(self, port: int, tls: tuple[ssl.SSLContext, str] | None = None) -> None:
        super().__init__("outbound")
        worker = SimpleNamespace(upstreams=_Upstreams(), connect_timeout=10.0)

        async def opener(factory: Any) -> tuple[asyncio.Transport, Any]:
            if tls is None:
                return await asyncio.get_running_loop().create_connection(factory, HOST, port)
            return await upstream.open_transport(
                worker,  # type: ignore[arg-type]
                factory,
                netns="",
                addr=(HOST, port),
                ssl_ctx=tls[0],
                expect_identity=tls[1],
            )

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
    from agent.proxy.wstate import WorkerState  # noqa: PLC0415

    worker = SimpleNamespace(worker_id=0, state=WorkerState(lambda _need: None))
    observer = Observer(worker)  # type: ignore[arg-type]
    record.RECORDER = observer

    def counted() -> int:
        samples = observer.m.snapshot().families.get("request_total", {})
        return int(sum(v for v in samples.values() if isinstance(v, (int, float))))

    return counted


async def serve(
    requests: int, connections: int, tls: tuple[ssl.SSLContext, ssl.SSLContext, str] | None = None
) -> tuple[int, int]:
    """Serve `requests` (split over `connections`), with mTLS to the server when `tls`
    (client context, server context, server identity) is given; (requests answered, by
    callbacks)."""
    loop = asyncio.get_running_loop()
    tasks: list[asyncio.Task[None]] = []
    if tls is None:
        server = await loop.create_server(_Server, HOST, 0)
        router = _Router(server.sockets[0].getsockname()[1])
    else:
        server = await loop.create_server(lambda: _TlsAccept(tls[1], tasks), HOST, 0)
        router = _Router(server.sockets[0].getsockname()[1], (tls[0], tls[2]))
    pool = ConnPool()
    conns: list[httpproxy.HttpConn] = []

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


def count(requests: int, connections: int, recorder: str, *, tls: bool) -> int:
    """Instructions callgrind counted for one `--run requests` process."""
    argv = ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null"]
    argv += [sys.executable, "-m", "agent.bench.icount", "--run", str(requests)]
    argv += ["--connections", str(connections), "--recorder", recorder]
    argv += ["--tls"] if tls else []
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
    ap.add_argument("--tls", action="store_true", help="mTLS between the proxy and the server")
    args = ap.parse_args(argv)
    if args.connections < 1:
        ap.error("--connections must be at least 1")
    if args.run:
        counted = observe() if args.recorder == "observe" else None
        with tempfile.TemporaryDirectory(prefix="icount-") as tmp:
            tls = tls_contexts(Path(tmp)) if args.tls else None
        answered, fast = uvloop.run(serve(args.run, args.connections, tls))
        line = f"native={native.STATE} requests={answered} callback_path={fast}"
        if counted is not None:
            line += f" recorded={counted()}"
        if tls is not None:
            line += f" tls_sessions={_TlsAccept.sessions}"
        sys.stdout.write(line + "\n")
        return 0
    try:
        low, high = (int(x) for x in args.requests.split(","))
    except ValueError:
        ap.error(f"--requests: two counts a,b, not {args.requests!r}")
    if not 0 < low < high:
        ap.error(f"--requests: need 0 < a < b, got {low},{high}")
    a = count(low, args.connections, args.recorder, tls=args.tls)
    b = count(high, args.connections, args.recorder, tls=args.tls)
    per = (b - a) / (high - low)
    sys.stdout.write(
        f"native={native.STATE}{' tls' if args.tls else ''} instructions per request: {per:,.0f}"
        f" ({a:,} at {low} requests, {b:,} at {high})\n"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
