"""agent.netlab_state: which links teardown leaves to their namespace (rule 2)."""

from __future__ import annotations

from agent.netlab_state import with_netns


def test_a_link_goes_with_a_removed_namespace_it_or_its_peer_end_is_in():
    records = [
        {"kind": "netns", "name": "lab-n-m1"},
        {"kind": "link", "name": "labb1", "netns": None},  # a host bridge: deleted
        {"kind": "link", "name": "labb2", "netns": "lab-n-m1"},  # a bridge in a node netns
        {"kind": "netns", "name": "lab-a"},
        {"kind": "link", "name": "labv3", "netns": None, "peer_netns": "lab-a"},  # a pod's veth
        {"kind": "link", "name": "labv4", "netns": None, "peer_netns": "elsewhere"},
        {"kind": "cgroup", "path": "/sys/fs/cgroup/meshagent/lab-a"},
    ]
    assert [r["name"] for r in with_netns(records)] == ["labb2", "labv3"]


def test_nothing_goes_with_a_namespace_the_records_do_not_remove():
    records = [{"kind": "link", "name": "labv1", "netns": None, "peer_netns": "lab-a"}]
    assert with_netns(records) == []
