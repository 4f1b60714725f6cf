"""Process logging: one line per record on stderr, `extra` fields appended as key=value.

Rules:
1. Every meshagent process (the CLI and what it runs, workers) logs through
   `setup(level, fmt)`: one stderr handler on the root logger, replacing any.
2. Fields passed as `extra={...}` follow the message as `key=value`, in the
   order given; the standard LogRecord attributes are never repeated.
3. An unknown level name means INFO here; the CLI refuses one (`LEVELS`) before it
   gets here.
"""

from __future__ import annotations

import logging
import sys

DEFAULT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
LEVELS = ("debug", "info", "warning", "error")  # what `--log-level` takes


class KeyValueFormatter(logging.Formatter):
    """`fmt`, then the record's `extra` fields as key=value (rule 2)."""

    _STD = frozenset(logging.makeLogRecord({}).__dict__) | {"message", "asctime"}

    def format(self, record: logging.LogRecord) -> str:
        base = super().format(record)
        extra = " ".join(f"{k}={v}" for k, v in record.__dict__.items() if k not in self._STD)
        return f"{base} {extra}" if extra else base


def setup(level: str, fmt: str = DEFAULT_FORMAT) -> None:
    """Rule 1: the root logger writes `fmt` lines to stderr at `level` (rule 3)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(KeyValueFormatter(fmt))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    name = level.upper()
    root.setLevel(name if name in logging.getLevelNamesMapping() else "INFO")
