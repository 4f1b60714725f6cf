"""`redirects show`'s text for the eBPF acceleration section (ebpf_inspect.acceleration_lines)."""

from __future__ import annotations

from agent.redirect import ebpf_inspect, maps

COUNTERS = dict.fromkeys(maps.ACCEL_STAT_NAMES, 0) | {"redirected_msgs": 12, "off_burst": 1}


def test_active_node_shows_pod_state_sockets_and_every_node_counter_in_order():
    view = {"enabled": True, "node": "active", "sockets": 2, "counters": COUNTERS}
    lines = ebpf_inspect.acceleration_lines(view)
    assert lines[0] == (
        "acceleration: enabled for this pod; node sk_msg active; 2 pod sockets in ma_accel_socks"
    )
    assert lines[1:] == [
        f"acceleration counter (node) {name}: {COUNTERS[name]}" for name in maps.ACCEL_STAT_NAMES
    ]
    assert "acceleration counter (node) redirected_msgs: 12" in lines


def test_sk_msg_never_loaded_is_one_line_without_counters():
    view = {"enabled": False, "node": "not-loaded", "sockets": 0, "counters": COUNTERS}
    assert ebpf_inspect.acceleration_lines(view) == [
        "acceleration: disabled for this pod; node sk_msg not-loaded"
    ]


def test_unreadable_counters_say_why():
    view = {"enabled": True, "node": "detached", "sockets": 0, "counters": {}, "error": "EPERM"}
    assert ebpf_inspect.acceleration_lines(view) == [
        "acceleration: enabled for this pod; node sk_msg detached; 0 pod sockets in ma_accel_socks",
        "acceleration counters unreadable: EPERM",
    ]
