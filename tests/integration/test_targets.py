"""`Targets.watch_unanswered` over a real control-plane client whose streams fail.

The check answers `exists=False` for a target whose streams fail before any answer
(here: nothing listens on the control plane's port), and it runs only while such a
target waits: an agent whose targets are all answered does not wake for it (each of
its wake-ups is a sleep, counted).
"""

from __future__ import annotations

import asyncio

from agent import aio
from agent.bench.mesh import free_port
from agent.control.cache import StateCache
from agent.control.client import Backoff, ContextToken, ControlPlaneClient
from agent.proxy import channel as ch
from agent.proxy import state
from agent.supervisor import targets as targets_mod
from agent.supervisor.targets import UNANSWERED_CHECK_S, Targets

OUTSIDER = "10.99.0.7:8080"  # an IP, so no authority: its GetProfile stream alone decides


class _Pool:
    """What `Targets` needs of a `WorkerPool`: where pushes go."""

    def __init__(self) -> None:
        self.pushed: list[ch.StateUpdate] = []
        self.arrived = asyncio.Event()

    def broadcast(self, msg: ch.StateUpdate) -> None:
        self.pushed.append(msg)
        self.arrived.set()


class _CountedSleeps:
    """`asyncio` as `agent.supervisor.targets` sees it, counting its sleeps: each is a wake-up."""

    def __init__(self) -> None:
        self.sleeps = 0

    def __getattr__(self, name: str) -> object:
        return getattr(asyncio, name)

    async def sleep(self, delay: float) -> None:
        self.sleeps += 1
        await asyncio.sleep(delay)


async def test_unanswered_target_gets_exists_false_and_the_check_then_sleeps(monkeypatch) -> None:
    counted = _CountedSleeps()
    monkeypatch.setattr(targets_mod, "asyncio", counted)
    dead = f"127.0.0.1:{free_port()}"  # nothing listens there: connections are refused
    client = ControlPlaneClient(
        destination=dead,
        identity=dead,
        policy=dead,
        context=ContextToken(ns="shop", node_name="node-a", pod="web-1"),
        cache=StateCache(),
        backoff=Backoff(base_s=0.05, cap_s=0.2),
    )
    targets = Targets(client.cache)
    pool = _Pool()
    targets.attach(client=client, pool=pool)  # type: ignore[arg-type] # the pool's one call
    task = aio.spawn(targets.watch_unanswered(), name="unanswered")
    try:
        await asyncio.sleep(10 * UNANSWERED_CHECK_S)
        assert counted.sleeps == 0  # nothing asked yet: the check never woke

        targets.need(0, ch.Need(kind=state.DST, key=(state.DST, OUTSIDER)))
        await asyncio.wait_for(pool.arrived.wait(), 5.0)
        [update] = pool.pushed
        assert update.key == (state.DST, OUTSIDER)
        assert update.value.exists is False

        await asyncio.sleep(2 * UNANSWERED_CHECK_S)  # the check that finds nobody waiting
        settled = counted.sleeps
        assert settled >= 1
        await asyncio.sleep(10 * UNANSWERED_CHECK_S)
        assert counted.sleeps == settled  # every target answered: the check waits, no timer
    finally:
        await aio.cancel_and_wait([task])
        await client.close()
