"""Tap: a live feed of request events for `/tap`, where slow readers lose events.

Rules:
1. `TapHub.publish(event)` is the feeding callable. It never blocks and never
   raises on a full reader: with no subscriber it costs one truthiness test;
   otherwise the event is encoded once (a JSON line) and appended to each
   subscriber's bounded ring, dropping that ring's oldest line when full.
2. A subscriber learns how many lines it lost: the next batch it reads starts
   with `{"dropped": N}`.
3. Call `publish` on the event loop's thread (workers' events arrive there
   through the channel).
4. At most `max_subscribers` streams at once; more are refused (503).
5. Workers record tap events only while someone taps their pod:
   `on_change(pods)` is called whenever the set of tapped pods changes
   (`pods`: the `pod` filters of the readers, "*" for a reader without one;
   empty when nobody taps). The supervisor turns it into `("tap",)` state.
"""

from __future__ import annotations

import asyncio
import json
from collections import deque
from typing import TYPE_CHECKING, Any, Self

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping


class TapFull(Exception):  # noqa: N818 - reads as a state
    """No room for another tap subscriber."""


class Subscription:
    """One reader's ring of encoded lines."""

    __slots__ = ("_hub", "_ring", "_wake", "dropped", "filters", "pending_dropped")

    def __init__(self, hub: TapHub, capacity: int, filters: Mapping[str, str]) -> None:
        self._hub = hub
        self._ring: deque[bytes] = deque(maxlen=capacity)
        self._wake = asyncio.Event()
        self.filters = dict(filters)
        self.dropped = 0
        self.pending_dropped = 0

    def _push(self, line: bytes) -> None:
        ring = self._ring
        if len(ring) == ring.maxlen:
            self.dropped += 1
            self.pending_dropped += 1
        ring.append(line)
        self._wake.set()

    async def next_batch(self) -> list[bytes]:
        """Wait for at least one line; return everything queued (rule 2)."""
        while not self._ring:
            self._wake.clear()
            await self._wake.wait()
        batch: list[bytes] = []
        if self.pending_dropped:
            batch.append(json.dumps({"dropped": self.pending_dropped}).encode() + b"\n")
            self.pending_dropped = 0
        batch.extend(self._ring)
        self._ring.clear()
        return batch

    def close(self) -> None:
        if self in self._hub._subs:  # noqa: SLF001 - the hub owns the set
            self._hub._subs.discard(self)  # noqa: SLF001
            self._hub._changed()  # noqa: SLF001

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class TapHub:
    """Fan-out of tap events to bounded per-reader rings; see the module rules."""

    def __init__(self, *, capacity: int = 1024, max_subscribers: int = 8) -> None:
        self.capacity = capacity
        self.max_subscribers = max_subscribers
        self._subs: set[Subscription] = set()
        self.published = 0
        self.on_change: Callable[[frozenset[str]], None] | None = None
        self._tapped: frozenset[str] = frozenset()

    @property
    def tapped(self) -> frozenset[str]:
        """The pods someone taps ("*": all), rule 5."""
        return frozenset(sub.filters.get("pod", "*") for sub in self._subs)

    def _changed(self) -> None:
        now = self.tapped
        if now != self._tapped:
            self._tapped = now
            if self.on_change is not None:
                self.on_change(now)

    @property
    def subscribers(self) -> int:
        return len(self._subs)

    def subscribe(self, filters: Mapping[str, str] | None = None) -> Subscription:
        """A new reader; events must match every `filters` item (str(event[k]) == v).

        Raises:
            TapFull: already `max_subscribers` readers.
        """
        if len(self._subs) >= self.max_subscribers:
            raise TapFull(f"{self.max_subscribers} tap readers already")
        sub = Subscription(self, self.capacity, filters or {})
        self._subs.add(sub)
        self._changed()
        return sub

    def publish(self, event: Mapping[str, Any]) -> None:
        """Offer `event` to every reader (rule 1)."""
        if not self._subs:
            return
        self.published += 1
        line: bytes | None = None
        for sub in self._subs:
            if sub.filters and any(str(event.get(k)) != v for k, v in sub.filters.items()):
                continue
            if line is None:
                line = json.dumps(event, default=str, separators=(",", ":")).encode() + b"\n"
            sub._push(line)  # noqa: SLF001 - same module
