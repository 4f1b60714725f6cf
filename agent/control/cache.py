"""The supervisor's state cache: what the control plane last said, by key (pure, no I/O).

Keys:
    DestinationKey(target)            Destination.Get: endpoints of `authority` or `ip:port`
    ProfileKey(target, context_ns)    Destination.GetProfile (a profile depends on the
                                      client's namespace: ServiceProfiles there win)
    PolicyKey(ns, pod, port)          InboundServerPolicies.WatchPort
    IdentityKey(ns, sa)               the service account's certificate (IdentityManager)

Rules (the endpoint rules are `destination.proto`'s):
1. `add` adds or replaces endpoints by address and means the service exists;
   `remove` removes (removing the last leaves an empty, existing set);
   `no_endpoints{exists}` clears the set and records `exists`.
2. After `begin_subscription(key)` (a new stream, e.g. after a reconnect) the
   old set stays readable, stale, until, and only until, the first message of
   the new stream: that message applies to an empty set.
3. Profiles, policies and identities are whole values: each message replaces.
4. Every change bumps the entry's version (from the cache's one counter, so
   versions also order changes across keys) and calls `on_change(key, value)`;
   a message that changes nothing calls nothing. `drop(key)` forgets a key and
   calls `on_change(key, None)`.
`on_change` runs synchronously inside the call that changed the state; it must
not call back into the cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from agent.proxy.model import Endpoint, Profile

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

    from agent.control.convert import Addr, EndpointsUpdate
    from agent.identity.manager import TlsMaterial
    from agent.policy.model import ServerPolicy


@dataclass(frozen=True, slots=True)
class DestinationKey:
    """Endpoints of `target` (`name:port` or `ip:port`)."""

    target: str


@dataclass(frozen=True, slots=True)
class ProfileKey:
    """The profile of `target` as seen from namespace `context_ns` ("" = the node's)."""

    target: str
    context_ns: str = ""


@dataclass(frozen=True, slots=True)
class PolicyKey:
    """The inbound policy of one pod port."""

    ns: str
    pod: str
    port: int


@dataclass(frozen=True, slots=True)
class IdentityKey:
    """The credentials of one service account."""

    ns: str
    sa: str


Key = DestinationKey | ProfileKey | PolicyKey | IdentityKey


@dataclass(frozen=True, slots=True, kw_only=True)
class EndpointSet:
    """The endpoints of a destination; `exists=False` means no such service."""

    endpoints: tuple[Endpoint, ...] = ()  # sorted by address
    exists: bool = True

    def by_addr(self) -> dict[Addr, Endpoint]:
        """The endpoints keyed by `(host, port)`."""
        return {e.addr: e for e in self.endpoints}


Value = EndpointSet | Profile | Any  # ServerPolicy | TlsMaterial, typed loosely to avoid cycles


@dataclass(frozen=True, slots=True, kw_only=True)
class Entry:
    """A cached value and the cache version of its last change."""

    value: Value
    version: int


@dataclass(slots=True)
class StateCache:
    """Last known control-plane state by key; see the module rules."""

    on_change: Callable[[Key, Any], None] | None = None
    version: int = 0
    _entries: dict[Key, Entry] = field(default_factory=dict)
    _stale: set[DestinationKey] = field(default_factory=set)

    # --- reading -----------------------------------------------------------------

    def get(self, key: Key) -> Any:
        """The value for `key`, or None before the first message."""
        entry = self._entries.get(key)
        return None if entry is None else entry.value

    def entry(self, key: Key) -> Entry | None:
        """The value and its version, or None."""
        return self._entries.get(key)

    def endpoints(self, key: DestinationKey) -> EndpointSet | None:
        """The endpoint set of a destination, or None before its first message."""
        value = self.get(key)
        return value if isinstance(value, EndpointSet) else None

    def profile(self, key: ProfileKey) -> Profile | None:
        """The profile of a destination, or None."""
        value = self.get(key)
        return value if isinstance(value, Profile) else None

    def policy(self, key: PolicyKey) -> ServerPolicy | None:
        """The policy of a pod port, or None before its first message."""
        return self.get(key)  # type: ignore[no-any-return]

    def identity(self, key: IdentityKey) -> TlsMaterial | None:
        """The credentials of a service account, or None."""
        return self.get(key)  # type: ignore[no-any-return]

    def is_stale(self, key: DestinationKey) -> bool:
        """True between `begin_subscription` and the new stream's first message."""
        return key in self._stale

    def items(self) -> Iterator[tuple[Key, Entry]]:
        """Every key and entry (a snapshot to push to a new worker)."""
        return iter(list(self._entries.items()))

    def __len__(self) -> int:
        return len(self._entries)

    # --- writing -----------------------------------------------------------------

    def begin_subscription(self, key: DestinationKey) -> None:
        """A new `Get` stream starts for `key`: keep the old set until its first message."""
        if key in self._entries:
            self._stale.add(key)

    def apply_update(self, key: DestinationKey, update: EndpointsUpdate) -> bool:
        """Apply one converted `Get` update (rules 1 and 2); True when the set changed."""
        entry = self._entries.get(key)
        fresh = entry is None or key in self._stale
        self._stale.discard(key)
        old = entry.value if entry is not None else EndpointSet(exists=False)
        if not isinstance(old, EndpointSet):
            raise TypeError(f"BUG: {key} holds a {type(old).__name__}")
        current: dict[Addr, Endpoint] = {} if fresh else old.by_addr()
        exists = True
        if update.no_endpoints is not None:
            current, exists = {}, update.no_endpoints
        for addr in update.removed:
            current.pop(addr, None)
        for ep in update.added:
            current[ep.addr] = ep
        new = EndpointSet(endpoints=tuple(current[a] for a in sorted(current)), exists=exists)
        if entry is not None and new == old:
            return False
        self._set(key, new)
        return True

    def set(self, key: ProfileKey | PolicyKey | IdentityKey, value: Any) -> bool:
        """Replace the value of `key` (rule 3); None drops it. True when it changed."""
        if value is None:
            return self.drop(key)
        entry = self._entries.get(key)
        if entry is not None and entry.value == value:
            return False
        self._set(key, value)
        return True

    def drop(self, key: Key) -> bool:
        """Forget `key` (its stream stopped); True when it was known."""
        if isinstance(key, DestinationKey):
            self._stale.discard(key)
        if self._entries.pop(key, None) is None:
            return False
        self.version += 1
        if self.on_change is not None:
            self.on_change(key, None)
        return True

    def _set(self, key: Key, value: Value) -> None:
        self.version += 1
        self._entries[key] = Entry(value=value, version=self.version)
        if self.on_change is not None:
            self.on_change(key, value)
