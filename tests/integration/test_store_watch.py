"""FolderWatcher on a real folder: add, edit, delete files; subscribers see it within 1 s."""

from __future__ import annotations

import asyncio
import contextlib
import queue
import shutil
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from agent.controlplane import kinds_core as k8s
from agent.controlplane import store as store_mod
from agent.controlplane.store import FolderWatcher, ResourceStore, Snapshot

if TYPE_CHECKING:
    from collections.abc import Iterator

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
DEADLINE = 1.0  # seconds: the promise made to users


def sa_yaml(*names: str) -> str:
    return "".join(
        f"---\napiVersion: v1\nkind: ServiceAccount\nmetadata: {{name: {n}, namespace: shop}}\n"
        for n in names
    )


@contextlib.contextmanager
def watching(
    folder: Path, interval: float
) -> Iterator[tuple[FolderWatcher, ResourceStore, queue.Queue[Snapshot]]]:
    """A started watcher of `folder`, its store, and every snapshot the store made."""
    store = ResourceStore()
    updates: queue.Queue[Snapshot] = queue.Queue()
    store.subscribe(updates.put)
    watcher = FolderWatcher(folder, store, interval=interval)
    watcher.start()
    try:
        yield watcher, store, updates
    finally:
        watcher.stop()


@pytest.fixture
def watched(tmp_path):
    with watching(tmp_path, 0.1) as (_, store, updates):
        yield tmp_path, store, updates


def wait_for(updates: queue.Queue[Snapshot], predicate) -> Snapshot:
    """The first snapshot within DEADLINE for which predicate holds; fails otherwise."""
    while True:
        try:
            snap = updates.get(timeout=DEADLINE)
        except queue.Empty:
            pytest.fail(f"no matching snapshot within {DEADLINE} s")
        if predicate(snap):
            return snap


def names(snap: Snapshot) -> set[str]:
    return {o.name for o in snap.of_kind(k8s.ServiceAccount)}


def test_add_edit_delete_file_reach_subscriber_within_a_second(watched):
    folder, store, updates = watched
    path = folder / "sa.yaml"
    path.write_text(sa_yaml("one"))
    assert names(wait_for(updates, lambda s: names(s) == {"one"})) == {"one"}

    path.write_text(sa_yaml("one", "two"))
    wait_for(updates, lambda s: names(s) == {"one", "two"})

    (folder / "nested").mkdir()
    (folder / "nested" / "more.yml").write_text(sa_yaml("three"))
    wait_for(updates, lambda s: names(s) == {"one", "two", "three"})

    path.unlink()
    snap = wait_for(updates, lambda s: names(s) == {"three"})
    assert store.files() == (str(folder / "nested" / "more.yml"),)
    assert snap.generation == store.generation


def test_same_size_rewrite_is_seen(watched):
    folder, _, updates = watched
    path = folder / "sa.yaml"
    path.write_text(sa_yaml("aaa"))
    wait_for(updates, lambda s: names(s) == {"aaa"})
    path.write_text(sa_yaml("bbb"))  # same length: mtime_ns must tell it apart
    wait_for(updates, lambda s: names(s) == {"bbb"})


def test_atomic_rename_replacement_is_seen(watched):
    folder, _, updates = watched
    path = folder / "sa.yaml"
    path.write_text(sa_yaml("old"))
    wait_for(updates, lambda s: names(s) == {"old"})
    tmp = folder / ".sa.yaml.tmp"
    tmp.write_text(sa_yaml("new"))
    tmp.replace(path)  # as editors and kubectl-style tools do
    wait_for(updates, lambda s: names(s) == {"new"})


def test_broken_edit_reports_error_and_keeps_other_files(watched):
    folder, store, updates = watched
    (folder / "good.yaml").write_text(sa_yaml("good"))
    (folder / "bad.yaml").write_text(sa_yaml("fine"))
    wait_for(updates, lambda s: names(s) == {"good", "fine"})

    (folder / "bad.yaml").write_text(sa_yaml("fine") + "---\nkind: [\n")
    snap = wait_for(updates, lambda s: len(s.errors) == 1)
    assert names(snap) == {"good", "fine"}  # only the broken document is rejected
    err = store.errors()[0]
    assert (err.file, err.index) == (str(folder / "bad.yaml"), 1)
    assert "invalid YAML" in err.reason

    (folder / "bad.yaml").write_text(sa_yaml("fixed"))
    snap = wait_for(updates, lambda s: not s.errors)
    assert names(snap) == {"good", "fixed"}


def test_non_manifest_files_are_ignored(watched):
    folder, store, updates = watched
    (folder / "notes.txt").write_text(sa_yaml("excluded"))
    (folder / "sa.yaml").write_text(sa_yaml("included"))
    snap = wait_for(updates, lambda s: names(s) == {"included"})
    assert "excluded" not in names(snap)
    assert all(f.endswith(".yaml") for f in store.files())


def test_start_loads_examples_before_returning(tmp_path):
    folder = tmp_path / "examples"
    shutil.copytree(EXAMPLES, folder)
    store = ResourceStore()
    watcher = FolderWatcher(folder, store)
    watcher.start()
    try:
        snap = store.snapshot()
        assert snap.errors == ()
        assert snap.get(k8s.Deployment, "shop", "api") is not None
        assert snap.service("shop", "web") is not None
    finally:
        watcher.stop()


