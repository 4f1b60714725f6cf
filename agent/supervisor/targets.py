"""The destinations workers asked for, and the control-plane streams each follows (asyncio shell).

A worker's `Need("dst", ("dst", target))` reaches `Targets.need` through the
pool; what a target resolves to is decided by `agent.supervisor.resolve`
(pure), and this module keeps the bookkeeping around it: which streams each
target follows and what was last pushed for it.

Rules:
1. The first need of a target opens its GetProfile stream (then Get) and
   pushes `("dst", target)` -> Destination whenever an answer changes
   (`refresh_for`, called by the supervisor once a cache change has
   returned). Streams stay open; the client reconnects with backoff and the
   last state keeps being served meanwhile. A later need of the same target
   re-pushes what was pushed last.
2. When a profile names another authority, the target's Get stream follows
   it; the old stream is unwatched unless another target still follows it.
3. A target whose stream fails before its first answer (NOT_FOUND,
   INVALID_ARGUMENT, control plane unreachable) gets `exists=False` within
   `UNANSWERED_CHECK_S` (`watch_unanswered`), so workers forward at once
   instead of waiting out their timeout; a later answer replaces it. The check
   runs only while a target waits for its first answer: an agent whose targets
   are all answered does not wake for it.
4. The client and the pool arrive through `attach` (`Supervisor.start`);
   until then no worker can ask, and `watch_unanswered` waits.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from agent.control.cache import DestinationKey, ProfileKey
from agent.control.client import StreamState
from agent.proxy import channel as ch
from agent.proxy import state
from agent.supervisor import resolve

if TYPE_CHECKING:
    from agent.control.cache import StateCache
    from agent.control.client import ControlPlaneClient
    from agent.proxy.pool import WorkerPool

logger = logging.getLogger(__name__)

UNANSWERED_CHECK_S = 0.05  # how often targets with failed, unanswered streams are looked for


@dataclass(slots=True)
class Target:
    """A destination workers asked for, and the streams it follows."""

    profile: ProfileKey
    endpoints: DestinationKey | None = None
    pushed: state.Destination | None = None


class Targets:
    """Every target workers asked for, by name (`host:port`); see the module docstring."""

    def __init__(self, cache: StateCache) -> None:
        self.cache = cache
        self.client: ControlPlaneClient | None = None
        self.pool: WorkerPool | None = None
        self.by_name: dict[str, Target] = {}
        self._unanswered = asyncio.Event()  # set while a target may wait for its first answer

    def attach(self, *, client: ControlPlaneClient, pool: WorkerPool) -> None:
        """Hand over the streams' client and the pool pushes go to (rule 4)."""
        self.client = client
        self.pool = pool

    def need(self, worker_id: int, need: ch.Need) -> None:
        """A worker's `Need`: follow a new target, or re-push a known one (rule 1)."""
        key = need.key
        if need.kind != state.DST or not (isinstance(key, tuple) and len(key) == 2):
            logger.debug("need ignored", extra={"worker": worker_id, "key": repr(key)})
            return
        target = str(key[1])
        t = self.by_name.get(target)
        if t is not None:
            if t.pushed is not None and self.pool is not None:
                self.pool.broadcast(ch.StateUpdate(key=(state.DST, target), value=t.pushed))
            return
        assert self.client is not None  # noqa: S101 - set by attach()
        plan = resolve.streams_for(target, None)
        t = Target(profile=self.client.watch_profile(plan.profile_target))
        self.by_name[target] = t
        if plan.authority is not None:
            t.endpoints = self.client.watch_destination(plan.authority)
        self._refresh(target, t)
        if t.pushed is None:
            self._unanswered.set()

    async def watch_unanswered(self) -> None:
        """Rule 3: targets whose streams failed before any answer are not mesh services."""
        while True:
            await self._unanswered.wait()
            await asyncio.sleep(UNANSWERED_CHECK_S)
            if self.client is None or self.pool is None:
                continue
            waiting = {n: t for n, t in self.by_name.items() if t.pushed is None}
            if not waiting:
                self._unanswered.clear()  # need() sets it again; no await since the check
                continue
            failed = {
                st.key
                for st in self.client.streams()
                if st.state is StreamState.BACKOFF and st.messages == 0
            }
            for name, t in waiting.items():
                if t.profile in failed or (t.endpoints is not None and t.endpoints in failed):
                    t.pushed = resolve.not_a_service(name)
                    logger.info(
                        "destination unanswered, forwarding as not a mesh service",
                        extra={"target": name},
                    )
                    self.pool.broadcast(ch.StateUpdate(key=(state.DST, name), value=t.pushed))

    def refresh_for(self, key: Any) -> None:
        """Re-resolve every target following the stream `key` (its answer changed)."""
        for target, t in list(self.by_name.items()):
            if key in (t.profile, t.endpoints):
                self._refresh(target, t)

    def _refresh(self, target: str, t: Target) -> None:
        assert self.client is not None  # noqa: S101 - set by attach()
        assert self.pool is not None  # noqa: S101 - set by attach()
        profile = self.cache.profile(t.profile)
        plan = resolve.streams_for(target, profile)
        want = DestinationKey(plan.authority) if plan.authority is not None else None
        if want != t.endpoints:
            if t.endpoints is not None and not self._shared(t.endpoints, target):
                self.client.unwatch(t.endpoints)
            t.endpoints = self.client.watch_destination(plan.authority) if plan.authority else None
        eps = self.cache.endpoints(t.endpoints) if t.endpoints is not None else None
        dst = resolve.destination(target, profile, eps, profile_seen=profile is not None)
        if dst is not None and dst != t.pushed:
            t.pushed = dst
            self.pool.broadcast(ch.StateUpdate(key=(state.DST, target), value=dst))

    def _shared(self, key: DestinationKey, but: str) -> bool:
        """Whether a target other than `but` follows the Get stream `key` (rule 2)."""
        return any(t.endpoints == key for name, t in self.by_name.items() if name != but)
