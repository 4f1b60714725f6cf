"""Destination translation: endpoint sets, update diffs and profiles from YAML snapshots."""

from __future__ import annotations

import pytest
from google.protobuf import json_format

from agent._proto import destination_pb2 as pb
from agent.controlplane import destination as dst
from agent.controlplane import profiles
from agent.controlplane.manifests import parse_text
from agent.controlplane.store import ResourceStore, Snapshot

MESH = dst.MeshConfig()

BASE = """\
apiVersion: v1
kind: Namespace
metadata: {name: shop, annotations: {linkerd.io/inject: enabled}}
---
apiVersion: v1
kind: Namespace
metadata: {name: outside}
---
apiVersion: apps/v1
kind: Deployment
metadata: {name: web, namespace: shop}
spec:
  selector: {matchLabels: {app: web}}
  template:
    metadata: {labels: {app: web}}
    spec: {containers: [{name: web, ports: [{name: http, containerPort: 8080}]}]}
---
apiVersion: v1
kind: Service
metadata: {name: web, namespace: shop}
spec:
  clusterIP: 10.96.0.10
  selector: {app: web}
  ports: [{name: http, port: 80, targetPort: http}]
---
apiVersion: v1
kind: Service
metadata:
  name: db
  namespace: shop
  annotations: {config.linkerd.io/opaque-ports: "5432"}
spec:
  clusterIP: 10.96.0.20
  selector: {app: db}
  ports: [{port: 5432}]
"""


def pod(
    name: str, ip: str, *, app: str = "web", ready: bool = True, ns: str = "shop", **extra: str
) -> str:
    annotations = "".join(f'    {k}: "{v}"\n' for k, v in extra.items())
    meta_ann = f"  annotations:\n{annotations}" if annotations else ""
    return f"""\
---
apiVersion: v1
kind: Pod
metadata:
  name: {name}
  namespace: {ns}
  labels: {{app: {app}, pod-template-hash: abc123}}
{meta_ann}spec:
  serviceAccountName: {app}
  containers: [{{name: c, ports: [{{name: http, containerPort: 8080}}, {{containerPort: 5432}}]}}]
status:
  phase: Running
  podIP: {ip}
  conditions: [{{type: Ready, status: "{ready}"}}]
"""


def snapshot(*texts: str) -> Snapshot:
    objects, errors = parse_text("".join(texts), file="t.yaml")
    assert errors == []
    store = ResourceStore()
    snap = store.replace_file("t.yaml", objects)
    assert snap.errors == ()
    return snap


def js(message: object) -> dict:
    return json_format.MessageToDict(message, preserving_proto_field_name=True)  # type: ignore[arg-type]


WEB = dst.Target.parse("web.shop.svc.cluster.local:80")


# --- targets and tokens --------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "host", "port"),
    [
        ("web.shop.svc.cluster.local:80", "web.shop.svc.cluster.local", 80),
        ("web.shop.svc.cluster.local", "web.shop.svc.cluster.local", 80),
        ("10.0.0.1:8080", "10.0.0.1", 8080),
        ("[fd00::1]:8080", "fd00::1", 8080),
    ],
)
def test_target_parse_accepts_names_and_ips(path, host, port):
    target = dst.Target.parse(path)
    assert (target.host, target.port) == (host, port)


@pytest.mark.parametrize("path", ["", "web:0", "web:99999", "web:http", ":80", "fd00::1:80"])
def test_target_parse_refuses_bad_authorities_saying_so(path):
    with pytest.raises(dst.InvalidTarget, match="Invalid authority"):
        dst.Target.parse(path)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            '{"ns":"shop","nodeName":"n1","pod":"p"}',
            dst.ContextToken(ns="shop", node_name="n1", pod="p"),
        ),
        ("ns:shop", dst.ContextToken(ns="shop")),
        ("garbage", dst.ContextToken()),
        ("", dst.ContextToken()),
        ("[1]", dst.ContextToken()),
    ],
)
def test_context_token_parses_like_linkerd(text, expected):
    assert dst.ContextToken.parse(text) == expected


def test_names_outside_the_cluster_domain_are_invalid():
    with pytest.raises(dst.InvalidTarget):
        dst.resolve(snapshot(BASE), dst.Target.parse("example.com:80"), MESH)


# --- endpoint sets -----------------------------------------------------------------------


