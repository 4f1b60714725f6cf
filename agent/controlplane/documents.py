"""Manifest text -> typed objects and located errors: documents, YAML, kind dispatch.

`parse_text(text, file=, only=)` splits a manifest text at its `---`
markers (`split_documents`), loads each document with `yaml.safe_load_all`,
finds its kind in the kind tables (`plain.KIND_TABLE`, then
`convert_core.KIND_TABLE` and `convert_linkerd.KIND_TABLE`), checks the
apiVersion, reads the metadata (`plain.base`) and the document (the kind's
`read`). Every failure becomes a `ManifestError` naming file, document index,
kind/name and field. `only` keeps just the documents of those kinds, and
skips the others unread: the supervisor reads Pods and Namespaces this way.

Rules:
1. A bad document rejects only itself. A text is split at its `---` markers
   before parsing, so even broken YAML costs only the document it is in.
2. Document indexes are 0-based and count every document, empty ones too,
   as `yaml.safe_load_all` would. `kind: List` items keep their List's index
   and carry `items[i].` in front of their field.
3. Errors are mapped here, once: a YAML error names its line and column in
   the file; a kind's `Invalid` its dotted field (`spec.ports[0].name`) and
   reason (`convert_core.validated` makes pydantic's errors `Invalid`s).
4. pydantic loads with the first document of a kind `plain` does not read
   (`_kind`): parsing only `plain`'s kinds never imports it.
5. Pure: no file I/O (`manifests` reads the files); cross-document checks
   are `manifests.check_references`'s.
"""

from __future__ import annotations

import functools
import re
from typing import TYPE_CHECKING, Any, TypeAlias

import yaml

from agent.controlplane import kinds, plain
from agent.controlplane import resources as r
from agent.controlplane.plain import Invalid, Kind
from agent.errors import ManifestError

if TYPE_CHECKING:
    from collections.abc import Collection

Loaded: TypeAlias = tuple[list[kinds.Resource], list[ManifestError]]


# --- documents ----------------------------------------------------------------------------


@functools.cache
def _validated_kinds() -> dict[str, Kind]:
    """The kinds with pydantic shapes, imported on first use (rule 4)."""
    from agent.controlplane import convert_core, convert_linkerd  # noqa: PLC0415 - rule 4

    return {**convert_core.KIND_TABLE, **convert_linkerd.KIND_TABLE}


def _kind(name: str) -> Kind | None:
    return plain.KIND_TABLE.get(name) or _validated_kinds().get(name)


def _parse_document(  # noqa: PLR0911
    doc: Any, file: str, index: int, prefix: str = "", only: Collection[str] | None = None
) -> Loaded:
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
        return _parse_list(doc, file, index, prefix, only)
    if only is not None and kind not in only:
        return [], []
    spec = _kind(kind)
    if spec is None:
        return fail(f"unknown kind {kind!r}", "kind", kind, name)
    if not isinstance(api, str) or api not in spec.versions:
        served = ", ".join(sorted(spec.versions))
        return fail(f"apiVersion {api!r} is not one of {served}", "apiVersion", kind, name)
    try:
        source = r.Source(file=file, index=index)
        obj = spec.read(doc, plain.base(doc, namespaced=spec.namespaced, source=source))
    except Invalid as exc:
        return fail(exc.reason, exc.field, kind, name)
    return [obj], []


def _parse_list(
    doc: dict[str, Any], file: str, index: int, prefix: str, only: Collection[str] | None
) -> Loaded:
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
        objs, errs = _parse_document(item, file, index, f"{prefix}items[{i}].", only)
        objects += objs
        errors += errs
    return objects, errors


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


def parse_text(text: str, *, file: str = "<text>", only: Collection[str] | None = None) -> Loaded:
    """Every document of a manifest text (of the kinds in `only`, if given) ->
    (objects, errors). Never raises."""
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
            objs, errs = _parse_document(doc, file, index, only=only)
            objects += objs
            errors += errs
    return objects, errors
