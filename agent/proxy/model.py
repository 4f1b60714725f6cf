"""Domain types the proxy works on: endpoints, service profiles, routes.

Pure data, no I/O. The control-plane client converts Destination protobufs
into these (agent.control); the proxy never sees protobuf. Shapes follow
`io.linkerd.proxy.destination` (GetProfile's `DestinationProfile`, `Route`,
`RequestMatch`, `ResponseClass`, `RetryBudget`; Get's `WeightedAddr`).

Rules:
1. Values are frozen and validated in `__post_init__`; a bad value raises
   `ValueError(reason)`, which the converter wraps in `InvalidResource`.
2. Regexes are compiled once, when a `PathRegex` is built, never per request.
3. Timeouts are data (`Route.timeout_s`); the shell arms the timers.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Mapping

# Linkerd's destination controller gives every endpoint this weight.
DEFAULT_WEIGHT = 10_000


class ProtocolHint(enum.Enum):
    """What the destination says the endpoint's proxy can speak."""

    H2 = "h2"
    OPAQUE = "opaque"


@dataclass(frozen=True, slots=True, kw_only=True)
class Endpoint:
    """One address a logical destination resolves to (Destination `WeightedAddr`)."""

    addr: tuple[str, int]
    weight: int = DEFAULT_WEIGHT
    labels: Mapping[str, str] = field(default_factory=dict, hash=False)
    tls_identity: str | None = None  # DNS-like identity the server must present
    protocol_hint: ProtocolHint | None = None
    opaque_transport_port: int | None = None  # inbound port for opaque transport
    node: str | None = None  # node name; same node means no network hop, no TLS
    authority_override: str | None = None

    def __post_init__(self) -> None:
        host, port = self.addr
        if not host:
            raise ValueError("endpoint address has no host")
        if not 0 < port < 65536:
            raise ValueError(f"endpoint port {port} out of range")
        if self.weight < 0:
            raise ValueError(f"endpoint weight {self.weight} is negative")
        if self.opaque_transport_port is not None and not 0 < self.opaque_transport_port < 65536:
            raise ValueError(f"opaque transport port {self.opaque_transport_port} out of range")


# --- request matching (Destination `RequestMatch`) -----------------------------


@dataclass(frozen=True, slots=True)
class MatchAll:
    """Matches when every child matches (true when empty)."""

    matches: tuple[RequestMatch, ...]


@dataclass(frozen=True, slots=True)
class MatchAny:
    """Matches when some child matches (false when empty)."""

    matches: tuple[RequestMatch, ...]


@dataclass(frozen=True, slots=True)
class MatchNot:
    """Matches when its child does not."""

    match: RequestMatch


@dataclass(frozen=True, slots=True)
class MethodIs:
    """Matches the request method exactly (`GET`, `POST`, ...)."""

    method: str


@dataclass(frozen=True, slots=True)
class PathRegex:
    """Matches when the regex matches the whole request path (query excluded)."""

    regex: str
    pattern: re.Pattern[str] = field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        try:
            # Used with fullmatch: a profile regex describes the whole path.
            compiled = re.compile(self.regex)
        except re.error as exc:
            raise ValueError(f"bad path regex {self.regex!r}: {exc}") from None
        object.__setattr__(self, "pattern", compiled)


RequestMatch = MatchAll | MatchAny | MatchNot | MethodIs | PathRegex


# --- response classes (Destination `ResponseClass`) ----------------------------


@dataclass(frozen=True, slots=True)
class StatusRange:
    """Matches an HTTP status in `min..=max`."""

    min: int
    max: int

    def __post_init__(self) -> None:
        if not 100 <= self.min <= self.max <= 599:
            raise ValueError(f"bad status range {self.min}-{self.max}")


@dataclass(frozen=True, slots=True)
class ResponseAll:
    """Matches when every child matches."""

    matches: tuple[ResponseMatch, ...]


@dataclass(frozen=True, slots=True)
class ResponseAny:
    """Matches when some child matches."""

    matches: tuple[ResponseMatch, ...]


@dataclass(frozen=True, slots=True)
class ResponseNot:
    """Matches when its child does not."""

    match: ResponseMatch


ResponseMatch = StatusRange | ResponseAll | ResponseAny | ResponseNot


@dataclass(frozen=True, slots=True, kw_only=True)
class ResponseClass:
    """Responses matching `condition` are failures when `is_failure`."""

    condition: ResponseMatch
    is_failure: bool


# --- routes, budgets, profiles -------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Route:
    """A ServiceProfile route: how to recognize, classify, retry and time out requests."""

    name: str
    condition: RequestMatch
    response_classes: tuple[ResponseClass, ...] = ()
    is_retryable: bool = False
    timeout_s: float | None = None  # None: no route timeout
    labels: Mapping[str, str] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        if self.timeout_s is not None and self.timeout_s <= 0:
            raise ValueError(f"route {self.name!r} timeout must be positive")


@dataclass(frozen=True, slots=True, kw_only=True)
class RetryBudget:
    """Retries allowed as a ratio of requests over a window, plus a floor per second.

    Linkerd's defaults: 20% extra load, at least 10 retries/s, a 10 s window.
    """

    retry_ratio: float = 0.2
    min_retries_per_second: int = 10
    ttl_s: float = 10.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.retry_ratio <= 1000.0:
            raise ValueError(f"retry ratio {self.retry_ratio} not in 0..1000")
        if self.min_retries_per_second < 0:
            raise ValueError("min retries per second is negative")
        if not 1.0 <= self.ttl_s <= 60.0:
            raise ValueError(f"retry budget ttl {self.ttl_s}s not in 1..60 s")


@dataclass(frozen=True, slots=True, kw_only=True)
class WeightedDst:
    """A traffic-split target (`dst_overrides`): another authority and its weight."""

    authority: str
    weight: int

    def __post_init__(self) -> None:
        if self.weight < 0:
            raise ValueError(f"dst override {self.authority!r} weight is negative")


@dataclass(frozen=True, slots=True, kw_only=True)
class Profile:
    """What GetProfile says about one destination."""

    fqn: str = ""
    routes: tuple[Route, ...] = ()
    retry_budget: RetryBudget | None = None
    opaque_protocol: bool = False
    endpoint: Endpoint | None = None  # set when the target is a single pod/IP
    dst_overrides: tuple[WeightedDst, ...] = ()
