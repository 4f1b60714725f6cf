"""The pod lab creates real pods and leaves nothing behind, even after failures."""

from __future__ import annotations

import errno
import json
import os
import secrets
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from agent import netlab, netlab_state
from agent.netlab import Lab
from agent.redirect.netns import NetnsId

pytestmark = pytest.mark.privileged

SERVER = (
    "import socket,sys;s=socket.socket();s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1);"
    "s.bind(('0.0.0.0',int(sys.argv[1])));s.listen();print('ready',flush=True);"
    "c,a=s.accept();c.sendall(a[0].encode());c.close()"
)


def snapshot(prefix: str) -> dict[str, set[str]]:
    """Everything on this machine that carries `prefix`."""
    netns = set(
        subprocess.run(
            ["ip", "netns", "list"], capture_output=True, text=True, check=False
        ).stdout.split()
    )
    links = {
        line.split(":")[1].strip().split("@")[0]
        for line in subprocess.run(
            ["ip", "-o", "link"], capture_output=True, text=True, check=False
        ).stdout.splitlines()
    }
    root = netlab.cgroup2_root()
    cgroups = (
        {p.name for p in (root / "meshagent").iterdir() if p.is_dir()}
        if root and (root / "meshagent").is_dir()
        else set()
    )
    states = {p.name for p in netlab.STATE_DIR.glob("*.json")}
    return {
        "netns": {n for n in netns if n.startswith(prefix)},
        "links": {n for n in links if n.startswith(prefix)},
        "cgroups": {n for n in cgroups if n.startswith(prefix)},
        "state": {n for n in states if n.startswith(prefix)},
    }


def empty(snap: dict[str, set[str]]) -> bool:
    return not any(snap.values())


def build(lb: Lab) -> subprocess.Popen:
    node = lb.node("n1")
    a = lb.pod(node, "a")
    lb.pod(node, "b")
    m1, m2 = lb.node("m1", isolated=True), lb.node("m2", isolated=True)
    lb.link(m1, m2)
    lb.pod(m1, "c")
    return a.spawn(["sleep", "60"])


def new_prefix() -> str:
    return "x" + secrets.token_hex(3)


def test_close_removes_netns_links_cgroups_processes_and_state():
    prefix = new_prefix()
    assert empty(snapshot(prefix))
    lb = Lab(prefix)
    proc = build(lb)
    during = snapshot(prefix)
    assert during["netns"] == {
        f"{prefix}-a",
        f"{prefix}-b",
        f"{prefix}-c",
        f"{prefix}-n-m1",
        f"{prefix}-n-m2",
    }
    assert {f"{prefix}b1"} <= during["links"]  # the host bridge (isolated ones live in node netns)
    assert during["cgroups"] == {f"{prefix}-a", f"{prefix}-b", f"{prefix}-c"}
    assert during["state"] == {f"{prefix}.json"}
    lb.close()
    assert proc.poll() is not None
    assert snapshot(prefix) == {"netns": set(), "links": set(), "cgroups": set(), "state": set()}


def test_context_manager_cleans_up_after_an_exception():
    prefix = new_prefix()
    seen = {}

    def failing_test():
        with netlab.lab(prefix) as lb:
            build(lb)
            seen.update(snapshot(prefix))
            raise RuntimeError("test failed")

    with pytest.raises(RuntimeError, match="test failed"):
        failing_test()
    assert seen["netns"]
    assert empty(snapshot(prefix))


def test_cleanup_recorded_removes_what_a_crashed_run_left():
    prefix = new_prefix()
    lb = Lab(prefix)
    try:
        proc = build(lb)
        errors = Lab.cleanup_recorded(prefix)  # as a later run would, from the state file
        assert errors == []
        assert proc.wait(timeout=5) == -9
        assert empty(snapshot(prefix))
    finally:
        lb.close()
    assert empty(snapshot(prefix))


def test_a_veth_whose_pod_netns_something_else_holds_is_still_removed(monkeypatch):
    """A pod's veth goes with its namespace (netlab_state rule 2), unless something
    outside the lab holds that namespace: then teardown deletes the veth itself."""
    monkeypatch.setattr(netlab_state, "LINK_GONE_S", 0.2)
    prefix = new_prefix()
    lb = Lab(prefix)
    try:
        node = lb.node("n1")
        held = lb.pod(node, "held")
        lb.pod(node, "free")
        fd = os.open(f"/run/netns/{held.netns_name}", os.O_RDONLY)
    finally:
        lb.close()
    try:
        assert empty(snapshot(prefix))
        # the namespace itself lives on while held, without its veth
        links = subprocess.run(
            ["nsenter", f"--net=/proc/self/fd/{fd}", "ip", "-o", "link"],
            capture_output=True,
            text=True,
            check=True,
            pass_fds=(fd,),
        ).stdout
        assert "eth0" not in links
        assert "lo:" in links
    finally:
        os.close(fd)


