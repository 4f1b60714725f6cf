"""ResourceStore: atomic file replacement, snapshots, subscribers, errors."""

from __future__ import annotations

import asyncio
import logging
import threading

import pytest

from agent.controlplane import kinds
from agent.controlplane import kinds_core as k8s
from agent.controlplane import resources as r
from agent.controlplane.manifests import parse_text
from agent.controlplane.store import FileLoad, ResourceStore

SVC_NO_SELECTOR = """\
apiVersion: v1
kind: Service
metadata: {name: ext, namespace: shop}
spec: {clusterIP: 10.96.0.9, ports: [{name: http, port: 80}]}
"""
ENDPOINTS = """\
apiVersion: v1
kind: Endpoints
metadata: {name: ext, namespace: shop}
subsets: [{addresses: [{ip: 10.9.0.1}], ports: [{name: http, port: 8080}]}]
"""


def load(text: str, file: str) -> tuple[list[kinds.Resource], list]:
    return parse_text(text, file=file)


def sa(name: str) -> k8s.ServiceAccount:
    return k8s.ServiceAccount(name=name, namespace="shop")


def test_replace_and_remove_bump_generation_and_swap_objects():
    store = ResourceStore()
    assert store.generation == 0
    snap = store.replace_file("a.yaml", [sa("one"), sa("two")])
    assert snap.generation == 1
    assert {o.name for o in snap.of_kind(k8s.ServiceAccount)} == {"one", "two"}
    snap = store.replace_file("a.yaml", [sa("three")])
    assert [o.name for o in snap.of_kind(k8s.ServiceAccount)] == ["three"]
    snap = store.remove_file("a.yaml")
    assert snap.generation == 3
    assert snap.objects == ()
    assert store.files() == ()


def test_unchanged_content_makes_no_generation_and_no_notification():
    store = ResourceStore()
    seen: list[int] = []
    store.subscribe(lambda s: seen.append(s.generation))
    store.replace_file("a.yaml", [sa("one")])
    store.replace_file("a.yaml", [sa("one")])
    store.remove_file("missing.yaml")
    assert store.generation == 1
    assert seen == [1]


def test_old_snapshot_is_unchanged_by_later_changes():
    store = ResourceStore()
    old = store.replace_file("a.yaml", [sa("one")])
    store.replace_file("a.yaml", [sa("two")])
    assert [o.name for o in old.objects] == ["one"]
    assert old.generation == 1


def test_apply_changes_several_files_in_one_generation():
    store = ResourceStore()
    store.replace_file("a.yaml", [sa("a")])
    snap = store.apply({"a.yaml": None, "b.yaml": FileLoad(objects=(sa("b"),))})
    assert snap.generation == 2
    assert [o.name for o in snap.objects] == ["b"]


def test_cross_file_references_are_checked_over_all_files():
    store = ResourceStore()
    objects, _ = load(SVC_NO_SELECTOR, "svc.yaml")
    snap = store.replace_file("svc.yaml", objects)
    assert snap.service("shop", "ext") is None
    assert [e.field for e in store.errors()] == ["spec.selector"]
    assert store.errors()[0].file == "svc.yaml"
    objects, _ = load(ENDPOINTS, "eps.yaml")
    snap = store.replace_file("eps.yaml", objects)
    assert store.errors() == ()
    svc = snap.service("shop", "ext")
    assert svc is not None
    assert [(e.ip, e.port) for e in snap.endpoints(svc, 80)] == [("10.9.0.1", 8080)]
    assert snap.service_by_cluster_ip("10.96.0.9") is svc
    snap = store.remove_file("eps.yaml")
    assert snap.service("shop", "ext") is None


def test_duplicate_across_files_first_file_wins():
    store = ResourceStore()
    store.replace_file(
        "b.yaml", [k8s.ServiceAccount(name="x", namespace="shop", labels=r.FrozenMap({"f": "b"}))]
    )
    snap = store.replace_file(
        "a.yaml",
        [
            k8s.ServiceAccount(
                name="x",
                namespace="shop",
                labels=r.FrozenMap({"f": "a"}),
                source=r.Source(file="a.yaml", index=0),
            )
        ],
    )
    found = snap.get(k8s.ServiceAccount, "shop", "x")
    assert found is not None
    assert found.labels == {"f": "a"}
    assert len(snap.errors) == 1


