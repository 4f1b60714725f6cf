"""The node's admin HTTP/1.1 server (default 0.0.0.0:4191, flag `--admin-addr`).

Endpoints (Linkerd's admin names):
    GET  /metrics          Prometheus text 0.0.4 from the `metrics` callable
    GET  /live             200 "live"
    GET  /ready            200 "ready", or 503 with one reason per line
    GET  /config_dump      JSON from the `config_dump` callable, scrubbed of secrets
    GET  /proxy-log-level  the current level
    PUT  /proxy-log-level  set it (body `info` or `agent.proxy=debug,info`); local only
    GET  /tap              JSON lines of live events (`?limit=N`, `?key=value` filters); local only

Rules:
1. Local only means: the peer *and* our end of the connection are loopback
   addresses. The agent runs in the host network namespace and this socket
   lives there, so a loopback connection came from a process in the host
   netns. A pod's netns has its own 127.0.0.1 which cannot reach ours: a pod
   reaches this server only through the node's address, so its peer address
   is the pod IP and it gets 403. (This holds while the host keeps the kernel
   default `route_localnet=0`, which drops 127.0.0.0/8 arriving on other
   interfaces as martians.)
2. Small and robust: httptools parses; headers are capped at 16 KiB, bodies
   at 64 KiB; a connection idle for `idle_timeout_s` is closed; keep-alive
   and pipelining work; a callable that raises gives 500 and is logged, never
   taking the server down.
3. `/config_dump` output passes through `controls.scrub`, and a body that
   would still contain "PRIVATE KEY" is refused with 500 (a BUG).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import logging
from collections import deque
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import TYPE_CHECKING, Any, Self
from urllib.parse import parse_qsl

import httptools

from agent import aio
from agent.admin.aggregate import CONTENT_TYPE
from agent.admin.controls import PEM_PRIVATE, LogLevelControl, Readiness, scrub
from agent.admin.tap import TapFull, TapHub
from agent.config import ADMIN_PORT, Option, parse_host_port

if TYPE_CHECKING:
    from collections.abc import Callable

    from agent.admin.tap import Subscription

logger = logging.getLogger(__name__)

ADMIN_ADDR_OPTION = Option(
    flag="--admin-addr",
    parse=parse_host_port,
    default=f"0.0.0.0:{ADMIN_PORT}",
    help="admin server address (/metrics /live /ready /config_dump)",
)
MAX_HEADER_BYTES = 16 * 1024
MAX_BODY_BYTES = 64 * 1024
READ_CHUNK = 64 * 1024


def is_local_caller(peer: tuple[Any, ...] | None, local: tuple[Any, ...] | None) -> bool:
    """True when both ends of the connection are loopback addresses (rule 1)."""
    if not peer or not local:
        return False
    try:
        ips = [ipaddress.ip_address(str(a[0]).split("%")[0]) for a in (peer, local)]
    except ValueError:
        return False
    for i, ip in enumerate(ips):
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ips[i] = ip.ipv4_mapped
    return all(ip.is_loopback for ip in ips)


@dataclass(slots=True)
class Request:
    """One parsed request."""

    method: str = ""
    path: str = ""
    query: dict[str, str] = field(default_factory=dict)
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    keep_alive: bool = True


@dataclass(frozen=True, slots=True, kw_only=True)
class Response:
    status: int
    body: bytes = b""
    content_type: str = "text/plain; charset=utf-8"
    headers: tuple[tuple[str, str], ...] = ()


class _TooLarge(Exception):  # noqa: N818 - internal signal
    pass


class _Parser:
    """httptools callbacks collecting complete requests in `done`."""

    def __init__(self) -> None:
        self.parser = httptools.HttpRequestParser(self)
        self.done: deque[Request] = deque()
        self._url = b""
        self._headers: dict[str, str] = {}
        self._body = bytearray()
        self._header_bytes = 0
        self.too_large = False

    def feed(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_message_begin(self) -> None:
        self._url, self._headers, self._body, self._header_bytes = b"", {}, bytearray(), 0

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._count(len(url))

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count(len(name) + len(value))
        self._headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_body(self, body: bytes) -> None:
        self._body += body
        if len(self._body) > MAX_BODY_BYTES:
            self.too_large = True
            raise _TooLarge

    def on_message_complete(self) -> None:
        url = httptools.parse_url(self._url)
        self.done.append(
            Request(
                method=self.parser.get_method().decode("ascii", "replace"),
                path=(url.path or b"/").decode("utf-8", "replace"),
                query=dict(parse_qsl((url.query or b"").decode("utf-8", "replace"))),
                headers=self._headers,
                body=bytes(self._body),
                keep_alive=self.parser.should_keep_alive(),
            )
        )

    def _count(self, n: int) -> None:
        self._header_bytes += n
        if self._header_bytes > MAX_HEADER_BYTES:
            self.too_large = True
            raise _TooLarge


def _text(status: int, text: str) -> Response:
    return Response(status=status, body=text.encode() + b"\n")


_BAD_REQUEST = _text(400, "bad request")


class AdminServer:
    """The admin server; see the module docstring for endpoints and rules."""

    def __init__(  # noqa: PLR0913 - each is one endpoint's provider
        self,
        *,
        host: str = "0.0.0.0",
        port: int = ADMIN_PORT,
        metrics: Callable[[], str],
        ready: Callable[[], Readiness],
        config_dump: Callable[[], Any] | None = None,
        log_level: LogLevelControl | None = None,
        tap: TapHub | None = None,
        idle_timeout_s: float = 60.0,
    ) -> None:
        self.host = host
        self._port = port
        self._metrics = metrics
        self._ready = ready
        self._config_dump = config_dump or dict
        self.log_level = log_level or LogLevelControl()
        self.tap = tap or TapHub()
        self.idle_timeout_s = idle_timeout_s
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    @property
    def port(self) -> int:
        """The bound port (useful after binding port 0)."""
        if self._server is None or not self._server.sockets:
            return self._port
        return int(self._server.sockets[0].getsockname()[1])

    async def start(self) -> None:
        """Bind and start accepting.

        Raises:
            OSError: the address cannot be bound.
        """
        self._server = await asyncio.start_server(
            self._serve, self.host, self._port, reuse_address=True
        )
        logger.info("admin server listening", extra={"addr": f"{self.host}:{self.port}"})

    async def close(self) -> None:
        """Stop accepting and close every open connection."""
        if self._server is not None:
            self._server.close()
        for writer in list(self._writers):
            writer.close()
        for writer in list(self._writers):
            with contextlib.suppress(Exception):
                await writer.wait_closed()
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # --- connections ----------------------------------------------------------

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        local = is_local_caller(
            writer.get_extra_info("peername"), writer.get_extra_info("sockname")
        )
        try:
            await self._requests(reader, writer, local)
        except (ConnectionError, TimeoutError, asyncio.IncompleteReadError):
            pass
        except Exception:
            logger.exception("BUG: admin connection failed")
        finally:
            self._writers.discard(writer)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _requests(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, local: bool
    ) -> None:
        parser = _Parser()
        while True:
            while not parser.done:
                data = await asyncio.wait_for(reader.read(READ_CHUNK), self.idle_timeout_s)
                if not data:
                    return
                try:
                    parser.feed(data)
                except (_TooLarge, httptools.HttpParserError):
                    # httptools wraps what a callback raises; the flag says which it was.
                    bad = _text(413, "request too large") if parser.too_large else _BAD_REQUEST
                    await self._send(writer, bad, keep_alive=False)
                    return
            req = parser.done.popleft()
            if req.path == "/tap" and req.method == "GET":
                await self._tap(req, reader, writer, local)
                return
            response = self._dispatch(req, local)
            await self._send(writer, response, keep_alive=req.keep_alive, head=req.method == "HEAD")
            if not req.keep_alive:
                return

    async def _send(
        self,
        writer: asyncio.StreamWriter,
        resp: Response,
        *,
        keep_alive: bool,
        head: bool = False,
    ) -> None:
        reason = HTTPStatus(resp.status).phrase
        lines = [f"HTTP/1.1 {resp.status} {reason}"]
        if resp.status != 204:
            lines.append(f"Content-Type: {resp.content_type}")
            lines.append(f"Content-Length: {len(resp.body)}")
        lines.extend(f"{k}: {v}" for k, v in resp.headers)
        lines.append("Connection: " + ("keep-alive" if keep_alive else "close"))
        head_bytes = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
        writer.write(head_bytes if head or resp.status == 204 else head_bytes + resp.body)
        await writer.drain()

    # --- routing ---------------------------------------------------------------

    def _dispatch(self, req: Request, local: bool) -> Response:
        routes: dict[str, dict[str, Callable[[Request], Response]]] = {
            "/metrics": {"GET": self._get_metrics},
            "/live": {"GET": lambda _: _text(200, "live")},
            "/ready": {"GET": self._get_ready},
            "/config_dump": {"GET": self._get_config_dump},
            "/proxy-log-level": {"GET": self._get_log_level, "PUT": self._put_log_level},
            "/tap": {"GET": lambda _: _text(400, "bad tap request")},
        }
        methods = routes.get(req.path)
        if methods is None:
            return _text(404, "not found")
        method = "GET" if req.method == "HEAD" else req.method
        handler = methods.get(method)
        if handler is None:
            allow = ", ".join(sorted(methods))
            return Response(status=405, body=b"method not allowed\n", headers=(("Allow", allow),))
        if method != "GET" and not local:
            logger.info("refused non-local admin change", extra={"path": req.path})
            return _text(403, "only local callers in the host network namespace may change this")
        try:
            return handler(req)
        except Exception:
            logger.exception("admin endpoint failed", extra={"path": req.path})
            return _text(500, "internal error")

    def _get_metrics(self, _: Request) -> Response:
        return Response(status=200, body=self._metrics().encode(), content_type=CONTENT_TYPE)

    def _get_ready(self, _: Request) -> Response:
        state = self._ready()
        if state.ready:
            return _text(200, "ready")
        return _text(503, "\n".join(["not ready", *state.reasons]))

    def _get_config_dump(self, _: Request) -> Response:
        body = json.dumps(scrub(self._config_dump()), indent=2, sort_keys=True)
        if PEM_PRIVATE in body:
            logger.error("BUG: config_dump still holds a private key after scrubbing")
            return _text(500, "internal error")
        return Response(status=200, body=body.encode() + b"\n", content_type="application/json")

    def _get_log_level(self, _: Request) -> Response:
        return _text(200, self.log_level.current)

    def _put_log_level(self, req: Request) -> Response:
        try:
            self.log_level.set(req.body.decode("utf-8", "replace"))
        except ValueError as exc:
            return _text(400, str(exc))
        return Response(status=204)

    # --- tap ---------------------------------------------------------------------

    async def _tap(
        self,
        req: Request,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        local: bool,
    ) -> None:
        if not local:
            await self._send(writer, _text(403, "tap is for local callers only"), keep_alive=False)
            return
        query = dict(req.query)
        try:
            limit = int(query.pop("limit", "0"))
        except ValueError:
            await self._send(writer, _text(400, "limit must be an integer"), keep_alive=False)
            return
        try:
            sub = self.tap.subscribe(query)
        except TapFull as exc:
            await self._send(writer, _text(503, str(exc)), keep_alive=False)
            return
        with sub:
            writer.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: application/x-ndjson\r\n"
                b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
            )
            await writer.drain()
            await self._stream(sub, reader, writer, limit)

    async def _stream(
        self,
        sub: Subscription,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        limit: int,
    ) -> None:
        gone = aio.spawn(reader.read(1), name="admin-tap-eof")  # any read result: reader left
        sent = 0
        try:
            while limit <= 0 or sent < limit:
                batch_task = aio.spawn(sub.next_batch(), name="admin-tap-batch")
                await asyncio.wait({batch_task, gone}, return_when=asyncio.FIRST_COMPLETED)
                if not batch_task.done():
                    batch_task.cancel()
                    return
                batch = batch_task.result()
                if limit > 0:
                    events = [b for b in batch if not b.startswith(b'{"dropped"')]
                    room = limit - sent
                    batch = batch[: len(batch) - max(len(events) - room, 0)]
                    sent += min(len(events), room)
                chunk = b"".join(batch)
                writer.write(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
                await asyncio.wait_for(writer.drain(), self.idle_timeout_s)
            writer.write(b"0\r\n\r\n")
            await writer.drain()
        finally:
            gone.cancel()
