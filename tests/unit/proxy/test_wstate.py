"""agent.proxy.wstate: the worker's state copy asks once per key and remembers a wait that
timed out until the key changes."""

from __future__ import annotations

import asyncio

import pytest

from agent.proxy import channel as ch
from agent.proxy.wstate import WorkerState

KEY = ("policy", "shop/web", 9000)


def test_a_timed_out_want_is_unanswered_until_an_update_or_delete_of_its_key() -> None:
    asked: list[ch.Need] = []
    state = WorkerState(asked.append)

    async def scenario() -> None:
        assert not state.unanswered(KEY)
        with pytest.raises(TimeoutError):
            await state.want(KEY, kind="policy", wait_s=0.01)
        assert state.unanswered(KEY)
        assert not state.unanswered(("policy", "shop/web", 9001))
        with pytest.raises(TimeoutError):  # still waits if asked to: callers choose
            await state.want(KEY, kind="policy", wait_s=0.01)
        assert asked == [ch.Need(kind="policy", key=KEY)]  # asked once
        state.apply(ch.StateUpdate(key=KEY, value="answer"))
        assert not state.unanswered(KEY)
        assert await state.want(KEY, kind="policy", wait_s=0.01) == "answer"
        state.apply(ch.StateDelete(key=KEY))
        with pytest.raises(TimeoutError):
            await state.want(KEY, kind="policy", wait_s=0.01)
        assert state.unanswered(KEY)
        state.apply(ch.StateDelete(key=KEY))
        assert not state.unanswered(KEY)  # gone: the next wait starts afresh

    asyncio.run(scenario())
