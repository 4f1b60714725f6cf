"""Each simulated node's share of the machine (agent.bench.topology rule 4)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from agent.bench import topology


def test_one_node_gets_every_cpu_and_two_nodes_share_them() -> None:
    cpus = len(os.sched_getaffinity(0))
    assert topology.per_node(1) == cpus
    assert topology.per_node(2) == max(1, cpus // 2)
    assert topology.per_node(cpus * 4) == 1  # never no worker at all


def test_the_share_follows_the_cpus_the_process_may_run_on() -> None:
    # a real affinity set (taskset's call), not the machine's count: one CPU for one node
    code = "from agent.bench import topology; print(topology.per_node(1), topology.per_node(2))"
    done = subprocess.run(
        ["taskset", "-c", "0", sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
    )
    assert done.stdout.split() == ["1", "1"]


def test_two_nodes_get_consecutive_halves_and_one_node_all_of_them() -> None:
    """Rule 5: node a the first share of the CPUs, node b the next."""
    assert topology.split_cpus([0, 1], 2) == [frozenset({0}), frozenset({1})]
    assert topology.split_cpus([3, 1, 2, 0], 2) == [frozenset({0, 1}), frozenset({2, 3})]
    assert topology.split_cpus([0, 1, 2], 2) == [frozenset({0}), frozenset({1})]  # equal shares
    assert topology.split_cpus([0, 1], 1) == [frozenset({0, 1})]


def test_fewer_cpus_than_nodes_gives_every_node_all_of_them() -> None:
    assert topology.split_cpus([5], 2) == [frozenset({5}), frozenset({5})]


def test_no_cpus_or_no_nodes_is_refused() -> None:
    with pytest.raises(ValueError, match="cannot split"):
        topology.split_cpus([], 2)
    with pytest.raises(ValueError, match="cannot split"):
        topology.split_cpus([0, 1], 0)


def test_the_twin_topology_puts_the_peers_pods_in_the_meshed_pods_places():
    pods = {name: object() for name in ("cli", "srv", "srv2", "pcli", "psrv", "psrv2")}
    base = {"lab": None, "a": None, "b": None, "workdir": None, "mesh": None}
    topo = topology.Topology(**base, cli=pods["cli"], srv=pods["srv"], srv2=pods["srv2"])
    with pytest.raises(topology.BenchError, match="no twin pods"):
        topology.twin(topo)
    topo.peer_cli, topo.peer_srv, topo.peer_srv2 = pods["pcli"], pods["psrv"], pods["psrv2"]
    got = topology.twin(topo)
    assert (got.cli, got.srv, got.srv2) == (pods["pcli"], pods["psrv"], pods["psrv2"])
    assert got.peer_cli is None  # no twin of the twins
    assert topo.cli is pods["cli"]  # the meshed topology itself is left as it was
