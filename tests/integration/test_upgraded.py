"""HTTP/1 upgraded to h2 between two proxies, in-process on real sockets: both paths.

client (HTTP/1) -> `HttpConn` whose target takes HTTP/1 upgraded to h2
(agent.proxy.h1toh2) -> an inbound `h2serve.serve` that gives each marked stream
to the app as HTTP/1 (agent.proxy.h2toh1) -> a scripted HTTP/1 server. Once the h2
connection and an app connection are up, a bodiless request goes the whole way in
callbacks (h1toh2 rule 6, h2toh1 rule 5); the rest takes the coroutines. The
tests run on asyncio's loop and on uvloop (the workers' loop).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from agent.proxy import (
    h1toh2,
    h2msg,
    h2pool,
    h2serve,
    h2stream,
    h2toh1,
    http2,
    httpproxy,
    origproto,
    record,
)
from agent.proxy.h1plan import Router
from agent.proxy.h1upstream import UpstreamConn
from agent.proxy.h2toh1 import Downgrade
from agent.proxy.upstream import ConnPool
from tests.integration.test_httpproxy import (
    HOST,
    Run,
    Upstream,
    _ok,
    _read_responses,
    _Seen,
    _Server,
)

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable, Iterator

    from agent.proxy.http1 import RequestHead


class _Inbound:
    """The peer proxy's inbound router: every (marked) stream to the app over HTTP/1."""

    direction = "inbound"

    def __init__(self, app_port: int) -> None:
        async def opener(factory: Any) -> Any:
            return await asyncio.get_running_loop().create_connection(factory, HOST, app_port)

        self.pool = ConnPool()
        self.way = Downgrade(self.pool, ("app", app_port), opener, {"direction": "inbound"})

    def route_now(self, headers: h2msg.H2Headers) -> http2.Routed | h2msg.Answer:
        request = origproto.downgrade_request(headers)
        assert request is not None, "only marked streams here"
        return http2.Routed(key="app", open=self.way.open, headers=headers, h1=(self.way, request))

    async def route(self, headers: h2msg.H2Headers) -> http2.Routed | h2msg.Answer:
        return self.route_now(headers)


class _Outbound(Router):
    """The client's router: every request to the peer, upgraded to h2 (`h2_plain` 0), or
    upgraded only when `h2_plain` HTTP/1 connections are busy (`--h2-upgrade auto`)."""

    def __init__(self, peer_port: int, app_port: int, h2_plain: int) -> None:
        super().__init__("outbound")

        async def opener(factory: Any) -> Any:
            # The real peer's inbound detects h2 or HTTP/1; here HTTP/1 goes to the app.
            port = app_port if factory is UpstreamConn else peer_port
            return await asyncio.get_running_loop().create_connection(factory, HOST, port)

        self.labels = {"direction": "outbound", "authority": "web"}
        self.h2 = h2pool.H2Pool()
        self.pool = ConnPool()  # the worker's HTTP/1 pool, shared by its client connections
        self.key = ("h1", peer_port)
        target = httpproxy.Target(
            key=self.key,
            open=opener,
            labels=self.labels,
            h2=self.h2,
            h2_key="peer",
            h2_plain=h2_plain,
        )
        self.plan_ = httpproxy.Plan(choose=lambda _attempt: target, labels=self.labels)

    def plan_now(self, head: RequestHead) -> httpproxy.Plan:  # noqa: ARG002 - Router API
        return self.plan_

    async def plan(self, head: RequestHead) -> httpproxy.Plan:
        return self.plan_now(head)

    def close(self) -> None:
        pass


@dataclass
class World:
    up: Upstream
    inbound: _Inbound
    outbound: _Outbound | None = None
    port: int = 0  # the client's proxy
    conns: list[httpproxy.HttpConn] = field(default_factory=list)  # the client connections
    serving: list[asyncio.Task[Any]] = field(default_factory=list)  # and their coroutines
    peers: list[asyncio.Transport] = field(default_factory=list)  # the inbound's connections
    tasks: list[asyncio.Task[Any]] = field(default_factory=list)

    def starters(self) -> list[h2serve.Starter]:
        """The inbound's `h2serve.Starter` per connection (its `on_incoming`)."""
        return [tr.get_protocol().on_incoming.__self__ for tr in self.peers]  # type: ignore[attr-defined]

    def open_streams(self) -> int:
        """Streams open on the outbound's h2 connections."""
        assert self.outbound is not None
        conns = self.outbound.h2._conns.values()
        return sum(len(c.streams) for cs in conns for c in cs)


