"""The sandbox's cluster plan: expansion, spreading, addresses, names."""

from __future__ import annotations

import ipaddress
from pathlib import Path

import pytest
import yaml

from agent.controlplane import manifests
from agent.sandbox import cluster as c

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"


def _nodes(n: int) -> list[c.NodeSpec]:
    return [
        c.NodeSpec(name=f"node-{i + 1}", pod_cidr=ipaddress.IPv4Network(f"10.200.{i + 1}.0/24"))
        for i in range(n)
    ]


def _examples_plan(n: int = 2) -> c.ClusterPlan:
    objects, errors = manifests.load_folder(EXAMPLES)
    assert errors == []
    return c.plan(objects, _nodes(n))


def test_examples_expand_into_one_pod_per_replica():
    plan = _examples_plan()
    workloads = sorted(p.key.split("/")[0] + "/" + p.workload for p in plan.pods)
    assert workloads == [
        "outside/curl",
        "shop/api",
        "shop/api",
        "shop/db",
        "shop/load",
        "shop/locked",
        "shop/web",
    ]


def test_pod_names_carry_template_hash_and_index_and_uids_are_stable():
    a, b = _examples_plan(), _examples_plan()
    api = a.pods_of("shop", "api")
    assert [p.name.rsplit("-", 1)[1] for p in api] == ["0", "1"]
    assert api[0].name.startswith("api-")
    assert len(api[0].name.split("-")[1]) == 5
    assert [p.uid for p in a.pods] == [p.uid for p in b.pods]
    assert len({p.uid for p in a.pods}) == len(a.pods)


def test_replicas_of_one_deployment_land_on_different_nodes():
    plan = _examples_plan(2)
    assert {p.node for p in plan.pods_of("shop", "api")} == {"node-1", "node-2"}


def test_pods_are_balanced_over_nodes():
    plan = _examples_plan(3)
    counts = [sum(p.node == n.name for p in plan.pods) for n in plan.nodes]
    assert max(counts) - min(counts) <= 1


def test_pod_ips_come_from_their_node_cidr_after_the_gateway_and_are_unique():
    plan = _examples_plan()
    cidrs = {n.name: n.pod_cidr for n in plan.nodes}
    for pod in plan.pods:
        assert ipaddress.ip_address(pod.ip) in cidrs[pod.node]
        assert pod.ip != str(cidrs[pod.node].network_address + 1)
    assert len({p.ip for p in plan.pods}) == len(plan.pods)


def test_full_node_cidr_is_a_plan_error():
    objects, _ = manifests.load_folder(EXAMPLES)
    tiny = [c.NodeSpec(name="n", pod_cidr=ipaddress.IPv4Network("10.200.1.0/29"))]
    with pytest.raises(c.PlanError, match="node n"):
        c.plan(objects, tiny)


def test_services_get_distinct_cluster_ips_in_the_service_range():
    plan = _examples_plan()
    ips = list(plan.cluster_ips.values())
    assert len(ips) == len(set(ips)) == 6
    assert all(ipaddress.ip_address(ip) in c.SERVICE_CIDR for ip in ips)


def test_service_port_backends_resolve_named_target_ports_per_pod():
    plan = _examples_plan()
    api = [sp for sp in plan.service_ports if sp.service == "api"]
    assert len(api) == 1
    want = sorted((p.ip, 8080) for p in plan.pods_of("shop", "api"))
    assert sorted((b.ip, b.port) for b in api[0].backends) == want


def test_meshed_follows_namespace_annotation_and_opaque_ports_follow_annotation():
    plan = _examples_plan()
    assert all(p.meshed for p in plan.pods if p.namespace == "shop")
    assert not plan.pods_of("outside", "curl")[0].meshed
    db = plan.pods_of("shop", "db")[0]
    assert db.app_ports == (c.AppPort(port=5432, opaque=True),)
    web = plan.pods_of("shop", "web")[0]
    assert web.app_ports == (c.AppPort(port=8080, opaque=False),)


def test_pod_manifest_round_trips_through_the_manifest_loader():
    plan = _examples_plan()
    text = yaml.safe_dump_all([c.pod_manifest(p) for p in plan.pods])
    objects, errors = manifests.parse_text(text)
    assert errors == []
    by_name = {o.name: o for o in objects}
    for pod in plan.pods:
        got = by_name[pod.name]
        assert got.status.pod_ip == pod.ip
        assert got.status.ready
        assert got.node_name == pod.node
        assert got.uid == pod.uid
        assert got.service_account == pod.service_account


def test_patched_documents_give_services_cluster_ips_and_drop_pods():
    plan = _examples_plan()
    docs = [
        {"kind": "Service", "metadata": {"name": "api", "namespace": "shop"}, "spec": {}},
        {"kind": "Pod", "metadata": {"name": "x"}},
        {"kind": "Namespace", "metadata": {"name": "shop"}},
    ]
    out = c.patch_documents(docs, plan)
    assert [d["kind"] for d in out] == ["Service", "Namespace"]
    assert out[0]["spec"]["clusterIP"] == plan.cluster_ips[("shop", "api")]
    assert docs[0]["spec"] == {}


def test_bare_pods_keep_their_name():
    text = """
apiVersion: v1
kind: Pod
metadata: {name: solo, namespace: default, labels: {app: solo}}
spec:
  containers: [{name: c, ports: [{containerPort: 9000}]}]
"""
    objects, errors = manifests.parse_text(text)
    assert errors == []
    plan = c.plan(objects, _nodes(1))
    assert [p.name for p in plan.pods] == ["solo"]
    assert plan.pods[0].app_ports == (c.AppPort(port=9000, opaque=False),)


def test_hosts_file_resolves_fqdn_and_short_names_in_own_namespace_only():
    plan = _examples_plan()
    web = plan.pods_of("shop", "web")[0]
    curl = plan.pods_of("outside", "curl")[0]
    api_ip = plan.cluster_ips[("shop", "api")]

    def names(pod: c.PodPlan) -> dict[str, str]:
        found = {}
        for line in c.hosts_file(plan, pod).splitlines():
            if line and not line.startswith("#"):
                ip, *hosts = line.split()
                found.update(dict.fromkeys(hosts, ip))
        return found

    assert names(web)["api.shop.svc.cluster.local"] == api_ip
    assert names(web)["api"] == api_ip
    assert names(curl)["api.shop.svc.cluster.local"] == api_ip
    assert "api" not in names(curl)
    assert c.resolve(plan, "api.shop.svc.cluster.local") == api_ip


def test_custom_command_annotation_is_carried():
    text = """
apiVersion: apps/v1
kind: Deployment
metadata: {name: d, namespace: default}
spec:
  selector: {matchLabels: {app: d}}
  template:
    metadata:
      labels: {app: d}
      annotations: {sandbox.meshagent.io/command: "sleep 1000"}
    spec:
      containers: [{name: c}]
"""
    objects, errors = manifests.parse_text(text)
    assert errors == []
    plan = c.plan(objects, _nodes(1))
    assert plan.pods[0].command == "sleep 1000"
