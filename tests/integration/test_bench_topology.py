"""The bench's pods (agent.bench.topology): tuned for load, read back from the pod's netns,
and placed on their node's CPUs; a peer that cannot listen says why."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from agent import config
from agent.bench import haproxy, peers, setups, topology

pytestmark = pytest.mark.privileged


def test_bench_pods_get_their_sysctls_and_keep_the_agent_ports_out_of_the_ephemeral_range(lab):
    pod = lab.pod(lab.node("n1", "10.201.9.0/24"), "a", ip="10.201.9.5")
    topology.tune_pod(pod)  # the step build_topology runs per pod
    reserved_key = "net/ipv4/ip_local_reserved_ports"
    for key, value in topology.POD_SYSCTLS.items():
        got = pod.run(["cat", f"/proc/sys/{key}"]).stdout.split()
        if key != reserved_key:  # the kernel writes that one back with ranges (8080-8081)
            assert got == value.replace(",", " ").split() or got == [value], key
    # A conn-rate load leaves TIME_WAIT client ports behind; on a listener port one makes the
    # next setup's listen fail (SO_REUSEADDR does not help: the client had none): the agent's,
    # and HAProxy's in the client pod, which met one in most rounds at 8,000 connections/s.
    reserved = pod.run(["cat", f"/proc/sys/{reserved_key}"]).stdout.strip()
    ports = set()
    for item in reserved.split(","):
        low, _, high = item.partition("-")
        ports |= set(range(int(low), int(high or low) + 1))
    assert ports == set(topology.LISTEN_PORTS)
    assert topology.SIDE_PORT in ports
    assert {config.OUTBOUND_PORT, config.INBOUND_PORT, topology.PROXY_HTTP_PORT} <= ports


def _cpus(pid: int) -> set[int]:
    """Every thread's CPUs of `pid`, read from the kernel (one set when they agree)."""
    tasks = Path(f"/proc/{pid}/task").iterdir()
    found = {frozenset(os.sched_getaffinity(int(t.name))) for t in tasks}
    assert len(found) == 1, found
    return set(next(iter(found)))


def _pod_pids(pod) -> list[int]:
    return [int(p) for p in (pod.cgroup / "cgroup.procs").read_text().split()]


@pytest.mark.timeout(120)
def test_a_two_node_path_runs_each_node_on_its_own_cpus_agents_and_workers_too(lab, tmp_path):
    """Rule 5: node a (cli, its agent) on the first share, node b (srv2, its agent) the next."""
    every = os.sched_getaffinity(0)
    first, second = topology.split_cpus(every, 2)
    topo = topology.build_topology(lab, tmp_path)
    try:
        with topology.placed(topo, 2):
            assert all(_cpus(p) == second for p in _pod_pids(topo.srv2))  # running servers moved
            assert all(_cpus(p) == first for p in _pod_pids(topo.srv))
            assert _cpus(topo.cli.spawn(["sleep", "30"]).pid) == first  # a load, started now
            agent = setups.start_node_agent(
                topo, ["srv2"], "iptables", node="b", name="b", workers=1
            )
            try:
                workers = agent.worker_pids()
                assert workers
                assert {frozenset(_cpus(p)) for p in [agent.pid, *workers]} == {second}
            finally:
                agent.stop()
        assert all(_cpus(p) == every for p in _pod_pids(topo.srv2))  # anywhere again
        with topology.placed(topo, 1):  # one node: all of them
            assert all(_cpus(p) == every for p in _pod_pids(topo.srv))
    finally:
        topo.mesh.stop()


def test_a_peer_that_cannot_listen_says_why(lab, tmp_path):
    """HAProxy cannot bind its port (here a socket of ours holds it, as a TIME_WAIT client
    port did at 8,000 connections/s): `wait_port` stops when HAProxy exits and quotes its
    stderr, which the setup keeps beside its config."""
    pod = lab.pod(lab.node("n2", "10.201.10.0/24"), "b", ip="10.201.10.5")
    port = topology.PROXY_HTTP_PORT
    cfg = tmp_path / "haproxy-http.cfg"
    route = haproxy.Route(name="http", bind=f"127.0.0.1:{port}", target="10.201.10.9:8080")
    with pod.socket() as taken:
        taken.bind(("127.0.0.1", port))  # bound, not listening: connects are refused
        proc = peers._haproxy(pod, [route], cfg, nodes=1)
        try:
            with pytest.raises(topology.BenchError) as err:
                topology.wait_port(pod, "127.0.0.1", port, proc=proc, log=peers.log_of(cfg))
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
    assert f"haproxy exited with {proc.returncode} before it listened" in str(err.value)
    assert proc.returncode != 0
    assert "Address already in use" in str(err.value)


@pytest.mark.timeout(60)
def test_a_peer_that_listens_but_carries_nothing_says_why(lab, tmp_path):
    """Topology rule 10: HAProxy listens, its server refuses; in tcp mode it holds the client
    while it retries (3 s), so a short turn counted no requests and no errors. `wait_answer`
    fails the setup instead, quoting HAProxy's log of that connection (haproxy rule 3)."""
    pod = lab.pod(lab.node("n3", "10.201.11.0/24"), "c", ip="10.201.11.5")
    port = topology.PROXY_HTTP_PORT
    cfg = tmp_path / "haproxy-tcp.cfg"
    route = haproxy.Route(name="http", bind=f"127.0.0.1:{port}", target="127.0.0.1:9")
    proc = peers._haproxy(pod, [route], cfg, nodes=1)
    try:
        topology.wait_port(pod, "127.0.0.1", port, proc=proc, log=peers.log_of(cfg))
        with pytest.raises(topology.BenchError) as err:
            topology.wait_answer(pod, "127.0.0.1", port, within=4, logs=[peers.log_of(cfg)])
    finally:
        peers._stop(proc)
    said = str(err.value)
    assert f"no 200 from 127.0.0.1:{port} within 4s" in said, said
    # the connection's log line: its route and server, and termination state SC (the
    # server refused the connection), which only the abnormal-connection log shows
    assert " http http/s1 " in said, said
    assert " SC " in said, said
