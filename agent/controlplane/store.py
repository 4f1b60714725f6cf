"""The resource store: current objects per file, snapshots, subscribers, folder watching.

`ResourceStore` holds, per manifest file, the objects and errors it loaded.
Every change builds a new immutable `Snapshot` (a `Catalog` plus generation
and errors) in one step, after `check_references` has run over all files
together, and then tells subscribers.

Rules:
1. Thread-safe: any thread may change the store; `snapshot()` never blocks on
   a subscriber. Changes that leave objects and errors as they were make no
   new generation and notify nobody.
2. Subscribers are called outside the store lock, on the thread that made the
   change (the `FolderWatcher` thread, for folder changes), in generation
   order, each with the newest snapshot: a subscriber may skip generations
   when changes race, never see one go backwards. A subscriber must not
   block; asyncio code should use `changes()`, which hops onto its own loop.
3. Each load error is logged once, when it first appears (again if it goes
   away and comes back), with file/index/kind/name/field in `extra`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Self

from agent.controlplane.endpoints import Catalog
from agent.controlplane.inotify import Inotify
from agent.controlplane.manifests import (
    check_references,
    load_file,
    manifest_files,
    manifest_folders,
)

if TYPE_CHECKING:
    from agent.controlplane import kinds
    from agent.errors import ManifestError

logger = logging.getLogger(__name__)

Subscriber = Callable[["Snapshot"], None]


class Snapshot(Catalog):
    """One consistent, immutable view of the store: objects, indexes, errors, generation."""

    __slots__ = ("errors", "generation")

    def __init__(
        self, objects: Iterable[kinds.Resource], *, generation: int, errors: Iterable[ManifestError]
    ) -> None:
        super().__init__(objects)
        self.generation = generation
        self.errors: tuple[ManifestError, ...] = tuple(errors)

    def __repr__(self) -> str:
        counts = f"objects={len(self.objects)}, errors={len(self.errors)}"
        return f"Snapshot(generation={self.generation}, {counts})"


@dataclass(frozen=True, slots=True, kw_only=True)
class FileLoad:
    """What one file yielded."""

    objects: tuple[kinds.Resource, ...] = ()
    errors: tuple[ManifestError, ...] = ()


def _same(a: FileLoad | None, b: FileLoad | None) -> bool:
    if a is None or b is None:
        return a is b
    return a.objects == b.objects and [str(e) for e in a.errors] == [str(e) for e in b.errors]


class ResourceStore:
    """Objects by file; see the module rules."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._notify_lock = threading.RLock()  # serializes delivery; re-entrant for nested changes
        self._files: dict[str, FileLoad] = {}
        self._snapshot = Snapshot((), generation=0, errors=())
        self._subscribers: list[Subscriber] = []
        self._delivered = 0
        self._logged: set[str] = set()

    @property
    def generation(self) -> int:
        """Bumped by every change that altered objects or errors."""
        return self._snapshot.generation

    def snapshot(self) -> Snapshot:
        """The current snapshot (immutable; safe to keep and read from any thread)."""
        return self._snapshot

    def errors(self) -> tuple[ManifestError, ...]:
        """Current load errors: per-document ones, then cross-document ones."""
        return self._snapshot.errors

    def files(self) -> tuple[str, ...]:
        """Files the store currently holds, sorted."""
        with self._lock:
            return tuple(sorted(self._files))

    def replace_file(
        self, path: str, objects: Iterable[kinds.Resource], errors: Iterable[ManifestError] = ()
    ) -> Snapshot:
        """Set what `path` holds, atomically; returns the resulting snapshot."""
        return self.apply({path: FileLoad(objects=tuple(objects), errors=tuple(errors))})

    def remove_file(self, path: str) -> Snapshot:
        """Forget `path` and everything it held."""
        return self.apply({path: None})

    def apply(self, changes: Mapping[str, FileLoad | None]) -> Snapshot:
        """Replace (FileLoad) or remove (None) several files in one generation."""
        with self._lock:
            changed = False
            for path, load in changes.items():
                if _same(self._files.get(path), load):
                    continue
                changed = True
                if load is None:
                    del self._files[path]
                else:
                    self._files[path] = load
            if not changed:
                return self._snapshot
            self._snapshot = self._build(self._snapshot.generation + 1)
            new_errors = self._note_errors(self._snapshot.errors)
        for err in new_errors:
            _log_error(err)
        self._notify()
        return self._snapshot

    def _build(self, generation: int) -> Snapshot:
        objects: list[kinds.Resource] = []
        errors: list[ManifestError] = []
        for path in sorted(self._files):
            objects += self._files[path].objects
            errors += self._files[path].errors
        kept, ref_errors = check_references(objects)
        return Snapshot(kept, generation=generation, errors=errors + ref_errors)

    def _note_errors(self, errors: tuple[ManifestError, ...]) -> list[ManifestError]:
        current = {str(e): e for e in errors}
        fresh = [e for key, e in current.items() if key not in self._logged]
        self._logged = set(current)
        return fresh

    def subscribe(self, callback: Subscriber) -> Callable[[], None]:
        """Call `callback(snapshot)` after each change (module rule 2); returns an unsubscribe."""
        with self._lock:
            self._subscribers.append(callback)

        def unsubscribe() -> None:
            with self._lock:
                if callback in self._subscribers:
                    self._subscribers.remove(callback)

        return unsubscribe

    def _notify(self) -> None:
        with self._notify_lock:
            snap = self._snapshot
            if snap.generation <= self._delivered:
                return
            self._delivered = snap.generation
            with self._lock:
                subscribers = list(self._subscribers)
            for callback in subscribers:
                if self._delivered != snap.generation:
                    return  # a subscriber changed the store; the newer snapshot went out already
                try:
                    callback(snap)
                except Exception:
                    logger.exception(
                        "store subscriber failed", extra={"generation": snap.generation}
                    )

    def changes(self, *, initial: bool = True) -> ChangeStream:
        """An async iterator of the newest snapshot after each change; see `ChangeStream`.

        It subscribes at once, so no change made after this call is missed.
        Call it from a coroutine (it binds to the running loop).
        """
        return ChangeStream(self, initial=initial)


