"""Manifest loading end to end: a bad document is located and the rest still loads.

Also the files (JSON, unreadable), the checks across documents and the examples folder.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.controlplane import kinds_core as k8s
from agent.controlplane import kinds_linkerd as l5d
from agent.controlplane import resources as r
from agent.controlplane.manifests import (
    check_references,
    load_file,
    load_folder,
    manifest_files,
    manifest_folders,
    parse_text,
)

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"

GOOD = """\
apiVersion: v1
kind: ServiceAccount
metadata: {name: good, namespace: shop}
"""

SERVER_HEAD = (
    "apiVersion: policy.linkerd.io/v1beta3\nkind: Server\nmetadata: {name: srv, namespace: shop}\n"
)
PROFILE_HEAD = (
    "apiVersion: linkerd.io/v1alpha2\nkind: ServiceProfile\nmetadata: {name: p, namespace: shop}\n"
)

# --- every located-error case, each next to a good document that still loads ----

BAD_CASES = [
    pytest.param(
        "kind: Service\napiVersion: v1\nmetadata: {name: x\n",
        ("", "", ""),
        "invalid YAML at line",
        id="broken-yaml",
    ),
    pytest.param(
        "apiVersion: v1\nkind: Gizmo\nmetadata: {name: g}\n",
        ("Gizmo", "g", "kind"),
        "unknown kind 'Gizmo'",
        id="unknown-kind",
    ),
    pytest.param(
        "apiVersion: v2\nkind: Service\nmetadata: {name: s}\n",
        ("Service", "s", "apiVersion"),
        "is not one of v1",
        id="wrong-api-version",
    ),
    pytest.param(
        "apiVersion: v1\nkind: Service\nmetadata: {name: s, namespace: shop}\n"
        "spec: {ports: [{port: 80}]}\n",
        ("Service", "s", "spec.selector"),
        "no selector, and no Endpoints",
        id="missing-selector",
    ),
    pytest.param(
        SERVER_HEAD + "spec: {podSelector: {matchLabels: {app: web}}, port: admin}\n"
        "---\n"
        "apiVersion: v1\nkind: Pod\nmetadata: {name: web-1, namespace: shop, labels: {app: web}}\n"
        "spec: {containers: [{name: web, ports: [{name: http, containerPort: 8080}]}]}\n",
        ("Server", "srv", "spec.port"),
        "no selected container declares a port named 'admin'",
        id="port-name-not-found",
    ),
    pytest.param(
        "apiVersion: policy.linkerd.io/v1alpha1\nkind: NetworkAuthentication\n"
        "metadata: {name: nets, namespace: shop}\nspec: {networks: [{cidr: 10.0.0.0/40}]}\n",
        ("NetworkAuthentication", "nets", "spec.networks[0].cidr"),
        "is not a CIDR",
        id="bad-cidr",
    ),
    pytest.param(
        "apiVersion: policy.linkerd.io/v1beta1\nkind: ServerAuthorization\n"
        "metadata: {name: saz, namespace: shop}\n"
        "spec: {server: {name: srv}, client: {unauthenticated: true, networks: [{cidr: 10.0.0.0/8,"
        " except: [nope]}]}}\n",
        ("ServerAuthorization", "saz", "spec.client.networks[0].except[0]"),
        "is not a CIDR",
        id="bad-cidr-except",
    ),
    pytest.param(
        PROFILE_HEAD
        + "spec: {routes: [{name: r, condition: {method: GET}, timeout: 3 seconds}]}\n",
        ("ServiceProfile", "p", "spec.routes[0].timeout"),
        "not a duration",
        id="bad-duration",
    ),
    pytest.param(
        PROFILE_HEAD + "spec: {retryBudget: {retryRatio: 0.2, minRetriesPerSecond: 10, ttl: 10}}\n",
        ("ServiceProfile", "p", "spec.retryBudget.ttl"),
        "expected a duration",
        id="duration-without-unit",
    ),
    pytest.param(
        PROFILE_HEAD + "spec: {routes: [{name: r, condition: {pathRegex: '/a/(['}}]}\n",
        ("ServiceProfile", "p", "spec.routes[0].condition.pathRegex"),
        "invalid regular expression",
        id="bad-regex",
    ),
    pytest.param(
        PROFILE_HEAD + "spec: {routes: [{name: r, condition: {}}]}\n",
        ("ServiceProfile", "p", "spec.routes[0].condition"),
        "needs one of",
        id="empty-route-condition",
    ),
    pytest.param(
        "apiVersion: v1\nkind: Service\nmetadata: {name: s, namespace: shop}\n"
        "spec: {selector: {app: a}, ports: [{port: 80, targetPort: 70000}]}\n",
        ("Service", "s", "spec.ports[0].targetPort"),
        "not between 1 and 65535",
        id="bad-target-port",
    ),
    pytest.param(
        "apiVersion: v1\nkind: Service\nmetadata: {name: s, namespace: shop}\n"
        "spec: {selector: {app: a}, ports: [{port: 80}, {port: 81}]}\n",
        ("Service", "s", "spec.ports[0].name"),
        "required when a Service has several ports",
        id="unnamed-ports",
    ),
    pytest.param(
        "apiVersion: v1\nkind: Pod\nmetadata: {namespace: shop}\nspec: {containers: [{name: c}]}\n",
        ("Pod", "", "metadata.name"),
        "required",
        id="missing-name",
    ),
    pytest.param(
        "apiVersion: v1\nkind: Service\nmetadata: {name: s, namespace: shop, labels: {tier: 2}}\n"
        "spec: {selector: {app: a}, ports: [{port: 80}]}\n",
        ("Service", "s", "metadata.labels.tier"),
        "expected a string, not int",
        id="label-not-a-string",
    ),
    pytest.param(
        "apiVersion: v1\nkind: Pod\nmetadata: {name: p, namespace: shop}\n"
        "spec: {containers: [{name: c}]}\nstatus: {podIP: 10.1.2.300}\n",
        ("Pod", "p", "status.podIP"),
        "not an IP address",
        id="bad-pod-ip",
    ),
    pytest.param(
        SERVER_HEAD
        + "spec: {podSelector: {matchLabels: {app: a}}, port: 80, accessPolicy: maybe}\n",
        ("Server", "srv", "spec.accessPolicy"),
        "Input should be",
        id="bad-access-policy",
    ),
    pytest.param(
        SERVER_HEAD
        + "spec: {podSelector: {matchExpressions: [{key: a, operator: In}]}, port: 80}\n",
        ("Server", "srv", "spec.podSelector.matchExpressions[0]"),
        "operator In needs values",
        id="selector-in-without-values",
    ),
    pytest.param(
        "apiVersion: policy.linkerd.io/v1alpha1\nkind: AuthorizationPolicy\n"
        "metadata: {name: ap, namespace: shop}\n"
        "spec: {targetRef: {kind: Deployment, name: web}, requiredAuthenticationRefs: []}\n",
        ("AuthorizationPolicy", "ap", "spec.targetRef.kind"),
        "unsupported target kind",
        id="authz-bad-target",
    ),
    pytest.param(
        "apiVersion: policy.linkerd.io/v1alpha1\nkind: MeshTLSAuthentication\n"
        "metadata: {name: m, namespace: shop}\nspec: {}\n",
        ("MeshTLSAuthentication", "m", "spec"),
        "exactly one of identities and identityRefs",
        id="meshtls-empty",
    ),
    pytest.param(
        "apiVersion: policy.linkerd.io/v1beta1\nkind: ServerAuthorization\n"
        "metadata: {name: saz, namespace: shop}\nspec: {server: {name: srv}, client: {}}\n",
        ("ServerAuthorization", "saz", "spec.client"),
        "meshTLS is required unless unauthenticated",
        id="saz-no-client",
    ),
    pytest.param(
        "apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: d, namespace: shop}\n"
        "spec: {selector: {matchLabels: {app: x}}, template: {metadata: {labels: {app: y}},"
        " spec: {containers: [{name: c}]}}}\n",
        ("Deployment", "d", "spec.selector"),
        "does not match template labels",
        id="deployment-selector-mismatch",
    ),
    pytest.param(
        "apiVersion: gateway.networking.k8s.io/v1\nkind: HTTPRoute\n"
        "metadata: {name: hr, namespace: shop}\n"
        "spec: {rules: [{matches: [{path: {type: PathPrefix, value: nope}}]}]}\n",
        ("HTTPRoute", "hr", "spec.rules[0].matches[0].path"),
        "must start with '/'",
        id="route-path-without-slash",
    ),
    pytest.param(
        "apiVersion: v1\nkind: Pod\nmetadata:\n  name: p\n  namespace: shop\n  annotations:\n"
        "    config.linkerd.io/opaque-ports: '5432,abc_def'\nspec: {containers: [{name: c}]}\n",
        ("Pod", "p", "metadata.annotations"),
        "opaque-ports",
        id="bad-opaque-ports-annotation",
    ),
    pytest.param(
        "- just\n- a list\n",
        ("", "", ""),
        "a document must be a mapping",
        id="not-a-mapping",
    ),
]


@pytest.mark.parametrize(("bad", "where", "reason"), BAD_CASES)
def test_bad_document_is_located_and_rejects_only_itself(bad, where, reason):
    text = GOOD + "---\n" + bad + "---\n" + GOOD.replace("good", "also-good")
    objects, errors = parse_text(text, file="shop.yaml")
    objects, ref_errors = check_references(objects)
    errors += ref_errors
    assert len(errors) == 1, errors
    err = errors[0]
    assert (err.file, err.index) == ("shop.yaml", 1)
    assert (err.kind, err.name, err.field) == where
    assert reason in err.reason
    names = {o.name for o in objects}
    assert {"good", "also-good"} <= names


# --- files ---------------------------------------------------------------------------------


def test_json_file_loads(tmp_path):
    path = tmp_path / "sa.json"
    path.write_text('{"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "j"}}')
    objects, errors = load_file(path)
    assert errors == []
    assert objects[0] == k8s.ServiceAccount(name="j", namespace="default")
    assert objects[0].source == r.Source(file=str(path), index=0)


def test_unreadable_file_is_one_error(tmp_path):
    path = tmp_path / "bin.yaml"
    path.write_bytes(b"\xff\xfe\x00bad")
    objects, errors = load_file(path)
    assert objects == []
    assert len(errors) == 1
    assert "cannot read" in errors[0].reason


# --- cross-document checks -------------------------------------------------------------


def test_folders_are_those_whose_files_are_read(tmp_path):
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / ".hidden" / "c").mkdir(parents=True)
    (tmp_path / "link").symlink_to(tmp_path / "a")
    (tmp_path / "a" / "b" / "x.yaml").write_text(GOOD)
    (tmp_path / ".hidden" / "c" / "x.yaml").write_text(GOOD)
    (tmp_path / ".dot.yaml").write_text(GOOD)
    (tmp_path / "a" / "notes.txt").write_text("not a manifest")
    (tmp_path / "l.yaml").symlink_to(tmp_path / "a" / "b" / "x.yaml")  # a ConfigMap's kind
    (tmp_path / "gone.yaml").symlink_to(tmp_path / "nowhere.yaml")
    assert manifest_folders(tmp_path) == [tmp_path, tmp_path / "a", tmp_path / "a" / "b"]
    assert manifest_files(tmp_path) == [tmp_path / "a" / "b" / "x.yaml", tmp_path / "l.yaml"]
    assert manifest_folders(tmp_path / "missing") == []
    assert manifest_files(tmp_path / "missing") == []


def test_service_without_selector_is_fine_when_endpoints_exist():
    objects, errors = parse_text("""\
