"""Inbound policy: Server protos for pod ports from YAML snapshots, with their authorizations."""

from __future__ import annotations

import dataclasses
import ipaddress

import pytest
from google.protobuf import json_format

from agent._proto import inbound_pb2
from agent.controlplane import kinds_core as k8s
from agent.controlplane import kinds_linkerd as l5d
from agent.controlplane import policy as pol
from agent.controlplane import resources as r
from agent.controlplane.manifests import parse_text
from agent.controlplane.store import ResourceStore, Snapshot

CFG = pol.PolicyConfig()
WEB = pol.Workload(namespace="shop", pod="web-1")

BASE = """\
apiVersion: v1
kind: Namespace
metadata: {name: shop, annotations: {linkerd.io/inject: enabled}}
---
apiVersion: v1
kind: Pod
metadata:
  name: web-1
  namespace: shop
  labels: {app: web}
  annotations: {config.linkerd.io/opaque-ports: "5432"}
spec:
  serviceAccountName: web
  containers: [{name: c, ports: [{name: http, containerPort: 8080}, {containerPort: 5432}]}]
status: {phase: Running, podIP: 10.1.0.1, conditions: [{type: Ready, status: "True"}]}
"""

SERVER = """\
---
apiVersion: policy.linkerd.io/v1beta3
kind: Server
metadata: {name: web-http, namespace: shop, labels: {tier: front}}
spec:
  podSelector: {matchLabels: {app: web}}
  port: http
  proxyProtocol: HTTP/1
"""


def snapshot(*texts: str) -> Snapshot:
    objects, errors = parse_text("".join(texts), file="t.yaml")
    assert errors == []
    return ResourceStore().replace_file("t.yaml", objects)


def js(message: object) -> dict:
    return json_format.MessageToDict(message, preserving_proto_field_name=True)  # type: ignore[arg-type]


def server(snap: Snapshot, port: int = 8080, cfg: pol.PolicyConfig = CFG) -> dict:
    return js(pol.inbound_server(snap, WEB, port, cfg))


ALL_V4 = {"net": {"ip": {"ipv4": 0}}}  # prefix_len 0 is proto3's default: not on the wire
ALL_V6 = {"net": {"ip": {"ipv6": {}}}}
DEFAULT_ROUTE = {
    "metadata": {"default": "default"},
    "rules": [{"matches": [{"path": {"prefix": "/"}}]}],
}


# --- workloads -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('{"ns":"shop","pod":"web-1"}', WEB),
        ("shop:web-1", WEB),
    ],
)
def test_workload_parses_linkerd_forms(text, expected):
    assert pol.Workload.parse(text) == expected


@pytest.mark.parametrize(
    "text", ["", "web-1", '{"ns":"shop"}', "{bad json", ":web", '{"ns":1,"pod":"p"}']
)
def test_bad_workload_is_invalid_and_says_so(text):
    with pytest.raises(pol.InvalidWorkload, match="Invalid workload"):
        pol.Workload.parse(text)


def test_external_workload_is_unknown():
    with pytest.raises(pol.UnknownWorkload, match="external workload"):
        pol.Workload.parse('{"ns":"shop","external_workload":"vm-1"}')


def test_unknown_pod_is_unknown_workload_naming_it():
    with pytest.raises(pol.UnknownWorkload, match="shop/nope"):
        pol.inbound_server(snapshot(BASE), pol.Workload(namespace="shop", pod="nope"), 80, CFG)


# --- default policies ------------------------------------------------------------------------


def test_no_server_gets_all_unauthenticated_default_with_detect_10s():
    assert server(snapshot(BASE)) == {
        "protocol": {"detect": {"timeout": "10s", "http_routes": [DEFAULT_ROUTE]}},
        "authorizations": [
            {
                "networks": [ALL_V4, ALL_V6],
                "authentication": {"unauthenticated": {}},
                "labels": {"group": "", "kind": "default", "name": "all-unauthenticated"},
                "metadata": {"default": "all-unauthenticated"},
            }
        ],
        "labels": {"group": "", "kind": "default", "name": "all-unauthenticated"},
    }


def test_opaque_port_without_server_is_opaque():
    assert server(snapshot(BASE), port=5432)["protocol"] == {"opaque": {}}


