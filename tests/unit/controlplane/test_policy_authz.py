"""Inbound authorizations: the `authorizations` of Server protos for pod ports.

The authorizations reach the wire only inside an `inbound.Server`, so these
tests drive `policy.inbound_server` and read its `authorizations`.
"""

from __future__ import annotations

import ipaddress

import pytest
from google.protobuf import json_format

from agent._proto import inbound_pb2
from agent.controlplane import kinds_linkerd as l5d
from agent.controlplane import policy as pol
from agent.controlplane import policy_authz as pa
from agent.controlplane.manifests import parse_text
from agent.controlplane.store import ResourceStore, Snapshot

CFG = pa.PolicyConfig()
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


def server(snap: Snapshot, port: int = 8080, cfg: pa.PolicyConfig = CFG) -> dict:
    return js(pol.inbound_server(snap, WEB, port, cfg))


ALL_V4 = {"net": {"ip": {"ipv4": 0}}}  # prefix_len 0 is proto3's default: not on the wire
ALL_V6 = {"net": {"ip": {"ipv6": {}}}}


# --- default policies ------------------------------------------------------------------------


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
    cfg = pa.PolicyConfig(default_policy=l5d.AccessPolicy(policy))
    got = server(snapshot(BASE), cfg=cfg)
    [authz] = got["authorizations"]
    assert got["labels"]["name"] == policy
    assert authz["metadata"] == {"default": policy}
    assert nets(authz) == networks
    assert authz["authentication"] == authn


def test_deny_default_has_no_authorizations():
    got = server(snapshot(BASE), cfg=pa.PolicyConfig(default_policy=l5d.AccessPolicy.DENY))
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
