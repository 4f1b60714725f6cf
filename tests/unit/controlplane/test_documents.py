"""Manifest text -> objects: YAML and document errors located, lists, document counting, fuzz."""

from __future__ import annotations

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.controlplane.documents import parse_text, split_documents

GOOD = """\
apiVersion: v1
kind: ServiceAccount
metadata: {name: good, namespace: shop}
"""

# --- located errors ------------------------------------------------------------------


def test_broken_yaml_error_names_the_file_line():
    text = GOOD + "---\nkind: Service\nmetadata: {name: [\n"
    _, errors = parse_text(text, file="f.yaml")
    assert len(errors) == 1
    assert "line 6" in errors[0].reason or "line 7" in errors[0].reason


def test_error_message_reads_file_index_kind_name_field():
    _, errors = parse_text("apiVersion: v1\nkind: Gizmo\nmetadata: {name: g}\n", file="a.yaml")
    assert str(errors[0]) == "a.yaml document 0 (Gizmo/g) field kind: unknown kind 'Gizmo'"


@pytest.mark.parametrize("api", ["{a: 1}", "[v1]", "1", "null"])
def test_an_apiversion_that_is_not_a_string_is_a_located_error(api):
    objects, errors = parse_text(f"apiVersion: {api}\nkind: Pod\nmetadata: {{name: p}}\n")
    assert objects == []
    assert [(e.kind, e.name, e.field) for e in errors] == [("Pod", "p", "apiVersion")]
    assert "is not one of v1" in errors[0].reason


# --- documents and lists -------------------------------------------------------------


def test_empty_documents_are_skipped_but_counted():
    text = (
        "# header\n---\n---\n"
        + GOOD
        + "---\n\n---\napiVersion: v1\nkind: Gizmo\nmetadata: {name: g}\n"
    )
    objects, errors = parse_text(text, file="f.yaml")
    assert [o.name for o in objects] == ["good"]
    assert errors[0].index == 3  # empty, good, empty, gizmo


def test_split_documents_keeps_line_offsets_and_drops_comment_preamble():
    chunks = split_documents("# c\n---\na: 1\n--- # next\nb: 2\n")
    assert [start for start, _ in chunks] == [1, 3]
    assert chunks[1][1].startswith("--- # next")


def test_list_items_load_and_bad_items_are_located_under_items():
    text = """\
apiVersion: v1
kind: List
items:
  - apiVersion: v1
    kind: ServiceAccount
    metadata: {name: one, namespace: shop}
  - apiVersion: v1
    kind: Gizmo
    metadata: {name: two}
"""
    objects, errors = parse_text(text, file="l.yaml")
    assert [o.name for o in objects] == ["one"]
    assert (errors[0].index, errors[0].field, errors[0].kind) == (0, "items[1].kind", "Gizmo")


def test_only_keeps_the_named_kinds_and_skips_the_others_unread():
    text = """\
apiVersion: v1
kind: Namespace
metadata: {name: shop}
---
apiVersion: v1
kind: Service
metadata: {name: broken}
spec: {ports: [{port: 0}]}
---
apiVersion: v1
kind: Gizmo
metadata: {name: g}
---
apiVersion: v1
kind: List
items:
  - {apiVersion: v1, kind: Pod, metadata: {name: p}, spec: {containers: [{name: c}]}}
  - {apiVersion: v1, kind: Pod, metadata: {name: q}, spec: {containers: []}}
  - {apiVersion: v1, kind: ConfigMap, metadata: {name: cm}}
"""
    objects, errors = parse_text(text, file="f.yaml", only={"Pod", "Namespace"})
    assert [(type(o).__name__, o.name) for o in objects] == [("Namespace", "shop"), ("Pod", "p")]
    # the bad Service and the unknown kinds are not this reader's to report; the bad Pod is
    assert [(e.index, e.field) for e in errors] == [(3, "items[1].spec.containers")]
    _, unfiltered = parse_text(text, file="f.yaml")
    assert [e.kind for e in unfiltered] == ["Service", "Gizmo", "Pod", "ConfigMap"]


# --- fuzz: the parser never raises ------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=300))
def test_parse_text_never_raises_on_arbitrary_text(text):
    objects, errors = parse_text(text, file="fuzz.yaml")
    assert isinstance(objects, list)
    assert all(e.file == "fuzz.yaml" for e in errors)


@settings(max_examples=100, deadline=None)
@given(
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.text(max_size=10),
        lambda inner: (
            st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
        ),
        max_leaves=20,
    ),
    st.sampled_from(["Service", "Pod", "Server", "ServiceProfile", "HTTPRoute", "Deployment"]),
)
def test_any_spec_shape_gives_objects_or_located_errors(spec, kind):
    api = {
        "Service": "v1",
        "Pod": "v1",
        "Server": "policy.linkerd.io/v1beta3",
        "ServiceProfile": "linkerd.io/v1alpha2",
        "HTTPRoute": "gateway.networking.k8s.io/v1",
        "Deployment": "apps/v1",
    }[kind]
    doc = {"apiVersion": api, "kind": kind, "metadata": {"name": "x"}, "spec": spec}
    objects, errors = parse_text(yaml.safe_dump(doc), file="f.yaml")
    assert len(objects) + len(errors) == 1
    if errors:
        assert (errors[0].kind, errors[0].name, errors[0].index) == (kind, "x", 0)
