"""agent.aio: tasks referenced until they end, failures logged; `at_most`."""

from __future__ import annotations

import asyncio
import logging

import pytest

from agent import aio


async def _fail() -> None:
    raise ValueError("boom")


async def _ok() -> int:
    return 1


def test_a_task_set_holds_its_tasks_until_they_end_and_logs_a_failure(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def main() -> None:
        tasks = aio.TaskSet(asyncio.get_running_loop())
        ok = tasks.spawn(_ok(), name="ok")
        bad = tasks.spawn(_fail(), name="bad")
        assert tasks.tasks == {ok, bad}
        await asyncio.wait([ok, bad])
        await asyncio.sleep(0)  # the done callbacks run
        assert tasks.tasks == set()
        assert ok.result() == 1

    with caplog.at_level(logging.ERROR, logger="agent.aio"):
        aio.run(main())
    (record,) = [r for r in caplog.records if r.message == "task failed"]
    assert record.task == "bad"  # type: ignore[attr-defined]
    assert record.exc_info is not None
    assert isinstance(record.exc_info[1], ValueError)


def test_a_cancelled_task_is_not_a_failure(caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        tasks = aio.TaskSet(asyncio.get_running_loop())
        t = tasks.spawn(asyncio.sleep(10), name="sleeper")
        await asyncio.sleep(0)
        t.cancel()
        await asyncio.wait([t])
        await asyncio.sleep(0)
        assert tasks.tasks == set()

    with caplog.at_level(logging.ERROR, logger="agent.aio"):
        aio.run(main())
    assert not [r for r in caplog.records if r.message == "task failed"]


def test_at_most_runs_every_coroutine_never_more_than_width_at_once() -> None:
    running, peak, done = 0, 0, []

    async def step(i: int) -> None:
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        await asyncio.sleep(0.01)
        running -= 1
        done.append(i)

    aio.run(aio.at_most(3, [step(i) for i in range(10)]))
    assert sorted(done) == list(range(10))
    assert peak == 3


def test_at_most_finishes_the_others_before_raising_the_first_error() -> None:
    done = []

    async def step(i: int) -> None:
        await asyncio.sleep(0.01 * i)
        if i in (1, 3):
            raise ValueError(f"step {i}")
        done.append(i)

    with pytest.raises(ValueError, match="step 1"):
        aio.run(aio.at_most(2, [step(i) for i in range(6)]))
    assert done == [0, 2, 4, 5]