apiVersion: v1
kind: Service
metadata: {name: ext, namespace: shop}
spec: {ports: [{port: 80}]}
---
apiVersion: v1
kind: Endpoints
metadata: {name: ext, namespace: shop}
subsets: [{addresses: [{ip: 10.9.0.1}], ports: [{port: 80}]}]
""")
    kept, ref_errors = check_references(objects)
    assert errors == ref_errors == []
    assert len(kept) == 2


def test_duplicate_object_keeps_the_first_and_names_it():
    objects, _ = parse_text(GOOD + "---\n" + GOOD, file="d.yaml")
    kept, errors = check_references(objects)
    assert len(kept) == 1
    assert kept[0].source == r.Source(file="d.yaml", index=0)
    assert errors[0].index == 1
    assert "duplicate of d.yaml document 0" in errors[0].reason


def test_server_named_port_declared_by_deployment_template_is_fine():
    objects, _ = parse_text("""\
apiVersion: policy.linkerd.io/v1beta3
kind: Server
metadata: {name: srv, namespace: shop}
spec: {podSelector: {matchLabels: {app: api}}, port: http}
---
apiVersion: apps/v1
kind: Deployment
metadata: {name: api, namespace: shop}
spec:
  selector: {matchLabels: {app: api}}
  template:
    metadata: {labels: {app: api}}
    spec: {containers: [{name: api, ports: [{name: http, containerPort: 8080}]}]}