async def test_changes_follow_the_folder_on_the_loop(tmp_path):
    store = ResourceStore()
    watcher = FolderWatcher(tmp_path, store, interval=0.1)
    watcher.start()
    stream = store.changes(initial=False)
    try:
        (tmp_path / "sa.yaml").write_text(sa_yaml("async"))
        snap = await asyncio.wait_for(anext(stream), DEADLINE)
        assert names(snap) == {"async"}
        (tmp_path / "sa.yaml").unlink()
        snap = await asyncio.wait_for(anext(stream), DEADLINE)
        assert names(snap) == set()
    finally:
        await stream.aclose()
        watcher.stop()


@pytest.fixture
def notified(tmp_path):
    """A watcher whose poll would take an hour: whatever it sees, inotify told it."""
    with watching(tmp_path, 3600.0) as (watcher, _, updates):
        yield tmp_path, watcher, updates


def test_inotify_sees_files_and_new_subfolders_without_polling(notified):
    folder, _, updates = notified
    (folder / "sa.yaml").write_text(sa_yaml("one"))
    wait_for(updates, lambda s: names(s) == {"one"})
    deep = folder / "a" / "b"
    deep.mkdir(parents=True)  # files right after: written before or after the new watch
    (deep / "sa.yaml").write_text(sa_yaml("deep"))
    (folder / "a" / "sa.json").write_text(
        '{"apiVersion": "v1", "kind": "ServiceAccount", '
        '"metadata": {"name": "json", "namespace": "shop"}}'
    )
    wait_for(updates, lambda s: names(s) == {"one", "deep", "json"})
    shutil.rmtree(folder / "a")
    wait_for(updates, lambda s: names(s) == {"one"})


def test_inotify_sees_a_configmap_style_symlink_swap(notified):
    """Kubernetes updates a ConfigMap volume by pointing ..data at a new folder."""
    folder, _, updates = notified
    (folder / "..v1").mkdir()
    (folder / "..v1" / "sa.yaml").write_text(sa_yaml("v1"))
    (folder / "..data").symlink_to("..v1")
    (folder / "sa.yaml").symlink_to("..data/sa.yaml")
    wait_for(updates, lambda s: names(s) == {"v1"})
    (folder / "..v2").mkdir()
    (folder / "..v2" / "sa.yaml").write_text(sa_yaml("v2"))
    (folder / "..data_tmp").symlink_to("..v2")
    (folder / "..data_tmp").replace(folder / "..data")
    wait_for(updates, lambda s: names(s) == {"v2"})


def test_a_watched_idle_folder_is_not_scanned(tmp_path):
    store = ResourceStore()
    watcher = FolderWatcher(tmp_path, store, interval=0.01)  # polling: ~50 scans below
    scans: list[bool] = []  # each appended once its scan is over
    real_scan = watcher.scan

    def counted() -> bool:
        changed = real_scan()
        scans.append(changed)
        return changed

    watcher.scan = counted  # type: ignore[method-assign]
    watcher.start()
    try:
        assert len(scans) == 1  # start's load
        stop = threading.Event()
        stop.wait(0.5)
        assert len(scans) == 1
        (tmp_path / "sa.yaml").write_text(sa_yaml("wake"))
        deadline = time.monotonic() + DEADLINE
        while len(scans) == 1 and time.monotonic() < deadline:
            stop.wait(0.01)
        assert len(scans) >= 2
        assert names(store.snapshot()) == {"wake"}
    finally:
        watcher.stop()


def test_without_inotify_the_folder_is_polled(tmp_path, monkeypatch):
    monkeypatch.setattr(store_mod.Inotify, "open", classmethod(lambda _cls: None))
    with watching(tmp_path, 0.05) as (_, _, updates):
        (tmp_path / "sa.yaml").write_text(sa_yaml("polled"))
        wait_for(updates, lambda s: names(s) == {"polled"})


def test_stop_ends_a_thread_waiting_on_inotify(tmp_path):
    watcher = FolderWatcher(tmp_path, ResourceStore(), interval=3600.0)
    watcher.start()
    thread = watcher._thread
    assert thread is not None
    assert thread.is_alive()
    watcher.stop(timeout=2.0)  # the safety scan is 10 s away: only wake() ends the wait
    assert not thread.is_alive()


def test_folder_created_after_start_is_picked_up_and_missing_logged(tmp_path, caplog):
    folder = tmp_path / "later"
    store = ResourceStore()
    updates: queue.Queue[Snapshot] = queue.Queue()
    store.subscribe(updates.put)
    watcher = FolderWatcher(folder, store, interval=0.1)
    with caplog.at_level("WARNING", logger="agent.controlplane.store"):
        watcher.start()
    try:
        assert "manifests folder missing" in caplog.text
        folder.mkdir()
        (folder / "sa.yaml").write_text(sa_yaml("late"))
        wait_for(updates, lambda s: names(s) == {"late"})
    finally:
        watcher.stop()
