"""The sandbox's pure helpers: the eBPF-unavailable error and the hinted example call."""

from __future__ import annotations

from agent.redirect.check import CheckResult
from agent.sandbox import run


def test_ebpf_unavailable_names_each_failed_check_and_its_fix():
    checks = [
        CheckResult(name="bcc importable", ok=True, detail="bcc"),
        CheckResult(
            name="kernel headers",
            ok=False,
            detail="no /lib/modules/6.1.0/build",
            hint="run scripts/setup",
        ),
        CheckResult(name="bpf program sk_lookup", ok=False, detail="EINVAL", hint=""),
    ]
    err = run.ebpf_unavailable(checks)
    assert "kernel headers: no /lib/modules/6.1.0/build" in err.reason
    assert "bpf program sk_lookup: EINVAL" in err.reason
    assert "bcc importable" not in err.reason
    assert err.hint == "run scripts/setup; or use --redirect iptables"


def test_ebpf_unavailable_without_the_ebpf_module_points_to_iptables():
    err = run.ebpf_unavailable(None)
    assert "not available in this build" in err.reason
    assert "--redirect iptables" in err.hint


SERVICES = """\
apiVersion: v1
kind: Service
metadata: {name: web, namespace: shop}
spec: {ports: [{port: 80}]}
---
apiVersion: v1
kind: Service
metadata:
  name: db
  namespace: shop
  annotations: {config.linkerd.io/opaque-ports: "5432"}
spec: {ports: [{port: 5432}]}
"""


def _pod(name: str, *, meshed: bool, ns: str = "shop") -> dict:
    return {"name": name, "namespace": ns, "meshed": meshed}


def test_example_call_is_a_meshed_pod_calling_another_http_service(tmp_path):
    (tmp_path / "svc.yaml").write_text(SERVICES)
    pods = [_pod("web-7d9f-abcde", meshed=True), _pod("client-5c6b-xyz12", meshed=True)]
    got = run.example_call({"generated": str(tmp_path), "pods": pods})
    # not web's own pod, not the opaque db service
    assert got == (pods[1], "http://web.shop.svc.cluster.local:80/")


def test_example_call_falls_back_to_an_unmeshed_caller_and_else_gives_none(tmp_path):
    (tmp_path / "svc.yaml").write_text(SERVICES)
    plain = _pod("legacy-1a2b-c3d4e", meshed=False)
    got = run.example_call({"generated": str(tmp_path), "pods": [plain]})
    assert got == (plain, "http://web.shop.svc.cluster.local:80/")
    other_ns = [_pod("client-5c6b-xyz12", meshed=True, ns="other")]
    assert run.example_call({"generated": str(tmp_path), "pods": other_ns}) is None
