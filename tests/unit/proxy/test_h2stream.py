"""agent.proxy.h2stream's queue: what the connection pushed, taken in order, put back,
reset for good."""

from __future__ import annotations

import pytest

from agent.proxy.h2conn import H2Conn
from agent.proxy.h2stream import END, Data, H2Stream, Head, Reset, StreamGoneError, Trailers


@pytest.fixture
async def stream():
    return H2Stream(H2Conn(client_side=True), 1)


async def test_items_come_out_in_the_order_pushed_and_the_queue_empties(stream):
    head, data = Head([(b":status", b"200")], end=False), Data(b"ok", 2)
    for item in (head, data, END):
        stream.push(item)
    assert stream.remote_ended
    assert stream.next_now() is head
    assert stream.next_now() is data
    assert stream.peek_end()
    assert stream.next_now() is END
    assert stream.next_now() is None
    assert stream.items == []  # all read: emptied


async def test_queued_bytes_counts_the_data_not_taken_yet(stream):
    assert stream.queued_bytes() == 0
    for item in (Head([(b":status", b"200")], end=False), Data(b"abc", 3), Data(b"de", 2), END):
        stream.push(item)
    assert stream.queued_bytes() == 5
    stream.next_now()
    stream.next_now()
    assert stream.queued_bytes() == 2  # the first DATA taken
    stream.next_now()
    assert stream.queued_bytes() == 0


async def test_whole_within_needs_the_end_queued_no_reset_and_the_data_under_the_limit(stream):
    stream.push(Data(b"abc", 3))
    assert not stream.whole_within(10)  # the end has not come
    stream.push(Data(b"de", 2))
    stream.push(END)
    assert stream.whole_within(5)
    assert not stream.whole_within(4)  # more DATA than the limit
    reset = H2Stream(H2Conn(client_side=True), 3)
    reset.push(END)
    assert reset.whole_within(0)
    reset.gone = 8  # reset (CANCEL)
    assert not reset.whole_within(0)


async def test_an_item_put_back_comes_out_first_again(stream):
    data, trailers = Data(b"a", 1), Trailers([(b"grpc-status", b"0")])
    stream.push(data)
    stream.push(trailers)
    taken = stream.next_now()
    stream.unget(taken)
    assert stream.next_now() is data
    stream.push(END)
    assert stream.next_now() is trailers
    last = stream.next_now()
    stream.unget(last)  # taken as the queue emptied: put back into the empty queue
    assert stream.items == [END]
    assert stream.next_now() is END


async def test_bodiless_and_drop_end_see_only_what_is_still_queued(stream):
    head = Head([(b":status", b"204")], end=False)
    stream.push(head)
    stream.push(END)
    assert not stream.bodiless  # the head is still queued
    assert stream.next_now() is head
    assert stream.bodiless
    assert stream.peek_end()
    stream.drop_end()
    assert stream.next_now() is None
    assert not stream.peek_end()


async def test_a_reset_stays_queued_so_every_later_take_sees_it(stream):
    stream.push(Head([(b":status", b"200")], end=False))
    stream.push(Reset(8))
    stream.next_now()
    for _ in range(2):
        with pytest.raises(StreamGoneError) as gone:
            stream.next_now()
        assert gone.value.code == 8


async def test_discard_keeps_only_the_reset_of_a_gone_stream(stream):
    stream.push(Head([], end=False))
    stream.push(END)
    stream.next_now()
    stream.discard()
    assert stream.items == []
    assert stream.next_now() is None
    stream.gone = 5
    stream.discard()
    assert [type(i) for i in stream.items] == [Reset]
    with pytest.raises(StreamGoneError):
        stream.next_now()
