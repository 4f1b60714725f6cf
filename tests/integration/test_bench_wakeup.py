"""agent.bench.wakeup: round trips between two real processes, on one CPU and on two."""

from __future__ import annotations

import json
import os

import pytest

from agent.bench import wakeup


def test_each_case_is_measured_over_its_rounds_and_the_process_is_left_where_it_was() -> None:
    before = os.sched_getaffinity(0)
    cases = wakeup.measure(rounds=300, gap_rounds=100)
    assert os.sched_getaffinity(0) == before
    names = ["one CPU, back to back", "one CPU, 2 ms apart"]
    if len(before) > 1:
        names += ["two CPUs, back to back", "two CPUs, 2 ms apart"]
    assert [c.name for c in cases] == names
    assert [c.rounds for c in cases] == [300, 100] * (len(names) // 2)
    for c in cases:
        assert 0 < c.p50_us <= c.p99_us, c


def test_the_json_output_holds_every_case(capsys) -> None:
    assert wakeup.main(["--rounds", "200", "-o", "json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert {c["name"] for c in got} >= {"one CPU, back to back", "one CPU, 2 ms apart"}
    assert all(c["p50_us"] > 0 for c in got)


def test_too_few_rounds_is_refused_with_the_flag_named(capsys) -> None:
    with pytest.raises(SystemExit):
        wakeup.main(["--rounds", "10"])
    assert "--rounds: at least 100, got 10" in capsys.readouterr().err
