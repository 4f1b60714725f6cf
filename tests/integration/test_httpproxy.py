"""agent.proxy.httpproxy over real sockets on 127.0.0.1: both paths (coroutine and callbacks).

A client socket talks to an `HttpConn` (accepted on a real listener) whose
router sends every request to a small scripted HTTP/1.1 server. The tests run
on asyncio's loop and on uvloop (the workers' loop). Module rule 7 (the
callback path) must keep rules 1-6; `HttpConn.callback_requests` shows which
path served a request.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from agent.proxy import httpproxy, record
from agent.proxy.h1client import ClientSide
from agent.proxy.h1plan import Router
from agent.proxy.http1 import RequestHead, RequestParser, ResponseParser
from agent.proxy.upstream import ConnPool

HOST = "127.0.0.1"
OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"


Run = Callable[[Callable[[], Coroutine[Any, Any, None]]], None]


# --- a scripted upstream ----------------------------------------------------------------


class _Server(asyncio.Protocol):
    """Answers each request by `script(path) -> bytes | None` (None: close at once)."""

    def __init__(self, up: Upstream) -> None:
        self.up = up
        self.buf = b""
        self.tr: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.tr = transport  # type: ignore[assignment]
        self.up.conns.append(self)

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while b"\r\n\r\n" in self.buf:
            head, _, rest = self.buf.partition(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
                if name.strip().lower() == b"transfer-encoding":  # only tiny chunked bodies here
                    if b"0\r\n\r\n" not in rest:
                        return
                    length = rest.index(b"0\r\n\r\n") + 5
            if len(rest) < length:
                return
            body, self.buf = rest[:length], rest[length:]
            path = head.split(b" ")[1]
            self.up.seen.append((head, body))
            answer = self.up.script(path)
            assert self.tr is not None
            if answer is None:
                self.tr.close()
                return
            self.tr.write(answer)

    def connection_lost(self, exc: Exception | None) -> None:  # noqa: ARG002 - Protocol API
        self.up.closed += 1


@dataclass
class Upstream:
    script: Callable[[bytes], bytes | None]
    port: int = 0
    conns: list[_Server] = field(default_factory=list)
    seen: list[tuple[bytes, bytes]] = field(default_factory=list)
    closed: int = 0


class _Router(Router):
    """Every request to the upstream; /deny answered 403 by the router itself."""

    def __init__(self, port: int) -> None:
        super().__init__("outbound")

        async def opener(factory: Any) -> tuple[asyncio.Transport, Any]:
            loop = asyncio.get_running_loop()
            return await loop.create_connection(factory, HOST, port)

        self.labels = {"direction": "outbound", "authority": "web"}
        self.target = httpproxy.Target(key=("up", port), open=opener, labels=self.labels)
        self.plan_ = httpproxy.Plan(choose=lambda _attempt: self.target, labels=self.labels)
        self.closed = False

    def plan_now(self, head: RequestHead) -> httpproxy.Plan | httpproxy.Reject:
        if head.target == b"/deny":
            return httpproxy.reject(403, "denied by test")
        return self.plan_

    async def plan(self, head: RequestHead) -> httpproxy.Plan | httpproxy.Reject:
        return self.plan_now(head)

    def close(self) -> None:
        self.closed = True


@dataclass
class Proxy:
    port: int
    pool: ConnPool
    conns: list[httpproxy.HttpConn] = field(default_factory=list)
    tasks: list[asyncio.Task[None]] = field(default_factory=list)


@contextlib.asynccontextmanager
async def _world(script: Callable[[bytes], bytes | None]) -> AsyncIterator[tuple[Upstream, Proxy]]:
    loop = asyncio.get_running_loop()
    up = Upstream(script)
    srv = await loop.create_server(lambda: _Server(up), HOST, 0)
    up.port = srv.sockets[0].getsockname()[1]
    pool = ConnPool()
    router = _Router(up.port)
    proxy = Proxy(port=0, pool=pool)

    async def serve(tr: asyncio.Transport) -> None:
        record.CONN.set(("conn", len(proxy.conns)))
        conn = httpproxy.HttpConn(tr, router, pool)
        proxy.conns.append(conn)
        conn.attach(b"")
        await conn.serve()

    class _Accept(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            transport.pause_reading()  # type: ignore[attr-defined]
            proxy.tasks.append(loop.create_task(serve(transport)))  # type: ignore[arg-type]

    psrv = await loop.create_server(_Accept, HOST, 0)
    proxy.port = psrv.sockets[0].getsockname()[1]
    try:
        yield up, proxy
    finally:
        psrv.close()
        for t in proxy.tasks:
            t.cancel()
        await asyncio.gather(*proxy.tasks, return_exceptions=True)
        pool.close()
        srv.close()
        for c in up.conns:
            if c.tr is not None:
                c.tr.abort()
        await psrv.wait_closed()
        await asyncio.sleep(0)


async def _read_responses(
    reader: asyncio.StreamReader, n: int, methods: list[bytes] | None = None
) -> list[tuple[int, bytes, bytes]]:
    """n responses as (status, head, body), parsed with the proxy's own response framing."""
    parser = ResponseParser(decode_chunked=True)
    for m in methods or [b"GET"] * n:
        parser.expect(m)
    out: list[tuple[int, bytes, bytes]] = []
    head: Any = None
    body = b""
    while len(out) < n:
        data = await asyncio.wait_for(reader.read(65536), 5)
        evs = parser.feed_eof() if not data else parser.feed(data)
        for ev in evs:
            name = type(ev).__name__
            if name == "ResponseHead":
                head, body = ev, b""
            elif name == "BodyData":
                body += bytes(ev.data)
            elif name == "MessageEnd":
                out.append((head.status, head.raw, body))
            else:
                raise AssertionError(f"unexpected {ev!r}")
        if not data:
            break
    return out


