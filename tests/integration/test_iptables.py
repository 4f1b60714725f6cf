"""iptables capture in real pods, for each writer: traffic, skips, idempotency, cleanup, CLI."""

from __future__ import annotations

import dataclasses
import json
import select
import socket
import subprocess
from pathlib import Path

import pytest

from agent import cli
from agent.proxy.accept import original_dst_of_fd
from agent.redirect import rules
from agent.redirect.annotations import build_spec
from agent.redirect.iptables import Backend, IptablesRedirector, save
from agent.redirect.model import PROXY_MARK
from agent.redirect.orig_dst import OriginalDstError, original_dst
from agent.redirect.registry import Registry

pytestmark = pytest.mark.privileged

WRITERS = [("restore", "nft"), ("restore", "legacy"), ("iptc", "legacy")]


@pytest.fixture(params=WRITERS, ids=lambda p: f"{p[0]}-{p[1]}")
def redirector(request, tmp_path):
    writer, backend = request.param
    return IptablesRedirector(
        writer=writer, iptables_mode=backend, registry=Registry(tmp_path / "enrolled.json")
    )


@pytest.fixture
def pods(lab):
    node = lab.node("n1")
    return lab.pod(node, "a"), lab.pod(node, "b")


def spec_of(pod, **annotations):
    return build_spec(
        pod=f"default/{pod.name}",
        netns=pod.netns,
        pod_ip=pod.ip,
        pod_annotations={
            f"config.linkerd.io/{k.replace('_', '-')}": v for k, v in annotations.items()
        },
    )


class Listeners:
    """Listening sockets inside pods; closed by the test's finalizer."""

    def __init__(self):
        self.socks = []

    def on(self, pod, port, addr="0.0.0.0"):
        s = pod.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((addr, port))
        s.listen(8)
        self.socks.append(s)
        return s

    def close(self):
        for s in self.socks:
            s.close()


@pytest.fixture
def listen():
    ls = Listeners()
    yield ls.on
    ls.close()


def arrived(*listeners, timeout=3.0):
    """The listener that got the connection (accepted and returned with it), or None."""
    ready, _, _ = select.select(list(listeners), [], [], timeout)
    if not ready:
        return None, None
    conn, _ = ready[0].accept()
    conn.settimeout(timeout)
    return ready[0], conn


def connect_from(pod, dst, *, mark=None):
    s = pod.socket()
    if mark is not None:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_MARK, mark)
    s.settimeout(3)
    s.connect(dst)
    return s


def backend_of(r):
    return Backend(r.requested)


def rule_lines(text):
    return [line for line in text.splitlines() if line.startswith("-A ")]


# --- traffic --------------------------------------------------------------------


def test_outbound_connect_arrives_at_4140_with_the_original_destination(redirector, pods, listen):
    a, b = pods
    redirector.enroll(spec_of(a))
    proxy, app = listen(a, 4140), listen(b, 8080)
    for dst in ((b.ip, 8080), ("198.51.100.7", 443)):
        with connect_from(a, dst):
            which, conn = arrived(proxy, app)
            assert which is proxy
            with conn:
                assert original_dst(conn) == dst
                # the proxy's per-connection form, from the fd: the same answer
                assert original_dst_of_fd(conn.fileno()) == dst
                assert conn.fileno() >= 0  # the fd is still the caller's


def test_original_dst_of_fd_is_none_where_original_dst_raises(pods, listen):
    a, _ = pods
    server = listen(a, 8099)  # not enrolled: no REDIRECT, no conntrack NAT entry
    with connect_from(a, (a.ip, 8099)):
        conn, _ = server.accept()
        with conn:
            with pytest.raises(OriginalDstError):
                original_dst(conn)
            assert original_dst_of_fd(conn.fileno()) is None
            conn.getsockname()  # still open


def test_skipped_port_and_skipped_subnet_bypass_the_proxy(redirector, pods, listen):
    a, b = pods
    redirector.enroll(spec_of(a, skip_outbound_ports="8081,9000-9100", skip_subnets=f"{b.ip}/32"))
    proxy = listen(a, 4140)
    app_port, app_range, app_subnet = listen(b, 8081), listen(b, 9050), listen(b, 8080)
    for dst, target in (((b.ip, 8081), app_port), ((b.ip, 9050), app_range)):
        with connect_from(a, dst):
            which, conn = arrived(proxy, target)
            conn.close()
            assert which is target
    with connect_from(a, (b.ip, 8080)):
        which, conn = arrived(proxy, app_subnet)
        conn.close()
        assert which is app_subnet  # skipped by subnet even though port 8080 is captured


