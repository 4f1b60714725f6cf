"""Core documents -> kinds_core objects: fields read as kubectl shows them, Kubernetes defaults."""

from __future__ import annotations

from agent.controlplane import kinds
from agent.controlplane import kinds_core as k8s
from agent.controlplane import resources as r
from agent.controlplane.documents import parse_text


def _one(text: str) -> kinds.Resource:
    objects, errors = parse_text(text, file="t.yaml")
    assert errors == []
    assert len(objects) == 1
    return objects[0]


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