def test_half_built_pod_is_still_removed(lab):
    node = lab.node("n1")
    lab.pod(node, "a")
    with pytest.raises(netlab.LabError):
        lab.pod(node, "b", ip="192.0.2.9")  # outside the subnet: refused before creation
    with pytest.raises(netlab.LabError):
        lab.pod(node, "a")  # same name twice
    lab.close()
    assert empty(snapshot(lab.prefix))


def test_spawned_process_runs_in_the_pod_netns_and_cgroup(lab):
    pod = lab.pod(lab.node("n1"), "a")
    proc = pod.spawn(["sleep", "30"])
    deadline = time.monotonic() + 5
    while NetnsId.of(f"/proc/{proc.pid}/ns/net") != NetnsId.of(pod.netns):
        assert time.monotonic() < deadline, "process never entered the pod netns"
        time.sleep(0.02)
    cgroup_line = Path(f"/proc/{proc.pid}/cgroup").read_text().splitlines()
    unified = [line for line in cgroup_line if line.startswith("0::")]
    assert unified == [f"0::/meshagent/{pod.netns_name}"]
    assert str(proc.pid) in (pod.cgroup / "cgroup.procs").read_text().split()


def test_processes_started_from_many_threads_at_once_are_all_recorded(lab):
    """Rule 5: `pod.run` from several threads (as tests call it through to_thread)."""
    pod = lab.pod(lab.node("n1"), "a")
    with ThreadPoolExecutor(8) as pool:
        done = list(pool.map(lambda _: pod.run(["true"], timeout=10), range(32)))
    assert [d.returncode for d in done] == [0] * 32
    state = json.loads(lab.state_file.read_text())
    assert [r for r in state["records"] if r["kind"] == "proc"] == []  # each run untracked


