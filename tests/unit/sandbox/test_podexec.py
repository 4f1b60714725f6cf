from __future__ import annotations

import pytest

from agent.sandbox.podexec import PodNotFoundError, argv_for, find_pod

STATE = {
    "pods": [
        {"namespace": "shop", "name": "web-830e7-0", "netns": "sb-shop-web", "cgroup": "/cg/web"},
        {"namespace": "shop", "name": "api-bd955-0", "netns": "sb-shop-api-0", "cgroup": "/cg/a0"},
        {"namespace": "shop", "name": "api-bd955-1", "netns": "sb-shop-api-1", "cgroup": "/cg/a1"},
        {"namespace": "outside", "name": "web-1", "netns": "sb-outside-web", "cgroup": "/cg/o"},
    ]
}


@pytest.mark.parametrize(
    ("ref", "netns"),
    [
        ("shop/web-830e7-0", "sb-shop-web"),
        ("shop/web", "sb-shop-web"),
        ("outside/web", "sb-outside-web"),
        ("api-bd955-1", "sb-shop-api-1"),
    ],
)
def test_find_pod_accepts_full_names_and_unique_prefixes(ref, netns):
    assert find_pod(STATE, ref)["netns"] == netns


@pytest.mark.parametrize("ref", ["shop/api", "web", "nope", "other/web-830e7-0"])
def test_find_pod_refuses_ambiguous_or_unknown_refs_and_lists_pods(ref):
    with pytest.raises(PodNotFoundError) as exc:
        find_pod(STATE, ref)
    assert "shop/api-bd955-0" in str(exc.value)


def test_find_pod_without_a_sandbox_says_so():
    with pytest.raises(PodNotFoundError, match="is the sandbox up"):
        find_pod({}, "shop/web")


def test_argv_enters_the_pod_netns_by_name():
    assert argv_for(STATE["pods"][0], ["curl", "-s", "x"]) == [
        "ip",
        "netns",
        "exec",
        "sb-shop-web",
        "curl",
        "-s",
        "x",
    ]