def test_load_errors_are_listed_and_logged_once(caplog):
    store = ResourceStore()
    objects, errors = load("apiVersion: v1\nkind: Gizmo\nmetadata: {name: g}\n", "bad.yaml")
    with caplog.at_level(logging.WARNING, logger="agent.controlplane.store"):
        store.replace_file("bad.yaml", objects, errors)
        store.replace_file("other.yaml", [sa("x")])
    assert [e.kind for e in store.errors()] == ["Gizmo"]
    records = [rec for rec in caplog.records if "manifest rejected" in rec.getMessage()]
    assert len(records) == 1
    assert records[0].file == "bad.yaml"  # type: ignore[attr-defined]
    assert records[0].index == 0  # type: ignore[attr-defined]
    store.remove_file("bad.yaml")
    assert store.errors() == ()


def test_subscriber_called_with_new_snapshot_and_unsubscribe_stops_it():
    store = ResourceStore()
    seen: list[int] = []
    unsubscribe = store.subscribe(lambda s: seen.append(s.generation))
    store.replace_file("a.yaml", [sa("a")])
    unsubscribe()
    store.replace_file("a.yaml", [sa("b")])
    assert seen == [1]
    unsubscribe()  # idempotent


def test_failing_subscriber_does_not_break_the_store_or_others(caplog):
    store = ResourceStore()
    seen: list[int] = []

    def boom(_):
        raise RuntimeError("subscriber bug")

    store.subscribe(boom)
    store.subscribe(lambda s: seen.append(s.generation))
    with caplog.at_level(logging.ERROR):
        store.replace_file("a.yaml", [sa("a")])
    assert seen == [1]
    assert "store subscriber failed" in caplog.text


def test_subscriber_may_change_the_store_without_deadlock():
    store = ResourceStore()
    seen: list[int] = []

    def chain(snap):
        seen.append(snap.generation)
        if snap.generation == 1:
            store.replace_file("b.yaml", [sa("b")])

    later: list[int] = []
    store.subscribe(chain)
    store.subscribe(lambda s: later.append(s.generation))
    store.replace_file("a.yaml", [sa("a")])
    assert seen == [1, 2]
    assert later == [2]  # never sees generation 1 after 2


def test_concurrent_writers_give_monotonic_notifications_and_all_files():
    store = ResourceStore()
    seen: list[int] = []
    store.subscribe(lambda s: seen.append(s.generation))

    def writer(i: int) -> None:
        for j in range(20):
            store.replace_file(f"f{i}.yaml", [sa(f"w{i}-{j}")])

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert store.generation == 80
    assert seen == sorted(seen)
    assert seen[-1] == 80
    assert {o.name for o in store.snapshot().objects} == {f"w{i}-19" for i in range(4)}


async def test_changes_yields_current_then_coalesced_latest():
    store = ResourceStore()
    store.replace_file("a.yaml", [sa("a")])
    stream = store.changes()
    first = await anext(stream)
    assert first.generation == 1
    store.replace_file("a.yaml", [sa("b")])
    store.replace_file("a.yaml", [sa("c")])
    latest = await asyncio.wait_for(anext(stream), 1)
    assert latest.generation == 3
    await stream.aclose()


async def test_changes_wakes_on_change_from_another_thread():
    store = ResourceStore()
    stream = store.changes(initial=False)
    pending = asyncio.ensure_future(anext(stream))
    await asyncio.sleep(0)
    thread = threading.Thread(target=store.replace_file, args=("a.yaml", [sa("t")]))
    thread.start()
    snap = await asyncio.wait_for(pending, 1)
    thread.join()
    assert [o.name for o in snap.objects] == ["t"]
    await stream.aclose()


def test_snapshot_errors_are_tuple_and_repr_is_short():
    store = ResourceStore()
    snap = store.snapshot()
    assert snap.errors == ()
    assert repr(snap) == "Snapshot(generation=0, objects=0, errors=0)"


@pytest.mark.parametrize("bad", ["", "   "])
def test_remove_of_unknown_file_is_a_no_op(bad):
    store = ResourceStore()
    assert store.remove_file(bad).generation == 0
