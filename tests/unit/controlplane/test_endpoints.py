"""Endpoint derivation and catalog lookups, on YAML text as users write it."""

from __future__ import annotations

import pytest

from agent.controlplane import kinds_core as k8s
from agent.controlplane import kinds_linkerd as l5d
from agent.controlplane import resources as r
from agent.controlplane.endpoints import (
    Catalog,
    EndpointAddress,
    PodRef,
    default_inbound_policy,
    opaque_ports,
    parse_service_fqdn,
    selector_matches,
)
from agent.controlplane.manifests import parse_text

NS = """\
apiVersion: v1
kind: Namespace
metadata: {name: shop, annotations: {linkerd.io/inject: enabled}}
---
apiVersion: v1
kind: Namespace
metadata: {name: outside}
"""


def pod(  # noqa: PLR0913 - a table of pod facts
    name, ip, *, ready=True, labels="app: api", ns="shop", phase="Running", extra="", ports=None
):
    ports = ports or "[{name: http, containerPort: 8080}]"
    cond = "True" if ready else "False"
    return f"""\
---
apiVersion: v1
kind: Pod
metadata:
  name: {name}
  namespace: {ns}
  labels: {{{labels}}}
  {extra or "annotations: {}"}
spec:
  serviceAccountName: {name.split("-")[0]}
  nodeName: node-a
  containers: [{{name: c, ports: {ports}}}]
status:
  phase: {phase}
  podIP: "{ip}"
  conditions: [{{type: Ready, status: "{cond}"}}]
"""


SERVICE = """\
---
apiVersion: v1
kind: Service
metadata: {name: api, namespace: shop}
spec:
  clusterIP: 10.96.0.20
  selector: {app: api}
  ports: [{name: http, port: 80, targetPort: http}, {name: raw, port: 9000, targetPort: 9001}]
"""


def catalog(*texts: str) -> Catalog:
    objects, errors = parse_text("".join(texts), file="t.yaml")
    assert errors == []
    return Catalog(objects)


def test_endpoints_derived_from_selected_pods_with_named_target_port():
    cat = catalog(
        NS,
        SERVICE,
        pod("api-1", "10.0.0.2"),
        pod("api-2", "10.0.0.1", ready=False),
        pod("web-1", "10.0.0.3", labels="app: web"),
    )
    svc = cat.service("shop", "api")
    assert svc is not None
    eps = cat.endpoints(svc, 80)
    assert eps == (
        EndpointAddress(
            ip="10.0.0.1",
            port=8080,
            ready=False,
            pod=PodRef(namespace="shop", name="api-2"),
            node_name="node-a",
            service_account="api",
            meshed=True,
        ),
        EndpointAddress(
            ip="10.0.0.2",
            port=8080,
            ready=True,
            pod=PodRef(namespace="shop", name="api-1"),
            node_name="node-a",
            service_account="api",
            meshed=True,
        ),
    )


def test_numeric_target_port_and_unknown_service_port():
    cat = catalog(NS, SERVICE, pod("api-1", "10.0.0.2"))
    svc = cat.service("shop", "api")
    assert svc is not None
    assert [(e.ip, e.port) for e in cat.endpoints(svc, 9000)] == [("10.0.0.2", 9001)]
    assert cat.endpoints(svc, 1234) == ()


@pytest.mark.parametrize(
    ("pod_text", "why"),
    [
        (pod("api-1", "", ready=True), "no pod IP yet"),
        (pod("api-1", "10.0.0.2", phase="Succeeded"), "terminal phase"),
        (pod("api-1", "10.0.0.2", phase="Failed"), "terminal phase"),
        (
            pod("api-1", "10.0.0.2", ports="[{name: metrics, containerPort: 9090}]"),
            "no port named http",
        ),
        (pod("api-1", "10.0.0.2", ns="other"), "other namespace"),
    ],
)
def test_pods_the_endpoints_controller_leaves_out(pod_text, why):
    cat = catalog(NS, SERVICE, pod_text)
    svc = cat.service("shop", "api")
    assert svc is not None
    assert cat.endpoints(svc, 80) == (), why


def test_publish_not_ready_addresses_makes_every_pod_ready():
    text = SERVICE.replace("selector:", "publishNotReadyAddresses: true\n  selector:")
    cat = catalog(NS, text, pod("api-1", "10.0.0.2", ready=False))
    svc = cat.service("shop", "api")
    assert svc is not None
    assert [e.ready for e in cat.endpoints(svc, 80)] == [True]