async def _get(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, path: bytes
) -> tuple[int, bytes, bytes]:
    """GET `path` on the open connection; its (status, head, body)."""
    writer.write(b"GET " + path + b" HTTP/1.1\r\nHost: web\r\n\r\n")
    [got] = await _read_responses(reader, 1)
    return got


def _ok(body: bytes, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\n" + extra + b"Content-Length: %d\r\n\r\n" % len(body) + body


# --- tests ------------------------------------------------------------------------------


def test_keepalive_requests_are_served_in_callbacks_on_one_pooled_connection(run: Run) -> None:
    async def body() -> None:
        async with _world(_ok) as (up, proxy):
            reader, writer = await asyncio.open_connection(HOST, proxy.port)
            for i in range(20):
                writer.write(b"GET /r%d HTTP/1.1\r\nHost: web\r\n\r\n" % i)
                [(status, _, body)] = await _read_responses(reader, 1)
                assert (status, body) == (200, b"/r%d" % i)
            conn = proxy.conns[0]
            assert conn.requests == 20
            # The first request opened the upstream connection (coroutine); the rest were callbacks.
            assert conn.callback_requests == 19
            assert len(up.conns) == 1
            writer.close()
            await writer.wait_closed()

    run(body)


def test_pipelined_mix_of_simple_and_streamed_requests_is_answered_in_order(run: Run) -> None:
    async def body() -> None:
        async with _world(_ok) as (up, proxy):
            reader, writer = await asyncio.open_connection(HOST, proxy.port)
            await _get(reader, writer, b"/warm")
            batch = (
                b"GET /a HTTP/1.1\r\nHost: web\r\n\r\n"
                b"POST /b HTTP/1.1\r\nHost: web\r\nContent-Length: 5\r\n\r\nhello"
                b"POST /c HTTP/1.1\r\nHost: web\r\nTransfer-Encoding: chunked\r\n\r\n"
                b"3\r\nabc\r\n0\r\n\r\n"
                b"GET /deny HTTP/1.1\r\nHost: web\r\n\r\n"
                b"GET /d HTTP/1.1\r\nHost: web\r\n\r\n"
            )
            writer.write(batch)
            got = await _read_responses(reader, 5)
            assert [(s, b) for s, _, b in got[:3]] == [(200, b"/a"), (200, b"/b"), (200, b"/c")]
            assert got[3][0] == 403
            assert b"l5d-proxy-error: denied by test" in got[3][1]
            assert (got[4][0], got[4][2]) == (200, b"/d")
            bodies = {h.split(b" ")[1]: b for h, b in up.seen}
            assert bodies[b"/b"] == b"hello"
            assert bodies[b"/c"] == b"3\r\nabc\r\n0\r\n\r\n"  # chunked passes through raw
            writer.close()
            await writer.wait_closed()

    run(body)


def test_pooled_connection_closed_while_idle_is_replaced_without_the_client_noticing(
    run: Run,
) -> None:
    async def body() -> None:
        async with _world(_ok) as (up, proxy):
            reader, writer = await asyncio.open_connection(HOST, proxy.port)
            await _get(reader, writer, b"/one")
            # The server closes the idle connection; the proxy has not noticed yet when the next
            # request comes (no loop turn between).
            first = up.conns[0]
            assert first.tr is not None
            first.tr.abort()
            (status, _, body) = await _get(reader, writer, b"/two")
            assert (status, body) == (200, b"/two")
            assert len(up.conns) == 2
            writer.close()
            await writer.wait_closed()

    run(body)


def test_dead_pooled_connection_found_on_send_hands_the_request_to_the_coroutine(run: Run) -> None:
    async def body() -> None:
        answers = iter([_ok(b"first"), None, _ok(b"again")])
        async with _world(lambda _path: next(answers)) as (up, proxy):
            reader, writer = await asyncio.open_connection(HOST, proxy.port)
            await _get(reader, writer, b"/one")
            # The pooled connection is taken by the callbacks, and the server closes it without
            # answering: the request is sent again on a fresh connection.
            writer.write(b"POST /two HTTP/1.1\r\nHost: web\r\nContent-Length: 3\r\n\r\nxyz")
            [(status, _, body)] = await _read_responses(reader, 1)
            assert (status, body) == (200, b"again")
            assert [b for h, b in up.seen if h.startswith(b"POST")] == [b"xyz", b"xyz"]
            assert len(up.conns) == 2
            writer.close()
            await writer.wait_closed()

    run(body)


def test_garbage_response_is_answered_502_and_the_client_connection_stays_usable(run: Run) -> None:
    async def body() -> None:
        answers = iter([_ok(b"x"), b"NOT HTTP AT ALL\r\n\r\n", _ok(b"fine")])
        async with _world(lambda _path: next(answers)) as (_up, proxy):
            reader, writer = await asyncio.open_connection(HOST, proxy.port)
            await _get(reader, writer, b"/1")
            (status, head, _) = await _get(reader, writer, b"/2")
            assert status == 502
            assert b"l5d-proxy-error" in head
            (status, _, body) = await _get(reader, writer, b"/3")
            assert (status, body) == (200, b"fine")
            assert proxy.conns[0].callback_requests == 1  # /2; /3 found the pool empty
            writer.close()
            await writer.wait_closed()

    run(body)


def test_upstream_dying_mid_body_aborts_the_client_and_nothing_else(run: Run) -> None:
    async def body() -> None:
        truncated = b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\npartial"
        answers = iter([_ok(b"x"), truncated])
        async with _world(lambda _path: next(answers)) as (up, proxy):
            reader, writer = await asyncio.open_connection(HOST, proxy.port)
            await _get(reader, writer, b"/1")
            writer.write(b"GET /2 HTTP/1.1\r\nHost: web\r\n\r\n")
            await asyncio.sleep(0.05)
            up.conns[0].tr.close()  # type: ignore[union-attr]
            data = b""
            with contextlib.suppress(ConnectionError):
                while chunk := await asyncio.wait_for(reader.read(65536), 5):
                    data += chunk
            assert data.startswith(b"HTTP/1.1 200 OK")
            assert data.endswith(b"partial")  # the rest never comes: the client sees the cut
            await asyncio.wait_for(proxy.tasks[0], 5)
            writer.close()

    run(body)


def test_upstream_close_is_hop_by_hop_and_a_client_close_ends_the_connection(run: Run) -> None:
    async def body() -> None:
        async with _world(lambda path: _ok(path, b"Connection: close\r\n")) as (_up, proxy):
            reader, writer = await asyncio.open_connection(HOST, proxy.port)
            await _get(reader, writer, b"/1")
            (status, head, _) = await _get(reader, writer, b"/2")
            assert status == 200
            # The client keeps alive unless it asks not to: the upstream close is hop-by-hop.
            assert b"connection: close" not in head.lower()
            writer.write(b"GET /3 HTTP/1.1\r\nHost: web\r\nConnection: close\r\n\r\n")
            [(status, head, _)] = await _read_responses(reader, 1)
            assert status == 200
            assert b"connection: close" in head.lower()
            assert await asyncio.wait_for(reader.read(), 5) == b""
            writer.close()

    run(body)


def test_half_closed_client_still_gets_its_answers(run: Run) -> None:
    async def body() -> None:
        async with _world(_ok) as (_up, proxy):
            reader, writer = await asyncio.open_connection(HOST, proxy.port)
            await _get(reader, writer, b"/warm")
            writer.write(
                b"GET /a HTTP/1.1\r\nHost: web\r\n\r\nGET /b HTTP/1.1\r\nHost: web\r\n\r\n"
            )
            writer.write_eof()
            got = await _read_responses(reader, 2)
            assert [b for _, _, b in got] == [b"/a", b"/b"]
            assert await asyncio.wait_for(reader.read(), 5) == b""
            writer.close()

    run(body)


def test_client_leaving_mid_exchange_aborts_its_upstream_and_ends_cleanly(run: Run) -> None:
    async def body() -> None:
        async with _world(lambda path: _ok(path) if path != b"/slow" else b"") as (up, proxy):
            reader, writer = await asyncio.open_connection(HOST, proxy.port)
            await _get(reader, writer, b"/warm")
            writer.write(b"GET /slow HTTP/1.1\r\nHost: web\r\n\r\n")
            await asyncio.sleep(0.05)
            assert proxy.conns[0].fast is not None  # out, served by the callbacks
            sock = writer.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.transport.abort()  # a reset: a FIN alone would be a half-close, still answered
            await asyncio.wait_for(proxy.tasks[0], 5)
            for _ in range(50):
                if up.closed:
                    break
                await asyncio.sleep(0.01)
            assert up.closed == 1  # the upstream connection was dropped, not pooled
            assert proxy.pool.idle_count() == 0

    run(body)


def test_a_finished_connection_leaves_no_cycle_for_the_collector(run: Run, cycles) -> None:
    # Worker rule 7: the client side, its parser and the connection are freed by reference
    # counting when the connection ends, and the router heard `close`.
    async def body() -> None:
        async with _world(_ok) as (_, proxy):
            reader, writer = await asyncio.open_connection(HOST, proxy.port)
            for path in (b"/a", b"/b", b"/a"):
                assert (await _get(reader, writer, path))[0] == 200
            writer.write(b"POST /p HTTP/1.1\r\nHost: web\r\nContent-Length: 2\r\n\r\nhi")
            assert (await _read_responses(reader, 1))[0][0] == 200
            writer.close()
            await asyncio.wait_for(proxy.tasks[0], 5)
            router = proxy.conns[0].router
            proxy.conns.clear()
            proxy.tasks.clear()
            assert cycles((httpproxy.HttpConn, ClientSide, RequestParser, ResponseParser)) == 0
            assert router.closed

    run(body)


def test_large_response_to_a_slow_reader_arrives_whole(run: Run) -> None:
    async def body() -> None:
        big = bytes(range(256)) * 8192  # 2 MiB
        async with _world(lambda path: _ok(big) if path == b"/big" else _ok(path)) as (_up, proxy):
            reader, writer = await asyncio.open_connection(HOST, proxy.port, limit=1 << 16)
            await _get(reader, writer, b"/warm")
            writer.write(b"GET /big HTTP/1.1\r\nHost: web\r\n\r\n")
            await asyncio.sleep(0.2)  # let buffers fill: the proxy must pause the upstream
            [(status, _, body)] = await _read_responses(reader, 1)
            assert status == 200
            assert body == big
            assert proxy.conns[0].callback_requests == 1
            writer.close()
            await writer.wait_closed()

    run(body)


class _Seen:
    """A recorder noting the connection context each call ran in."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any, Any]] = []

    def request(self, direction: str, labels: Any) -> None:  # noqa: ARG002 - Recorder API
        self.calls.append(("request", record.CONN.get(), record.REQUEST.get()))

    def response(self, direction: str, labels: Any, **kw: Any) -> None:  # noqa: ARG002
        self.calls.append(("response", record.CONN.get(), kw["status"]))

    def exchange(self, direction: str, labels: Any, **kw: Any) -> None:
        self.request(direction, labels)
        self.response(direction, labels, **kw)

    def bind_http(self, direction: str, labels: Any) -> Any:
        seen = self

        class Bound(record.BoundHttp):  # a Python subclass of the compiled handle
            def exchange(self, status: int, latency_s: float, failure: bool) -> None:
                seen.exchange(
                    direction, labels, status=status, latency_s=latency_s, failure=failure
                )

        return Bound(labels)

    def tcp_open(self, *a: Any, **kw: Any) -> None: ...
    def tcp_close(self, *a: Any, **kw: Any) -> None: ...
    def authz(self, *a: Any, **kw: Any) -> None: ...
    def conn_end(self, *a: Any) -> None: ...


def test_recorder_sees_the_right_connection_and_request_from_callbacks(run: Run) -> None:
    async def body() -> None:
        seen = _Seen()
        saved, record.RECORDER = record.RECORDER, seen
        try:
            async with _world(_ok) as (_up, proxy):
                pairs = [await asyncio.open_connection(HOST, proxy.port) for _ in range(2)]
                for rnd in range(3):
                    for k, (reader, writer) in enumerate(pairs):
                        writer.write(b"GET /c%d-%d HTTP/1.1\r\nHost: web\r\n\r\n" % (k, rnd))
                        await _read_responses(reader, 1)
                for _, writer in pairs:
                    writer.close()
                    await writer.wait_closed()
                # Only the very first request opened the one upstream connection.
                assert sum(c.callback_requests for c in proxy.conns) == 5
        finally:
            record.RECORDER = saved
        requests = [c for c in seen.calls if c[0] == "request"]
        assert len(requests) == 6
        for _, conn, head in requests:
            k = int(head.target.split(b"-")[0][2:])
            assert conn == ("conn", k)
        responses = [c for c in seen.calls if c[0] == "response"]
        assert [s for _, _, s in responses] == [200] * 6

    run(body)


def test_a_whole_response_goes_out_byte_for_byte_unless_its_head_must_change(run: Run) -> None:
    odd = b"HTTP/1.1 200 OK\r\nX-Odd:   spaced \r\nserver: Up\r\nContent-Length: 4\r\n\r\nbody"

    async def read_exactly(reader: asyncio.StreamReader, n: int) -> bytes:
        return await asyncio.wait_for(reader.readexactly(n), 5)

    async def body() -> None:
        async with _world(lambda _path: odd) as (_up, proxy):
            reader, writer = await asyncio.open_connection(HOST, proxy.port)
            for _ in range(4):  # the first one parses the head; then the whole-response path
                writer.write(b"GET /x HTTP/1.1\r\nHost: web\r\n\r\n")
                assert await read_exactly(reader, len(odd)) == odd
            assert proxy.conns[0].callback_requests == 3
            # An HTTP/1.0 client needs `connection: keep-alive` added: head rebuilt, body kept.
            writer.write(b"GET /x HTTP/1.0\r\nHost: web\r\nConnection: keep-alive\r\n\r\n")
            [(status, head, got)] = await _read_responses(reader, 1)
            assert (status, got) == (200, b"body")
            assert b"connection: keep-alive" in head.lower()
            assert proxy.conns[0].callback_requests == 4
            writer.close()
            await writer.wait_closed()

    run(body)


def test_upstream_paused_for_a_slow_reader_reads_again_when_pooled(run: Run) -> None:
    # The response ends while the client's buffer is over high water, so the upstream's
    # reading was paused for it; the pooled connection must read again for whoever
    # takes it next (here another client connection, which the first cannot resume for).
    async def body() -> None:
        big = bytes(range(256)) * 16384  # 4 MiB
        async with _world(lambda path: _ok(big) if path == b"/big" else _ok(path)) as (up, proxy):
            for rnd in range(3):
                reader, writer = await asyncio.open_connection(HOST, proxy.port, limit=1 << 16)
                await _get(reader, writer, b"/warm%d" % rnd)
                writer.write(b"GET /big HTTP/1.1\r\nHost: web\r\n\r\n")
                await asyncio.sleep(0.2)  # buffers fill: the proxy pauses the upstream
                want, got = len(_ok(big)), b""
                while len(got) < want:  # a slow reader to the very end
                    got += await asyncio.wait_for(reader.read(1 << 16), 5)
                    await asyncio.sleep(0.001)
                assert got.endswith(big)
                writer.close()
                await writer.wait_closed()
            assert len(up.conns) == 1  # each connection reused the one pooled upstream
            assert up.closed == 0

    run(body)


def test_requests_the_router_refuses_are_answered_in_callbacks_and_the_connection_goes_on(
    run: Run,
) -> None:
    async def body() -> None:
        async with _world(_ok) as (up, proxy):
            reader, writer = await asyncio.open_connection(HOST, proxy.port)
            for i in range(3):  # each arrives alone: taken past the queue, refused at once
                assert (await _get(reader, writer, b"/deny"))[0] == 403
                status, _, answer = await _get(reader, writer, b"/ok%d" % i)
                assert (status, answer) == (200, b"/ok%d" % i)
            assert proxy.conns[0].requests == 6
            assert proxy.conns[0].callback_requests >= 5  # all but the upstream's first open
            assert [p.split(b" ")[1] for p, _ in up.seen] == [b"/ok0", b"/ok1", b"/ok2"]
            writer.close()
            await writer.wait_closed()

    run(body)
