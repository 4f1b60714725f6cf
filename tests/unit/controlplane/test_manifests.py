"""Manifest parsing: typed objects out, located errors for bad documents, the rest still loads."""

from __future__ import annotations

import ipaddress
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.controlplane import kinds
from agent.controlplane import kinds_core as k8s
from agent.controlplane import kinds_linkerd as l5d
from agent.controlplane import resources as r
from agent.controlplane.manifests import (
    check_references,
    load_file,
    load_folder,
    parse_text,
    split_documents,
)

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"

GOOD = """\
apiVersion: v1
kind: ServiceAccount
metadata: {name: good, namespace: shop}
"""


def _one(text: str) -> kinds.Resource:
    objects, errors = parse_text(text, file="t.yaml")
    assert errors == []
    assert len(objects) == 1
    return objects[0]


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
        "Field required",
        id="missing-name",
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


def test_broken_yaml_error_names_the_file_line():
    text = GOOD + "---\nkind: Service\nmetadata: {name: [\n"
    _, errors = parse_text(text, file="f.yaml")
    assert len(errors) == 1
    assert "line 6" in errors[0].reason or "line 7" in errors[0].reason


def test_error_message_reads_file_index_kind_name_field():
    _, errors = parse_text("apiVersion: v1\nkind: Gizmo\nmetadata: {name: g}\n", file="a.yaml")
    assert str(errors[0]) == "a.yaml document 0 (Gizmo/g) field kind: unknown kind 'Gizmo'"


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


# --- typed objects and defaults --------------------------------------------------------


def test_pod_reads_status_like_kubectl_prints_it():
    pod = _one(
        """\
apiVersion: v1
kind: Pod
metadata:
  name: web-1
  namespace: shop
  uid: 1234
  labels: {app: web}
spec:
  nodeName: node-a
  containers:
    - name: web
      ports: [{name: http, containerPort: 8080}]
status:
  phase: Running
  podIP: 10.0.0.5
  podIPs: [{ip: 10.0.0.5}]
  conditions:
    - {type: Initialized, status: "True"}
    - {type: Ready, status: "True", lastTransitionTime: 2024-01-01T00:00:00Z}
""".replace("uid: 1234", "uid: '1234'")
    )
    assert isinstance(pod, k8s.Pod)
    assert pod.service_account == "default"
    assert pod.node_name == "node-a"
    assert pod.status == k8s.PodStatus(
        phase=k8s.PodPhase.RUNNING, pod_ip="10.0.0.5", pod_ips=("10.0.0.5",), ready=True
    )
    assert pod.port("http") == 8080
    assert pod.uid == "1234"


def test_pod_without_ready_condition_is_not_ready():
    pod = _one(
        "apiVersion: v1\nkind: Pod\nmetadata: {name: p}\nspec: {containers: [{name: c}]}\n"
        "status: {phase: Running, podIP: 10.0.0.9, conditions: [{type: Ready, status: 'False'}]}\n"
    )
    assert isinstance(pod, k8s.Pod)
    assert pod.status.ready is False
    assert pod.namespace == "default"


def test_service_defaults_target_port_to_port_and_keeps_named_target():
    svc = _one("""\
apiVersion: v1
kind: Service
metadata: {name: web, namespace: shop}
spec:
  clusterIP: 10.96.0.10
  selector: {app: web}
  ports:
    - {name: http, port: 80, targetPort: http}
    - {name: admin, port: 9000}
    - {name: alt, port: 81, targetPort: "8081"}
""")
    assert isinstance(svc, k8s.Service)
    assert [p.target_port for p in svc.ports] == ["http", 9000, 8081]
    assert svc.type is k8s.ServiceType.CLUSTER_IP
    assert svc.cluster_ips == ("10.96.0.10",)
    assert svc.selector == {"app": "web"}


def test_service_profile_is_fully_typed():
    profile = _one("""\
apiVersion: linkerd.io/v1alpha2
kind: ServiceProfile
metadata: {name: api.shop.svc.cluster.local, namespace: shop}
spec:
  opaquePorts: ["5432", "6000-6002"]
  dstOverrides:
    - {authority: api-v2.shop.svc.cluster.local:8080, weight: 500m}
  routes:
    - name: tree
      condition:
        all:
          - method: GET
          - any:
              - pathRegex: /a
              - not: {pathRegex: /b}
      responseClasses:
        - condition: {not: {status: {min: 200, max: 399}}}
          isFailure: true
      timeout: 1m30s
  retryBudget: {retryRatio: 0.2, minRetriesPerSecond: 10, ttl: 10s}
""")
    assert isinstance(profile, l5d.ServiceProfile)
    route = profile.routes[0]
    assert route.timeout == 90.0
    inner = route.condition.all[1].any[1]
    assert inner.not_ == l5d.RequestMatch(path_regex="/b")
    rc = route.response_classes[0]
    assert rc.is_failure
    assert rc.condition.not_ is not None
    assert rc.condition.not_.status == l5d.StatusRange(min=200, max=399)
    assert profile.retry_budget == l5d.RetryBudget(
        retry_ratio=0.2, min_retries_per_second=10, ttl=10.0
    )
    assert profile.opaque_ports == (r.PortRange(5432, 5432), r.PortRange(6000, 6002))
    assert profile.dst_overrides == (
        l5d.WeightedDst(authority="api-v2.shop.svc.cluster.local:8080", weight=0.5),
    )


