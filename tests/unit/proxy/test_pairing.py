"""agent.proxy.pairing's pure part: which kernel keys a relay's two legs pair."""

from __future__ import annotations

import ctypes

from agent.proxy.pairing import Leg, keys_for, sock_key
from agent.redirect import maps


def fields(key: maps.SockKeyC) -> tuple[int, str, str, int, int]:
    return (
        key.netns,
        maps.ip_str(key.local_ip),
        maps.ip_str(key.remote_ip),
        key.local_port,
        key.remote_port,
    )


def test_a_key_holds_addresses_as_the_kernel_does_and_ports_in_host_order() -> None:
    key = sock_key(7, ("10.0.0.1", 4140), ("127.0.0.1", 50000))
    assert fields(key) == (7, "10.0.0.1", "127.0.0.1", 4140, 50000)
    assert bytes(key)[8:12] == bytes([10, 0, 0, 1])  # network order in memory
    assert ctypes.sizeof(key) == 24


def test_each_app_end_is_paired_with_the_worker_socket_on_the_other_leg() -> None:
    # A's app dialled B's port; connect4 sent it to the outbound listener in A's netns
    # (11). The worker dialled B's app from B's pod IP in B's netns (22).
    down = Leg(11, ("127.0.0.1", 4140), ("127.0.0.1", 40001))
    up = Leg(22, ("10.1.0.9", 51000), ("10.1.0.9", 9400))
    keys = keys_for(down, up)
    assert fields(keys.app_a) == (11, "127.0.0.1", "127.0.0.1", 40001, 4140)
    assert fields(keys.to_upstream) == (22, "10.1.0.9", "10.1.0.9", 51000, 9400)
    assert fields(keys.app_b) == (22, "10.1.0.9", "10.1.0.9", 9400, 51000)
    assert fields(keys.to_downstream) == (11, "127.0.0.1", "127.0.0.1", 4140, 40001)