def test_socket_with_proxy_mark_is_not_looped_back(redirector, pods, listen):
    a, b = pods
    redirector.enroll(spec_of(a))
    proxy, app = listen(a, 4140), listen(b, 8080)
    with connect_from(a, (b.ip, 8080), mark=PROXY_MARK):
        which, conn = arrived(proxy, app)
        conn.close()
        assert which is app
    with connect_from(a, (b.ip, 8080), mark=PROXY_MARK + 1):
        which, conn = arrived(proxy, app)
        conn.close()
        assert which is proxy


def test_inbound_from_another_pod_arrives_at_4143(redirector, pods, listen):
    a, b = pods
    redirector.enroll(spec_of(b))
    inbound, app = listen(b, 4143), listen(b, 8080)
    with connect_from(a, (b.ip, 8080)):
        which, conn = arrived(inbound, app)
        assert which is inbound
        with conn:
            assert original_dst(conn) == (b.ip, 8080)
            assert conn.getpeername()[0] == a.ip


@pytest.mark.parametrize("port", [4190, 4191])
def test_proxy_admin_ports_are_not_captured(redirector, pods, listen, port):
    a, b = pods
    redirector.enroll(spec_of(b))
    inbound, admin = listen(b, 4143), listen(b, port)
    with connect_from(a, (b.ip, port)):
        which, conn = arrived(inbound, admin)
        conn.close()
        assert which is admin


def test_skip_inbound_ports_are_not_captured(redirector, pods, listen):
    a, b = pods
    redirector.enroll(spec_of(b, skip_inbound_ports="22,5000-5010"))
    inbound, app = listen(b, 4143), listen(b, 5005)
    with connect_from(a, (b.ip, 5005)):
        which, conn = arrived(inbound, app)
        conn.close()
        assert which is app


def test_established_connection_survives_enrollment(redirector, pods, listen):
    a, b = pods
    app = listen(b, 8080)
    client = connect_from(a, (b.ip, 8080))
    which, server = arrived(app)
    assert which is app
    with client, server:
        redirector.enroll(spec_of(a))
        redirector.enroll(spec_of(b))
        client.sendall(b"ping")
        assert server.recv(4) == b"ping"
        server.sendall(b"pong")
        assert client.recv(4) == b"pong"
    proxy = listen(a, 4140)
    with connect_from(a, (b.ip, 8080)):  # a new connection is captured
        which, conn = arrived(proxy, app)
        conn.close()
        assert which is proxy


# --- rules: read back, idempotency, reconcile, cleanup -------------------------------


def test_plan_is_applied_and_read_back_exactly(redirector, pods):
    a, _ = pods
    spec = spec_of(a, skip_outbound_ports="22,1000-2000", skip_subnets="10.96.0.0/12")
    redirector.enroll(spec)
    saved = save(a.netns, backend_of(redirector))
    assert rule_lines(saved) == [r.render() for r in rules.plan(spec).rules()]


def test_enrolling_twice_leaves_the_same_rules(redirector, pods):
    a, _ = pods
    spec = spec_of(a, skip_inbound_ports="22")
    redirector.enroll(spec)
    first = rule_lines(save(a.netns, backend_of(redirector)))
    redirector.enroll(spec)
    assert rule_lines(save(a.netns, backend_of(redirector))) == first


def test_unenroll_removes_exactly_what_was_added(redirector, pods):
    a, _ = pods
    backend = backend_of(redirector)
    foreign = "*nat\n-A OUTPUT -p udp -m comment --comment other -j RETURN\nCOMMIT\n"
    subprocess.run(
        ["nsenter", f"--net={a.netns}", f"iptables-{backend.value}-restore", "--noflush"],
        input=foreign,
        text=True,
        check=True,
    )
    before = rule_lines(save(a.netns, backend))
    spec = spec_of(a, skip_subnets="10.0.0.0/8")
    redirector.enroll(spec)
    assert rules.ours(rules.parse_save(save(a.netns, backend)))
    redirector.unenroll(spec)
    after = save(a.netns, backend)
    assert rule_lines(after) == before
    assert rules.ours(rules.parse_save(after)) == []
    assert redirector.registry.get(spec.pod) is None


