"""The worker's copy of the supervisor's state (agent.proxy.state), compiled.

It lives apart from agent.proxy.worker, which runs interpreted, so that the request
path's reads of it (`generation` by every per-connection memo, `get` by the routers)
are native attribute reads and calls (agent.native rule 11).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from agent.proxy import channel as ch

if TYPE_CHECKING:
    from collections.abc import Callable, Hashable


class WorkerState:
    """The worker's copy of the supervisor's state: opaque values by key."""

    def __init__(self, ask: Callable[[ch.Need], None]) -> None:
        self.generation = 0  # bumped by every change: per-connection memos check it
        self._values: dict[Hashable, Any] = {}
        self._waiters: dict[Hashable, list[asyncio.Future[Any]]] = {}
        self._asked: set[Hashable] = set()
        self._unanswered: set[Hashable] = set()  # a `want` of it timed out; no value since
        self._ask = ask

    def __contains__(self, key: Hashable) -> bool:
        return key in self._values

    def __getitem__(self, key: Hashable) -> Any:
        return self._values[key]

    def __len__(self) -> int:
        return len(self._values)

    def get(self, key: Hashable, default: Any = None) -> Any:
        return self._values.get(key, default)

    def apply(self, msg: ch.StateUpdate | ch.StateDelete) -> None:
        """Apply one update from the supervisor; wake `want`ers of that key."""
        self.generation += 1
        self._unanswered.discard(msg.key)
        if isinstance(msg, ch.StateDelete):
            self._values.pop(msg.key, None)
            return
        self._values[msg.key] = msg.value
        self._asked.discard(msg.key)
        for fut in self._waiters.pop(msg.key, ()):
            if not fut.done():
                fut.set_result(msg.value)

    def unanswered(self, key: Hashable) -> bool:
        """Whether a `want` of `key` timed out and no update or delete of it came since:
        a caller with a fallback may use it at once instead of waiting again."""
        return key in self._unanswered

    async def want(self, key: Hashable, *, kind: str, wait_s: float) -> Any:
        """The value of `key`, asking the supervisor once (`Need(kind, key)`) if absent.

        Raises:
            TimeoutError: no value arrived within `wait_s` seconds.
        """
        if key in self._values:
            return self._values[key]
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._waiters.setdefault(key, []).append(fut)
        if key not in self._asked:
            self._asked.add(key)
            self._ask(ch.Need(kind=kind, key=key))
        try:
            async with asyncio.timeout(wait_s):
                return await fut
        except TimeoutError:
            self._unanswered.add(key)
            raise
        finally:
            waiters = self._waiters.get(key)
            if waiters and fut in waiters:
                waiters.remove(fut)
