"""The sandbox's built-in application: an echo server on each declared port.

    python -m agent.sandbox.app --pod P --namespace N --http 8080 --tcp 5432

HTTP ports answer every request with JSON `{"pod", "namespace", "method",
"path", "client_id"}` (`client_id`: the `l5d-client-id` header received, or
""); `/status/NNN` answers with status NNN, `/delay/MS` answers after MS
milliseconds; on any path the query parameters `status=NNN`, `delay=MS` and
`fail_pod=NAME` (500 from that pod only) do the same, so routes such as
`/slow/{id}` or `/retry/{id}` can be exercised. Opaque (`--tcp`) ports echo
every byte back, and answer a client's half-close with their own once the
echo is written; a connection whose first bytes are `RESET_MARK` gets that
first read echoed and is then reset (SO_LINGER 0), so tests can make an
upstream reset. With no port at all the process just waits: it is the pod's
"pause" process, so the pod has a process in its cgroup for the agent to
discover.

Rules:
1. HTTP/1.1 with keep-alive; `Connection: close` or HTTP/1.0 without
   keep-alive closes after the response. Request bodies (Content-Length or
   chunked) are read and discarded.
2. A malformed request gets 400 and the connection closes.
3. SIGTERM/SIGINT stop the process at once.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import re
import signal
import socket
import struct
import sys
import urllib.parse
from dataclasses import dataclass
from http import HTTPStatus

_STATUS = re.compile(r"^/status/(\d{3})(?:[/?].*)?$")
_DELAY = re.compile(r"^/delay/(\d+)(?:[/?].*)?$")
MAX_HEAD = 64 * 1024
RESET_MARK = b"meshagent-sandbox-reset\n"


@dataclass(frozen=True, slots=True, kw_only=True)
class Request:
    method: str
    path: str
    version: str
    headers: dict[str, str]  # lower-case names; the last value wins


class BadRequest(Exception):  # noqa: N818 - a 400 signal
    """The request could not be parsed."""


def parse_head(head: bytes) -> Request:
    """Request line and headers (without the final blank line). Raises BadRequest."""
    try:
        text = head.decode("latin-1")
        line, *rest = text.split("\r\n")
        method, path, version = line.split(" ")
    except ValueError:
        raise BadRequest("bad request line") from None
    if not version.startswith("HTTP/1."):
        raise BadRequest(f"unsupported version {version!r}")
    headers: dict[str, str] = {}
    for item in rest:
        if not item:
            continue
        name, sep, value = item.partition(":")
        if not sep or not name or name != name.strip():
            raise BadRequest(f"bad header line {item!r}")
        headers[name.lower()] = value.strip()
    return Request(method=method, path=path, version=version, headers=headers)


def respond(req: Request, *, pod: str, namespace: str) -> tuple[int, float, bytes]:
    """(status, delay in seconds, JSON body) for `req` (pure)."""
    status, delay = 200, 0.0
    path, _, query = req.path.partition("?")
    params = dict(urllib.parse.parse_qsl(query))
    if m := _STATUS.match(path):
        status = int(m.group(1))
    elif m := _DELAY.match(path):
        delay = int(m.group(1)) / 1000
    if params.get("status", "").isdigit() and len(params["status"]) == 3:
        status = int(params["status"])
    if params.get("delay", "").isdigit():
        delay = int(params["delay"]) / 1000
    if params.get("fail_pod") == pod:
        status = 500
    body = {
        "pod": pod,
        "namespace": namespace,
        "method": req.method,
        "path": req.path,
        "client_id": req.headers.get("l5d-client-id", ""),
    }
    return status, delay, json.dumps(body).encode() + b"\n"


def keep_alive(req: Request) -> bool:
    conn = req.headers.get("connection", "").lower()
    if req.version == "HTTP/1.0":
        return conn == "keep-alive"
    return conn != "close"


def response_bytes(status: int, body: bytes, *, close: bool) -> bytes:
    try:
        reason = HTTPStatus(status).phrase
    except ValueError:
        reason = "Status"
    head = (
        f"HTTP/1.1 {status} {reason}\r\n"
        "content-type: application/json\r\n"
        f"content-length: {len(body)}\r\n"
        f"connection: {'close' if close else 'keep-alive'}\r\n\r\n"
    )
    return head.encode() + body


async def _read_body(reader: asyncio.StreamReader, req: Request) -> None:
    if req.headers.get("transfer-encoding", "").lower() == "chunked":
        while True:
            size_line = await reader.readuntil(b"\r\n")
            try:
                size = int(size_line.split(b";")[0].strip(), 16)
            except ValueError:
                raise BadRequest("bad chunk size") from None
            if size == 0:
                while (await reader.readuntil(b"\r\n")) != b"\r\n":
                    pass  # trailers
                return
            await reader.readexactly(size + 2)
    length = req.headers.get("content-length")
    if length:
        if not length.isdigit():
            raise BadRequest("bad content-length")
        await reader.readexactly(int(length))


def _bounded(head: bytes) -> bytes:
    """Raises: BadRequest: the request head is over MAX_HEAD bytes."""
    if len(head) > MAX_HEAD:
        raise BadRequest("head too large")
    return head


class Echo:
    """HTTP and TCP echo servers of one pod."""

    def __init__(self, pod: str, namespace: str) -> None:
        self.pod = pod
        self.namespace = namespace

    async def http(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except asyncio.IncompleteReadError:
                    return
                req = parse_head(_bounded(head)[:-4])
                await _read_body(reader, req)
                status, delay, body = respond(req, pod=self.pod, namespace=self.namespace)
                if delay:
                    await asyncio.sleep(delay)
                close = not keep_alive(req)
                writer.write(response_bytes(status, body, close=close))
                await writer.drain()
                if close:
                    return
        except BadRequest as exc:
            writer.write(response_bytes(400, f'{{"error": "{exc}"}}\n'.encode(), close=True))
            with contextlib.suppress(OSError):
                await writer.drain()
        except (OSError, asyncio.LimitOverrunError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()

    async def tcp(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            first = True
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
                if first and data.startswith(RESET_MARK):
                    await _reset(writer)
                    return
                first = False
            if writer.can_write_eof():
                writer.write_eof()
        except OSError:
            pass
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()


async def _reset(writer: asyncio.StreamWriter) -> None:
    """End with a reset once what was written has left this process."""
    writer.transport.set_write_buffer_limits(high=0)  # drain() now waits for an empty buffer
    await writer.drain()
    writer.get_extra_info("socket").setsockopt(
        socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
    )
    writer.transport.abort()


async def serve(pod: str, namespace: str, http: list[int], tcp: list[int]) -> None:
    """Listen on every port (all addresses) until cancelled or signalled."""
    echo = Echo(pod, namespace)
    servers = [
        await asyncio.start_server(echo.http, host=None, port=p, reuse_address=True, limit=MAX_HEAD)
        for p in http
    ] + [await asyncio.start_server(echo.tcp, host=None, port=p, reuse_address=True) for p in tcp]
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    sys.stdout.write(f"echo pod={namespace}/{pod} http={http} tcp={tcp} ready\n")
    sys.stdout.flush()
    try:
        await stop.wait()
    finally:
        for srv in servers:
            srv.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m agent.sandbox.app", description=__doc__)
    parser.add_argument("--pod", required=True)
    parser.add_argument("--namespace", required=True)
    parser.add_argument("--http", type=int, action="append", default=[], metavar="PORT")
    parser.add_argument("--tcp", type=int, action="append", default=[], metavar="PORT")
    args = parser.parse_args(argv)
    try:
        asyncio.run(serve(args.pod, args.namespace, args.http, args.tcp))
    except OSError as exc:
        sys.stderr.write(f"echo: {exc}\n")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
