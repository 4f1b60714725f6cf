"""Which setups span two nodes (placed each on its own CPUs: agent.bench.topology rule 5)."""

from __future__ import annotations

from agent.bench import setups


def test_cross_node_and_two_hop_tls_paths_span_two_nodes_and_the_rest_one():
    two = {name for name in setups.SETUPS if setups.nodes_of(name) == 2}
    assert two == {
        name
        for name in setups.SETUPS
        if name.endswith("-xnode") or name.startswith(("haproxy-tls", "python-floor-tls"))
    }
    assert setups.nodes_of("meshagent-ebpf") == 1
    assert setups.nodes_of("haproxy-http") == 1