def test_namespace_annotation_overrides_cluster_default_and_pod_overrides_namespace():
    ns_deny = BASE.replace(
        "annotations: {linkerd.io/inject: enabled}",
        "annotations: {linkerd.io/inject: enabled, config.linkerd.io/default-inbound-policy: deny}",
    )
    assert server(snapshot(ns_deny))["labels"]["name"] == "deny"
    pod_auth = ns_deny.replace(
        'config.linkerd.io/opaque-ports: "5432"}',
        'config.linkerd.io/opaque-ports: "5432", '
        "config.linkerd.io/default-inbound-policy: all-authenticated}",
    )
    assert server(snapshot(pod_auth))["labels"]["name"] == "all-authenticated"


def test_bad_default_policy_annotation_falls_back_to_cluster_default():
    # The manifest loader rejects such a pod; a store fed another way may still hold one.
    objects, _ = parse_text(BASE, file="t.yaml")
    bad = {"config.linkerd.io/default-inbound-policy": "bogus"}
    patched = [
        dataclasses.replace(o, annotations=r.FrozenMap({**o.annotations, **bad}))
        if isinstance(o, k8s.Pod)
        else o
        for o in objects
    ]
    snap = ResourceStore().replace_file("t.yaml", patched)
    assert server(snap)["labels"]["name"] == "all-unauthenticated"


# --- Servers and authorizations -----------------------------------------------------------------


def test_server_without_authorizations_denies_with_its_protocol_and_labels():
    got = server(snapshot(BASE, SERVER))
    assert got == {
        "protocol": {"http1": {"routes": [DEFAULT_ROUTE]}},
        "labels": {"group": "policy.linkerd.io", "kind": "server", "name": "web-http"},
    }


def test_server_only_applies_to_its_port():
    assert server(snapshot(BASE, SERVER), port=5432)["labels"]["kind"] == "default"


@pytest.mark.parametrize(
    ("proto", "kind"),
    [
        ("unknown", "detect"),
        ("HTTP/2", "http2"),
        ("gRPC", "grpc"),
        ("opaque", "opaque"),
        ("TLS", "tls"),
    ],
)
def test_server_proxy_protocol_maps_to_proto_kind(proto, kind):
    got = server(snapshot(BASE, SERVER.replace("HTTP/1", proto)))
    assert list(got["protocol"]) == [kind]


def test_grpc_server_gets_the_default_grpc_route():
    got = server(snapshot(BASE, SERVER.replace("HTTP/1", "gRPC")))
    assert got["protocol"]["grpc"]["routes"] == [
        {"metadata": {"default": "default"}, "rules": [{"matches": [{"rpc": {}}]}]}
    ]


# --- routes --------------------------------------------------------------------------------------

ROUTE = """\
---
apiVersion: policy.linkerd.io/v1beta3
kind: HTTPRoute
metadata: {name: books, namespace: shop}
spec:
  parentRefs: [{group: policy.linkerd.io, kind: Server, name: web-http}]
  hostnames: ["*.example.com"]
  rules:
  - matches:
    - path: {type: PathPrefix, value: /books}
      method: GET
      headers: [{name: x-user, value: alice}]
---
apiVersion: policy.linkerd.io/v1alpha1
kind: AuthorizationPolicy
metadata: {name: books-authz, namespace: shop}
spec:
  targetRef: {group: policy.linkerd.io, kind: HTTPRoute, name: books}
  requiredAuthenticationRefs: [{kind: ServiceAccount, name: load}]
"""


def test_http_route_on_server_replaces_default_route_and_carries_its_authorizations():
    got = server(snapshot(BASE, SERVER, ROUTE))
    [route] = got["protocol"]["http1"]["routes"]
    assert route["metadata"] == {
        "resource": {"group": "policy.linkerd.io", "kind": "HTTPRoute", "name": "books"}
    }
    assert route["hosts"] == [{"suffix": {"reverse_labels": ["com", "example"]}}]
    assert route["rules"] == [
        {
            "matches": [
                {
                    "path": {"prefix": "/books"},
                    "headers": [{"name": "x-user", "exact": "YWxpY2U="}],
                    "method": {"registered": "GET"},
                }
            ]
        }
    ]
    [authz] = route["authorizations"]
    assert authz["labels"]["name"] == "books-authz"
    assert "authorizations" not in got  # a route policy is not a server policy


# --- authorizations (policy_authz, on the wire inside a Server) ---------------------------