def test_explicit_endpoints_win_over_pods_and_resolve_target_pods():
    endpoints = """\
---
apiVersion: v1
kind: Endpoints
metadata: {name: api, namespace: shop}
subsets:
  - addresses:
      - {ip: 10.0.0.2, nodeName: node-b, targetRef: {kind: Pod, name: api-1}}
      - {ip: 10.9.9.9}
    notReadyAddresses:
      - {ip: 10.9.9.8, targetRef: {kind: Pod, name: gone}}
    ports: [{name: http, port: 8080}, {name: raw, port: 9001}]
"""
    cat = catalog(NS, SERVICE, pod("api-1", "10.0.0.2"), pod("api-2", "10.0.0.7"), endpoints)
    svc = cat.service("shop", "api")
    assert svc is not None
    eps = cat.endpoints(svc, 80)
    assert [(e.ip, e.port, e.ready) for e in eps] == [
        ("10.0.0.2", 8080, True),
        ("10.9.9.8", 8080, False),
        ("10.9.9.9", 8080, True),
    ]
    assert eps[0].service_account == "api"
    assert eps[0].node_name == "node-b"
    assert eps[0].meshed
    assert eps[1].pod == PodRef(namespace="shop", name="gone")
    assert eps[1].service_account == ""
    assert eps[2].pod is None
    assert not eps[2].meshed


def test_endpoint_slices_win_over_endpoints_and_read_conditions():
    slices = """\
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: api-abc
  namespace: shop
  labels: {kubernetes.io/service-name: api}
addressType: IPv4
endpoints:
  - addresses: [10.1.0.1]
    zone: z1
    targetRef: {kind: Pod, name: api-1, namespace: shop}
  - addresses: [10.1.0.2]
    conditions: {ready: false}
ports: [{name: http, port: 8080}]
---
apiVersion: v1
kind: Endpoints
metadata: {name: api, namespace: shop}
subsets: [{addresses: [{ip: 10.9.9.9}], ports: [{name: http, port: 8080}]}]
"""
    cat = catalog(NS, SERVICE, pod("api-1", "10.0.0.2"), slices)
    svc = cat.service("shop", "api")
    assert svc is not None
    eps = cat.endpoints(svc, 80)
    assert [(e.ip, e.ready, e.zone) for e in eps] == [
        ("10.1.0.1", True, "z1"),
        ("10.1.0.2", False, ""),
    ]
    assert eps[0].service_account == "api"


def test_service_without_selector_and_endpoints_has_no_endpoints():
    svc = k8s.Service(name="x", namespace="shop", ports=(k8s.ServicePort(port=80, target_port=80),))
    assert Catalog([svc]).endpoints(svc, 80) == ()


def test_hostname_only_when_pod_subdomain_is_the_service():
    extra = "annotations: {}"
    text = pod("api-0", "10.0.0.2", extra=extra).replace(
        "  nodeName: node-a", "  nodeName: node-a\n  hostname: api-0\n  subdomain: api"
    )
    cat = catalog(NS, SERVICE, text)
    svc = cat.service("shop", "api")
    assert svc is not None
    assert cat.endpoints(svc, 80)[0].hostname == "api-0"


# --- lookups ------------------------------------------------------------------------------


def test_lookups_by_name_cluster_ip_pod_ip_and_fqdn():
    cat = catalog(NS, SERVICE, pod("api-1", "10.0.0.2"))
    svc = cat.service("shop", "api")
    assert svc is not None
    assert cat.service_by_cluster_ip("10.96.0.20") is svc
    assert cat.service_by_cluster_ip("10.96.0.21") is None
    found = cat.pod_by_ip("10.0.0.2")
    assert found is not None
    assert found.name == "api-1"
    assert cat.service_by_fqdn("api.shop.svc.cluster.local") is svc
    assert cat.service_by_fqdn("api.shop.svc") is svc
    assert cat.service_by_fqdn("api.shop.svc.other.domain") is None
    assert cat.service_by_fqdn("api.shop") is None
    assert cat.service_by_fqdn("api-0.api.shop.svc.cluster.local.") is svc
    assert cat.namespace("shop") is not None
    assert [p.name for p in cat.of_kind(k8s.Pod, "shop")] == ["api-1"]
    assert cat.of_kind(k8s.Pod, "outside") == ()


