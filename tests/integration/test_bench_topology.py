"""The bench's pods (agent.bench.topology): tuned for load, read back from the pod's netns."""

from __future__ import annotations

import pytest

from agent import config
from agent.bench import topology

pytestmark = pytest.mark.privileged


def test_bench_pods_get_their_sysctls_and_keep_the_agent_ports_out_of_the_ephemeral_range(lab):
    pod = lab.pod(lab.node("n1", "10.201.9.0/24"), "a", ip="10.201.9.5")
    topology.tune_pod(pod)  # the step build_topology runs per pod
    for key, value in topology.POD_SYSCTLS.items():
        got = pod.run(["cat", f"/proc/sys/{key}"]).stdout.split()
        assert got == value.replace(",", " ").split() or got == [value], key
    # A conn-rate load leaves TIME_WAIT client ports behind; on the agent's listener port one
    # makes the next agent's listen fail (SO_REUSEADDR does not help: the client had none).
    reserved = pod.run(["cat", "/proc/sys/net/ipv4/ip_local_reserved_ports"]).stdout.strip()
    assert reserved.split(",") == [str(config.OUTBOUND_PORT), str(config.INBOUND_PORT)]