def test_policy_objects_are_typed_with_linkerd_defaults():
    objects, errors = parse_text("""\
apiVersion: policy.linkerd.io/v1beta3
kind: Server
metadata: {name: srv, namespace: shop}
spec:
  podSelector:
    matchExpressions: [{key: app, operator: In, values: [api, web]}]
  port: 8080
---
apiVersion: policy.linkerd.io/v1beta1
kind: ServerAuthorization
metadata: {name: saz, namespace: shop}
spec:
  server: {selector: {matchLabels: {tier: back}}}
  client:
    networks: [{cidr: 10.0.0.0/8, except: [10.1.0.0/16, 10.2.3.4]}]
    meshTLS:
      identities: ["*.shop.serviceaccount.identity.linkerd.cluster.local"]
      serviceAccounts: [{name: web}, {name: load, namespace: other}]
---
apiVersion: policy.linkerd.io/v1alpha1
kind: NetworkAuthentication
metadata: {name: nets, namespace: shop}
spec:
  networks: [{cidr: 192.168.0.0/16}, {cidr: "fd00::/8"}]
""")
    assert errors == []
    srv, saz, nets = objects
    assert isinstance(srv, l5d.Server)
    assert srv.port == 8080
    assert srv.proxy_protocol is l5d.ProxyProtocol.UNKNOWN
    assert srv.access_policy is l5d.AccessPolicy.DENY
    assert srv.pod_selector.matches({"app": "web"})
    assert not srv.pod_selector.matches({"app": "db"})
    assert isinstance(saz, l5d.ServerAuthorization)
    assert saz.server_name == ""
    assert saz.networks[0].contains("10.9.9.9")
    assert not saz.networks[0].contains("10.1.2.3")
    assert not saz.networks[0].contains("10.2.3.4")
    assert saz.mesh_tls is not None
    assert saz.mesh_tls.service_accounts[1] == l5d.ServiceAccountRef(name="load", namespace="other")
    assert isinstance(nets, l5d.NetworkAuthentication)
    assert nets.networks[1].cidr == ipaddress.ip_network("fd00::/8")


def test_http_routes_of_both_groups_get_gateway_defaults():
    objects, errors = parse_text("""\
apiVersion: policy.linkerd.io/v1beta3
kind: HTTPRoute
metadata: {name: r, namespace: shop}
spec:
  parentRefs: [{name: api-http, kind: Server}]
  rules:
    - matches:
        - path: {value: /retry}
          method: GET
          headers: [{name: x-user, value: "a.*", type: RegularExpression}]
      timeouts: {request: 2s}
---
apiVersion: gateway.networking.k8s.io/v1
kind: HTTPRoute
metadata: {name: r, namespace: shop}
spec:
  parentRefs: [{name: api, kind: Service, group: core, port: 8080}]
""")
    assert errors == []
    policy, gateway = objects
    assert isinstance(policy, l5d.HTTPRoute)
    assert isinstance(gateway, l5d.HTTPRoute)
    assert policy.key != gateway.key  # same name, different API groups
    assert policy.parent_refs[0].group == "policy.linkerd.io"
    match = policy.rules[0].matches[0]
    assert match.path == l5d.PathMatch(type=l5d.PathMatchType.PATH_PREFIX, value="/retry")
    assert match.headers[0].type is l5d.ValueMatchType.REGULAR_EXPRESSION
    assert policy.rules[0].timeout == 2.0
    assert gateway.rules == (l5d.RouteRule(),)  # default: PathPrefix "/"
    assert gateway.rules[0].matches[0].path == l5d.PathMatch()


def test_deployment_is_typed():
    dep = _one("""\
apiVersion: apps/v1
kind: Deployment
metadata: {name: api, namespace: shop}
spec:
  replicas: 2
  selector: {matchLabels: {app: api}}
  template:
    metadata:
      labels: {app: api, version: v1}
      annotations: {linkerd.io/inject: enabled}
    spec:
      serviceAccountName: api
      containers: [{name: api, ports: [{name: http, containerPort: 8080}]}]
""")
    assert isinstance(dep, k8s.Deployment)
    assert dep.replicas == 2
    assert dep.template.service_account == "api"
    assert dep.template.annotations == {"linkerd.io/inject": "enabled"}
    assert r.resolve_port(dep.template.containers, "http") == 8080


# --- cross-document checks -------------------------------------------------------------


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
