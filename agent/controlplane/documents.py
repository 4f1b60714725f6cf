"""Manifest text -> typed objects and located errors: documents, YAML, kind dispatch.

`parse_text(text, file=)` splits a manifest text at its `---` markers
(`split_documents`), loads each document with `yaml.safe_load_all`, finds its
kind in the converters' tables (`convert_core.KIND_TABLE`,
`convert_linkerd.KIND_TABLE`), checks the apiVersion, validates the document
against the kind's pydantic model and converts it. Every failure becomes a
`ManifestError` naming file, document index, kind/name and field.

Rules:
1. A bad document rejects only itself. A text is split at its `---` markers
   before parsing, so even broken YAML costs only the document it is in.
2. Document indexes are 0-based and count every document, empty ones too,
   as `yaml.safe_load_all` would. `kind: List` items keep their List's index
   and carry `items[i].` in front of their field.
3. YAML and pydantic errors are mapped here, once: a YAML error names its
   line and column in the file; a pydantic error its first location as a
   dotted field (`spec.ports[0].name`), its message, and how many more.
4. Pure: no file I/O (`manifests` reads the files); cross-document checks
   are `manifests.check_references`'s.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, TypeAlias

import yaml
from pydantic import ValidationError

from agent.controlplane import convert_core, convert_linkerd, kinds
from agent.controlplane import resources as r
from agent.controlplane.convert_core import Invalid, Kind
from agent.errors import ManifestError

if TYPE_CHECKING:
    from agent.controlplane import manifests_schema as schema

Loaded: TypeAlias = tuple[list[kinds.Resource], list[ManifestError]]

_KINDS: dict[str, Kind] = {**convert_core.KIND_TABLE, **convert_linkerd.KIND_TABLE}


# --- documents ----------------------------------------------------------------------------


def _loc(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else part
    return out


def _pydantic_error(exc: ValidationError) -> tuple[str, str]:
    errors = exc.errors(include_url=False)
    first = errors[0]
    reason = str(first["msg"]).removeprefix("Value error, ")
    if len(errors) > 1:
        reason += f" (and {len(errors) - 1} more)"
    return _loc(tuple(first["loc"])), reason


def _parse_document(doc: Any, file: str, index: int, prefix: str = "") -> Loaded:  # noqa: PLR0911
    """One YAML document (or List item) -> objects and errors; never raises."""

    def fail(reason: str, field: str = "", kind: str = "", name: str = "") -> Loaded:
        where = prefix + field if field else prefix.rstrip(".")
        err = ManifestError(
            file=file, index=index, kind=kind, name=name, field=where, reason=reason
        )
        return [], [err]

    if doc is None:
        return [], []
    if not isinstance(doc, dict):
        return fail(f"a document must be a mapping, not {type(doc).__name__}")
    kind, api = doc.get("kind"), doc.get("apiVersion")
    meta = doc.get("metadata")
    name = str(meta.get("name", "")) if isinstance(meta, dict) else ""
    if not isinstance(kind, str) or not kind:
        return fail("kind is missing", "kind", name=name)
    if kind == "List" or (kind.endswith("List") and isinstance(doc.get("items"), list)):
        return _parse_list(doc, file, index, prefix)
    spec = _KINDS.get(kind)
    if spec is None:
        return fail(f"unknown kind {kind!r}", "kind", kind, name)
    if not isinstance(api, str) or api not in spec.versions:
        served = ", ".join(sorted(spec.versions))
        return fail(f"apiVersion {api!r} is not one of {served}", "apiVersion", kind, name)
    try:
        model = spec.model.model_validate(doc)
        obj = spec.convert(model, _base(model.metadata, spec, file, index))
    except ValidationError as exc:
        field, reason = _pydantic_error(exc)
        return fail(reason, field, kind, name)
    except Invalid as exc:
        return fail(exc.reason, exc.field, kind, name)
    return [obj], []


def _parse_list(doc: dict[str, Any], file: str, index: int, prefix: str) -> Loaded:
    items = doc.get("items")
    if not isinstance(items, list):
        err = ManifestError(
            file=file,
            index=index,
            kind="List",
            field=prefix + "items",
            reason="items must be a list",
        )
        return [], [err]
    objects: list[kinds.Resource] = []
    errors: list[ManifestError] = []
    for i, item in enumerate(items):
        objs, errs = _parse_document(item, file, index, f"{prefix}items[{i}].")
        objects += objs
        errors += errs
    return objects, errors


def _base(meta: schema.Meta, spec: Kind, file: str, index: int) -> dict[str, Any]:
    return {
        "name": meta.name,
        "namespace": (meta.namespace or "default") if spec.namespaced else "",
        "uid": meta.uid,
        "labels": r.FrozenMap(meta.labels),
        "annotations": r.FrozenMap(meta.annotations),
        "source": r.Source(file=file, index=index),
    }


_MARKER = re.compile(r"^---(?:[ \t]|$)")


def split_documents(text: str) -> list[tuple[int, str]]:
    """Split at `---` lines: (0-based first line, text) per document, as safe_load_all counts them.

    A leading chunk of only comments, blank lines or directives is not a document.
    """
    chunks: list[tuple[int, list[str]]] = [(0, [])]
    for lineno, line in enumerate(text.splitlines(keepends=True)):
        if _MARKER.match(line):
            chunks.append((lineno, [line]))
        else:
            chunks[-1][1].append(line)
    _first_line, first = chunks[0]
    if len(chunks) > 1 and all(
        not ln.strip() or ln.lstrip().startswith(("#", "%")) for ln in first
    ):
        chunks = chunks[1:]
    return [(start, "".join(lines)) for start, lines in chunks]


def _yaml_reason(exc: yaml.YAMLError, first_line: int) -> str:
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc)
    if mark is not None:
        line, column = first_line + mark.line + 1, mark.column + 1
        return f"invalid YAML at line {line}, column {column}: {problem}"
    return f"invalid YAML: {problem}"


def parse_text(text: str, *, file: str = "<text>") -> Loaded:
    """Every document of a manifest text -> (objects, errors). Never raises."""
    objects: list[kinds.Resource] = []
    errors: list[ManifestError] = []
    for index, (first_line, chunk) in enumerate(split_documents(text)):
        try:
            docs = list(yaml.safe_load_all(chunk))
        except yaml.YAMLError as exc:
            errors.append(
                ManifestError(file=file, index=index, reason=_yaml_reason(exc, first_line))
            )
            continue
        for doc in docs:  # one, or none for an empty chunk
            objs, errs = _parse_document(doc, file, index)
            objects += objs
            errors += errs
    return objects, errors