def nets(authz: dict) -> list[str]:
    out = []
    for n in authz["networks"]:
        ip = n["net"]["ip"]
        if "ipv4" in ip:
            addr = ipaddress.ip_address(ip["ipv4"])
        else:
            v6 = ip["ipv6"]
            addr = ipaddress.IPv6Address((int(v6.get("first", 0)) << 64) | int(v6.get("last", 0)))
        out.append(f"{addr}/{n['net'].get('prefix_len', 0)}")
    return out


@pytest.mark.parametrize(
    ("policy", "networks", "authn"),
    [
        (
            "all-authenticated",
            ["0.0.0.0/0", "::/0"],
            {"meshTLS": {"identities": {"suffixes": [{}]}}},
        ),
        (
            "cluster-unauthenticated",
            ["10.0.0.0/8", "100.64.0.0/10", "172.16.0.0/12", "192.168.0.0/16"],
            {"unauthenticated": {}},
        ),
        (
            "cluster-authenticated",
            ["10.0.0.0/8", "100.64.0.0/10", "172.16.0.0/12", "192.168.0.0/16"],
            {"meshTLS": {"identities": {"suffixes": [{}]}}},
        ),
        ("audit", ["0.0.0.0/0", "::/0"], {"unauthenticated": {}}),
    ],
)
def test_cluster_default_policy_sets_networks_and_authentication(policy, networks, authn):
    cfg = pol.PolicyConfig(default_policy=l5d.AccessPolicy(policy))
    got = server(snapshot(BASE), cfg=cfg)
    [authz] = got["authorizations"]
    assert got["labels"]["name"] == policy
    assert authz["metadata"] == {"default": policy}
    assert nets(authz) == networks
    assert authz["authentication"] == authn


def test_deny_default_has_no_authorizations():
    got = server(snapshot(BASE), cfg=pol.PolicyConfig(default_policy=l5d.AccessPolicy.DENY))
    assert got["labels"]["name"] == "deny"
    assert "authorizations" not in got


# --- Servers and authorizations -----------------------------------------------------------------


def test_server_access_policy_adds_its_default_authorization():
    got = server(snapshot(BASE, SERVER + "  accessPolicy: all-authenticated\n"))
    assert [a["metadata"] for a in got["authorizations"]] == [{"default": "all-authenticated"}]


SAZ = """\
---
apiVersion: policy.linkerd.io/v1beta1
kind: ServerAuthorization
metadata: {name: web-from-load, namespace: shop}
spec:
  server: {name: web-http}
  client:
    meshTLS:
      serviceAccounts: [{name: load}]
      identities: ["*.outside.serviceaccount.identity.linkerd.cluster.local"]
"""


def test_server_authorization_by_name_permits_its_identities_on_cluster_networks():
    [authz] = server(snapshot(BASE, SERVER, SAZ))["authorizations"]
    assert authz["labels"] == {
        "group": "policy.linkerd.io",
        "kind": "serverauthorization",
        "name": "web-from-load",
    }
    assert authz["metadata"] == {
        "resource": {
            "group": "policy.linkerd.io",
            "kind": "serverauthorization",
            "name": "web-from-load",
        }
    }
    assert authz["authentication"] == {
        "meshTLS": {
            "identities": {
                "identities": [{"name": "load.shop.serviceaccount.identity.linkerd.cluster.local"}],
                "suffixes": [
                    {
                        "parts": [
                            "outside",
                            "serviceaccount",
                            "identity",
                            "linkerd",
                            "cluster",
                            "local",
                        ]
                    }
                ],
            }
        }
    }
    assert nets(authz) == ["10.0.0.0/8", "100.64.0.0/10", "172.16.0.0/12", "192.168.0.0/16"]


def test_server_authorization_by_selector_and_unauthenticated_networks():
    saz = """\
---
apiVersion: policy.linkerd.io/v1beta1
kind: ServerAuthorization
metadata: {name: from-lan, namespace: shop}
spec:
  server: {selector: {matchLabels: {tier: front}}}
  client:
    unauthenticated: true
    networks: [{cidr: 192.168.0.0/16, except: [192.168.1.0/24]}]
"""
    [authz] = server(snapshot(BASE, SERVER, saz))["authorizations"]
    assert authz["authentication"] == {"unauthenticated": {}}
    assert authz["networks"] == [
        {
            "net": {"ip": {"ipv4": 0xC0A80000}, "prefix_len": 16},
            "except": [{"ip": {"ipv4": 0xC0A80100}, "prefix_len": 24}],
        }
    ]


