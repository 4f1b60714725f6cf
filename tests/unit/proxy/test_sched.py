"""agent.proxy.sched: the worker's scheduler slice, parsed and packed."""

from __future__ import annotations

import os
import threading

import pytest

from agent.proxy import sched


@pytest.mark.parametrize(
    ("raw", "seconds"),
    [
        ("100us", 0.0001),
        ("250US", 0.00025),
        ("0.5ms", 0.0005),
        ("1ms", 0.001),
        ("100ms", 0.1),
        ("0.002", 0.002),
    ],
)
def test_a_slice_is_a_duration_within_the_kernels_clamp(raw, seconds):
    assert sched.parse_slice(raw) == pytest.approx(seconds)


def test_off_asks_for_nothing():
    assert sched.parse_slice("off") is None
    assert sched.parse_slice(" OFF ") is None


@pytest.mark.parametrize("raw", ["50us", "99us", "101ms", "1s", "fast", "", "-100us", "nan"])
def test_a_slice_outside_the_clamp_or_not_a_duration_says_what_it_takes(raw):
    with pytest.raises(ValueError, match="off or a duration from 100us to 100ms"):
        sched.parse_slice(raw)


def test_the_attr_asks_sched_other_at_nice_0_for_the_slice_only():
    packed = sched.attr(100_000)
    assert len(packed) == sched.ATTR_SIZE == 56
    size, policy, flags, nice, priority, runtime, deadline, period, umin, umax = sched._ATTR.unpack(
        packed
    )
    assert (size, policy, flags, nice, priority) == (56, sched.SCHED_OTHER, 0, 0, 0)
    assert (runtime, deadline, period, umin, umax) == (100_000, 0, 0, 0, 0)


@pytest.mark.skipif(
    sched.slice_of(os.getpid()) is None, reason="the kernel reports no slice (Linux < 6.12)"
)
def test_a_thread_that_asks_runs_on_its_slice_and_the_others_keep_theirs():
    """Read back from the kernel (/proc/TID/sched) on a thread of this process."""
    before = sched.slice_of(os.getpid())
    seen: list[object] = []

    def ask() -> None:
        seen.append(sched.request(0.0003))
        seen.append(sched.slice_of(threading.get_native_id()))

    thread = threading.Thread(target=ask)
    thread.start()
    thread.join()
    assert seen == [True, 300_000]
    assert sched.slice_of(os.getpid()) == before != 300_000


def test_a_task_that_does_not_exist_has_no_slice():
    assert sched.slice_of(2**22 + 1) is None