class ChangeStream:
    """`async for snap in store.changes()`: the newest snapshot after each change.

    Yields the current snapshot first when `initial`. Changes that arrive while
    the consumer is busy are coalesced: it gets the newest, never a stale one.
    Close it with `aclose()` (or use `async with`) to unsubscribe.
    """

    def __init__(self, store: ResourceStore, *, initial: bool) -> None:
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        self._store = store
        self._closed = False
        self._unsubscribe = store.subscribe(self._on_change)
        self._last = -1 if initial else store.generation

    def _on_change(self, _: Snapshot) -> None:
        # Runs on the changing thread. RuntimeError: the loop is closed, nobody waits.
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._wake.set)

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> Snapshot:
        while not self._closed:
            self._wake.clear()
            snap = self._store.snapshot()
            if snap.generation != self._last:
                self._last = snap.generation
                return snap
            await self._wake.wait()
        raise StopAsyncIteration

    async def aclose(self) -> None:
        """Unsubscribe; a pending `__anext__` ends the iteration."""
        self._closed = True
        self._unsubscribe()
        self._wake.set()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.aclose()


def _log_error(err: ManifestError) -> None:
    logger.warning(
        "manifest rejected: %s",
        err,
        extra={
            "file": err.file,
            "index": err.index,
            "kind": err.kind,
            "resource": f"{err.kind}/{err.name}",
            "field": err.field,
        },
    )


# --- folder watching ---------------------------------------------------------------

Signature = tuple[int, int, int]  # (st_mtime_ns, st_size, st_ino)
SAFETY_SCAN_S = 10.0  # watched by inotify: a full scan at least this often anyway
SETTLE_S = 0.02  # events closer than this are one change (a write, then a rename or chmod)
SETTLE_ROUNDS = 50  # a folder that never settles is still scanned about once a second


