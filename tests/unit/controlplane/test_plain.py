"""The hand reader of metadata, Namespace, ServiceAccount and Pod: Kubernetes' types,
strictly, with every bad field located; one pod-spec reader for Pods and Deployments."""

from __future__ import annotations

import json
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.controlplane import kinds_core as k8s
from agent.controlplane import plain
from agent.controlplane import resources as r
from agent.controlplane.documents import parse_text

SOURCE = r.Source(file="t.yaml", index=0)


def _pod(text: str) -> k8s.Pod:
    doc = yaml.safe_load(text)
    pod = plain.KIND_TABLE["Pod"].read(doc, plain.base(doc, namespaced=True, source=SOURCE))
    assert isinstance(pod, k8s.Pod)
    return pod


def _invalid(text: str) -> tuple[str, str]:
    doc = yaml.safe_load(text)
    kind = plain.KIND_TABLE[doc["kind"]]

    def read() -> object:
        return kind.read(doc, plain.base(doc, namespaced=kind.namespaced, source=SOURCE))

    with pytest.raises(plain.Invalid) as caught:
        read()
    return caught.value.field, caught.value.reason


POD = "apiVersion: v1\nkind: Pod\nmetadata: {name: p}\n"


def test_a_pod_reads_its_spec_and_status_with_kubernetes_defaults():
    pod = _pod(
        POD + "spec:\n  serviceAccount: old\n  nodeName: n1\n  hostNetwork: false\n"
        "  containers: [{name: c, image: i, ports: [{containerPort: 53, protocol: UDP},"
        " {containerPort: 80, name: http}]}]\n"
        "status: {phase: Running, podIPs: [{ip: 10.0.0.2}, {ip: 'fd00::2'}], hostIP: 10.9.0.1}\n"
    )
    assert pod.namespace == "default"
    assert pod.service_account == "old"  # the deprecated field, when the new one is unset
    assert pod.node_name == "n1"
    assert pod.containers == (
        r.Container(
            name="c",
            image="i",
            ports=(
                r.ContainerPort(container_port=53, protocol="UDP"),
                r.ContainerPort(container_port=80, name="http", protocol="TCP"),
            ),
        ),
    )
    assert pod.status == k8s.PodStatus(
        phase=k8s.PodPhase.RUNNING,
        pod_ip="10.0.0.2",
        pod_ips=("10.0.0.2", "fd00::2"),
        host_ip="10.9.0.1",
        ready=False,
    )


def test_null_means_unset_as_kubernetes_reads_it():
    pod = _pod(
        "apiVersion: v1\nkind: Pod\nmetadata: {name: p, namespace:, labels:}\n"
        "spec: {serviceAccountName:, hostNetwork:, containers: [{name: c, ports:}]}\nstatus:\n"
    )
    assert (pod.namespace, pod.service_account, pod.host_network) == ("default", "default", False)
    assert pod.labels == r.FrozenMap()
    assert pod.status == k8s.PodStatus()


