"""The pure reading of `iptables-save` text: a pod's capture state, the host's backend."""

# ruff: noqa: E501 - recorded iptables-save lines are kept whole, as the kernel prints them

from __future__ import annotations

import pytest

from agent.redirect.iptables_state import Backend, choose_backend, nat_section, state_from_save


def test_state_from_save_reports_capture_counters_and_drift(recorded, recorded_spec):
    state = state_from_save(recorded_spec, recorded, backend=Backend.NFT)
    assert (state.inbound, state.outbound, state.drift) == ("captured", "captured", ())
    assert state.counters["inbound_packets"] == 2
    assert state.counters["outbound_bytes"] == 180
    assert state.counters["outbound_skipped_packets"] == 2
    assert "out:22,1000-2000" in state.skipped_ports
    broken = recorded.replace(
        '[0:0] -A PROXY_INIT_OUTPUT -o lo -m comment --comment "proxy-init/ignore-loopback" -j RETURN\n',
        "",
    )
    state = state_from_save(recorded_spec, broken, backend=Backend.NFT)
    assert state.outbound == "drift"
    assert state.inbound == "captured"
    assert state.drift


def test_state_from_save_counts_every_direction_in_order_and_names_what_it_skips(
    recorded, recorded_spec
):
    state = state_from_save(recorded_spec, recorded, backend=Backend.NFT)
    assert list(state.counters.items()) == [
        ("inbound_packets", 2),
        ("inbound_bytes", 120),
        ("inbound_skipped_packets", 1),
        ("outbound_packets", 3),
        ("outbound_bytes", 180),
        ("outbound_skipped_packets", 2),
    ]
    assert state.skipped_ports == "in:4190,4191 out:22,1000-2000 subnets:10.9.0.0/16"
    assert state.extra == {"backend": "nft"}
    assert state.detail == recorded[recorded.index("*nat") : recorded.index("COMMIT") + 6]


def test_state_from_save_with_rules_in_both_backends_reports_it_as_drift(recorded, recorded_spec):
    state = state_from_save(recorded_spec, recorded, backend=Backend.LEGACY, mixed=True)
    assert state.drift == ("rules present in both nft and legacy backends",)
    assert state.extra == {"backend": "legacy"}


def test_state_from_save_without_the_jump_is_partial(recorded, recorded_spec):
    text = "\n".join(line for line in recorded.splitlines() if "prerouting" not in line)
    state = state_from_save(recorded_spec, text, backend=Backend.NFT)
    assert (state.inbound, state.outbound) == ("partial", "captured")


def test_nat_section_keeps_only_the_nat_table_as_printed(recorded):
    text = "*filter\n:INPUT ACCEPT [0:0]\nCOMMIT\n" + recorded + "*mangle\n-A X -j Y\nCOMMIT\n"
    got = nat_section(text)
    assert got.splitlines()[0] == "*nat"
    assert got.splitlines()[-1] == "COMMIT"
    assert "INPUT ACCEPT" in got  # the nat table's own INPUT chain
    assert "-A X -j Y" not in got
    assert got.count("COMMIT") == 1


def test_state_from_save_of_an_empty_netns_is_missing(spec):
    state = state_from_save(spec(), "", backend=Backend.LEGACY)
    assert (state.inbound, state.outbound) == ("missing", "missing")


@pytest.mark.parametrize(
    ("nft", "legacy", "default", "backend"),
    [
        (":KUBE-KUBELET-CANARY - [0:0]", "", None, Backend.NFT),
        ("", ":KUBE-IPTABLES-HINT - [0:0]", Backend.NFT, Backend.LEGACY),
        ("-A INPUT -j ACCEPT\n-A INPUT -j DROP", "-A INPUT -j ACCEPT", None, Backend.NFT),
        ("-A INPUT -j ACCEPT", "-A X -j Y\n-A X -j Z", Backend.NFT, Backend.LEGACY),
        ("", "", Backend.NFT, Backend.NFT),
        ("", "", None, Backend.LEGACY),
    ],
)
def test_backend_detection_follows_linkerd_init(nft, legacy, default, backend):
    assert choose_backend(nft_save=nft, legacy_save=legacy, default=default).backend is backend