def _accept(loop: asyncio.AbstractEventLoop, world: World, serve: Callable[..., Any]) -> Any:
    class _Accept(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            transport.pause_reading()  # type: ignore[attr-defined]
            world.tasks.append(loop.create_task(serve(transport)))

    return _Accept


@contextlib.asynccontextmanager
async def _world(
    script: Callable[[bytes], bytes | None], h2_plain: int = 0
) -> AsyncIterator[World]:
    loop = asyncio.get_running_loop()
    up = Upstream(script)
    app = await loop.create_server(lambda: _Server(up), HOST, 0)
    up.port = app.sockets[0].getsockname()[1]
    world = World(up, _Inbound(up.port))

    async def serve_in(tr: Any) -> None:
        world.peers.append(tr)
        await h2serve.serve(tr, world.inbound, h2pool.H2Pool(), b"", eof=False)

    async def serve_out(tr: Any) -> None:
        record.CONN.set(("conn", len(world.conns)))
        assert world.outbound is not None
        conn = httpproxy.HttpConn(tr, world.outbound, world.outbound.pool)
        world.conns.append(conn)
        task = asyncio.current_task()
        assert task is not None
        world.serving.append(task)
        conn.attach(b"")
        await conn.serve()

    peer = await loop.create_server(_accept(loop, world, serve_in), HOST, 0)
    world.outbound = outbound = _Outbound(peer.sockets[0].getsockname()[1], up.port, h2_plain)
    front = await loop.create_server(_accept(loop, world, serve_out), HOST, 0)
    world.port = front.sockets[0].getsockname()[1]
    try:
        yield world
    finally:
        front.close()
        for t in world.tasks:
            t.cancel()
        await asyncio.gather(*world.tasks, return_exceptions=True)
        outbound.h2.close()
        outbound.pool.close()
        world.inbound.pool.close()
        peer.close()
        app.close()
        for c in up.conns:
            if c.tr is not None:
                c.tr.abort()
        await asyncio.sleep(0)


@contextlib.contextmanager
def _recorded() -> Iterator[_Seen]:
    """The recorder is a `_Seen` inside the block, the one before again after it."""
    seen = _Seen()
    saved, record.RECORDER = record.RECORDER, seen
    try:
        yield seen
    finally:
        record.RECORDER = saved


def _inbound_calls(seen: _Seen) -> list[tuple[str, Any, Any]]:
    """The inbound's recorder calls: its connection tasks set no `record.CONN` here."""
    return [c for c in seen.calls if c[1] is None]


async def _get(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, path: bytes) -> Any:
    writer.write(b"GET " + path + b" HTTP/1.1\r\nHost: web\r\n\r\n")
    [got] = await _read_responses(reader, 1)
    return got


def test_keepalive_requests_go_upgraded_and_back_in_callbacks(run: Run) -> None:
    async def body() -> None:
        with _recorded() as seen:
            async with _world(_ok) as world:
                reader, writer = await asyncio.open_connection(HOST, world.port)
                for i in range(20):
                    status, head, got = await _get(reader, writer, b"/r%d" % i)
                    assert (status, got) == (200, b"/r%d" % i)
                    assert b"l5d-orig-proto" not in head.lower()
                writer.close()
                await writer.wait_closed()
                (conn,) = world.conns
                assert conn.requests == 20
                # The first request opened the h2 connection (coroutine); the rest were
                # upgraded from the client's callbacks.
                assert conn.callback_requests == 19
                # The app saw HTTP/1 requests, unmarked, on one connection (the first
                # stream opened it in a task; the others found it idle).
                assert len(world.up.conns) == 1
                assert [h.split(b" ")[1] for h, _ in world.up.seen] == [
                    b"/r%d" % i for i in range(20)
                ]
                assert all(b"l5d-orig-proto" not in h.lower() for h, _ in world.up.seen)
                (starter,) = world.starters()
                assert (starter.count, starter.relayed) == (20, 19)
        outbound = [c for c in seen.calls if c[1] == ("conn", 0)]
        assert [c[2] for c in outbound if c[0] == "response"] == [200] * 20
        assert [c[2].target for c in outbound if c[0] == "request"] == [
            b"/r%d" % i for i in range(20)
        ]
        # The inbound counted each stream's request once, with the stream's head in
        # context, then its response: the first in the task path, the others at once
        # through the bound handle (h2toh1 rule 6).
        inbound = _inbound_calls(seen)
        assert [c[0] for c in inbound] == ["request", "response"] * 20
        assert [c[2].target for c in inbound if c[0] == "request"] == [
            b"/r%d" % i for i in range(20)
        ]
        assert [c[2] for c in inbound if c[0] == "response"] == [200] * 20

    run(body)


def test_an_app_that_closes_unanswered_gets_502_and_the_connection_goes_on(run: Run) -> None:
    async def body() -> None:
        script = lambda path: None if path == b"/close" else _ok(path)  # noqa: E731
        with _recorded() as seen:
            async with _world(script) as world:
                reader, writer = await asyncio.open_connection(HOST, world.port)
                assert (await _get(reader, writer, b"/warm"))[0] == 200
                status, head, _ = await _get(reader, writer, b"/close")
                assert status == 502
                assert b"l5d-proxy-error" in head.lower()
                assert (await _get(reader, writer, b"/after"))[2] == b"/after"
                assert world.conns[0].callback_requests == 2
                writer.close()
                await writer.wait_closed()
        # The failed callback stream counts its request and its 502 once each, as the
        # answered ones do (h2toh1 rule 6).
        inbound = _inbound_calls(seen)
        assert [c[2].target for c in inbound if c[0] == "request"] == [
            b"/warm",
            b"/close",
            b"/after",
        ]
        assert [c[2] for c in inbound if c[0] == "response"] == [200, 502, 200]

    run(body)


def test_a_large_response_to_a_slow_reader_arrives_whole(run: Run) -> None:
    async def body() -> None:
        big = bytes(range(256)) * 8192  # 2 MiB: past the client's high water
        with _recorded() as seen:
            async with _world(lambda p: _ok(big) if p == b"/big" else _ok(p)) as world:
                reader, writer = await asyncio.open_connection(HOST, world.port, limit=1 << 16)
                await _get(reader, writer, b"/warm")
                writer.write(b"GET /big HTTP/1.1\r\nHost: web\r\n\r\n")
                await asyncio.sleep(0.3)  # let buffers fill: the rest must wait for the client
                [(status, _, got)] = await _read_responses(reader, 1)
                assert status == 200
                assert got == big
                assert (await _get(reader, writer, b"/next"))[2] == b"/next"
                assert world.conns[0].callback_requests == 2
                writer.close()
                await writer.wait_closed()
        # The big response went on in a task from the callbacks: its request and its
        # response are each counted once all the same (h2toh1 rule 6).
        inbound = _inbound_calls(seen)
        assert [c[0] for c in inbound] == ["request", "response"] * 3
        assert [c[2].target for c in inbound if c[0] == "request"] == [b"/warm", b"/big", b"/next"]

    run(body)


def test_a_client_that_leaves_mid_request_ends_its_connection_and_stream(run: Run) -> None:
    async def body() -> None:
        hung = asyncio.Event()

        def script(path: bytes) -> bytes:
            if path == b"/hang":
                hung.set()
                return b""  # never answered
            return _ok(path)

        async with _world(script) as world:
            reader, writer = await asyncio.open_connection(HOST, world.port)
            await _get(reader, writer, b"/warm")
            writer.write(b"GET /hang HTTP/1.1\r\nHost: web\r\n\r\n")
            await asyncio.wait_for(hung.wait(), 5)  # the app has it and never answers
            assert world.open_streams() == 1
            sock = writer.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.transport.abort()  # a reset: a FIN alone would be a half-close, still answered
            # The client connection's coroutine ends (not parked forever) and the
            # upgraded stream is cancelled.
            await asyncio.wait_for(asyncio.shield(world.serving[0]), 5)
            assert world.open_streams() == 0
            assert world.conns[0].callback_requests == 0  # /warm opened, /hang never ended
            (starter,) = world.starters()
            assert starter.relayed == 1  # /hang: the app connection /warm left was idle

    run(body)


def test_finished_upgraded_exchanges_leave_no_cycle_for_the_collector(run: Run, cycles) -> None:
    # A callback exchange and its stream refer to each other (the stream's sink) until
    # the exchange ends; then reference counting alone must free both, on both proxies.
    async def body() -> None:
        async with _world(_ok) as world:
            reader, writer = await asyncio.open_connection(HOST, world.port)
            for path in (b"/a", b"/b", b"/c", b"/d"):
                assert (await _get(reader, writer, path))[0] == 200
            writer.close()
            await asyncio.wait_for(asyncio.shield(world.serving[0]), 5)
            assert world.conns[0].callback_requests == 3
            world.conns.clear()
            world.serving.clear()
            kinds = (h1toh2.UpExchange, h2toh1.DownExchange, h2stream.H2Stream)
            assert cycles(kinds) == 0

    run(body)


class _Holding:
    """The app's script: a `/hold...` request is held for the test to answer."""

    def __init__(self) -> None:
        self.held: list[bytes] = []
        self.arrived = asyncio.Event()

    def script(self, path: bytes) -> bytes:
        if path.startswith(b"/hold"):
            self.held.append(path)
            self.arrived.set()
            return b""  # answered by the test
        return _ok(path)


def test_auto_upgrades_only_what_finds_its_http1_connections_busy(run: Run) -> None:
    # `--h2-upgrade auto` (h1toh2 rule 7) with 2 plain connections: requests one at a
    # time go as HTTP/1 on one pooled connection; a third request while two are held
    # goes upgraded; once the two are free again, HTTP/1 takes requests back.
    async def body() -> None:
        app = _Holding()
        held, arrived = app.held, app.arrived
        async with _world(app.script, h2_plain=2) as world:
            assert world.outbound is not None
            pool, inbound = world.outbound.pool, world.inbound.pool
            reader, writer = await asyncio.open_connection(HOST, world.port)
            for i in range(5):
                assert (await _get(reader, writer, b"/seq%d" % i))[2] == b"/seq%d" % i
            assert (pool.opened, pool.reused, world.outbound.h2.opened) == (1, 4, 0)
            assert world.conns[0].callback_requests == 4  # HTTP/1's own callback path
            assert world.peers == []  # no h2 connection to the peer at all
            # two requests held by the app: both HTTP/1 connections busy
            others = [await asyncio.open_connection(HOST, world.port) for _ in range(2)]
            for n, (_, w) in enumerate(others):
                arrived.clear()
                w.write(b"GET /hold%d HTTP/1.1\r\nHost: web\r\n\r\n" % n)
                await asyncio.wait_for(arrived.wait(), 5)
            assert (pool.live(world.outbound.key), pool.idle_count()) == (2, 0)
            # the next request finds them busy: upgraded, through the peer's inbound
            assert (await _get(reader, writer, b"/busy"))[2] == b"/busy"
            assert world.outbound.h2.opened == 1
            assert len(world.peers) == 1
            assert inbound.opened == 1
            for path, c in zip(held, world.up.conns[:2], strict=True):  # the app answers
                assert c.tr is not None
                c.tr.write(_ok(path))
            for (r, w), path in zip(others, held, strict=True):
                [(status, _, got)] = await _read_responses(r, 1)
                assert (status, got) == (200, path)
                w.close()
            # idle HTTP/1 connections again: plain, the inbound's app pool untouched
            assert (await _get(reader, writer, b"/calm"))[2] == b"/calm"
            assert (inbound.opened, inbound.reused) == (1, 0)
            assert pool.opened == 2
            writer.close()
            await writer.wait_closed()

    run(body)


def test_auto_keeps_joining_a_busy_lane_while_http1_connections_are_idle(run: Run) -> None:
    # h1toh2 rule 7: once the client connection's lane has a stream open, a request joins
    # it even when an HTTP/1 connection is idle (it would take its own TLS record and
    # wake-up, splitting the lane's batches); once the lane is quiet, HTTP/1 again.
    async def body() -> None:
        app = _Holding()
        held, arrived = app.held, app.arrived
        async with _world(app.script, h2_plain=2) as world:
            out = world.outbound
            assert out is not None
            out.h2.lanes = 1  # every client connection on one lane, as on a one-worker node
            pool, inbound = out.pool, world.inbound.pool
            reader, writer = await asyncio.open_connection(HOST, world.port)
            assert (await _get(reader, writer, b"/first"))[2] == b"/first"
            assert (pool.opened, out.h2.opened) == (1, 0)
            # /hold0 and /hold1 take both HTTP/1 connections; /hold2 then goes upgraded
            others = [await asyncio.open_connection(HOST, world.port) for _ in range(3)]
            for n, (_, w) in enumerate(others):
                arrived.clear()
                w.write(b"GET /hold%d HTTP/1.1\r\nHost: web\r\n\r\n" % n)
                await asyncio.wait_for(arrived.wait(), 5)
            assert (pool.opened, out.h2.opened, inbound.opened) == (2, 1, 1)
            # the app answers the two HTTP/1 requests: both connections idle again
            for path, c in zip(held[:2], world.up.conns[:2], strict=True):
                assert c.tr is not None
                c.tr.write(_ok(path))
            for (r, _), path in zip(others[:2], held[:2], strict=True):
                [(status, _, got)] = await _read_responses(r, 1)
                assert (status, got) == (200, path)
            assert pool.idle_count() == 2
            # /hold2's stream is still open on the lane: the next request joins it
            reused = pool.reused
            assert (await _get(reader, writer, b"/joins"))[2] == b"/joins"
            assert pool.reused == reused, "went on an idle HTTP/1 connection"
            assert inbound.opened == 2  # the peer took it to the app beside /hold2
            # the lane goes quiet: HTTP/1 takes requests back
            c = world.up.conns[2]
            assert c.tr is not None
            c.tr.write(_ok(held[2]))
            [(status, _, got)] = await _read_responses(others[2][0], 1)
            assert (status, got) == (200, b"/hold2")
            for _ in range(100):  # the stream closes once its end has gone to the client
                if not out.h2.busy(world.conns[0].h2_key):
                    break
                await asyncio.sleep(0.01)
            assert (await _get(reader, writer, b"/calm"))[2] == b"/calm"
            assert pool.reused == reused + 1
            for _, w in others:
                w.close()
            writer.close()
            await writer.wait_closed()

    run(body)


def test_posts_go_upgraded_with_their_bodies_and_their_answers_come_back_whole(run: Run) -> None:
    # A request whose body came whole goes upgraded in callbacks on both proxies (h1toh2
    # rule 6, h2toh1 rule 5), once the lane and an app connection are up: the body leaves
    # with the HEADERS and reaches the app with its head. A body one DATA frame cannot
    # carry goes on the coroutines. An answer that came whole is held for the batch
    # (h1toh2 rule 2); one larger than WHOLE_BYTES streams as before.
    big = b"b" * (h1toh2.WHOLE_BYTES + 1)
    frame = 16384  # the peer's SETTINGS_MAX_FRAME_SIZE (h2's default)

    def script(path: bytes) -> bytes:
        return _ok(big) if path == b"/big" else _ok(path)

    async def body() -> None:
        async with _world(script) as world:
            assert world.outbound is not None
            reader, writer = await asyncio.open_connection(HOST, world.port)
            sizes = {b"/p1": 1000, b"/p2": 1001, b"/big": 1002, b"/p3": frame, b"/p4": frame + 1}
            callbacks = []
            for n, (path, size) in enumerate(sizes.items()):
                payload = bytes([48 + n]) * size
                writer.write(
                    b"POST %s HTTP/1.1\r\nHost: web\r\nContent-Length: %d\r\n\r\n%s"
                    % (path, len(payload), payload)
                )
                [(status, _, got)] = await _read_responses(reader, 1)
                assert (status, got) == (200, big if path == b"/big" else path)
                head, sent = world.up.seen[-1]
                assert head.startswith(b"POST " + path)
                assert sent == payload
                (starter,) = world.starters()
                callbacks.append((world.conns[0].callback_requests, starter.relayed))
            assert world.outbound.h2.opened == 1  # every one upgraded, on one lane
            # The first opened the lane and the app connection (coroutines). /p4's body is
            # past one frame: the outbound's coroutine sends it (the inbound takes it in
            # callbacks or not, as its two frames come in one read or two).
            assert callbacks[:4] == [(0, 0), (1, 1), (2, 2), (3, 3)]
            assert callbacks[4][0] == 3
            writer.close()
            await writer.wait_closed()

    run(body)
