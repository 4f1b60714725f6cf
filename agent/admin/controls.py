"""What the admin endpoints decide, without I/O: readiness, log levels, config scrubbing.

Rules:
1. Readiness is the conjunction of named conditions (`REQUIRED`): capture
   programmed, workers up, certificates valid, control plane answered once.
   Each starts false; owners flip them with `ReadinessGate.set`. Not ready
   comes with one reason per failing condition.
2. Log levels use Linkerd's syntax: `LEVEL` or `target=LEVEL,...,LEVEL`,
   where a target is a Python logger name (`agent.proxy`; Linkerd's `::` is
   accepted as `.`). `trace` maps to DEBUG, `off` silences.
3. `scrub` turns a provider's object into JSON data and removes secrets even
   if the provider leaked them: keys named like a key, token, secret or
   password are dropped, as is any string holding "PRIVATE KEY" and any bytes
   (raw key material); private-key objects are dropped by type name.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import enum
import ipaddress
import logging
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import PurePath
from typing import Any

logger = logging.getLogger(__name__)

# --- readiness --------------------------------------------------------------------

REDIRECTS = "redirects"
WORKERS = "workers"
CERTIFICATES = "certificates"
CONTROL_PLANE = "control_plane"
REQUIRED = (REDIRECTS, WORKERS, CERTIFICATES, CONTROL_PLANE)
_DEFAULT_REASONS = {
    REDIRECTS: "traffic capture not programmed yet",
    WORKERS: "workers not up",
    CERTIFICATES: "no valid certificates yet",
    CONTROL_PLANE: "control plane has not answered yet",
}


@dataclass(frozen=True, slots=True, kw_only=True)
class Readiness:
    """The answer of a readiness check."""

    ready: bool
    reasons: tuple[str, ...] = ()


class ReadinessGate:
    """Named conditions that must all hold; `check` is the `/ready` callable."""

    def __init__(self, required: tuple[str, ...] = REQUIRED) -> None:
        self._state: dict[str, tuple[bool, str]] = {
            name: (False, _DEFAULT_REASONS.get(name, "not yet")) for name in required
        }

    def set(self, name: str, ok: bool, reason: str = "") -> None:
        """Set condition `name`; `reason` explains a false one.

        Raises:
            KeyError: `name` is not one of the gate's conditions.
        """
        if name not in self._state:
            raise KeyError(f"unknown readiness condition {name!r}; known: {sorted(self._state)}")
        self._state[name] = (ok, reason or _DEFAULT_REASONS.get(name, "not ready"))

    def check(self) -> Readiness:
        reasons = tuple(f"{name}: {why}" for name, (ok, why) in self._state.items() if not ok)
        return Readiness(ready=not reasons, reasons=reasons)


# --- log levels ----------------------------------------------------------------------

_LEVELS = {
    "trace": logging.DEBUG,
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warn": logging.WARNING,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "off": logging.CRITICAL + 10,
}
_TARGET_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


@dataclass(frozen=True, slots=True, kw_only=True)
class LogSpec:
    """A parsed log-level spec: a default level and per-logger levels."""

    default: str
    targets: tuple[tuple[str, str], ...] = ()

    def text(self) -> str:
        return ",".join([*(f"{t}={lvl}" for t, lvl in self.targets), self.default])


def parse_log_level(spec: str) -> LogSpec:
    """Parse `info` or `agent.proxy=debug,warn`.

    Raises:
        ValueError: empty, an unknown level, a bad target, or two defaults.
    """
    default: str | None = None
    targets: list[tuple[str, str]] = []
    items = [item.strip() for item in spec.strip().split(",") if item.strip()]
    if not items:
        raise ValueError("empty log level")
    for item in items:
        target, sep, level = item.rpartition("=")
        level = level.strip().lower()
        if level not in _LEVELS:
            raise ValueError(f"unknown level {level!r} (use {', '.join(sorted(_LEVELS))})")
        if not sep:
            if default is not None:
                raise ValueError("more than one default level")
            default = level
            continue
        name = target.strip().replace("::", ".")
        if not _TARGET_RE.match(name):
            raise ValueError(f"bad log target {target!r}")
        targets.append((name, level))
    return LogSpec(default=default or "info", targets=tuple(targets))


class LogLevelControl:
    """The process's current log level; `set` applies it to `logging` and tells `on_change`.

    `on_change(text)` lets the supervisor forward the level to its workers.
    """

    def __init__(
        self, initial: str = "info", *, on_change: Callable[[str], None] | None = None
    ) -> None:
        self._on_change = on_change
        self._spec = parse_log_level(initial)
        self._applied: set[str] = set()
        self._apply(self._spec)

    @property
    def current(self) -> str:
        return self._spec.text()

    def set(self, spec: str) -> str:
        """Apply `spec`; returns its normalised text.

        Raises:
            ValueError: `spec` does not parse (see `parse_log_level`).
        """
        parsed = parse_log_level(spec)
        self._apply(parsed)
        self._spec = parsed
        logger.info("log level changed", extra={"level": parsed.text()})
        if self._on_change is not None:
            self._on_change(parsed.text())
        return parsed.text()

    def _apply(self, spec: LogSpec) -> None:
        for name in self._applied:
            logging.getLogger(name).setLevel(logging.NOTSET)
        logging.getLogger().setLevel(_LEVELS[spec.default])
        for name, level in spec.targets:
            logging.getLogger(name).setLevel(_LEVELS[level])
        self._applied = {name for name, _ in spec.targets}


# --- config_dump scrubbing -----------------------------------------------------------------

_SECRET_WORDS = frozenset(
    {"key", "keys", "token", "tokens", "secret", "secrets", "password", "passphrase", "privkey"}
)
PEM_PRIVATE = "PRIVATE KEY"


def is_secret_name(name: str) -> bool:
    """True for `key`, `private_key`, `sa_token`, `clientSecret`, `tls.key`..."""
    snake = re.sub(r"(?<=[a-z0-9])([A-Z])", r"_\1", name).lower()
    words = set(re.split(r"[^a-z0-9]+", snake))
    return bool(words & _SECRET_WORDS) or "privatekey" in snake.replace("_", "")


_DROP = object()


def scrub(obj: Any) -> Any:
    """JSON-ready copy of `obj` with every secret removed (rule 3)."""
    out = _scrub(obj, 0)
    return None if out is _DROP else out


def _scrub(obj: Any, depth: int) -> Any:  # noqa: C901, PLR0911 - one branch per kind of value
    if depth > 64:
        return "<too deep>"
    if obj is None or isinstance(obj, bool | int | float):
        return obj
    if isinstance(obj, str):
        return _DROP if PEM_PRIVATE in obj else obj
    if isinstance(obj, bytes | bytearray | memoryview):
        return _DROP
    if isinstance(obj, enum.Enum):
        return _scrub(obj.value, depth + 1)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        fields = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
        return _scrub_mapping(fields, depth)
    if isinstance(obj, Mapping):
        return _scrub_mapping(obj, depth)
    if isinstance(obj, list | tuple | set | frozenset):
        items = sorted(obj, key=repr) if isinstance(obj, set | frozenset) else obj
        return [v for v in (_scrub(i, depth + 1) for i in items) if v is not _DROP]
    if isinstance(obj, dt.datetime | dt.date):
        return obj.isoformat()
    if "privatekey" in type(obj).__name__.lower():
        return _DROP
    if isinstance(obj, PurePath | ipaddress.IPv4Address | ipaddress.IPv6Address):
        return str(obj)
    return _scrub(str(obj), depth + 1)


def _scrub_mapping(obj: Mapping[Any, Any], depth: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in obj.items():
        name = str(k)
        if is_secret_name(name):
            continue
        value = _scrub(v, depth + 1)
        if value is not _DROP:
            out[name] = value
    return out