@pytest.mark.parametrize(
    ("host", "parsed"),
    [
        ("api.shop.svc.cluster.local", ("shop", "api", "")),
        ("api.shop.svc", ("shop", "api", "")),
        ("API.Shop.svc.cluster.local.", ("shop", "api", "")),
        ("api-0.api.shop.svc.cluster.local", ("shop", "api", "api-0")),
        ("api.shop.svc.example.org", None),
        ("api.shop.cluster.local", None),
        ("a.b.api.shop.svc.cluster.local", None),
        ("", None),
    ],
)
def test_parse_service_fqdn(host, parsed):
    assert parse_service_fqdn(host) == parsed


def test_pod_by_ip_prefers_a_live_pod_over_a_terminated_one():
    cat = catalog(NS, pod("api-1", "10.0.0.2"), pod("old-1", "10.0.0.2", phase="Succeeded"))
    found = cat.pod_by_ip("10.0.0.2")
    assert found is not None
    assert found.name == "api-1"


def test_service_profile_lookup_prefers_client_namespace():
    profiles = """\
---
apiVersion: linkerd.io/v1alpha2
kind: ServiceProfile
metadata: {name: api.shop.svc.cluster.local, namespace: shop}
spec: {routes: [{name: a, condition: {method: GET}}]}
---
apiVersion: linkerd.io/v1alpha2
kind: ServiceProfile
metadata: {name: api.shop.svc.cluster.local, namespace: outside}
spec: {routes: [{name: b, condition: {method: POST}}]}
"""
    cat = catalog(NS, SERVICE, profiles)
    svc = cat.service("shop", "api")
    assert svc is not None
    own = cat.service_profile(svc)
    assert own is not None
    assert own.namespace == "shop"
    client = cat.service_profile(svc, client_namespace="outside")
    assert client is not None
    assert client.namespace == "outside"
    assert cat.service_profile(svc, client_namespace="elsewhere") is own


# --- meshing, annotations -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("ns", "annotation", "meshed"),
    [
        ("shop", "", True),
        ("shop", "linkerd.io/inject: disabled", False),
        ("outside", "", False),
        ("outside", "linkerd.io/inject: enabled", True),
        ("outside", "linkerd.io/inject: ingress", True),
    ],
)
def test_pod_is_meshed_by_its_own_or_its_namespace_annotation(ns, annotation, meshed):
    extra = f"annotations: {{{annotation}}}"
    cat = catalog(NS, pod("api-1", "10.0.0.2", ns=ns, extra=extra))
    found = cat.pod(ns, "api-1")
    assert found is not None
    assert cat.is_meshed(found) is meshed


def test_opaque_ports_from_pod_then_namespace_then_default():
    extra = "annotations: {config.linkerd.io/opaque-ports: 'http,7000-7002'}"
    cat = catalog(NS, pod("api-1", "10.0.0.2", extra=extra), pod("api-2", "10.0.0.3"))
    p1, p2 = cat.pod("shop", "api-1"), cat.pod("shop", "api-2")
    assert p1 is not None
    assert p2 is not None
    assert opaque_ports(p1, cat.namespace("shop")) == {8080, 7000, 7001, 7002}
    assert 5432 in opaque_ports(p2, cat.namespace("shop"))
    assert 8080 not in opaque_ports(p2, cat.namespace("shop"))


def test_default_inbound_policy_annotation_overrides_cluster_default():
    extra = "annotations: {config.linkerd.io/default-inbound-policy: deny}"
    cat = catalog(NS, pod("locked-1", "10.0.0.2", extra=extra), pod("api-1", "10.0.0.3"))
    locked, other = cat.pod("shop", "locked-1"), cat.pod("shop", "api-1")
    assert locked is not None
    assert other is not None
    fallback = l5d.AccessPolicy.ALL_UNAUTHENTICATED
    assert default_inbound_policy(locked, cat.namespace("shop"), fallback) is l5d.AccessPolicy.DENY
    assert default_inbound_policy(other, cat.namespace("shop"), fallback) is fallback


# --- selectors and policy lookups ----------------------------------------------------------


