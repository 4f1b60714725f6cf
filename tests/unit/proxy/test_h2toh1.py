"""What of an upgraded request's body goes with its head to the app (h2toh1 rule 2)."""

from __future__ import annotations

import pytest

from agent import aio
from agent.proxy import origproto
from agent.proxy.h2conn import H2Conn
from agent.proxy.h2stream import END, Data, H2Stream, StreamGoneError
from agent.proxy.h2toh1 import JOIN_BYTES, take_queued_body


def _stream(*items: object) -> H2Stream:
    stream = H2Stream(H2Conn(client_side=False), 1)
    for item in items:
        stream.push(item)  # type: ignore[arg-type]
    return stream


def test_a_body_that_arrived_with_its_end_goes_whole_with_the_head() -> None:
    async def main() -> None:
        stream = _stream(Data(b"ab", 0), Data(b"cd", 0), END)
        parts = [b"HEAD"]
        assert take_queued_body(stream, parts, chunked=False)
        assert parts == [b"HEAD", b"ab", b"cd"]
        assert stream.next_now() is None

    aio.run(main())


def test_a_chunked_body_is_encoded_and_closed_with_the_last_chunk() -> None:
    async def main() -> None:
        stream = _stream(Data(b"ab", 0), END)
        parts = [b"HEAD"]
        assert take_queued_body(stream, parts, chunked=True)
        assert parts == [b"HEAD", origproto.chunk(b"ab"), origproto.last_chunk()]

    aio.run(main())


def test_a_body_still_arriving_leaves_the_rest_to_the_stream() -> None:
    async def main() -> None:
        stream = _stream(Data(b"ab", 0))
        parts = [b"HEAD"]
        assert not take_queued_body(stream, parts, chunked=False)
        assert parts == [b"HEAD", b"ab"]
        big = b"x" * JOIN_BYTES
        stream = _stream(Data(big, 0), Data(b"tail", 0), END)
        parts = [b"HEAD"]
        assert not take_queued_body(stream, parts, chunked=False)  # at most JOIN_BYTES
        assert parts == [b"HEAD", big]
        left = stream.next_now()  # what is left stays queued for the body loop
        assert isinstance(left, Data)
        assert left.data == b"tail"
        assert stream.next_now() is END

    aio.run(main())


def test_a_reset_stream_fails_as_the_body_loop_would() -> None:
    async def main() -> None:
        stream = _stream(Data(b"ab", 0))
        stream.peer_reset(8)
        with pytest.raises(StreamGoneError):
            take_queued_body(stream, [b"HEAD"], chunked=False)

    aio.run(main())
