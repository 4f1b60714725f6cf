"""Kubernetes-format YAML manifests -> validated domain objects: the manifest loader's entry.

`parse_text`/`load_file`/`load_folder` return `(objects, errors)`: objects are
`agent.controlplane.kinds.Resource`s (the `kinds_core` and `kinds_linkerd`
dataclasses), errors are `ManifestError`s locating each rejected document by
file, document index, kind/name and field.

The loader, top down (an import-linter layers contract keeps the direction):
- `manifests` (this module): the manifest files of a folder, reading them,
  and `check_references`, the checks across documents; `parse_text`,
  `split_documents` and `Loaded` are `documents`'s, re-exported.
- `documents`: text -> documents -> objects, with YAML and pydantic errors
  located (file, index, kind/name, field).
- `convert_linkerd` over `convert_core`: a validated model -> a
  `kinds_linkerd`/`kinds_core` dataclass, and the kinds and apiVersions each
  accepts.
- `schema_core` | `schema_linkerd` over `manifests_schema`: the pydantic shapes.

Rules:
1. A bad document rejects only itself; even broken YAML costs only the
   document it is in (`documents` rule 1). A file that cannot be read is one
   error at index 0.
2. pydantic lives only in the loader's lower modules (`documents`, the
   converters, the schema modules); nothing it builds is returned.
3. Document indexes are 0-based and count every document, empty ones too
   (`documents` rule 2).
4. `check_references` validates what a single document cannot: duplicates,
   a selector-less Service with no Endpoints, a Server's named port that no
   selected container declares. The store runs it over all files together.
5. The only I/O is here: listing a folder and reading its files.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from agent.controlplane import kinds
from agent.controlplane import kinds_core as k8s
from agent.controlplane import kinds_linkerd as l5d
from agent.controlplane import resources as r
from agent.controlplane.documents import Loaded, parse_text, split_documents
from agent.errors import ManifestError

if TYPE_CHECKING:
    from collections.abc import Collection, Iterable

__all__ = [
    "MANIFEST_SUFFIXES",
    "Loaded",
    "check_references",
    "load_file",
    "load_folder",
    "manifest_files",
    "parse_text",
    "split_documents",
]

MANIFEST_SUFFIXES = (".yaml", ".yml", ".json")


# --- files --------------------------------------------------------------------------------


def load_file(path: str | Path, *, only: Collection[str] | None = None) -> Loaded:
    """Read and parse one manifest file (its documents of the kinds in `only`, if
    given); an unreadable file is one error at index 0."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        return [], [ManifestError(file=str(path), index=0, reason=f"cannot read: {exc}")]
    return parse_text(text, file=str(path), only=only)


def manifest_files(directory: str | Path) -> list[Path]:
    """*.yaml, *.yml and *.json files in `manifest_folders(directory)`, sorted; dot-names
    skipped.

    Raises:
        OSError: `directory` itself cannot be listed (a subfolder that cannot is skipped,
            as the walk skips it).
    """
    root = Path(directory)
    found: list[Path] = []
    for folder in manifest_folders(root):
        try:
            entries = list(folder.iterdir())
        except OSError:
            if folder == root:
                raise
            continue
        found += (
            p
            for p in entries
            if p.suffix in MANIFEST_SUFFIXES and not p.name.startswith(".") and p.is_file()
        )
    return sorted(found)


def manifest_folders(directory: str | Path) -> list[Path]:
    """`directory` and its subfolders whose files `manifest_files` reads (symlinked
    folders are not entered, dot-names skipped); [] when it is not a folder."""
    root = Path(directory)
    if not root.is_dir():
        return []
    found = [root]
    for parent, dirs, _ in os.walk(root):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        found += (p for p in (Path(parent, d) for d in dirs) if not p.is_symlink())
    return sorted(found)


def load_folder(directory: str | Path) -> Loaded:
    """Every manifest file under `directory`, then `check_references` over all of them."""
    objects: list[kinds.Resource] = []
    errors: list[ManifestError] = []
    for path in manifest_files(directory):
        objs, errs = load_file(path)
        objects += objs
        errors += errs
    kept, ref_errors = check_references(objects)
    return kept, errors + ref_errors


# --- checks across documents ---------------------------------------------------------------


def _error(obj: kinds.Resource, field: str, reason: str) -> ManifestError:
    src = obj.source or r.Source(file="<unknown>", index=0)
    return ManifestError(
        file=src.file, index=src.index, kind=obj.kind, name=obj.name, field=field, reason=reason
    )


def check_references(objects: Iterable[kinds.Resource]) -> Loaded:
    """Reject what only the whole set shows; the first of duplicate objects wins.

    Kept objects keep their order. Checks: duplicate kind/namespace/name; a
    Service without a selector needs Endpoints or an EndpointSlice (ExternalName
    and headless Services excepted); a Server naming its port needs a selected
    pod or Deployment template that declares that port (when any is selected).
    """
    unique: list[kinds.Resource] = []
    errors: list[ManifestError] = []
    seen: dict[tuple[str, str, str], kinds.Resource] = {}
    for obj in objects:
        if (first := seen.get(obj.key)) is not None:
            errors.append(_error(obj, "metadata.name", f"duplicate of {first.source}"))
            continue
        seen[obj.key] = obj
        unique.append(obj)
    ctx = _Context(unique)
    kept: list[kinds.Resource] = []
    for obj in unique:
        err = ctx.check(obj)
        if err is None:
            kept.append(obj)
        else:
            errors.append(err)
    return kept, errors


class _Context:
    """What the cross-document checks look up, indexed once."""

    def __init__(self, objects: list[kinds.Resource]) -> None:
        self.backed: set[tuple[str, str]] = set()  # (namespace, service) with Endpoints/slices
        self.workloads: dict[str, list[tuple[tuple[r.Container, ...], r.FrozenMap]]] = {}
        for obj in objects:
            if isinstance(obj, k8s.Endpoints):
                self.backed.add((obj.namespace, obj.name))
            elif isinstance(obj, k8s.EndpointSlice) and obj.service_name:
                self.backed.add((obj.namespace, obj.service_name))
            elif isinstance(obj, k8s.Pod):
                self.workloads.setdefault(obj.namespace, []).append((obj.containers, obj.labels))
            elif isinstance(obj, k8s.Deployment):
                entry = (obj.template.containers, obj.template.labels)
                self.workloads.setdefault(obj.namespace, []).append(entry)

    def check(self, obj: kinds.Resource) -> ManifestError | None:
        if isinstance(obj, k8s.Service):
            return self._service(obj)
        if isinstance(obj, l5d.Server) and isinstance(obj.port, str):
            return self._server_port(obj, obj.port)
        return None

    def _service(self, svc: k8s.Service) -> ManifestError | None:
        if svc.selector is not None or svc.type is k8s.ServiceType.EXTERNAL_NAME or svc.headless:
            return None
        if (svc.namespace, svc.name) in self.backed:
            return None
        return _error(svc, "spec.selector", "no selector, and no Endpoints or EndpointSlice for it")

    def _server_port(self, srv: l5d.Server, port: str) -> ManifestError | None:
        selected = [
            containers
            for containers, labels in self.workloads.get(srv.namespace, [])
            if srv.pod_selector.matches(labels)
        ]
        if not selected or any(r.resolve_port(c, port) is not None for c in selected):
            return None
        return _error(srv, "spec.port", f"no selected container declares a port named {port!r}")