def _marked(marker: str) -> list[str]:
    """PIDs of the processes whose command line holds `marker`."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if marker.encode() in cmdline.read_bytes():
                found.append(cmdline.parent.name)
        except OSError:
            continue  # gone meanwhile
    return found


def test_closing_while_other_threads_still_run_commands_fails_nothing_and_leaves_none():
    """A lab closed while load threads still run commands in its pods (as a bench's load
    thread can outlive its `with`): close succeeds, each run ends in LabError, and none of
    the commands (each would sleep 30 s) stays."""
    prefix = new_prefix()
    marker = f"lab-close-{prefix}"  # in each command's argv, to find them in /proc
    lb = Lab(prefix)
    pod = lb.pod(lb.node("n1"), "a")
    ended: list[str] = []

    def keep_running() -> None:
        while True:
            try:
                pod.run([sys.executable, "-c", "import time;time.sleep(30)", marker], timeout=60)
            except netlab.LabError as exc:
                ended.append(exc.reason)
                return

    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(keep_running) for _ in range(8)]
        deadline = time.monotonic() + 10
        while len(_marked(marker)) < 8:
            assert time.monotonic() < deadline, "the commands never started"
            time.sleep(0.01)
        lb.close()
        for f in futures:
            f.result(timeout=20)
    assert len(ended) == 8
    assert _marked(marker) == []
    assert snapshot(prefix) == {"netns": set(), "links": set(), "cgroups": set(), "state": set()}


THREADED = (
    "import threading,time;t=threading.Thread(target=time.sleep,args=(30,));t.start();"
    "print('up',flush=True);t.join()"
)


def tasks_cpus(pid: int) -> dict[int, set[int]]:
    """The CPUs each thread of `pid` may run on, read from the kernel."""
    return {
        int(t.name): os.sched_getaffinity(int(t.name)) for t in Path(f"/proc/{pid}/task").iterdir()
    }


def test_placing_a_node_moves_its_running_threads_and_new_processes_inherit(lab):
    """Rule 6 (the bench's nodes on their own CPUs, agent.bench.topology rule 5)."""
    every = os.sched_getaffinity(0)
    first = {min(every)}
    node, other = lab.node("n1"), lab.node("n2")
    pod, elsewhere = lab.pod(node, "a"), lab.pod(other, "b")
    running = pod.spawn([sys.executable, "-c", THREADED], stdout=subprocess.PIPE, text=True)
    assert running.stdout.readline().strip() == "up"  # its second thread exists
    stays = elsewhere.spawn(["sleep", "30"])
    lab.place(node, first)
    assert lab.cpus_of(node) == first
    assert lab.cpus_of(other) is None
    moved = tasks_cpus(running.pid)
    assert len(moved) >= 2  # nsenter exec'd python: the pod's process and its thread
    assert set(map(frozenset, moved.values())) == {frozenset(first)}
    assert os.sched_getaffinity(stays.pid) == every  # another node's process is left alone
    started = pod.spawn(["sleep", "30"])
    assert os.sched_getaffinity(started.pid) == first  # set in the child before exec
    lab.place(node, None)
    assert lab.cpus_of(node) is None
    assert all(c == every for c in tasks_cpus(running.pid).values())
    assert os.sched_getaffinity(started.pid) == every


def test_placing_a_node_on_cpus_this_process_may_not_use_is_refused(lab):
    node = lab.node("n1")
    with pytest.raises(netlab.LabError, match="not within"):
        lab.place(node, {max(os.sched_getaffinity(0)) + 1000})
    with pytest.raises(netlab.LabError, match="not within"):
        lab.place(node, set())
    assert lab.cpus_of(node) is None


def test_pod_has_lo_up_and_default_route_via_gateway(lab):
    pod = lab.pod(lab.node("n1", "10.201.7.0/24"), "a", ip="10.201.7.9")
    out = pod.run(["ip", "-o", "addr", "show", "lo"]).stdout
    assert "127.0.0.1/8" in out
    assert "default via 10.201.7.1 dev eth0" in pod.run(["ip", "route"]).stdout
    assert (
        subprocess.run(["ip", "netns", "exec", pod.netns_name, "true"], check=False).returncode == 0
    )


def test_pods_on_one_node_and_the_host_reach_each_other(lab):
    node = lab.node("n1")
    a, b = lab.pod(node, "a"), lab.pod(node, "b")
    server = b.spawn([sys.executable, "-c", SERVER, "8080"], stdout=subprocess.PIPE, text=True)
    assert server.stdout.readline().strip() == "ready"
    with a.socket() as s:
        s.settimeout(5)
        s.connect((b.ip, 8080))
        assert s.recv(64).decode() == a.ip  # the peer saw pod a's IP
    server2 = a.spawn([sys.executable, "-c", SERVER, "8081"], stdout=subprocess.PIPE, text=True)
    assert server2.stdout.readline().strip() == "ready"
    with socket.create_connection((a.ip, 8081), timeout=5) as s:
        assert s.recv(64).decode() == node.gateway  # from the host via the bridge


def test_pods_on_two_linked_nodes_reach_each_other(lab):
    m1, m2 = lab.node("m1", isolated=True), lab.node("m2", isolated=True)
    lab.link(m1, m2)
    c, d = lab.pod(m1, "c"), lab.pod(m2, "d")
    server = d.spawn([sys.executable, "-c", SERVER, "9000"], stdout=subprocess.PIPE, text=True)
    assert server.stdout.readline().strip() == "ready"
    with c.socket() as s:
        s.settimeout(5)
        s.connect((d.ip, 9000))
        assert s.recv(64).decode() == c.ip


def _mac(node_ns: str, ifname: str) -> str:
    out = subprocess.run(
        ["ip", "-n", node_ns, "-j", "link", "show", ifname],
        capture_output=True,
        text=True,
        check=True,
    )
    return str(json.loads(out.stdout)[0]["address"])


def test_a_node_keeps_its_gateway_address_as_pods_join(lab):
    """Rule 8: a pod that resolved its gateway first still reaches the other node after a
    pod whose port has a lower MAC joins the bridge (without a fixed address the bridge
    took that port's, and the first pod's frames to the old one were dropped)."""
    m1, m2 = lab.node("m1", isolated=True), lab.node("m2", isolated=True)
    lab.link(m1, m2)
    first, far = lab.pod(m1, "first"), lab.pod(m2, "far")
    server = far.spawn([sys.executable, "-c", SERVER, "9000"], stdout=subprocess.PIPE, text=True)
    assert server.stdout.readline().strip() == "ready"
    with first.socket() as s:  # resolves the gateway: the bridge's address now
        s.settimeout(5)
        assert s.connect_ex((m2.gateway, 9)) == errno.ECONNREFUSED  # by the far node itself
    assert m1.netns_name is not None
    gateway = _mac(m1.netns_name, m1.bridge)
    late = lab.pod(m1, "late")
    low = "00:00:00:00:00:01"  # lower than any address the bridge could have taken
    subprocess.run(
        ["ip", "-n", m1.netns_name, "link", "set", late.veth, "address", low], check=True
    )
    assert _mac(m1.netns_name, late.veth) == low
    assert _mac(m1.netns_name, m1.bridge) == gateway
    with first.socket() as s:
        s.settimeout(5)
        s.connect((far.ip, 9000))
        assert s.recv(64).decode() == first.ip


def test_names_fit_interface_limits_and_bad_prefixes_are_refused():
    with pytest.raises(netlab.LabError):
        Lab("much-too-long-prefix")
    prefix = "z" + secrets.token_hex(3) + "9"
    with netlab.lab(prefix) as lb:
        node = lb.node("n1")
        pod = lb.pod(node, "a-long-pod-name")
        assert len(node.bridge) <= 15
        assert len(pod.veth) <= 15
    assert empty(snapshot(prefix))


def test_cgroup2_root_is_read_from_proc_mounts():
    mounts = (
        "cgroup /sys/fs/cgroup/cpu cgroup rw 0 0\ncgroup2 /sys/fs/cgroup/unified cgroup2 rw 0 0\n"
    )
    assert netlab.cgroup2_root(mounts) == Path("/sys/fs/cgroup/unified")
    assert netlab.cgroup2_root("cgroup /x cgroup rw 0 0\n") is None
    assert os.path.ismount(str(netlab.cgroup2_root()))