class FolderWatcher:
    """Watches a folder (recursively, *.yaml/*.yml/*.json) and mirrors it into a store.

    Each scan compares every file's (mtime_ns, size, inode) with the last scan,
    reloads changed or new files and drops deleted ones, all in one store
    generation. Scans run on a daemon thread (`start()`/`stop()`; `start` has
    loaded the folder once before it returns):
    - where inotify watches the folder and its subfolders
      (`agent.controlplane.inotify`), after each change (events `SETTLE_S`
      apart are one change), and every `SAFETY_SCAN_S` in case one was missed.
      An idle folder costs no CPU; a change shows within a few milliseconds;
    - otherwise (no inotify, the folder missing, a watch refused) every
      `interval` seconds, so a change shows within 1 s with the default 0.2.
    Subfolders are watched before each scan, so a file written into a new
    subfolder is either seen by that scan or wakes the next one.
    `only` mirrors just the documents of those kinds (`documents.parse_text`).
    """

    def __init__(
        self,
        directory: str | Path,
        store: ResourceStore,
        interval: float = 0.2,
        *,
        only: Collection[str] | None = None,
    ) -> None:
        self.directory = Path(directory)
        self.store = store
        self.interval = interval
        self.only = only
        self._seen: dict[str, Signature] = {}
        self._scan_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._notify: Inotify | None = None
        self._missing = False  # logged once per disappearance

    def scan(self) -> bool:
        """Scan once; True if the store changed."""
        with self._scan_lock:
            current = self._signatures()
            changes: dict[str, FileLoad | None] = {}
            for path, sig in current.items():
                if self._seen.get(path) != sig:
                    objects, errors = load_file(path, only=self.only)
                    changes[path] = FileLoad(objects=tuple(objects), errors=tuple(errors))
            for path in self._seen.keys() - current.keys():
                changes[path] = None
            self._seen = current
            if not changes:
                return False
            before = self.store.generation
            return self.store.apply(changes).generation != before

    def _signatures(self) -> dict[str, Signature]:
        out: dict[str, Signature] = {}
        present = self.directory.is_dir()
        if present == self._missing:
            self._missing = not present
            if self._missing:
                logger.warning("manifests folder missing", extra={"dir": str(self.directory)})
        try:
            paths = manifest_files(self.directory) if present else []
        except OSError as exc:
            logger.warning(
                "cannot list manifests folder",
                extra={"dir": str(self.directory), "error": str(exc)},
            )
            return dict(self._seen)  # keep what we have rather than dropping everything
        for path in paths:
            try:
                st = path.stat()
            except OSError:
                continue  # deleted between listing and stat
            out[str(path)] = (st.st_mtime_ns, st.st_size, st.st_ino)
        return out

    def start(self) -> None:
        """Load the folder now, then keep watching it on a daemon thread."""
        if self._thread is not None:
            raise RuntimeError("BUG: FolderWatcher started twice")
        self._stop.clear()
        self._notify = Inotify.open()
        watching = self._watch()
        self.scan()
        self._thread = threading.Thread(
            target=self._loop, args=(watching,), name=f"watch {self.directory}", daemon=True
        )
        self._thread.start()

    def _watch(self) -> bool:
        """Watch the folder and every subfolder that scans read; False if any is not watched."""
        notify = self._notify
        if notify is None:
            return False
        watched = [notify.watch(folder) for folder in manifest_folders(self.directory)]
        return bool(watched) and all(watched)  # a missing folder is polled for

    def _loop(self, watching: bool) -> None:
        notify = self._notify
        try:
            while not self._stop.is_set():
                if notify is None:
                    self._stop.wait(self.interval)
                elif notify.wait(SAFETY_SCAN_S if watching else self.interval):
                    for _ in range(SETTLE_ROUNDS):
                        if not notify.wait(SETTLE_S):
                            break
                if self._stop.is_set():
                    return
                watching = self._watch()
                try:
                    self.scan()
                except Exception:
                    logger.exception(
                        "manifest folder scan failed", extra={"dir": str(self.directory)}
                    )
        finally:
            if notify is not None:
                notify.close()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the watching thread and wait for it."""
        self._stop.set()
        if self._thread is not None:
            if self._notify is not None:
                self._notify.wake()
            self._thread.join(timeout)
            self._thread = None
        self._notify = None

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()
