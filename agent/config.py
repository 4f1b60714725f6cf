"""Typed settings from flags and `MESHAGENT_*` environment variables.

Rules:
1. Every flag has a mirror variable: `--admin-port` is `MESHAGENT_ADMIN_PORT`.
   A flag given on the command line wins over the variable, which wins over the
   default.
2. Every raw value goes through one parser; a parser raises `ValueError(reason)`
   and `resolve` turns it into a `SettingError` naming the flag or variable, the
   value and the reason.
3. Commands get frozen dataclasses, never the argparse namespace.
"""

from __future__ import annotations

import argparse
import ipaddress
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.errors import SettingError

# Linkerd's ports (DESIGN.md conventions).
OUTBOUND_PORT = 4140
INBOUND_PORT = 4143
ADMIN_PORT = 4191
CONTROL_PORT = 4190
DESTINATION_PORT = 8086
IDENTITY_PORT = 8080
POLICY_PORT = 8090

ENV_PREFIX = "MESHAGENT_"


def env_name(flag: str) -> str:
    """`--admin-port` -> `MESHAGENT_ADMIN_PORT`."""
    return ENV_PREFIX + flag.lstrip("-").replace("-", "_").upper()


# --- parsers: str -> value, raising ValueError(reason) ----------------------


def parse_port(raw: str) -> int:
    """A TCP port, 1-65535."""
    try:
        port = int(raw)
    except ValueError:
        raise ValueError("not an integer port") from None
    if not 0 < port < 65536:
        raise ValueError("port must be between 1 and 65535")
    return port


def parse_positive_int(raw: str) -> int:
    """An integer >= 1."""
    try:
        value = int(raw)
    except ValueError:
        raise ValueError("not an integer") from None
    if value < 1:
        raise ValueError("must be at least 1")
    return value


def parse_seconds(raw: str) -> float:
    """A duration: `30`, `1.5`, `30s`, `500ms`, `2m`, `1h`."""
    text = raw.strip().lower()
    scale = 1.0
    for suffix, factor in (("ms", 0.001), ("s", 1.0), ("m", 60.0), ("h", 3600.0)):
        if text.endswith(suffix):
            text, scale = text[: -len(suffix)], factor
            break
    try:
        value = float(text) * scale
    except ValueError:
        raise ValueError("not a duration (examples: 30, 30s, 500ms, 2m)") from None
    if value < 0:
        raise ValueError("duration must not be negative")
    return value


def parse_dir(raw: str) -> Path:
    """An existing directory."""
    path = Path(raw)
    if not path.is_dir():
        raise ValueError("no such directory")
    return path


def parse_path(raw: str) -> Path:
    """Any path (it may not exist yet)."""
    if not raw:
        raise ValueError("empty path")
    return Path(raw)


def parse_host_port(raw: str) -> tuple[str, int]:
    """`host:port` or `[v6]:port`."""
    host, sep, port = raw.rpartition(":")
    if not sep or not host:
        raise ValueError("expected HOST:PORT")
    host = host.strip("[]")
    return host, parse_port(port)


def parse_ip(raw: str) -> str:
    """An IPv4 or IPv6 address, normalised."""
    try:
        return str(ipaddress.ip_address(raw))
    except ValueError:
        raise ValueError("not an IP address") from None


def choice(*values: str) -> Callable[[str], str]:
    """A parser accepting exactly one of `values`."""

    def parse(raw: str) -> str:
        if raw not in values:
            raise ValueError(f"must be one of {', '.join(values)}")
        return raw

    return parse


# --- options ------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Option:
    """One flag and its mirror variable."""

    flag: str
    parse: Callable[[str], Any]
    default: str | None = None
    help: str = ""
    required: bool = False

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")

    @property
    def env(self) -> str:
        return env_name(self.flag)


def add_options(parser: argparse.ArgumentParser, options: Sequence[Option]) -> None:
    """Declare `options` on `parser`; values are parsed later by `resolve`."""
    for opt in options:
        default = f" (default {opt.default})" if opt.default is not None else ""
        parser.add_argument(
            opt.flag,
            dest=opt.dest,
            default=None,
            metavar=opt.dest.upper(),
            help=f"{opt.help}{default}; env {opt.env}",
        )


def resolve(
    args: argparse.Namespace, env: Mapping[str, str], options: Sequence[Option]
) -> dict[str, Any]:
    """Parse every option from flag, variable or default.

    Raises:
        SettingError: a value does not parse, or a required one is missing.
    """
    values: dict[str, Any] = {}
    for opt in options:
        raw = getattr(args, opt.dest, None)
        source = opt.flag
        if raw is None and opt.env in env:
            raw, source = env[opt.env], opt.env
        if raw is None:
            raw, source = opt.default, f"{opt.flag} (default)"
        if raw is None:
            if opt.required:
                raise SettingError(opt.flag, "", f"required (or set {opt.env})")
            values[opt.dest] = None
            continue
        try:
            values[opt.dest] = opt.parse(raw)
        except ValueError as exc:
            raise SettingError(source, raw, str(exc)) from None
    return values
