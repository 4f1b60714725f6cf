"""The load generator's closed-loop `rr` mode and its error kinds against a real HTTP server on
127.0.0.1."""

from __future__ import annotations

import asyncio

from agent.bench import loadgen
from agent.bench.hist import Histogram

RESPONSE = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"


async def _server(counts: list[int]) -> asyncio.Server:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while await reader.readuntil(b"\r\n\r\n"):
                counts.append(1)
                writer.write(RESPONSE)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    return await asyncio.start_server(serve, "127.0.0.1", 0)


async def test_rr_sends_each_request_after_the_last_response_and_records_each():
    counts: list[int] = []
    server = await _server(counts)
    port = server.sockets[0].getsockname()[1]
    async with server:
        out = await loadgen.run_rr("127.0.0.1", port, connections=1, duration=0.3)
    assert out["errors"] == 0
    assert out["requests"] > 10
    # closed loop, one connection: the server saw the recorded requests and at most one more
    assert out["requests"] <= len(counts) <= out["requests"] + 1
    assert Histogram.from_dict(out["hist"]).count == out["requests"]


async def test_rr_counts_a_refused_connection_as_an_error():
    server = await _server([])
    port = server.sockets[0].getsockname()[1]
    server.close()
    await server.wait_closed()
    out = await loadgen.run_rr("127.0.0.1", port, connections=1, duration=0.05)
    assert out["requests"] == 0
    assert out["errors"] >= 1


async def test_errors_are_counted_by_kind_a_5xx_and_a_connection_closed_mid_exchange():
    """The server answers its first request with 503 and closes the second connection
    without answering: each error is counted under its own kind (rule 4)."""
    seen: list[int] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readuntil(b"\r\n\r\n")
            seen.append(1)
            if len(seen) == 1:
                writer.write(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\n\r\n")
                await writer.drain()
                await reader.readuntil(b"\r\n\r\n")  # the next request: closed unanswered
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        out = await loadgen.run_rr("127.0.0.1", port, connections=1, duration=0.1)
    kinds = out["error_kinds"]
    assert kinds["status 503"] == 1
    assert kinds["ConnectionError: closed by peer"] >= 1
    assert sum(kinds.values()) == out["errors"]
    assert out["requests"] == 0
