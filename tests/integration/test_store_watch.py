"""FolderWatcher on a real folder: add, edit, delete files; subscribers see it within 1 s."""

from __future__ import annotations

import asyncio
import queue
import shutil
from pathlib import Path

import pytest

from agent import aio
from agent.controlplane import kinds_core as k8s
from agent.controlplane.store import FolderWatcher, ResourceStore, Snapshot

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
DEADLINE = 1.0  # seconds: the promise made to users


def sa_yaml(*names: str) -> str:
    return "".join(
        f"---\napiVersion: v1\nkind: ServiceAccount\nmetadata: {{name: {n}, namespace: shop}}\n"
        for n in names
    )


@pytest.fixture
def watched(tmp_path):
    store = ResourceStore()
    updates: queue.Queue[Snapshot] = queue.Queue()
    store.subscribe(updates.put)
    watcher = FolderWatcher(tmp_path, store, interval=0.1)
    watcher.start()
    yield tmp_path, store, updates
    watcher.stop()


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


async def test_async_run_and_changes_follow_the_folder(tmp_path):
    store = ResourceStore()
    watcher = FolderWatcher(tmp_path, store, interval=0.1)
    task = aio.spawn(watcher.run(), name="watch")
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
        await aio.cancel_and_wait([task])


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