def test_ready_meshed_pods_are_endpoints_with_identity_labels_and_h2_hint():
    snap = snapshot(BASE, pod("web-1", "10.1.0.1"), pod("web-2", "10.1.0.2", ready=False))
    got = dst.resolve(snap, WEB, MESH)
    assert got.exists
    assert [e.key for e in got.endpoints] == [("10.1.0.1", 8080)]
    [update] = dst.diff(None, got)
    assert js(update) == {
        "add": {
            "metric_labels": {"namespace": "shop", "service": "web"},
            "addrs": [
                {
                    "addr": {"ip": {"ipv4": 0x0A010001}, "port": 8080},
                    "weight": 10000,
                    "metric_labels": {
                        "pod": "web-1",
                        "serviceaccount": "web",
                        "deployment": "web",
                        "pod_template_hash": "abc123",
                        "control_plane_ns": "linkerd",
                        "zone": "",
                        "zone_locality": "unknown",
                    },
                    "tls_identity": {
                        "dns_like_identity": {
                            "name": "web.shop.serviceaccount.identity.linkerd.cluster.local"
                        },
                        "server_name": {
                            "name": "web.shop.serviceaccount.identity.linkerd.cluster.local"
                        },
                    },
                    "protocol_hint": {"h2": {}},
                }
            ],
        }
    }


def test_unmeshed_pod_has_no_identity_and_no_hint():
    text = BASE.replace("annotations: {linkerd.io/inject: enabled}", "annotations: {}")
    got = dst.resolve(snapshot(text, pod("web-1", "10.1.0.1")), WEB, MESH)
    [addr] = dst.diff(None, got)[0].add.addrs
    assert not addr.HasField("tls_identity")
    assert not addr.HasField("protocol_hint")
    assert "control_plane_ns" not in addr.metric_labels


def test_opaque_port_gets_opaque_hint_and_opaque_transport_to_inbound_port():
    snap = snapshot(
        BASE, pod("db-1", "10.1.0.9", app="db", **{"config.linkerd.io/opaque-ports": "5432"})
    )
    got = dst.resolve(snap, dst.Target.parse("db.shop.svc.cluster.local:5432"), MESH)
    [addr] = dst.diff(None, got)[0].add.addrs
    assert addr.protocol_hint.WhichOneof("protocol") == "opaque"
    assert addr.protocol_hint.opaque_transport.inbound_port == 4143


def test_skip_inbound_ports_drop_identity_and_hint():
    snap = snapshot(
        BASE, pod("web-1", "10.1.0.1", **{"config.linkerd.io/skip-inbound-ports": "8080"})
    )
    [addr] = dst.diff(None, dst.resolve(snap, WEB, MESH))[0].add.addrs
    assert not addr.HasField("tls_identity")
    assert not addr.HasField("protocol_hint")


def test_cluster_ip_resolves_to_its_service_and_pod_ip_to_the_pod():
    snap = snapshot(BASE, pod("web-1", "10.1.0.1"))
    by_vip = dst.resolve(snap, dst.Target.parse("10.96.0.10:80"), MESH)
    assert [e.key for e in by_vip.endpoints] == [("10.1.0.1", 8080)]
    by_pod = dst.resolve(snap, dst.Target.parse("10.1.0.1:8080"), MESH)
    assert [e.key for e in by_pod.endpoints] == [("10.1.0.1", 8080)]
    assert by_pod.endpoints[0].identity.startswith("web.shop.")
    assert dst.resolve(snap, dst.Target.parse("10.9.9.9:80"), MESH) == dst.NOT_FOUND


def test_ipv6_addresses_encode_as_two_halves():
    addr = dst.ip_address("fd00::1:2")
    assert (addr.ipv6.first, addr.ipv6.last) == (0xFD00 << 48, 0x0000000000010002)


# --- diffs (the proto's first-message and no_endpoints rules) -------------------------


def kinds(updates: list[pb.Update]) -> list[str]:
    out = []
    for u in updates:
        kind = u.WhichOneof("update")
        if kind == "no_endpoints":
            kind = f"no_endpoints(exists={u.no_endpoints.exists})"
        out.append(kind)
    return out


def test_unknown_service_starts_with_no_endpoints_exists_false():
    got = dst.resolve(snapshot(BASE), dst.Target.parse("nope.shop.svc.cluster.local:80"), MESH)
    assert kinds(dst.diff(None, got)) == ["no_endpoints(exists=False)"]


def test_service_without_ready_endpoints_starts_with_no_endpoints_exists_true():
    got = dst.resolve(snapshot(BASE, pod("web-1", "10.1.0.1", ready=False)), WEB, MESH)
    assert kinds(dst.diff(None, got)) == ["no_endpoints(exists=True)"]


