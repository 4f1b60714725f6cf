"""`meshagent redirects show` on real eBPF and iptables enrollments: the acceleration section.

A lab pod `app` is enrolled in eBPF mode under its own pin root and a
temporary registry; `srv` is enrolled in iptables mode. The CLI runs as a
subprocess (`python -m agent`), reads the kernel through the registry's
pin root, and its output is compared with `maps.accel_stats` and with the
messages this test sent over an accelerated connection.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from agent.netlab import lab
from agent.redirect import maps
from agent.redirect.ebpf import EbpfRedirector
from agent.redirect.iptables import IptablesRedirector
from agent.redirect.model import CaptureSpec
from agent.redirect.registry import Registry

pytestmark = [pytest.mark.privileged, pytest.mark.timeout(180)]

TIMEOUT = 10.0
ROUNDS = 5

# connects (to srv:8080, captured to the outbound listener), ROUNDS ping/pongs, then
# waits for the other end to close
CLIENT = textwrap.dedent(
    """
    import socket, sys
    s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10)
    for _ in range(int(sys.argv[3])):
        s.sendall(b"ping")
        assert s.recv(4) == b"pong"
    assert s.recv(1) == b""
    print("done")
    """
)


@pytest.fixture(scope="module")
def pods():
    with lab("ebpfshow") as lb:
        node = lb.node("n1")
        yield lb.pod(node, "app"), lb.pod(node, "srv")


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    return Registry(tmp_path_factory.mktemp("registry") / "redirects.json")


@pytest.fixture(scope="module")
def pin_root():
    root = Path(f"/sys/fs/bpf/meshagent-show-{os.getpid()}")
    yield root
    EbpfRedirector(pin_root=root, accelerate=False).uninstall()


@pytest.fixture(scope="module")
def ebpf_pod(pods, pin_root, registry):
    app, _ = pods
    spec = CaptureSpec(pod="test/app", netns=app.netns, pod_ip=app.ip, cgroup=app.cgroup)
    red = EbpfRedirector(pin_root=pin_root, accelerate=False, registry=registry)
    try:
        red.enroll(spec)
        yield red, spec
    finally:
        red.unenroll(spec)
        red.uninstall()


@pytest.fixture(scope="module")
def iptables_pod(pods, registry):
    _, srv = pods
    spec = CaptureSpec(pod="test/srv", netns=srv.netns, pod_ip=srv.ip)
    red = IptablesRedirector(registry=registry)
    try:
        red.enroll(spec)
        yield spec
    finally:
        red.unenroll(spec)


def _show(registry: Registry, pod: str, *fmt: str) -> str:
    argv = ["redirects", "show", pod, "--registry", str(registry.path), *fmt]
    proc = subprocess.run(
        [sys.executable, "-m", "agent", *argv],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        # Not this process's MESHAGENT_EBPF_ACCEL: show inspects with the recorded setting.
        env={k: v for k, v in os.environ.items() if k != "MESHAGENT_EBPF_ACCEL"},
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def _show_json(registry: Registry, pod: str) -> dict:
    return json.loads(_show(registry, pod, "-o", "json"))


def test_ebpf_pod_without_acceleration_shows_it_disabled_and_sk_msg_not_loaded(ebpf_pod, registry):
    red, _ = ebpf_pod
    assert not (red.maps_dir / maps.ACCEL_STATS).exists()
    view = _show_json(registry, "test/app")
    assert view["mode"] == "ebpf"
    assert not view["drift"]
    assert view["acceleration"] == {
        "enabled": False,
        "node": "not-loaded",
        "sockets": 0,
        "counters": dict.fromkeys(maps.ACCEL_STAT_NAMES, 0),
    }
    text = _show(registry, "test/app")
    assert "acceleration: disabled for this pod; node sk_msg not-loaded\n" in text
    assert "acceleration counter" not in text


def test_accelerated_pod_shows_its_sockets_and_the_counters_the_kernel_keeps(
    pods, ebpf_pod, registry
):
    app, srv = pods
    red, spec = ebpf_pod
    red.accelerate = True
    red.enroll(spec)
    shown = _show_json(registry, "test/app")
    assert not shown["drift"]  # accelerated as recorded, whatever the CLI's environment says
    before = shown["acceleration"]
    assert before["enabled"] is True
    assert before["node"] == "active"
    assert before["sockets"] == 0
    with app.socket() as listener:
        listener.bind(("127.0.0.1", spec.outbound_port))
        listener.listen(4)
        listener.settimeout(TIMEOUT)
        client = app.spawn(
            [sys.executable, "-c", CLIENT, srv.ip, "8080", str(ROUNDS)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            conn, _ = listener.accept()
            with conn:
                conn.settimeout(TIMEOUT)
                for _ in range(ROUNDS):
                    assert conn.recv(4) == b"ping"
                    conn.sendall(b"pong")
                during = _show_json(registry, "test/app")["acceleration"]
                text = _show(registry, "test/app")
        finally:
            out, err = client.communicate(timeout=TIMEOUT)
    assert (client.returncode, out.strip()) == (0, "done"), err
    assert during["sockets"] == 2
    assert during["counters"] == maps.accel_stats(red.maps_dir)
    delta = {k: during["counters"][k] - before["counters"][k] for k in maps.ACCEL_STAT_NAMES}
    # every ping and pong went socket to socket through sk_msg, none over TCP
    assert delta["redirected_msgs"] == 2 * ROUNDS
    assert delta["redirected_bytes"] == 8 * ROUNDS
    assert delta["passed_msgs"] == 0
    head = "acceleration: enabled for this pod; node sk_msg active; 2 pod sockets in ma_accel_socks"
    assert head in text.splitlines()
    for name, value in during["counters"].items():
        assert f"acceleration counter (node) {name}: {value}" in text.splitlines()


def test_acceleration_turned_off_shows_node_detached_and_keeps_the_counters(ebpf_pod, registry):
    red, spec = ebpf_pod
    red.accelerate = False
    red.enroll(spec)
    view = _show_json(registry, "test/app")["acceleration"]
    assert view["enabled"] is False
    assert view["node"] == "detached"
    assert view["counters"] == maps.accel_stats(red.maps_dir)
    assert view["counters"]["redirected_msgs"] >= 2 * ROUNDS


def test_iptables_pod_show_has_no_acceleration_section(iptables_pod, registry):
    view = _show_json(registry, "test/srv")
    assert view["mode"] == "iptables"
    assert set(view) == {
        "pod", "netns", "mode", "inbound", "outbound", "skipped",
        "in_packets", "out_packets", "in_bytes", "out_bytes", "backend", "drift", "rules",
    }  # fmt: skip
    assert ":PROXY_INIT_OUTPUT - [0:0]" in view["rules"]
    assert "acceleration" not in _show(registry, "test/srv")
