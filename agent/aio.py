"""asyncio helpers: the one place tasks are started and the loop is chosen.

Rules: start tasks only through `spawn` (or a `TaskSet`'s, for tasks an owner
waits on or cancels together, or `at_most`'s, which waits on its own), which
keeps a strong reference until the task ends (asyncio keeps only weak ones) and
logs a failure; pick uvloop through `new_loop`, falling back to the standard
loop where it is missing. One exception: a proxy worker's task per accepted
connection, which the worker references itself and whose coroutine logs its own
failures (agent.proxy.worker rule 2).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from collections.abc import Coroutine

logger = logging.getLogger(__name__)

T = TypeVar("T")

_TASKS: set[asyncio.Task[Any]] = set()


def spawn(coro: Coroutine[Any, Any, T], *, name: str) -> asyncio.Task[T]:
    """Start `coro` as a task that is referenced until it ends; log if it fails."""
    task = asyncio.get_running_loop().create_task(coro, name=name)
    _TASKS.add(task)
    task.add_done_callback(_done)
    return task


def _done(task: asyncio.Task[Any]) -> None:
    _TASKS.discard(task)
    _report(task)


def _report(task: asyncio.Task[Any]) -> None:
    if task.cancelled():
        return
    exc = task.exception()
    if exc is not None:
        logger.error("task failed", extra={"task": task.get_name()}, exc_info=exc)


class TaskSet:
    """Tasks on one loop that an owner waits on or cancels together (`tasks`), each
    referenced until it ends and its failure logged, as `spawn` does. Given its loop,
    it asks for no running loop per task (a `getpid()` system call in CPython 3.11),
    and each task has one done callback: for a task per h2 stream."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, coro: Coroutine[Any, Any, T], *, name: str) -> asyncio.Task[T]:
        task = self.loop.create_task(coro, name=name)
        self.tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[Any]) -> None:
        self.tasks.discard(task)
        _report(task)


def new_loop() -> asyncio.AbstractEventLoop:
    """A new event loop: uvloop when importable, else asyncio's default."""
    try:
        import uvloop  # noqa: PLC0415 - optional at import time
    except ImportError:  # pragma: no cover - uvloop is a dependency
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def run(coro: Coroutine[Any, Any, T]) -> T:
    """Run `coro` to completion on a fresh loop from `new_loop`."""
    with asyncio.Runner(loop_factory=new_loop) as runner:
        return runner.run(coro)


async def cancel_and_wait(tasks: list[asyncio.Task[Any]], grace_s: float = 5.0) -> None:
    """Cancel `tasks` and wait up to `grace_s` seconds for them to finish.

    Tasks still running after `grace_s` are left cancelled but unawaited; this
    never raises (a task's own exception stays on the task).
    """
    for task in tasks:
        task.cancel()
    if tasks:
        await asyncio.wait(tasks, timeout=grace_s)


async def at_most(width: int, coros: list[Coroutine[Any, Any, None]]) -> None:
    """Run `coros`, at most `width` at a time, every one to its end; then raise the
    first one's exception, if any (a coroutine handles those it expects itself)."""
    gate = asyncio.Semaphore(width)

    async def gated(coro: Coroutine[Any, Any, None]) -> None:
        async with gate:
            await coro

    for result in await asyncio.gather(*(gated(c) for c in coros), return_exceptions=True):
        if isinstance(result, BaseException):
            raise result