""")
    kept, errors = check_references(objects)
    assert errors == []
    assert len(kept) == 2


# --- the examples folder ---------------------------------------------------------------


def test_examples_load_with_zero_errors():
    objects, errors = load_folder(EXAMPLES)
    assert errors == []
    keys = {o.key for o in objects}
    for name in ("web", "api", "db", "load", "locked"):
        assert ("Deployment", "shop", name) in keys
        assert ("ServiceAccount", "shop", name) in keys
        assert ("Service", "shop", name) in keys
    assert ("Deployment", "outside", "curl") in keys
    deployments = {o.name: o for o in objects if isinstance(o, k8s.Deployment)}
    assert deployments["api"].replicas == 2
    db = deployments["db"].template.annotations
    assert db[r.OPAQUE_PORTS_ANNOTATION] == "5432"
    assert deployments["locked"].template.annotations[r.DEFAULT_INBOUND_POLICY_ANNOTATION] == "deny"
    profile = next(o for o in objects if isinstance(o, l5d.ServiceProfile))
    assert profile.name == "api.shop.svc.cluster.local"
    assert any(rt.is_retryable and rt.condition.method == "GET" for rt in profile.routes)
    assert any(rt.timeout == pytest.approx(0.3) for rt in profile.routes)
    assert profile.retry_budget is not None
    namespaces = {o.name: o for o in objects if isinstance(o, k8s.Namespace)}
    assert namespaces["shop"].annotations[r.INJECT_ANNOTATION] == "enabled"
    assert r.INJECT_ANNOTATION not in namespaces["outside"].annotations
