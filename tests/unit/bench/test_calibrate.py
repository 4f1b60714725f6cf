"""The machine calibration: two timed workloads and their ratio (agent.bench.calibrate)."""

from __future__ import annotations

import hashlib
import os

import pytest

from agent.bench import calibrate


def test_measure_times_both_workloads_and_their_ratio():
    got = calibrate.measure(rounds=2, scale=0.02)
    assert set(got) == {"python_ms", "c_ms", "python_over_c"}
    assert got["python_ms"] > 0
    assert got["c_ms"] > 0
    assert abs(got["python_over_c"] - got["python_ms"] / got["c_ms"]) < 0.01 * got["python_over_c"]


def test_more_work_takes_longer():
    small = calibrate.measure(rounds=3, scale=0.01)
    big = calibrate.measure(rounds=3, scale=0.2)
    assert big["python_ms"] > 4 * small["python_ms"]
    assert big["c_ms"] > 4 * small["c_ms"]


def test_the_workloads_do_their_work():
    # sha256 of the same bytes in one piece; the loop's total is deterministic
    data = (calibrate._CHUNK * 2)[:1_500_000]
    assert calibrate._c_work(1_500_000) == hashlib.sha256(data).digest()
    assert calibrate._python_work(1000) == calibrate._python_work(1000) > 0


def test_describe_names_both_ends():
    start = {"python_ms": 70.0, "c_ms": 35.0, "python_over_c": 2.0}
    end = {"python_ms": 90.0, "c_ms": 36.0, "python_over_c": 2.5}
    text = calibrate.describe(start, end)
    assert "python/C 2.0 at the start, 2.5 at the end" in text
    assert "70.0 / 90.0 ms" in text


@pytest.mark.parametrize(
    ("start", "end", "warned"),
    [(1.3, 1.88, "+45%"), (2.0, 1.6, "-20%"), (1.3, 1.49, None), (1.3, 1.12, None)],
)
def test_describe_warns_when_the_machine_changed_under_the_run(start, end, warned):
    text = calibrate.describe(
        {"python_ms": 20.0, "c_ms": 15.0, "python_over_c": start},
        {"python_ms": 30.0, "c_ms": 15.0, "python_over_c": end},
    )
    if warned is None:
        assert "moved" not in text
    else:
        assert f"python/C moved {warned} during the run" in text


STAT = """cpu  263510 0 49540 8611638 1200 0 22703 28742 0 0
cpu0 131000 0 24000 4300000 600 0 11000 14000 0 0
intr 1 2 3
"""


def test_steal_and_total_ticks_are_read_from_the_cpu_line():
    steal, total = calibrate.parse_cpu_times(STAT)
    assert steal == 28742
    assert total == 263510 + 49540 + 8611638 + 1200 + 22703 + 28742


def test_a_kernel_that_counts_no_steal_gives_none():
    assert calibrate.parse_cpu_times("cpu  1 2 3 4 5 6 7\n") is None
    assert calibrate.parse_cpu_times("intr 1\n") is None


def test_steal_pct_is_the_stolen_share_between_two_readings():
    assert calibrate.steal_pct((100, 1000), (130, 1200)) == 15.0
    assert calibrate.steal_pct((100, 1000), (100, 1000)) is None
    assert calibrate.steal_pct(None, (1, 2)) is None


def test_this_machine_is_read():
    got = calibrate.cpu_times()
    if got is not None:  # a kernel without steal accounting reads as None
        assert 0 <= got[0] <= got[1]


def test_idle_is_read_for_the_machine_then_each_cpu_with_iowait():
    got = calibrate.parse_idle(STAT)
    assert got == [
        (8611638 + 1200, 263510 + 49540 + 8611638 + 1200 + 22703 + 28742),
        (4300000 + 600, 131000 + 24000 + 4300000 + 600 + 11000 + 14000),
    ]


def test_idle_pct_is_each_entrys_idle_share_between_two_readings():
    before = [(100, 1000), (50, 500), (50, 500)]
    after = [(200, 1400), (60, 700), (140, 700)]
    assert calibrate.idle_pct(before, after) == [25.0, 5.0, 45.0]
    assert calibrate.idle_pct(before, before) is None  # no time passed
    assert calibrate.idle_pct(None, after) is None
    assert calibrate.idle_pct(before, after[:2]) is None  # a CPU came or went


def test_idle_times_reads_this_machine():
    got = calibrate.idle_times()
    assert got is not None
    assert len(got) == 1 + (os.cpu_count() or 0)  # the machine, then each CPU
    assert all(0 <= idle <= total for idle, total in got)
