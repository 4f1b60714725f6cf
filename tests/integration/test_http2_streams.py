"""The HTTP/2 per-stream proxy (agent.proxy.http2) on real loopback sockets, on uvloop.

Each test runs one loop holding an h2 client, the proxy front (accept, pause,
`h2serve.serve` with a small `StreamRouter`) and an h2 upstream server, all on
127.0.0.1 in this process, twice: with streams served in callbacks where they can be
(agent.proxy.h2serve's relay) and with every stream in a task (the router never
decides at once). Client and upstream are written here with the `h2`
library directly, so the proxy is not checked against itself.

Upstream paths: `/echo` answers the request body back, `/big/N` answers N
bytes of `b"z"`, `/grpc` answers a body and trailers with grpc-status 0,
`/reset` resets the stream with ENHANCE_YOUR_CALM, `/hang` never answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from dataclasses import dataclass, field
from typing import Any, Self

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.settings
import pytest
from hpack import NeverIndexedHeaderTuple

from agent import aio
from agent.proxy import (
    h1msg,
    h2conn,
    h2frame,
    h2msg,
    h2pool,
    h2serve,
    h2stream,
    http1,
    http2,
    origproto,
    record,
)
from agent.proxy.h2toh1 import Downgrade
from agent.proxy.upstream import ConnPool

MiB = 1 << 20
RELAY = {"on": True}  # this run's path, set by the `path` fixture


@pytest.fixture(autouse=True, params=["callbacks", "tasks"])
def path(request: pytest.FixtureRequest) -> str:
    RELAY["on"] = request.param == "callbacks"
    return str(request.param)


# --- upstream server ---------------------------------------------------------------------


class _Upstream(asyncio.Protocol):
    def __init__(self, rig: Rig) -> None:
        self.rig = rig
        config = h2.config.H2Configuration(client_side=False, header_encoding=None)
        self.h2 = h2.connection.H2Connection(config=config)
        self.transport: asyncio.Transport | None = None
        self.bodies: dict[int, bytearray] = {}
        self.paths: dict[int, bytes] = {}
        self.sending: dict[int, bytes] = {}  # what is left to send per stream (flow control)

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.rig.upstream_conns += 1
        self.h2.local_settings = h2.settings.Settings(
            client=False, initial_values={h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: 100}
        )
        self.h2.initiate_connection()
        self._flush()

    def data_received(self, data: bytes) -> None:
        for ev in self.h2.receive_data(data):
            self._event(ev)
        self._pump()
        self._flush()

    def _event(self, ev: h2.events.Event) -> None:
        if isinstance(ev, h2.events.RequestReceived):
            headers = list(ev.headers)
            self.rig.upstream_heads.append(headers)
            self.paths[ev.stream_id] = (h2msg.header(headers, b":path") or b"").partition(b"?")[0]
            self.bodies[ev.stream_id] = bytearray()
        elif isinstance(ev, h2.events.DataReceived):
            self.bodies[ev.stream_id] += ev.data
            self.h2.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
        elif isinstance(ev, h2.events.StreamEnded):
            self._answer(ev.stream_id)
        elif isinstance(ev, h2.events.StreamReset):
            self.rig.upstream_resets.append(ev.error_code)
            self.sending.pop(ev.stream_id, None)

    def _answer(self, sid: int) -> None:
        path = self.paths[sid]
        if path == b"/reset":
            self.h2.reset_stream(sid, h2.errors.ErrorCodes.ENHANCE_YOUR_CALM)
        elif path == b"/hang":
            pass
        elif path == b"/grpc":
            self.h2.send_headers(
                sid, [(b":status", b"200"), (b"content-type", b"application/grpc")]
            )
            self.h2.send_data(sid, b"\0\0\0\0\2ok")
            self.h2.send_headers(sid, [(b"grpc-status", b"0")], end_stream=True)
        else:
            body = bytes(self.bodies[sid]) if path == b"/echo" else b"z" * int(path.split(b"/")[2])
            self.h2.send_headers(sid, [(b":status", b"200")])
            self.sending[sid] = body

    def _pump(self) -> None:
        for sid, body in list(self.sending.items()):
            left = body
            while True:
                size = min(self.h2.local_flow_control_window(sid), self.h2.max_outbound_frame_size)
                if left and size <= 0:
                    break
                chunk, left = left[:size], left[size:]
                self.h2.send_data(sid, chunk, end_stream=not left)
                self.rig.upstream_sent += len(chunk)
                if not left:
                    break
            if left:
                self.sending[sid] = left
            else:
                del self.sending[sid]

    def _flush(self) -> None:
        data = self.h2.data_to_send()
        if data and self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)


# --- an HTTP/1 app, for streams marked `l5d-orig-proto` -----------------------------------


class _H1App(asyncio.Protocol):
    """Answers `/small` (a short body with its length), `/chunked` (two chunks and a
    trailer), `/split/N` (N bytes: the head and half now, the rest 50 ms later),
    `/big/N` (N bytes in one write); `/close` closes the connection unanswered."""

    def __init__(self, rig: Rig) -> None:
        self.rig = rig
        self.parser = http1.RequestParser()

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.rig.app_conns += 1

    def data_received(self, data: bytes) -> None:
        for ev in self.parser.feed(data):
            if isinstance(ev, http1.RequestHead):
                self.rig.app_heads.append(ev.target)
                self._answer(ev.target.decode())

    def _answer(self, path: str) -> None:
        tr = self.transport
        if path == "/close":
            tr.close()
        elif path == "/small":
            tr.write(h1msg.response_head_bytes(200, [(b"content-length", b"5")]) + b"hello")
        elif path == "/chunked":
            head = h1msg.response_head_bytes(200, [(b"transfer-encoding", b"chunked")])
            tr.write(head + b"3\r\nabc\r\n2\r\nde\r\n0\r\nx-end: 1\r\n\r\n")
        else:
            kind, size = path.split("/")[1], int(path.split("/")[2])
            head = h1msg.response_head_bytes(200, [(b"content-length", b"%d" % size)])
            if kind == "big":
                tr.write(head + b"b" * size)
            else:
                tr.write(head + b"s" * (size // 2))
                asyncio.get_running_loop().call_later(0.05, tr.write, b"s" * (size - size // 2))


# --- proxy front and router --------------------------------------------------------------


class _Front(asyncio.Protocol):
    def __init__(self, rig: Rig) -> None:
        self.rig = rig
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        assert self.transport is not None
        self.transport.pause_reading()
        self.rig.fronts.append(self.transport)
        record.CONN.set(f"conn-{len(self.rig.fronts)}")  # the serving task's context (a copy)
        task = aio.spawn(
            h2serve.serve(self.transport, self.rig, self.rig.pool, data, eof=False), name="serve"
        )
        self.rig.tasks.append(task)


class Rig:
    """client -> proxy (`h2serve.serve`, this object as the router) -> upstream."""

    direction = "outbound"

    def __init__(self, *, timeout_s: float | None = None) -> None:
        self.timeout_s = timeout_s
        self.relay = RELAY["on"]
        self.pool = h2pool.H2Pool()
        self.tasks: list[asyncio.Task[Any]] = []
        self.fronts: list[asyncio.Transport] = []  # the client connections' transports
        self.app_conns = 0
        self.app_heads: list[bytes] = []
        self.upstream_conns = 0
        self.upstream_heads: list[list[tuple[bytes, bytes]]] = []
        self.upstream_resets: list[int] = []
        self.upstream_sent = 0

    async def __aenter__(self) -> Self:
        loop = asyncio.get_running_loop()
        self.up = await loop.create_server(lambda: _Upstream(self), "127.0.0.1", 0)
        self.up_addr = self.up.sockets[0].getsockname()
        self.front = await loop.create_server(lambda: _Front(self), "127.0.0.1", 0)
        self.front_addr = self.front.sockets[0].getsockname()
        self.app = await loop.create_server(lambda: _H1App(self), "127.0.0.1", 0)
        self.h1pool = ConnPool()
        self.downgrade = Downgrade(self.h1pool, "app", self._open_app, {})
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.front.close()
        self.pool.close()
        await aio.cancel_and_wait(self.tasks)
        self.up.close()
        self.app.close()
        self.h1pool.close()
        await self.front.wait_closed()
        await self.up.wait_closed()

    async def route(self, headers: h2msg.H2Headers) -> http2.Routed | h2msg.Answer:
        return self._decide(headers)

    def route_now(self, headers: h2msg.H2Headers) -> http2.Routed | h2msg.Answer | None:
        return self._decide(headers) if self.relay else None

    def _decide(self, headers: h2msg.H2Headers) -> http2.Routed | h2msg.Answer:
        if (h2msg.header(headers, b":path") or b"").startswith(b"/deny"):
            return h2msg.Answer(status=200, message="denied", grpc=h2msg.GRPC_PERMISSION_DENIED)
        request = origproto.downgrade_request(headers)  # marked: to the HTTP/1 app
        h1 = None if request is None else (self.downgrade, request)
        return http2.Routed(
            key="up", open=self._open, headers=headers, timeout_s=self.timeout_s, h1=h1
        )

    async def _open_app(self, factory: Any) -> Any:
        addr = self.app.sockets[0].getsockname()
        return await asyncio.get_running_loop().create_connection(factory, *addr)

    async def _open(self, factory: Any) -> Any:
        return await asyncio.get_running_loop().create_connection(factory, *self.up_addr)

    def starters(self) -> list[h2serve.Starter]:
        """Each client connection's `h2serve.Starter` (its connection's `on_incoming`)."""
        return [tr.get_protocol().on_incoming.__self__ for tr in self.fronts]

    async def client(self, **kw: Any) -> Client:
        loop = asyncio.get_running_loop()
        _, client = await loop.create_connection(lambda: Client(**kw), *self.front_addr)
        return client


# --- client ------------------------------------------------------------------------------


@dataclass
class Response:
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    body: bytearray = field(default_factory=bytearray)
    trailers: list[tuple[bytes, bytes]] = field(default_factory=list)
    reset: int | None = None
    data_frames: int = 0
    done: asyncio.Future[None] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )


class Client(asyncio.Protocol):
    """An h2 client: requests with bodies; reads responses, acknowledging unless `hold`."""

    def __init__(self, *, hold: bool = False) -> None:
        config = h2.config.H2Configuration(client_side=True, header_encoding=None)
        self.h2 = h2.connection.H2Connection(config=config)
        self.hold = hold
        self.responses: dict[int, Response] = {}
        self.uploads: dict[int, bytes] = {}
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.h2.initiate_connection()
        self._flush()

    def data_received(self, data: bytes) -> None:
        for ev in self.h2.receive_data(data):
            self._event(ev)
        self._upload()
        self._flush()

    def connection_lost(self, exc: Exception | None) -> None:  # noqa: ARG002 - Protocol API
        for r in self.responses.values():
            if not r.done.done():
                r.done.set_exception(ConnectionError("lost"))

    def _event(self, ev: h2.events.Event) -> None:
        r = self.responses.get(getattr(ev, "stream_id", 0) or 0)
        if r is None:
            return
        if isinstance(ev, h2.events.ResponseReceived):
            r.headers = list(ev.headers)
        elif isinstance(ev, h2.events.DataReceived):
            r.body += ev.data
            r.data_frames += 1
            if not self.hold:
                self.h2.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
        elif isinstance(ev, h2.events.TrailersReceived):
            r.trailers = list(ev.headers)
        elif isinstance(ev, h2.events.StreamEnded):
            if not r.done.done():
                r.done.set_result(None)
        elif isinstance(ev, h2.events.StreamReset):
            r.reset = ev.error_code
            if not r.done.done():
                r.done.set_result(None)

    def request(
        self,
        path: bytes,
        body: bytes = b"",
        extra: list[tuple[bytes, bytes]] | None = None,
        *,
        flush: bool = True,
    ) -> Response:
        sid = self.h2.get_next_available_stream_id()
        method = b"POST" if body else b"GET"
        headers = [
            (b":method", method),
            (b":path", path),
            (b":scheme", b"http"),
            (b":authority", b"svc"),
            *(extra or []),
        ]
        self.h2.send_headers(sid, headers, end_stream=not body)
        self.responses[sid] = Response()
        if body:
            self.uploads[sid] = body
            self._upload()
        if flush:
            self._flush()
        return self.responses[sid]

    def reset(self, response: Response) -> None:
        sid = next(s for s, r in self.responses.items() if r is response)
        self.h2.reset_stream(sid, h2.errors.ErrorCodes.CANCEL)
        self._flush()

    def _upload(self) -> None:
        for sid, body in list(self.uploads.items()):
            left = body
            size = min(self.h2.local_flow_control_window(sid), self.h2.max_outbound_frame_size)
            while left and size > 0:
                self.h2.send_data(sid, left[:size], end_stream=size >= len(left))
                left = left[size:]
                size = min(self.h2.local_flow_control_window(sid), self.h2.max_outbound_frame_size)
            if left:
                self.uploads[sid] = left
            else:
                del self.uploads[sid]

    def flush(self) -> None:
        self._flush()

    def _flush(self) -> None:
        data = self.h2.data_to_send()
        if data and self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


class _WriteCounter:
    """The real transport, counting `write` calls (the proxy's writes towards upstream)."""

    def __init__(self, real: asyncio.Transport) -> None:
        self.real = real
        self.writes: list[int] = []

    def write(self, data: bytes) -> None:
        self.writes.append(len(data))
        self.real.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


async def _wait(*responses: Response, limit_s: float = 10) -> None:
    async with asyncio.timeout(limit_s):
        await asyncio.gather(*(r.done for r in responses))


async def _cancelled_upstream(rig: Rig, rs: list[Response]) -> None:
    """Each of `rs` (streams the upstream never answers) is reset upstream with CANCEL,
    and the client's side of each ends (reset, or its connection lost)."""
    async with asyncio.timeout(5):
        while len(rig.upstream_resets) < len(rs):  # noqa: ASYNC110 - set by the upstream
            await asyncio.sleep(0.01)
    assert rig.upstream_resets == [h2.errors.ErrorCodes.CANCEL] * len(rs)
    for r in rs:
        with contextlib.suppress(ConnectionError):
            await r.done


# --- tests -------------------------------------------------------------------------------


def test_a_thousand_streams_200_at_once_on_one_connection_complete_on_two_upstreams():
    async def main() -> None:
        async with Rig() as rig:
            client = await rig.client()
            try:
                batches = []
                for b in range(5):  # 5 x 200 in flight at once: under the 1000 we advertise
                    rs = [client.request(b"/echo", b"%d-%d" % (b, i)) for i in range(200)]
                    await _wait(*rs)
                    batches.append(rs)
                for b, rs in enumerate(batches):
                    assert [h2msg.status_of(r.headers) for r in rs] == [200] * 200
                    assert [bytes(r.body) for r in rs] == [b"%d-%d" % (b, i) for i in range(200)]
                    assert all(r.reset is None for r in rs)
                # The upstream takes 100 streams at once: a second connection, no more.
                assert rig.upstream_conns == 2
                assert rig.pool.opened == 2
            finally:
                client.close()

    aio.run(main())


def test_streams_on_an_established_connection_are_served_in_callbacks(path: str) -> None:
    """h2serve rule 1: once the upstream connection is up, a stream whose router decides
    at once is relayed in callbacks, with or without a body, with trailers or a reset;
    with every stream in a task (the router never decides at once) none is."""

    async def main() -> None:
        async with Rig() as rig:
            client = await rig.client()
            try:
                await _wait(client.request(b"/echo", b"first"))  # opens the upstream connection
                rs = [client.request(b"/echo", b"b%d" % i) for i in range(10)]
                rs += [client.request(b"/big/%d" % (i + 1)) for i in range(10)]
                rs += [client.request(b"/grpc") for _ in range(10)]
                resets = [client.request(b"/reset") for _ in range(3)]
                await _wait(*rs, *resets)
                assert [bytes(r.body) for r in rs[:10]] == [b"b%d" % i for i in range(10)]
                assert [len(r.body) for r in rs[10:20]] == list(range(1, 11))
                assert all(r.trailers == [(b"grpc-status", b"0")] for r in rs[20:])
                assert all(h2msg.status_of(r.headers) == 200 for r in rs)
                assert [r.reset for r in resets] == [h2.errors.ErrorCodes.ENHANCE_YOUR_CALM] * 3
                (starter,) = rig.starters()
                assert starter.count == 34
                assert starter.relayed == (33 if path == "callbacks" else 0)
            finally:
                client.close()

    aio.run(main())


class _Seen:
    """A recorder (agent.proxy.record's interface) keeping, per request and response, the
    request head's target and the connection its context names."""

    def __init__(self) -> None:
        self.requests: list[tuple[bytes, Any]] = []
        self.responses: list[tuple[bytes, Any, int, bool]] = []

    def request(self, direction: str, labels: record.Labels) -> None:  # noqa: ARG002
        self.requests.append((record.REQUEST.get().target, record.CONN.get()))

    def response(self, direction: str, labels: record.Labels, **kw: Any) -> None:  # noqa: ARG002
        head = record.REQUEST.get()
        self.responses.append((head.target, record.CONN.get(), kw["status"], kw["failure"]))

    def __getattr__(self, name: str) -> Any:  # the rest of the interface: not on this path
        return getattr(record.NoopRecorder(), name)


def test_each_stream_is_recorded_with_its_own_request_and_connection(monkeypatch) -> None:
    """http2 rule 7 and h2serve rule 3: whichever path serves a stream, the recorder sees
    that stream's request and its client connection, though the streams of two
    connections interleave and their responses arrive on one upstream connection."""
    seen = _Seen()
    monkeypatch.setattr(record, "RECORDER", seen)

    async def main() -> None:
        async with Rig() as rig:
            one, two = await rig.client(), await rig.client()
            try:
                await _wait(one.request(b"/echo", b"warm"))  # the upstream connection
                await _wait(two.request(b"/echo", b"warm"))
                rs = []
                for i in range(20):
                    rs.append(one.request(b"/big/%d?c=1&i=%d" % (i + 1, i)))
                    rs.append(two.request(b"/echo?c=2&i=%d" % i, b"x" * i))
                    rs.append(one.request(b"/deny?c=1&i=%d" % i))
                await _wait(*rs)
            finally:
                one.close()
                two.close()

    aio.run(main())
    got = sorted(seen.responses[2:])
    want = sorted(
        [(b"/big/%d?c=1&i=%d" % (i + 1, i), "conn-1", 200, False) for i in range(20)]
        + [(b"/echo?c=2&i=%d" % i, "conn-2", 200, False) for i in range(20)]
        + [(b"/deny?c=1&i=%d" % i, "conn-1", 200, True) for i in range(20)]
    )
    assert got == want
    assert sorted(seen.requests[2:]) == sorted((t, c) for t, c, _, ok in want if not ok)


MARK = [(b"l5d-orig-proto", b"HTTP/1.1")]


def test_marked_streams_go_to_the_http1_app_relayed_when_an_app_connection_is_idle(path):
    """h2toh1 rule 5: a marked stream that arrived whole (bodiless, or its body and end
    in the read of its head) with an idle app connection is answered in callbacks,
    whatever the response's shape (whole, chunked with a trailer, still arriving, too
    big for one frame) or the app's end (closed: 502); one that finds no idle
    connection goes the coroutine way."""

    async def main() -> None:
        async with Rig() as rig:
            client = await rig.client()
            try:
                got = []
                paths = [b"/small", b"/small", b"/chunked", b"/split/100000", b"/small"]
                paths += [b"/big/40000", b"/small", b"/close", b"/small"]
                for p in paths:  # one at a time: each finds the last one's app connection
                    r = client.request(p, extra=MARK)
                    await _wait(r)
                    got.append(r)
                body = client.request(b"/small", b"up", extra=MARK)  # a whole body
                await _wait(body)
                many = [client.request(b"/small", extra=MARK) for _ in range(10)]
                await _wait(*many)
                (starter,) = rig.starters()
            finally:
                client.close()
            return got, body, many, starter, rig.app_heads, rig.app_conns

    got, body, many, starter, heads, conns = aio.run(main())
    small = [r for r in got if r.headers and bytes(r.body) == b"hello"]
    assert len(small) == 5
    assert all(dict(r.headers)[b"l5d-orig-proto"] == b"HTTP/1.1" for r in small)
    chunked = got[2]
    assert (bytes(chunked.body), chunked.trailers) == (b"abcde", [(b"x-end", b"1")])
    assert bytes(got[3].body) == b"s" * 100000
    assert bytes(got[5].body) == b"b" * 40000
    closed = got[7]
    assert h2msg.status_of(closed.headers) == 502
    assert dict(closed.headers)[b"l5d-proxy-error"].startswith(b"upstream")
    assert bytes(body.body) == b"hello"
    assert all(bytes(r.body) == b"hello" for r in many)
    assert all(r.reset is None for r in [*got, body, *many])
    assert heads.count(b"/small") == 5 + 1 + 10
    # The app's connections: one, a new one after /close, and some for the ten at once.
    assert conns >= 2
    # Relayed: each of the nine but the first (no idle app connection yet) and the one
    # after /close (it aborted its connection), the one with a body, and of the ten the
    # one that found the idle connection.
    assert starter.relayed == (7 + 1 + 1 if path == "callbacks" else 0)


def test_eight_mib_both_ways_cross_the_proxy_byte_exact_under_flow_control():
    async def main() -> None:
        async with Rig() as rig:
            client = await rig.client()
            try:
                up_body = bytes(range(256)) * (32 * 1024)  # 8 MiB, peers' windows 64 KiB
                r_up = client.request(b"/echo", up_body)
                r_down = client.request(b"/big/%d" % (8 * MiB))
                await _wait(r_up, r_down, limit_s=30)
                assert r_up.body == up_body
                assert len(r_down.body) == 8 * MiB
                assert r_down.body == b"z" * (8 * MiB)
            finally:
                client.close()

    aio.run(main())


def test_a_client_that_stops_reading_stops_the_upstream_within_the_windows():
    async def main() -> None:
        async with Rig() as rig:
            client = await rig.client(hold=True)  # never acknowledges DATA
            try:
                r = client.request(b"/big/%d" % (32 * MiB))
                await asyncio.sleep(1.0)
                # client's window (64 KiB) + what the proxy may hold for one stream
                # (the window it advertises upstream) + socket buffers; not 32 MiB.
                bound = 65535 + h2conn.STREAM_WINDOW + 4 * MiB
                assert 0 < rig.upstream_sent < bound
                assert len(r.body) <= 65535
                assert not r.done.done()
            finally:
                client.close()

    aio.run(main())


def test_a_body_and_its_end_arrive_in_one_data_frame():
    async def main() -> None:
        async with Rig() as rig:
            client = await rig.client()
            try:
                rs = [client.request(b"/big/10") for _ in range(20)]
                await _wait(*rs)
                assert [bytes(r.body) for r in rs] == [b"z" * 10] * 20
                # One DATA frame each, carrying END_STREAM: no empty frame just to end.
                assert [r.data_frames for r in rs] == [1] * 20
            finally:
                client.close()

    aio.run(main())


def test_trailers_with_grpc_status_pass_through():
    async def main() -> None:
        async with Rig() as rig:
            client = await rig.client()
            try:
                r = client.request(b"/grpc", b"\0\0\0\0\2hi")
                await _wait(r)
                assert bytes(r.body) == b"\0\0\0\0\2ok"
                assert r.trailers == [(b"grpc-status", b"0")]
            finally:
                client.close()

    aio.run(main())


def test_router_answer_is_trailers_only_grpc_status_7_and_others_go_on():
    async def main() -> None:
        async with Rig() as rig:
            client = await rig.client()
            try:
                deny = client.request(b"/deny", b"body", [(b"content-type", b"application/grpc")])
                ok = client.request(b"/echo", b"fine")
                await _wait(deny, ok)
                assert h2msg.status_of(deny.headers) == 200
                assert h2msg.grpc_status(deny.headers) == 7
                assert h2msg.header(deny.headers, b"l5d-proxy-error") == b"denied"
                assert bytes(ok.body) == b"fine"
                assert rig.upstream_heads[0][1] == (b":path", b"/echo")  # deny never went up
                assert len(rig.upstream_heads) == 1
            finally:
                client.close()

    aio.run(main())


def test_resets_travel_both_ways_and_end_only_their_stream():
    async def main() -> None:
        async with Rig() as rig:
            client = await rig.client()
            try:
                upstream_reset = client.request(b"/reset")
                hang = client.request(b"/hang")
                ok = client.request(b"/echo", b"x")
                await _wait(upstream_reset, ok)
                assert upstream_reset.reset == h2.errors.ErrorCodes.ENHANCE_YOUR_CALM
                assert bytes(ok.body) == b"x"
                client.reset(hang)
                async with asyncio.timeout(5):
                    while not rig.upstream_resets:  # noqa: ASYNC110 - set by the upstream
                        await asyncio.sleep(0.01)
                assert rig.upstream_resets == [h2.errors.ErrorCodes.CANCEL]
                after = client.request(b"/echo", b"still")
                await _wait(after)
                assert bytes(after.body) == b"still"
            finally:
                client.close()

    aio.run(main())


def test_route_timeout_answers_504_and_cancels_upstream():
    async def main() -> None:
        async with Rig(timeout_s=0.2) as rig:
            client = await rig.client()
            try:
                r = client.request(b"/hang")
                await _wait(r)
                assert h2msg.status_of(r.headers) == 504
                async with asyncio.timeout(5):
                    while not rig.upstream_resets:  # noqa: ASYNC110 - set by the upstream
                        await asyncio.sleep(0.01)
                assert rig.upstream_resets == [h2.errors.ErrorCodes.CANCEL]
            finally:
                client.close()

    aio.run(main())


def test_credentials_are_forwarded_never_indexed():
    async def main() -> None:
        async with Rig() as rig:
            client = await rig.client()
            try:
                extra = [(b"authorization", b"Bearer secret"), (b"x-plain", b"v")]
                r = client.request(b"/echo", b"", extra)
                await _wait(r)
                head = dict(rig.upstream_heads[0])
                assert head[b"authorization"] == b"Bearer secret"
                auth = next(h for h in rig.upstream_heads[0] if h[0] == b"authorization")
                plain = next(h for h in rig.upstream_heads[0] if h[0] == b"x-plain")
                assert isinstance(auth, NeverIndexedHeaderTuple)
                assert not isinstance(plain, NeverIndexedHeaderTuple)
            finally:
                client.close()

    aio.run(main())


def test_frames_of_many_streams_sent_in_one_loop_iteration_leave_in_one_write():
    async def main() -> None:
        async with Rig() as rig:
            client = await rig.client()
            try:
                warm = client.request(b"/echo", b"w")
                await _wait(warm)
                conn = rig.pool._conns["up"][0]  # the one upstream connection
                assert conn.transport is not None
                spy = _WriteCounter(conn.transport)
                conn.transport = spy  # type: ignore[assignment]
                try:
                    rs = [client.request(b"/echo", b"%d" % i, flush=False) for i in range(50)]
                    client.flush()  # the 50 requests reach the proxy in one write
                    await _wait(*rs)
                finally:
                    conn.transport = spy.real
                assert [bytes(r.body) for r in rs] == [b"%d" % i for i in range(50)]
                # 50 streams' HEADERS + DATA: a few writes, not one or more per frame.
                assert 0 < len(spy.writes) <= 10, spy.writes
            finally:
                client.close()

    aio.run(main())


def test_closing_the_client_connection_resets_the_upstream_streams():
    async def main() -> None:
        async with Rig() as rig:
            client = await rig.client()
            rs = [client.request(b"/hang") for _ in range(3)]
            await asyncio.sleep(0.2)
            client.close()
            await _cancelled_upstream(rig, rs)

    aio.run(main())


def test_a_client_that_breaks_the_protocol_loses_its_connection_and_its_streams_upstream():
    """A connection error from the client (DATA on stream 0) closes its connection, and
    every stream it had open, relayed or in a task, is reset upstream; others go on."""

    async def main() -> None:
        async with Rig() as rig:
            bad, good = await rig.client(), await rig.client()
            try:
                await _wait(bad.request(b"/echo", b"warm"))  # the upstream connection is up
                hung = [bad.request(b"/hang") for _ in range(3)]
                await asyncio.sleep(0.2)
                assert bad.transport is not None
                bad.transport.write(b"\0\0\1\0\0\0\0\0\0x")  # DATA, length 1, stream 0
                await _cancelled_upstream(rig, hung)
                after = good.request(b"/echo", b"still")
                await _wait(after)
                assert bytes(after.body) == b"still"
            finally:
                bad.close()
                good.close()

    aio.run(main())


def test_finished_streams_leave_no_cycle_for_the_collector(cycles) -> None:
    # A proxied stream pair links the streams' reset callbacks to each other; once the
    # stream's task is over, reference counting alone must free both streams.
    async def main() -> None:
        async with Rig() as rig:
            client = await rig.client()
            try:
                rs = [client.request(b"/big/10"), client.request(b"/echo", b"body")]
                rs += [client.request(b"/reset"), client.request(b"/grpc")]
                await _wait(*rs)
                await asyncio.sleep(0.05)  # the streams' tasks end after the client saw the ends
                assert cycles((h2stream.H2Stream,)) == 0
            finally:
                client.close()

    aio.run(main())


def test_what_need_not_wait_is_done_at_once_and_the_rest_waits() -> None:
    """http2 rule 8: `send_data_now` sends DATA the window and the connection take at
    once, and refuses (sending nothing) what would wait; `next_now` gives a queued item
    or None; `H2Pool.stream_now` opens a stream only on an established connection."""

    async def main() -> None:
        loop = asyncio.get_running_loop()
        a, b = socket.socketpair()
        server = h2conn.H2Conn(client_side=False)
        await loop.connect_accepted_socket(lambda: server, b)
        pool = h2pool.H2Pool()
        head = [
            (b":method", b"POST"),
            (b":scheme", b"http"),
            (b":path", b"/"),
            (b":authority", b"x"),
        ]
        assert pool.stream_now("k", head, end=False) is None  # no connection yet

        async def opener(factory):
            return await loop.connect_accepted_socket(factory, a)

        up = await pool.stream("k", opener, head, end=False)
        again = pool.stream_now("k", head, end=True)  # the connection is there now
        assert again is not None
        assert again.conn is up.conn
        assert up.send_data_now(b"x" * 100)
        big = b"y" * (h2frame.DEFAULT_WINDOW + 1)  # past the window and one frame
        assert not up.send_data_now(big)
        assert not up.send_data_now(b"")  # nothing to send: the waiting path ends a stream
        down = await server.next_incoming()
        assert down is not None
        item = await down.next()
        assert isinstance(item, h2stream.Data)
        assert item.data == b"x" * 100
        await asyncio.sleep(0.05)
        assert down.next_now() is None  # the refused DATA was never sent
        assert up.send_data_now(b"z", end=True)
        await asyncio.sleep(0.05)
        last = down.next_now()
        assert isinstance(last, h2stream.Data)
        assert last.data == b"z"
        assert isinstance(down.next_now(), h2stream.End)
        pool.close()
        server.close()

    aio.run(main())


def test_a_lane_key_found_again_after_its_connection_went_and_came_back() -> None:
    """h2pool rule 3: a lane's key is one object, and `stream_now`'s memo of the last
    key's connections is dropped with them: a connection opened again is found."""

    async def main() -> None:
        loop = asyncio.get_running_loop()
        pool = h2pool.H2Pool(2)
        key = pool.lane_key(("h2", "ep"), 1)
        assert pool.lane_key(("h2", "ep"), 1) is key
        assert pool.lane_key(("h2", "ep"), 0) is not key
        head = [
            (b":method", b"GET"),
            (b":scheme", b"http"),
            (b":path", b"/"),
            (b":authority", b"x"),
        ]
        servers: list[h2conn.H2Conn] = []

        async def opener(factory):
            a, b = socket.socketpair()
            server = h2conn.H2Conn(client_side=False)
            servers.append(server)
            await loop.connect_accepted_socket(lambda: server, b)
            return await loop.connect_accepted_socket(factory, a)

        first = await pool.stream(key, opener, head, end=True)
        assert pool.stream_now(key, head, end=True) is not None  # remembered: `key`'s list
        servers[0].close()  # the peer goes away: the pool forgets that connection
        for _ in range(50):
            if pool.count(key) == 0:
                break
            await asyncio.sleep(0.01)
        assert pool.count(key) == 0
        assert first.conn.closed
        assert pool.stream_now(key, head, end=True) is None
        second = await pool.stream(key, opener, head, end=True)
        again = pool.stream_now(key, head, end=True)
        assert again is not None
        assert again.conn is second.conn is not first.conn
        pool.close()
        for server in servers:
            server.close()

    aio.run(main())