def test_port_the_service_does_not_declare_has_no_endpoints_but_exists():
    got = dst.resolve(
        snapshot(BASE, pod("web-1", "10.1.0.1")),
        dst.Target.parse("web.shop.svc.cluster.local:81"),
        MESH,
    )
    assert kinds(dst.diff(None, got)) == ["no_endpoints(exists=True)"]


def sets(*snaps: Snapshot, target: dst.Target = WEB) -> list[dst.EndpointSet]:
    return [dst.resolve(s, target, MESH) for s in snaps]


def test_scale_up_adds_only_the_new_endpoint():
    one, two = sets(
        snapshot(BASE, pod("web-1", "10.1.0.1")),
        snapshot(BASE, pod("web-1", "10.1.0.1"), pod("web-2", "10.1.0.2")),
    )
    [update] = dst.diff(one, two)
    assert [a.addr.ip.ipv4 for a in update.add.addrs] == [0x0A010002]


def test_scale_down_removes_the_gone_endpoint():
    two, one = sets(
        snapshot(BASE, pod("web-1", "10.1.0.1"), pod("web-2", "10.1.0.2")),
        snapshot(BASE, pod("web-1", "10.1.0.1")),
    )
    [update] = dst.diff(two, one)
    assert [a.ip.ipv4 for a in update.remove.addrs] == [0x0A010002]


def test_replacing_all_endpoints_adds_before_it_removes():
    a, b = sets(snapshot(BASE, pod("web-1", "10.1.0.1")), snapshot(BASE, pod("web-2", "10.1.0.2")))
    assert kinds(dst.diff(a, b)) == ["add", "remove"]


def test_last_endpoint_going_unready_is_no_endpoints_exists_true():
    a, b = sets(
        snapshot(BASE, pod("web-1", "10.1.0.1")),
        snapshot(BASE, pod("web-1", "10.1.0.1", ready=False)),
    )
    assert kinds(dst.diff(a, b)) == ["no_endpoints(exists=True)"]


def test_deleted_service_is_no_endpoints_exists_false_and_recreated_is_add():
    gone = BASE.replace(
        "name: web, namespace: shop}\nspec:\n  clusterIP",
        "name: other, namespace: shop}\nspec:\n  clusterIP",
    )
    a, b = sets(snapshot(BASE, pod("web-1", "10.1.0.1")), snapshot(gone, pod("web-1", "10.1.0.1")))
    assert kinds(dst.diff(a, b)) == ["no_endpoints(exists=False)"]
    assert kinds(dst.diff(b, a)) == ["add"]


def test_no_change_sends_nothing():
    a, b = sets(snapshot(BASE, pod("web-1", "10.1.0.1")), snapshot(BASE, pod("web-1", "10.1.0.1")))
    assert dst.diff(a, b) == []
    empty = dst.resolve(snapshot(BASE), WEB, MESH)
    assert dst.diff(empty, empty) == []
    assert dst.diff(dst.NOT_FOUND, dst.NOT_FOUND) == []


def test_pod_becoming_meshed_is_re_added_with_identity():
    plain = BASE.replace("annotations: {linkerd.io/inject: enabled}", "annotations: {}")
    a, b = sets(snapshot(plain, pod("web-1", "10.1.0.1")), snapshot(BASE, pod("web-1", "10.1.0.1")))
    [update] = dst.diff(a, b)
    assert update.add.addrs[0].tls_identity.dns_like_identity.name.startswith("web.shop.")


# --- profiles -----------------------------------------------------------------------------

PROFILE = """\
---
apiVersion: linkerd.io/v1alpha2
kind: ServiceProfile
metadata: {name: web.shop.svc.cluster.local, namespace: shop}
spec:
  routes:
  - name: GET /books/{id}
    condition: {method: GET, pathRegex: '/books/\\d+'}
    responseClasses:
    - condition: {status: {min: 500, max: 599}}
      isFailure: true
    isRetryable: true
    timeout: 300ms
  - name: not-post
    condition: {not: {method: POST}}
  retryBudget: {retryRatio: 0.5, minRetriesPerSecond: 3, ttl: 20s}
  dstOverrides:
  - {authority: web-v2.shop.svc.cluster.local, weight: 500m}
"""


def profile(snap: Snapshot, path: str, ns: str = "") -> pb.DestinationProfile | None:
    lookup = profiles.profile_lookup(dst.Target.parse(path), MESH)
    return profiles.profile(snap, lookup, dst.ContextToken(ns=ns), MESH)


