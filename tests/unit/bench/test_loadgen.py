"""The load generator's closed-loop `rr` mode, its error kinds and its side-by-side turns
against real servers on 127.0.0.1 (HTTP, and echo: rule 6); its slice plan and echo framing."""

from __future__ import annotations

import asyncio
import itertools
import re
import time

import pytest

from agent.bench import loadgen
from agent.bench.hist import Histogram

RESPONSE = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"


async def _server(counts: list[int]) -> asyncio.Server:
    """Answers every request 200; `counts` gets each request's arrival (perf ns)."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while await reader.readuntil(b"\r\n\r\n"):
                counts.append(time.perf_counter_ns())
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


def test_side_slices_give_each_path_its_time_in_shuffled_turns_never_twice_in_a_row():
    plan = loadgen.slice_plan(3, duration=2.5, slice_s=1.0, warmup=0.4, seed=7)
    warm, recorded = plan[:3], plan[3:]
    assert sorted(s.path for s in warm) == [0, 1, 2]
    assert all(not s.recorded and s.end_s - s.start_s == pytest.approx(0.4) for s in warm)
    assert all(s.recorded for s in recorded)
    assert len(recorded) == 9  # three cycles: 1 s, 1 s and the last 0.5 s each
    for path in range(3):
        mine = [s.end_s - s.start_s for s in recorded if s.path == path]
        assert sum(mine) == pytest.approx(2.5)
    for cycle in range(0, 9, 3):
        assert sorted(s.path for s in recorded[cycle : cycle + 3]) == [0, 1, 2]
    for a, b in itertools.pairwise(plan):
        assert a.path != b.path
        assert b.start_s == pytest.approx(a.end_s)  # back to back
    orders = {
        tuple(s.path for s in loadgen.slice_plan(3, duration=30, slice_s=1, seed=seed))
        for seed in range(3)
    }
    assert len(orders) == 3  # the seed shuffles


def test_side_slices_refuse_no_paths_or_no_time():
    for paths, duration, slice_s in ((0, 1.0, 1.0), (2, 0.0, 1.0), (2, 1.0, 0.0)):
        with pytest.raises(ValueError, match="side-by-side load needs"):
            loadgen.slice_plan(paths, duration=duration, slice_s=slice_s)


async def test_side_sends_each_path_its_rate_in_its_own_turns_only():
    """Two servers: each gets rate x duration recorded requests (and the warm-up's), and
    their arrivals come in runs that switch at most once per turn."""
    seen: dict[str, list[int]] = {"a": [], "b": []}
    a, b = await _server(seen["a"]), await _server(seen["b"])
    paths = [(n, "127.0.0.1", s.sockets[0].getsockname()[1]) for n, s in (("a", a), ("b", b))]
    async with a, b:
        out = await loadgen.run_side(
            paths, rate=200, connections=2, duration=0.6, slice_s=0.2, warmup=0.1
        )
    assert out["cycles"] == 3
    for name in ("a", "b"):
        got = out["paths"][name]
        assert got["errors"] == 0
        assert got["requests"] == 120  # 200/s for 0.6 s
        assert got["warmup_requests"] == 20
        assert Histogram.from_dict(got["hist"]).count == 120
        assert len(seen[name]) == 140
    names = [n for _, n in sorted((t, n) for n, times in seen.items() for t in times)]
    switches = sum(1 for x, y in itertools.pairwise(names) if x != y)
    assert 3 <= switches <= 7  # 8 turns (warm-up included): 7 switches, none within a turn


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--mode", "side", "--path", "a=127.0.0.1:1"], "two or more --path"),
        (["--mode", "side", "--path", "a=127.0.0.1:1", "--path", "b=x"], "NAME=IP:PORT"),
        (["--mode", "side", "--path", "a=h:1", "--path", "a=h:2"], "names must differ"),
        (["--mode", "rate"], "needs --target"),
    ],
)
def test_side_arguments_are_checked_with_what_was_given(argv, says, capsys):
    with pytest.raises(SystemExit):
        loadgen.parse_args(argv)
    assert says in capsys.readouterr().err


# --- echo (rule 6) ------------------------------------------------------------------------


def test_an_echo_is_done_when_every_byte_sent_came_back_in_any_pieces():
    reader = loadgen.EchoReader()
    reader.sent(b"abcdef")
    assert reader.received(b"ab") is False
    assert reader.received(b"cde") is False
    assert reader.received(b"f") is True
    reader.sent(b"xy")  # the next request on the same connection
    assert reader.received(b"xy") is True


@pytest.mark.parametrize(
    ("data", "says"),
    [
        (b"abX", "other bytes (3 bytes, 6 owed)"),
        (b"abcdefg", "more than was sent (7 bytes, 6 owed)"),
    ],
)
def test_an_echo_of_other_bytes_or_of_more_than_was_sent_is_an_error(data, says):
    reader = loadgen.EchoReader()
    reader.sent(b"abcdef")
    with pytest.raises(loadgen.EchoError, match=re.escape(says)):
        reader.received(data)


def test_bytes_when_nothing_is_owed_are_an_error():
    with pytest.raises(loadgen.EchoError, match="more than was sent"):
        loadgen.EchoReader().received(b"x")


def test_an_echo_request_is_size_bytes_of_a_pattern_and_never_empty():
    assert len(loadgen.echo_payload(64)) == 64
    assert len(loadgen.echo_payload(1000)) == 1000
    assert loadgen.echo_payload(4) == b"mesh"
    with pytest.raises(ValueError, match="at least one byte, got --size 0"):
        loadgen.echo_payload(0)


async def _echo_server(arrivals: list[int], *, spoil: bool = False) -> asyncio.Server:
    """Echoes what comes, byte for byte (`spoil`: the first byte changed); `arrivals` gets
    each read's time (perf ns)."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                arrivals.append(time.perf_counter_ns())
                writer.write(b"?" + data[1:] if spoil else data)
                await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()

    return await asyncio.start_server(serve, "127.0.0.1", 0)


async def test_side_echo_sends_each_path_its_rate_of_echoed_requests_in_its_own_turns():
    """Rule 6 keeps rule 5's turns, rate and counts: `size` bytes out, the same back."""
    seen: dict[str, list[int]] = {"a": [], "b": []}
    a, b = await _echo_server(seen["a"]), await _echo_server(seen["b"])
    paths = [(n, "127.0.0.1", s.sockets[0].getsockname()[1]) for n, s in (("a", a), ("b", b))]
    async with a, b:
        out = await loadgen.run_side(
            paths,
            rate=200,
            connections=2,
            duration=0.6,
            slice_s=0.2,
            warmup=0.1,
            proto="echo",
            size=64,
        )
    for name in ("a", "b"):
        got = out["paths"][name]
        assert got["errors"] == 0, got
        assert got["requests"] == 120  # 200/s for 0.6 s
        assert got["warmup_requests"] == 20
        assert Histogram.from_dict(got["hist"]).count == 120
        assert len(seen[name]) == 140  # one 64-byte request per read: nothing batched


async def test_side_echo_counts_a_wrong_echo_as_an_error_of_its_kind():
    a = await _echo_server([], spoil=True)
    b = await _echo_server([])
    paths = [(n, "127.0.0.1", s.sockets[0].getsockname()[1]) for n, s in (("a", a), ("b", b))]
    async with a, b:
        out = await loadgen.run_side(
            paths, rate=100, connections=1, duration=0.2, slice_s=0.1, proto="echo", size=8
        )
    spoiled, fine = out["paths"]["a"], out["paths"]["b"]
    assert spoiled["requests"] == 0
    assert spoiled["errors"] > 0
    assert set(spoiled["error_kinds"]) == {"EchoError: echo returned other bytes (8 bytes, 8 owed)"}
    assert (fine["errors"], fine["requests"]) == (0, 20)


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--mode", "rate", "--target", "h:1", "--proto", "echo"], "runs in --mode side only"),
        (["--mode", "side", "--path", "a=h:1", "--path", "b=h:2", "--size", "0"], "at least 1"),
    ],
)
def test_echo_arguments_are_checked_with_what_was_given(argv, says, capsys):
    with pytest.raises(SystemExit):
        loadgen.parse_args(argv)
    assert says in capsys.readouterr().err
