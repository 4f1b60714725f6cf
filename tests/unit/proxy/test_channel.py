"""The supervisor <-> worker channel: framing, fds, large messages, ordering, closing."""

from __future__ import annotations

import asyncio
import os
import pickle
import socket

import pytest

from agent.proxy import channel as ch
from agent.proxy.listener import ListenerKind


class End:
    """One channel end that collects what it receives."""

    def __init__(self, sock: socket.socket, name: str, *, start: bool = True) -> None:
        self.got: list[ch.Message] = []
        self.closed = 0
        self.arrived = asyncio.Event()
        self.channel = ch.Channel(sock, on_message=self._msg, on_closed=self._closed, name=name)
        if start:
            self.channel.start()

    def _msg(self, msg: ch.Message) -> None:
        self.got.append(msg)
        self.arrived.set()

    def _closed(self) -> None:
        self.closed += 1
        self.arrived.set()

    async def until(self, pred, within: float = 5.0) -> None:
        async with asyncio.timeout(within):
            while not pred():
                self.arrived.clear()
                await self.arrived.wait()


@pytest.fixture
async def ends():
    a_sock, b_sock = ch.pair()
    a, b = End(a_sock, "a"), End(b_sock, "b")
    yield a, b
    for end in (a, b):
        end.channel.close()
        for msg in end.got:
            if isinstance(msg, ch.AddListener):
                os.close(msg.fd)


def test_every_message_type_survives_encode_decode():
    msgs = [
        ch.RemoveListener(listener_id="l1", drain_s=2.5),
        ch.StateUpdate(key=("dst", "web:80"), value={"eps": [1, 2]}),
        ch.StateDelete(key="k"),
        ch.Drain(deadline_s=1.0),
        ch.Ready(worker_id=3),
        ch.Need(kind="destination", key="web.shop.svc.cluster.local:8080"),
        ch.Stats(
            worker_id=1,
            pid=2,
            listeners=3,
            open_connections=4,
            accepted_total=5,
            failed_total=6,
            bytes_up=7,
            bytes_down=8,
        ),
    ]
    for msg in msgs:
        grams, fds = ch.encode(msg)
        assert fds == []
        payload = b"".join([grams[0][ch.HEADER.size :], *grams[1:]])
        assert ch.decode(payload, []) == msg


def test_large_payload_is_split_into_chunks_with_one_header():
    msg = ch.StateUpdate(key="big", value=b"x" * (3 * ch.CHUNK + 17))
    grams, _ = ch.encode(msg)
    assert len(grams) >= 4
    assert all(len(g) <= ch.HEADER.size + ch.CHUNK for g in grams)
    (total,) = ch.HEADER.unpack_from(grams[0])
    assert total == sum(len(g) for g in grams) - ch.HEADER.size


def test_decode_rejects_foreign_objects_and_missing_fds():
    with pytest.raises(ch.ChannelError, match="unexpected object"):
        ch.decode(pickle.dumps({"not": "a message"}), [])
    add = ch.AddListener(listener_id="l", pod="p", kind=ListenerKind.INBOUND, netns="/x", fd=-1)
    with pytest.raises(ch.ChannelError, match="0 fds"):
        ch.decode(pickle.dumps(add), [])
    with pytest.raises(ch.ChannelError, match="undecodable"):
        ch.decode(b"\x80garbage", [])


async def test_messages_arrive_in_order_both_ways(ends):
    a, b = ends
    for i in range(200):
        a.channel.send(ch.StateUpdate(key=i, value=i * i))
    b.channel.send(ch.Ready(worker_id=7))
    await b.until(lambda: len(b.got) == 200)
    await a.until(lambda: len(a.got) == 1)
    assert [m.key for m in b.got] == list(range(200))  # type: ignore[union-attr]
    assert a.got == [ch.Ready(worker_id=7)]


async def test_large_state_message_arrives_whole_past_the_socket_buffer(ends):
    a, b = ends
    blob = os.urandom(6 * 1024 * 1024)  # far beyond SO_SNDBUF and the datagram queue
    a.channel.send(ch.StateUpdate(key="snapshot", value={"blob": blob, "n": 1}))
    a.channel.send(ch.StateUpdate(key="after", value=2))
    await b.until(lambda: len(b.got) == 2, within=20)
    first, second = b.got
    assert isinstance(first, ch.StateUpdate)
    assert first.value["blob"] == blob
    assert second == ch.StateUpdate(key="after", value=2)


async def test_listener_fd_is_passed_and_sender_may_close_its_own_at_once(ends):
    a, b = ends
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    ino = os.fstat(listener.fileno()).st_ino
    a.channel.send(
        ch.AddListener(
            listener_id="pod-a/outbound",
            pod="shop/web-1",
            kind=ListenerKind.OUTBOUND,
            netns="/run/netns/x",
            fd=listener.fileno(),
        )
    )
    listener.close()  # the channel dup'd it
    await b.until(lambda: len(b.got) == 1)
    (msg,) = b.got
    assert isinstance(msg, ch.AddListener)
    assert (msg.listener_id, msg.pod, msg.kind, msg.netns) == (
        "pod-a/outbound",
        "shop/web-1",
        ListenerKind.OUTBOUND,
        "/run/netns/x",
    )
    assert os.fstat(msg.fd).st_ino == ino
    # The received fd is the same listening socket: a client can connect and be accepted.
    received = socket.socket(fileno=os.dup(msg.fd))
    try:
        client = socket.create_connection(("127.0.0.1", port), timeout=2)
        conn, _ = received.accept()
        conn.close()
        client.close()
    finally:
        received.close()


async def test_fds_of_a_large_message_queue_survive_until_sent(ends):
    a, b = ends
    # Fill the peer's queue first so the AddListener has to wait in ours.
    a.channel.send(ch.StateUpdate(key="fill", value=b"y" * (2 * 1024 * 1024)))
    r, w = os.pipe()
    a.channel.send(
        ch.AddListener(listener_id="l", pod="p", kind=ListenerKind.INBOUND, netns="/n", fd=r)
    )
    os.close(r)
    await b.until(lambda: len(b.got) == 2, within=20)
    received = b.got[1]
    assert isinstance(received, ch.AddListener)
    os.write(w, b"ping")
    os.close(w)
    assert os.read(received.fd, 4) == b"ping"


async def test_peer_close_is_reported_once_and_send_then_fails(ends):
    a, b = ends
    a.channel.close()
    await b.until(lambda: b.closed > 0)
    await asyncio.sleep(0.05)
    assert b.closed == 1
    assert b.channel.closed
    assert b.channel.send(ch.Ready(worker_id=1)) is False


async def test_garbage_datagram_closes_the_channel(ends):
    a, b = ends
    raw = a.channel._sock
    raw.send(ch.HEADER.pack(5) + b"\x80junk")
    await b.until(lambda: b.closed > 0)
    assert b.got == []


async def test_flush_waits_until_the_peer_took_everything():
    a_sock, b_sock = ch.pair()
    a, b = End(a_sock, "a"), End(b_sock, "b", start=False)
    try:
        a.channel.send(ch.StateUpdate(key="big", value=b"z" * (3 * 1024 * 1024)))
        flushed = asyncio.ensure_future(a.channel.flush())
        await asyncio.sleep(0.1)
        assert not flushed.done()  # b does not read: the rest waits in a's queue
        b.channel.start()
        await b.until(lambda: len(b.got) == 1, within=20)
        await asyncio.wait_for(flushed, 5)
    finally:
        a.channel.close()
        b.channel.close()