@pytest.mark.parametrize(
    ("expr", "labels", "expected"),
    [
        ({"key": "app", "operator": "In", "values": ("a", "b")}, {"app": "a"}, True),
        ({"key": "app", "operator": "In", "values": ("a",)}, {}, False),
        ({"key": "app", "operator": "NotIn", "values": ("a",)}, {"app": "c"}, True),
        ({"key": "app", "operator": "NotIn", "values": ("a",)}, {}, True),
        ({"key": "app", "operator": "NotIn", "values": ("a",)}, {"app": "a"}, False),
        ({"key": "app", "operator": "Exists"}, {"app": ""}, True),
        ({"key": "app", "operator": "Exists"}, {}, False),
        ({"key": "app", "operator": "DoesNotExist"}, {}, True),
        ({"key": "app", "operator": "DoesNotExist"}, {"app": "x"}, False),
    ],
)
def test_match_expressions(expr, labels, expected):
    req = r.SelectorRequirement(
        key=expr["key"],
        operator=r.SelectorOperator(expr["operator"]),
        values=expr.get("values", ()),
    )
    selector = r.LabelSelector(match_expressions=(req,))
    assert selector_matches(selector, labels) is expected


def test_match_labels_and_expressions_are_anded_and_empty_selects_all():
    req = r.SelectorRequirement(key="tier", operator=r.SelectorOperator.EXISTS)
    sel = r.LabelSelector(match_labels=r.FrozenMap({"app": "a"}), match_expressions=(req,))
    assert selector_matches(sel, {"app": "a", "tier": "x"})
    assert not selector_matches(sel, {"app": "a"})
    assert selector_matches(r.LabelSelector(), {"anything": "x"})
    assert selector_matches({"app": "a"}, {"app": "a", "b": "c"})


POLICY = """\
---
apiVersion: policy.linkerd.io/v1beta3
kind: Server
metadata: {name: api-http, namespace: shop, labels: {tier: back}}
spec: {podSelector: {matchLabels: {app: api}}, port: http}
---
apiVersion: policy.linkerd.io/v1beta3
kind: Server
metadata: {name: api-raw, namespace: shop}
spec: {podSelector: {matchLabels: {app: api}}, port: 9001}
---
apiVersion: policy.linkerd.io/v1beta1
kind: ServerAuthorization
metadata: {name: by-name, namespace: shop}
spec: {server: {name: api-http}, client: {unauthenticated: true}}
---
apiVersion: policy.linkerd.io/v1beta1
kind: ServerAuthorization
metadata: {name: by-label, namespace: shop}
spec: {server: {selector: {matchLabels: {tier: back}}}, client: {meshTLS: {identities: ["*"]}}}
---
apiVersion: policy.linkerd.io/v1beta1
kind: ServerAuthorization
metadata: {name: other, namespace: shop}
spec: {server: {name: api-raw}, client: {unauthenticated: true}}
---
apiVersion: policy.linkerd.io/v1alpha1
kind: AuthorizationPolicy
metadata: {name: ap, namespace: shop}
spec:
  targetRef: {group: policy.linkerd.io, kind: Server, name: api-http}
  requiredAuthenticationRefs: [{kind: ServiceAccount, name: web}]
---
apiVersion: policy.linkerd.io/v1beta3
kind: HTTPRoute
metadata: {name: api-routes, namespace: shop}
spec: {parentRefs: [{name: api-http, kind: Server}]}
"""


def test_servers_authorizations_policies_and_routes_for_a_pod_port():
    cat = catalog(
        NS, SERVICE, POLICY, pod("api-1", "10.0.0.2", ports="[{name: http, containerPort: 8080}]")
    )
    api = cat.pod("shop", "api-1")
    assert api is not None
    servers = cat.servers_for(api, 8080)
    assert [s.name for s in servers] == ["api-http"]
    assert [s.name for s in cat.servers_for(api, 9001)] == ["api-raw"]
    assert cat.servers_for(api, 1) == ()
    server = servers[0]
    assert [a.name for a in cat.server_authorizations(server)] == ["by-label", "by-name"]
    assert [p.name for p in cat.authorization_policies("shop", "Server", "api-http")] == ["ap"]
    assert cat.authorization_policies("shop", "Namespace", "shop") == ()
    assert [rt.name for rt in cat.routes_for_server(server)] == ["api-routes"]