def test_restarted_agent_reconciles_without_duplicates(redirector, pods, tmp_path):
    a, _ = pods
    backend = backend_of(redirector)
    spec = spec_of(a)
    redirector.enroll(spec)
    planned = [r.render() for r in rules.plan(spec).rules()]
    # Drift while "down": a duplicate jump and a deleted rule.
    tamper = (
        "*nat\n" + rules.jump("OUTPUT").render() + "\n"
        '-D PROXY_INIT_OUTPUT -o lo -m comment --comment "proxy-init/ignore-loopback" -j RETURN\n'
        "COMMIT\n"
    )
    subprocess.run(
        ["nsenter", f"--net={a.netns}", f"iptables-{backend.value}-restore", "--noflush"],
        input=tamper,
        text=True,
        check=True,
    )
    restarted = IptablesRedirector(
        writer=redirector.writer_kind.value,
        iptables_mode=backend.value,
        registry=Registry(tmp_path / "enrolled.json"),
    )
    state = restarted.inspect(spec)
    assert state.outbound == "drift"
    assert any("ignore-loopback" in d for d in state.drift)
    assert any("duplicate" in d for d in state.drift)
    restarted.enroll(spec)
    assert rule_lines(save(a.netns, backend)) == planned
    assert restarted.inspect(spec).drift == ()


def test_inspect_counts_redirected_connections(redirector, pods, listen):
    a, b = pods
    spec = spec_of(a)
    redirector.enroll(spec)
    proxy = listen(a, 4140)
    for _ in range(3):
        with connect_from(a, (b.ip, 8080)):
            _, conn = arrived(proxy)
            conn.close()
    state = redirector.inspect(spec)
    assert state.counters["outbound_packets"] == 3  # nat sees the first packet of each
    assert state.counters["outbound_bytes"] > 0
    assert (state.inbound, state.outbound) == ("captured", "captured")


def test_enrolling_with_another_backend_moves_the_rules(pods, tmp_path):
    a, _ = pods
    spec = spec_of(a)
    IptablesRedirector(iptables_mode="legacy").enroll(spec)
    IptablesRedirector(iptables_mode="nft").enroll(spec)
    assert rules.ours(rules.parse_save(save(a.netns, Backend.LEGACY))) == []
    assert rules.ours(rules.parse_save(save(a.netns, Backend.NFT)))
    assert IptablesRedirector(iptables_mode="auto").backend_for(spec) is Backend.NFT
    IptablesRedirector().unenroll(spec)
    assert rules.ours(rules.parse_save(save(a.netns, Backend.NFT))) == []


# --- CLI ----------------------------------------------------------------------------


def run_cli(capsys, *argv):
    code = cli.main(list(argv))
    out = capsys.readouterr().out
    return code, out