@pytest.mark.parametrize(
    ("text", "field", "reason"),
    [
        pytest.param(
            POD + "spec: {containers: [{name: c, ports: [{containerPort: '8080'}]}]}\n",
            "spec.containers[0].ports[0].containerPort",
            "expected a port number, not str",
            id="port-as-string",
        ),
        pytest.param(
            POD + "spec: {containers: [{name: c, ports: [{containerPort: true}]}]}\n",
            "spec.containers[0].ports[0].containerPort",
            "expected a port number, not bool",
            id="port-as-bool",
        ),
        pytest.param(
            POD + "spec: {containers: [{name: c, ports: [{name: http}]}]}\n",
            "spec.containers[0].ports[0].containerPort",
            "required",
            id="port-missing",
        ),
        pytest.param(
            POD + "spec: {containers: [{name: c}, {name: d, ports: [{containerPort: 0}]}]}\n",
            "spec.containers[1].ports[0].containerPort",
            "not between 1 and 65535",
            id="port-zero",
        ),
        pytest.param(
            POD + "spec: {containers: [{name: c, ports: [{containerPort: 80, name: HTTP}]}]}\n",
            "spec.containers[0].ports[0].name",
            "not a valid port name",
            id="port-name",
        ),
        pytest.param(
            POD + "spec: {containers: [{name: c, ports: [{containerPort: 80, protocol: ICMP}]}]}\n",
            "spec.containers[0].ports[0].protocol",
            "'ICMP' is not one of TCP, UDP, SCTP",
            id="protocol",
        ),
        pytest.param(
            POD + "spec: {hostNetwork: 'true', containers: [{name: c}]}\n",
            "spec.hostNetwork",
            "expected true or false, not str",
            id="host-network-as-string",
        ),
        pytest.param(
            POD + "spec: {nodeName: 7, containers: [{name: c}]}\n",
            "spec.nodeName",
            "expected a string, not int",
            id="node-name-as-int",
        ),
        pytest.param(POD, "spec", "required", id="no-spec"),
        pytest.param(
            POD + "spec: {containers: []}\n",
            "spec.containers",
            "a pod needs at least one container",
            id="no-containers",
        ),
        pytest.param(
            POD + "spec: {containers: {name: c}}\n",
            "spec.containers",
            "expected a list, not dict",
            id="containers-not-a-list",
        ),
        pytest.param(
            POD + "spec: {containers: [{image: i}]}\n",
            "spec.containers[0].name",
            "required",
            id="container-without-name",
        ),
        pytest.param(
            POD + "spec: {containers: [c]}\n",
            "spec.containers[0]",
            "expected a mapping, not str",
            id="container-not-a-mapping",
        ),
        pytest.param(
            POD + "spec: {containers: [{name: c}]}\nstatus: {phase: Sleeping}\n",
            "status.phase",
            "'Sleeping' is not one of Pending, Running",
            id="phase",
        ),
        pytest.param(
            POD + "spec: {containers: [{name: c}]}\nstatus: {podIPs: [{ip: 10.0.0.1}, {}]}\n",
            "status.podIPs[1].ip",
            "required",
            id="pod-ips-item-without-ip",
        ),
        pytest.param(
            POD + "spec: {containers: [{name: c}]}\nstatus: {hostIP: 10.0.0.256}\n",
            "status.hostIP",
            "'10.0.0.256' is not an IP address",
            id="host-ip",
        ),
        pytest.param(
            POD + "spec: {containers: [{name: c}]}\nstatus: {conditions: [{status: 'True'}]}\n",
            "status.conditions[0].type",
            "required",
            id="condition-without-type",
        ),
        pytest.param(
            "apiVersion: v1\nkind: Pod\nmetadata: [p]\nspec: {containers: [{name: c}]}\n",
            "metadata",
            "expected a mapping, not list",
            id="metadata-not-a-mapping",
        ),
        pytest.param(
            "apiVersion: v1\nkind: Pod\nmetadata: {name: ''}\nspec: {containers: [{name: c}]}\n",
            "metadata.name",
            "required",
            id="empty-name",
        ),
        pytest.param(
            "apiVersion: v1\nkind: Pod\nmetadata: {name: p, annotations: {a: 1}}\n"
            "spec: {containers: [{name: c}]}\n",
            "metadata.annotations.a",
            "expected a string, not int",
            id="annotation-value-not-a-string",
        ),
        pytest.param(
            "apiVersion: v1\nkind: Pod\nmetadata: {name: p, labels: {1: a}}\n"
            "spec: {containers: [{name: c}]}\n",
            "metadata.labels",
            "a key must be a string, not int (1)",
            id="label-key-not-a-string",
        ),
        pytest.param(
            "apiVersion: v1\nkind: Namespace\nmetadata:\n  name: shop\n  annotations:\n"
            "    config.linkerd.io/default-inbound-policy: everyone\n",
            "metadata.annotations",
            "unknown policy 'everyone'",
            id="namespace-policy-annotation",
        ),
    ],
)
def test_a_bad_field_is_invalid_at_its_path(text, field, reason):
    got_field, got_reason = _invalid(text)
    assert got_field == field
    assert reason in got_reason


def test_a_namespace_is_cluster_scoped_and_keeps_its_annotations():
    doc: dict[str, Any] = yaml.safe_load(
        "apiVersion: v1\nkind: Namespace\nmetadata:\n  name: shop\n  namespace: ignored\n"
        "  annotations: {linkerd.io/inject: enabled}\n"
    )
    kind = plain.KIND_TABLE["Namespace"]
    ns = kind.read(doc, plain.base(doc, namespaced=kind.namespaced, source=SOURCE))
    assert ns == k8s.Namespace(
        name="shop", annotations=r.FrozenMap({"linkerd.io/inject": "enabled"})
    )


def test_a_deployment_template_is_read_by_the_pod_reader():
    spec = (
        "{serviceAccountName: api, containers: [{name: api, ports: "
        "[{name: http, containerPort: 8080}]}]}"
    )
    objects, errors = parse_text(
        f"apiVersion: v1\nkind: Pod\nmetadata: {{name: p}}\nspec: {spec}\n---\n"
        "apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: d}\n"
        "spec: {selector: {matchLabels: {app: a}}, template: {metadata: {labels: {app: a}},"
        f" spec: {spec}}}}}\n"
    )
    assert errors == []
    pod, deployment = objects
    assert isinstance(pod, k8s.Pod)
    assert isinstance(deployment, k8s.Deployment)
    assert deployment.template.containers == pod.containers
    assert deployment.template.service_account == pod.service_account == "api"


def test_a_bad_deployment_template_is_located_under_the_template():
    _, errors = parse_text(
        "apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: d}\n"
        "spec: {selector: {matchLabels: {app: a}}, template: {metadata: {labels: {app: a}},"
        " spec: {containers: [{name: c, ports: [{containerPort: '80'}]}]}}}\n"
    )
    (error,) = errors
    assert error.field == "spec.template.spec.containers[0].ports[0].containerPort"
    assert "expected a port number" in error.reason


def test_check_ip_takes_empty_and_addresses_and_refuses_the_rest():
    assert plain.check_ip("") == ""
    assert plain.check_ip("fd00::1") == "fd00::1"
    with pytest.raises(ValueError, match="is not an IP address"):
        plain.check_ip("10.0.0")


