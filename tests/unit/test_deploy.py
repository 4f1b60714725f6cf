"""deploy/daemonset.yaml: loads as YAML and carries what a node agent needs.

Checks shape, not a cluster: kinds, namespace, host namespaces, privilege,
mounts (each backed by a declared volume), probes on the admin port, RBAC,
the trust-roots ConfigMap, and that every flag in `args` is one `meshagent
run` knows (agent.supervisor.settings.RUN_OPTIONS), so the manifest cannot
drift from the CLI unnoticed.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from agent.config import ADMIN_PORT
from agent.supervisor.settings import RUN_OPTIONS

MANIFEST = Path(__file__).resolve().parents[2] / "deploy" / "daemonset.yaml"
NAMESPACE = "linkerd"
REQUIRED_MOUNTS = {
    "/run/netns",
    "/sys/fs/bpf",
    "/sys/fs/cgroup",
    "/lib/modules",
    "/usr/src",
    "/run/meshagent",
}
REQUIRED_HOST_PATHS = REQUIRED_MOUNTS | {"/proc"}


@pytest.fixture(scope="module")
def docs() -> dict[str, dict]:
    loaded = [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d is not None]
    by_kind = {d["kind"]: d for d in loaded}
    assert len(by_kind) == len(loaded), "one object per kind"
    return by_kind


@pytest.fixture(scope="module")
def pod(docs) -> dict:
    return docs["DaemonSet"]["spec"]["template"]["spec"]


@pytest.fixture(scope="module")
def container(pod) -> dict:
    [only] = pod["containers"]
    return only


def test_manifest_holds_service_account_rbac_and_daemonset(docs):
    assert set(docs) == {"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "DaemonSet"}
    assert docs["DaemonSet"]["metadata"]["namespace"] == NAMESPACE
    assert docs["ServiceAccount"]["metadata"]["namespace"] == NAMESPACE


def test_header_says_pods_from_kubernetes_is_not_built_yet():
    header = MANIFEST.read_text().split("\n---", 1)[0]
    assert "--pods-from kubernetes" in header
    assert "next milestone" in header


def test_selector_matches_template_labels(docs):
    ds = docs["DaemonSet"]["spec"]
    labels = ds["template"]["metadata"]["labels"]
    assert ds["selector"]["matchLabels"].items() <= labels.items()


def test_pod_runs_in_host_network_and_pid_namespaces_privileged(pod, container):
    assert pod["hostNetwork"] is True
    assert pod["hostPID"] is True
    assert pod["dnsPolicy"] == "ClusterFirstWithHostNet"  # cluster DNS despite hostNetwork
    assert container["securityContext"]["privileged"] is True


def test_every_required_host_path_is_mounted_from_a_declared_volume(pod, container):
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    assert {m["name"] for m in mounts.values()} <= set(volumes)
    assert set(mounts) >= REQUIRED_MOUNTS
    host_paths = {v["hostPath"]["path"] for v in volumes.values() if "hostPath" in v}
    assert host_paths >= REQUIRED_HOST_PATHS
    for path in ("/lib/modules", "/usr/src", "/sys/fs/cgroup"):
        assert mounts[path].get("readOnly") is True
    assert mounts["/sys/fs/bpf"]["mountPropagation"] == "Bidirectional"  # pins outlive restarts


def test_trust_roots_come_from_linkerds_configmap_and_feed_trust_anchors(pod, container):
    [cm] = [v for v in pod["volumes"] if "configMap" in v]
    assert cm["configMap"]["name"] == "linkerd-identity-trust-roots"
    keys = {i["key"]: i["path"] for i in cm["configMap"]["items"]}
    assert keys == {"ca-bundle.crt": "ca-bundle.crt"}
    [mount] = [m for m in container["volumeMounts"] if m["name"] == cm["name"]]
    args = container["args"]
    anchors = args[args.index("--trust-anchors") + 1]
    assert anchors == f"{mount['mountPath']}/ca-bundle.crt"


def test_args_run_against_linkerd_on_this_node(container):
    args = container["args"]
    assert args[0] == "run"
    flags = dict(zip(args[1::2], args[2::2], strict=True))
    assert flags["--control-plane"] == "linkerd-dst-headless.linkerd.svc.cluster.local:8086"
    assert flags["--pods-from"] == "kubernetes"
    assert flags["--node"] == "$(NODE_NAME)"
    [env] = [e for e in container["env"] if e["name"] == "NODE_NAME"]
    assert env["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"


def test_every_flag_is_one_meshagent_run_knows(container):
    known = {o.flag for o in RUN_OPTIONS}
    flags = [a for a in container["args"] if a.startswith("--")]
    assert flags
    assert set(flags) <= known, set(flags) - known


@pytest.mark.parametrize(
    ("probe", "path"), [("livenessProbe", "/live"), ("readinessProbe", "/ready")]
)
def test_probes_hit_the_admin_server(container, probe, path):
    get = container[probe]["httpGet"]
    assert get == {"path": path, "port": ADMIN_PORT}


def test_prometheus_scrapes_the_admin_port(docs):
    annotations = docs["DaemonSet"]["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == str(ADMIN_PORT)
    assert annotations["prometheus.io/path"] == "/metrics"


def test_rbac_reads_pods_namespaces_services_and_binds_the_agents_account(docs):
    [rule] = docs["ClusterRole"]["rules"]
    assert set(rule["resources"]) == {"pods", "namespaces", "services"}
    assert set(rule["verbs"]) == {"get", "list", "watch"}  # read only
    binding = docs["ClusterRoleBinding"]
    assert binding["roleRef"]["name"] == docs["ClusterRole"]["metadata"]["name"]
    [subject] = binding["subjects"]
    sa = docs["ServiceAccount"]["metadata"]
    assert (subject["name"], subject["namespace"]) == (sa["name"], sa["namespace"])
    assert docs["DaemonSet"]["spec"]["template"]["spec"]["serviceAccountName"] == sa["name"]
