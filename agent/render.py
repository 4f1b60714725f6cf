"""Render listings for the CLI: a table by default, or JSON / YAML for machines."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import yaml

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

FORMATS = ("table", "wide", "json", "yaml")


def render(
    data: Any,
    *,
    fmt: str = "table",
    columns: Sequence[str] | None = None,
    rows: Sequence[Mapping[str, Any]] | None = None,
) -> str:
    """Render `data` as json/yaml, or `rows` (default: `data`) as a table.

    `columns` picks and orders table columns (default: keys of the first row).
    """
    if fmt == "json":
        return json.dumps(data, indent=2, sort_keys=False, default=str)
    if fmt == "yaml":
        return yaml.safe_dump(_plain(data), sort_keys=False).rstrip("\n")
    return table(rows if rows is not None else data, columns)


def _plain(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


def table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str] | None = None) -> str:
    """A plain aligned text table with upper-case headers."""
    if not rows:
        return "(none)"
    cols = list(columns) if columns else list(rows[0].keys())
    cells = [[_cell(row.get(col)) for col in cols] for row in rows]
    headers = [col.upper().replace("_", " ") for col in cols]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip()]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells]
    return "\n".join(lines)


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.2f}"
    if isinstance(value, list | tuple):
        return ",".join(_cell(v) for v in value) or "-"
    return str(value)