ANY = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=10),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=20,
)
FIELDS = {
    "metadata": ["name", "namespace", "uid", "labels", "annotations"],
    "spec": ["containers", "nodeName", "hostNetwork", "serviceAccountName"],
    "status": ["phase", "podIP", "podIPs", "hostIP", "conditions"],
}


@settings(max_examples=150, deadline=None)
@given(
    part=st.sampled_from(sorted(FIELDS)),
    values=st.data(),
)
def test_any_value_in_any_pod_field_reads_or_is_located_in_that_part(part, values):
    """Every field of a valid pod replaced by any shape: a Pod, or an `Invalid` whose
    path is in the part that was changed; never another exception."""
    doc: dict[str, Any] = yaml.safe_load(
        POD + "spec: {containers: [{name: c, ports: [{containerPort: 80}]}]}\n"
        "status: {phase: Running, podIP: 10.0.0.1}\n"
    )
    key = values.draw(st.sampled_from(FIELDS[part]))
    doc[part][key] = values.draw(ANY)
    try:
        pod = plain.KIND_TABLE["Pod"].read(doc, plain.base(doc, namespaced=True, source=SOURCE))
    except plain.Invalid as exc:
        where, reason = exc.field, exc.reason
    else:
        assert isinstance(pod, k8s.Pod)
        return
    assert where.startswith(part), (where, part)
    assert reason


API_POD = """{
  "apiVersion": "v1",
  "kind": "Pod",
  "metadata": {
    "name": "web-7d4b9c-x2x9z",
    "generateName": "web-7d4b9c-",
    "namespace": "shop",
    "uid": "0b4f0e53-6a0c-4c1e-9c55-2f1f4f8a1a11",
    "resourceVersion": "81234",
    "creationTimestamp": "2026-12-01T10:00:00Z",
    "labels": {"app": "web", "pod-template-hash": "7d4b9c"},
    "annotations": {"linkerd.io/inject": "enabled"},
    "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "web-7d4b9c",
                         "uid": "5e0c", "controller": true, "blockOwnerDeletion": true}],
    "managedFields": [{"manager": "kube-controller-manager", "operation": "Update"}]
  },
  "spec": {
    "containers": [{
      "name": "web",
      "image": "ghcr.io/example/web:1.2",
      "ports": [{"name": "http", "containerPort": 8080, "protocol": "TCP"}],
      "resources": {"limits": {"cpu": "500m"}},
      "volumeMounts": [{"name": "token", "mountPath": "/var/run/secrets", "readOnly": true}],
      "imagePullPolicy": "IfNotPresent"
    }],
    "restartPolicy": "Always",
    "terminationGracePeriodSeconds": 30,
    "dnsPolicy": "ClusterFirst",
    "serviceAccountName": "web",
    "serviceAccount": "web",
    "nodeName": "node-a",
    "securityContext": {},
    "schedulerName": "default-scheduler",
    "tolerations": [{"key": "node.kubernetes.io/not-ready", "operator": "Exists",
                     "effect": "NoExecute", "tolerationSeconds": 300}],
    "enableServiceLinks": true
  },
  "status": {
    "phase": "Running",
    "conditions": [
      {"type": "Initialized", "status": "True", "lastProbeTime": null,
       "lastTransitionTime": "2026-12-01T10:00:00Z"},
      {"type": "Ready", "status": "True", "lastProbeTime": null,
       "lastTransitionTime": "2026-12-01T10:00:05Z"}
    ],
    "hostIP": "10.0.1.4",
    "hostIPs": [{"ip": "10.0.1.4"}],
    "podIP": "10.244.1.17",
    "podIPs": [{"ip": "10.244.1.17"}],
    "startTime": "2026-12-01T10:00:00Z",
    "containerStatuses": [{"name": "web", "ready": true, "restartCount": 0,
                           "state": {"running": {"startedAt": "2026-12-01T10:00:04Z"}}}],
    "qosClass": "Burstable"
  }
}"""


def test_a_pod_as_the_api_server_returns_it_reads():
    """Kubernetes mode's Pod watch will hand this reader the API server's JSON: every
    field the mesh does not read (managedFields, tolerations, containerStatuses, nulls)
    is ignored, the ones it reads come out as from a manifest."""
    doc = json.loads(API_POD)
    pod = plain.KIND_TABLE["Pod"].read(doc, plain.base(doc, namespaced=True, source=SOURCE))
    assert isinstance(pod, k8s.Pod)
    assert (pod.namespace, pod.name, pod.node_name) == ("shop", "web-7d4b9c-x2x9z", "node-a")
    assert pod.uid == "0b4f0e53-6a0c-4c1e-9c55-2f1f4f8a1a11"
    assert pod.service_account == "web"
    assert pod.annotations == r.FrozenMap({"linkerd.io/inject": "enabled"})
    assert pod.port("http") == 8080
    assert pod.status == k8s.PodStatus(
        phase=k8s.PodPhase.RUNNING,
        pod_ip="10.244.1.17",
        pod_ips=("10.244.1.17",),
        host_ip="10.0.1.4",
        ready=True,
    )