def test_server_authorization_unauthenticated_tls():
    saz = """\
---
apiVersion: policy.linkerd.io/v1beta1
kind: ServerAuthorization
metadata: {name: any-tls, namespace: shop}
spec:
  server: {name: web-http}
  client: {meshTLS: {unauthenticatedTLS: true}}
"""
    [authz] = server(snapshot(BASE, SERVER, saz))["authorizations"]
    assert authz["authentication"] == {"meshTLS": {"unauthenticated": {}}}


AP = """\
---
apiVersion: policy.linkerd.io/v1alpha1
kind: AuthorizationPolicy
metadata: {name: web-authn, namespace: shop}
spec:
  targetRef: {group: policy.linkerd.io, kind: Server, name: web-http}
  requiredAuthenticationRefs:
  - {group: policy.linkerd.io, kind: MeshTLSAuthentication, name: web-clients}
  - {group: policy.linkerd.io, kind: NetworkAuthentication, name: lan}
---
apiVersion: policy.linkerd.io/v1alpha1
kind: MeshTLSAuthentication
metadata: {name: web-clients, namespace: shop}
spec:
  identityRefs:
  - {kind: ServiceAccount, name: load}
  - {kind: Namespace, name: outside}
---
apiVersion: policy.linkerd.io/v1alpha1
kind: NetworkAuthentication
metadata: {name: lan, namespace: shop}
spec:
  networks: [{cidr: 10.0.0.0/8}]
"""


def test_authorization_policy_combines_meshtls_and_network_authentications():
    [authz] = server(snapshot(BASE, SERVER, AP))["authorizations"]
    assert authz["metadata"]["resource"]["kind"] == "authorizationpolicy"
    assert authz["labels"]["name"] == "web-authn"
    assert authz["authentication"]["meshTLS"]["identities"] == {
        "identities": [{"name": "load.shop.serviceaccount.identity.linkerd.cluster.local"}],
        "suffixes": [
            {"parts": ["outside", "serviceaccount", "identity", "linkerd", "cluster", "local"]}
        ],
    }
    assert nets(authz) == ["10.0.0.0/8"]


def test_authorization_policy_on_namespace_applies_to_every_server():
    ns_ap = AP.replace(
        "{group: policy.linkerd.io, kind: Server, name: web-http}", "{kind: Namespace, name: shop}"
    )
    [authz] = server(snapshot(BASE, SERVER, ns_ap))["authorizations"]
    assert authz["labels"]["name"] == "web-authn"


def test_authorization_policy_for_a_service_account_without_networks_is_everywhere():
    ap = """\
---
apiVersion: policy.linkerd.io/v1alpha1
kind: AuthorizationPolicy
metadata: {name: sa-only, namespace: shop}
spec:
  targetRef: {group: policy.linkerd.io, kind: Server, name: web-http}
  requiredAuthenticationRefs: [{kind: ServiceAccount, name: load}]
"""
    [authz] = server(snapshot(BASE, SERVER, ap))["authorizations"]
    assert authz["networks"] == [ALL_V4, ALL_V6]
    assert authz["authentication"]["meshTLS"]["identities"]["identities"] == [
        {"name": "load.shop.serviceaccount.identity.linkerd.cluster.local"}
    ]


def test_authorization_policy_naming_a_missing_authentication_is_ignored():
    marker = "---\napiVersion: policy.linkerd.io/v1alpha1\nkind: MeshTLSAuthentication"
    ap = AP.split(marker, maxsplit=1)[0]
    snap = ResourceStore().replace_file("t.yaml", parse_text(BASE + SERVER + ap, file="t.yaml")[0])
    assert "authorizations" not in js(pol.inbound_server(snap, WEB, 8080, CFG))


def test_authorization_policy_for_another_server_does_not_apply():
    other = AP.replace("name: web-http}", "name: other}")
    assert "authorizations" not in server(snapshot(BASE, SERVER, other))


def test_equal_inputs_give_equal_protos():
    a = pol.inbound_server(snapshot(BASE, SERVER, SAZ, AP), WEB, 8080, CFG)
    b = pol.inbound_server(snapshot(BASE, AP, SAZ, SERVER), WEB, 8080, CFG)
    assert a == b
    assert isinstance(a, inbound_pb2.Server)
