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