def test_service_profile_becomes_routes_budget_and_overrides():
    got = profile(snapshot(BASE, PROFILE), "web.shop.svc.cluster.local:80")
    assert js(got) == {
        "fully_qualified_name": "web.shop.svc.cluster.local",
        "routes": [
            {
                "condition": {
                    "all": {
                        "matches": [
                            {"method": {"registered": "GET"}},
                            {"path": {"regex": "/books/\\d+"}},
                        ]
                    }
                },
                "response_classes": [
                    {"condition": {"status": {"min": 500, "max": 599}}, "is_failure": True}
                ],
                "metrics_labels": {"route": "GET /books/{id}"},
                "is_retryable": True,
                "timeout": "0.300s",
            },
            {
                "condition": {"not": {"method": {"registered": "POST"}}},
                "metrics_labels": {"route": "not-post"},
            },
        ],
        "retry_budget": {"retry_ratio": 0.5, "min_retries_per_second": 3, "ttl": "20s"},
        "dst_overrides": [{"authority": "web-v2.shop.svc.cluster.local:80", "weight": 5000}],
        "parent_ref": {
            "resource": {
                "group": "core",
                "kind": "Service",
                "name": "web",
                "namespace": "shop",
                "port": 80,
            }
        },
        "profile_ref": {
            "resource": {
                "group": "linkerd.io",
                "kind": "ServiceProfile",
                "name": "web.shop.svc.cluster.local",
                "namespace": "shop",
            }
        },
    }


def test_service_without_profile_gets_default_budget_and_name():
    got = profile(snapshot(BASE), "web.shop.svc.cluster.local:80")
    assert got is not None
    assert got.fully_qualified_name == "web.shop.svc.cluster.local"
    assert list(got.routes) == []
    assert (got.retry_budget.retry_ratio, got.retry_budget.min_retries_per_second) == (
        pytest.approx(0.2),
        10,
    )
    assert got.retry_budget.ttl.seconds == 10
    assert not got.HasField("profile_ref")


def test_undeclared_port_gets_an_empty_profile():
    got = profile(snapshot(BASE, PROFILE), "web.shop.svc.cluster.local:9999")
    assert got == pb.DestinationProfile()


def test_opaque_service_port_sets_opaque_protocol():
    assert profile(snapshot(BASE), "db.shop.svc.cluster.local:5432").opaque_protocol  # type: ignore[union-attr]
    assert not profile(snapshot(BASE), "web.shop.svc.cluster.local:80").opaque_protocol  # type: ignore[union-attr]


def test_client_namespace_profile_wins_over_service_namespace():
    client_sp = PROFILE.replace("namespace: shop}", "namespace: outside}").replace(
        "not-post", "client-route"
    )
    got = profile(snapshot(BASE, PROFILE, client_sp), "web.shop.svc.cluster.local:80", ns="outside")
    assert [r.metrics_labels["route"] for r in got.routes] == ["GET /books/{id}", "client-route"]  # type: ignore[union-attr]
    assert got.profile_ref.resource.namespace == "outside"  # type: ignore[union-attr]


def test_cluster_ip_profile_is_the_service_profile():
    got = profile(snapshot(BASE, PROFILE), "10.96.0.10:80")
    assert got is not None
    assert got.fully_qualified_name == "web.shop.svc.cluster.local"
    assert len(got.routes) == 2


def test_pod_ip_profile_has_endpoint_and_no_name():
    got = profile(snapshot(BASE, pod("web-1", "10.1.0.1")), "10.1.0.1:8080")
    assert got is not None
    assert got.fully_qualified_name == ""
    assert got.endpoint.metric_labels["namespace"] == "shop"
    assert got.endpoint.metric_labels["pod"] == "web-1"
    assert got.endpoint.tls_identity.dns_like_identity.name.startswith("web.shop.")
    assert not got.opaque_protocol


def test_unknown_ip_profile_has_a_bare_endpoint_and_default_opaque_ports():
    got = profile(snapshot(BASE), "10.9.9.9:3306")
    assert got is not None
    assert got.endpoint.weight == 10000
    assert not got.endpoint.HasField("tls_identity")
    assert got.opaque_protocol  # 3306 is in Linkerd's default opaque ports


def test_unknown_service_profile_is_none():
    assert profile(snapshot(BASE), "nope.shop.svc.cluster.local:80") is None