def test_cli_redirects_list_show_verify_against_a_real_pod(lab, tmp_path, capsys):
    pod = lab.pod(lab.node("n1"), "web")
    reg = str(tmp_path / "enrolled.json")
    code, _ = run_cli(
        capsys,
        "redirects",
        "enroll",
        "shop/web",
        "--netns",
        str(pod.netns),
        "--ip",
        pod.ip,
        "--annotations",
        "config.linkerd.io/skip-outbound-ports=3306",
        "--registry",
        reg,
        "-o",
        "json",
    )
    assert code == 0

    code, out = run_cli(capsys, "redirects", "list", "--registry", reg, "-o", "json")
    rows = {r["pod"]: r for r in json.loads(out)}
    assert code == 0
    row = rows["shop/web"]
    assert (row["mode"], row["inbound"], row["outbound"], row["drift"]) == (
        "iptables",
        "captured",
        "captured",
        "",
    )
    assert "out:3306" in row["skipped"]

    code, out = run_cli(capsys, "redirects", "show", "shop/web", "--registry", reg, "-o", "json")
    shown = json.loads(out)
    assert any("--dports 3306" in line for line in shown["rules"])
    assert "*nat" in shown["rules"]

    code, out = run_cli(capsys, "redirects", "verify", "shop/web", "--registry", reg, "-o", "json")
    result = json.loads(out)
    assert code == 0, result
    assert result["ok"] is True
    assert {p["direction"] for p in result["probes"] if p["ok"]} == {"outbound", "inbound"}
    assert all("original destination" in p["detail"] for p in result["probes"])

    # Someone deletes a rule: list reads the kernel and shows the drift.
    subprocess.run(
        [
            "ip",
            "netns",
            "exec",
            pod.netns_name,
            "iptables",
            "-t",
            "nat",
            "-D",
            "PREROUTING",
            "-m",
            "comment",
            "--comment",
            "proxy-init/install-proxy-init-prerouting",
            "-j",
            "PROXY_INIT_REDIRECT",
        ],
        check=True,
    )
    code, out = run_cli(capsys, "redirects", "list", "--registry", reg, "-o", "json")
    row = {r["pod"]: r for r in json.loads(out)}["shop/web"]
    assert row["inbound"] == "partial"
    assert "install-proxy-init-prerouting" in row["drift"]
    code, out = run_cli(capsys, "redirects", "verify", "shop/web", "--registry", reg, "-o", "json")
    assert code == 1
    assert not {p["direction"]: p["ok"] for p in json.loads(out)["probes"]}["inbound"]

    code, _ = run_cli(capsys, "redirects", "unenroll", "shop/web", "--registry", reg)
    assert code == 0
    assert Registry(reg).get("shop/web") is None
    assert rules.ours(rules.parse_save(save(Path(pod.netns), Backend.NFT))) == []


def test_cli_redirects_list_names_a_pod_whose_netns_is_gone(lab, tmp_path, capsys):
    pod = lab.pod(lab.node("n1"), "web")
    reg = str(tmp_path / "enrolled.json")
    argv = ["redirects", "enroll", "shop/web", "--netns", str(pod.netns), "--ip", pod.ip]
    assert run_cli(capsys, *argv, "--registry", reg, "-o", "json")[0] == 0
    entry = Registry(reg).get("shop/web")
    assert entry is not None
    gone = dataclasses.replace(entry.spec, netns=tmp_path / "no-such-netns")
    Registry(reg).put(dataclasses.replace(entry, spec=gone))
    code, out = run_cli(capsys, "redirects", "list", "--registry", reg, "-o", "json")
    row = {r["pod"]: r for r in json.loads(out)}["shop/web"]
    assert code == 0
    assert (row["inbound"], row["outbound"], row["drift"]) == (
        "gone",
        "gone",
        "netns no longer exists",
    )
    Registry(reg).put(entry)  # back to the real netns: unenroll removes the rules
    assert run_cli(capsys, "redirects", "unenroll", "shop/web", "--registry", reg)[0] == 0
    assert rules.ours(rules.parse_save(save(Path(pod.netns), Backend.NFT))) == []


def test_cli_malformed_annotation_is_a_clear_error(lab, tmp_path, capsys):
    pod = lab.pod(lab.node("n1"), "web")
    code = cli.main(
        [
            "redirects",
            "enroll",
            "shop/web",
            "--netns",
            str(pod.netns),
            "--ip",
            pod.ip,
            "--annotations",
            "config.linkerd.io/skip-inbound-ports=80-",
            "--registry",
            str(tmp_path / "r.json"),
        ]
    )
    err = capsys.readouterr().err
    assert code == 2
    assert "pod shop/web: annotation config.linkerd.io/skip-inbound-ports='80-'" in err


def test_cli_check_passes_here_and_reports_the_auto_mode(capsys):
    code, out = run_cli(capsys, "check", "-o", "json")
    data = json.loads(out)
    assert code == 0, data
    names = {c["check"]: c["status"] for c in data["checks"]}
    for needed in (
        "kernel version",
        "cgroup v2 mounted",
        "network namespaces usable",
        "REDIRECT target (nft)",
        "mark match (legacy)",
        "comment match (nft)",
        "compiled program cache",
    ):
        assert names[needed] == "pass"
    assert data["redirect_auto"]["mode"] in ("iptables", "ebpf")
    assert data["redirect_auto"]["reason"]
