"""The rule plan against recorded `iptables-save` output: order, multiport, subnets, restore text."""

# ruff: noqa: E501 - recorded iptables-save lines are kept whole, as the kernel prints them

from __future__ import annotations

import ipaddress

import pytest

from agent.redirect import rules_plan
from agent.redirect.model import PortRange, PortSet


def rule_lines(text: str) -> list[str]:
    return [line[line.index("-A ") :] for line in text.splitlines() if "-A " in line]


def test_plan_renders_exactly_as_iptables_save_prints_it(recorded, recorded_spec):
    assert [r.render() for r in rules_plan.plan(recorded_spec).rules()] == rule_lines(recorded)


def test_default_plan_is_linkerd_inits_rules_with_a_mark_instead_of_a_uid(spec):
    got = [r.render() for r in rules_plan.plan(spec()).rules()]
    assert got == [
        '-A PREROUTING -m comment --comment "proxy-init/install-proxy-init-prerouting" -j PROXY_INIT_REDIRECT',
        '-A OUTPUT -m comment --comment "proxy-init/install-proxy-init-output" -j PROXY_INIT_OUTPUT',
        '-A PROXY_INIT_OUTPUT -m mark --mark 0x539 -m comment --comment "proxy-init/ignore-proxy-mark" -j RETURN',
        '-A PROXY_INIT_OUTPUT -o lo -m comment --comment "proxy-init/ignore-loopback" -j RETURN',
        '-A PROXY_INIT_OUTPUT -p tcp -m tcp --tcp-flags FIN,SYN,RST,ACK SYN -m comment --comment "proxy-init/redirect-all-outgoing-to-proxy-port" -j REDIRECT --to-ports 4140',
        '-A PROXY_INIT_REDIRECT -p tcp -m multiport --dports 4190,4191 -m comment --comment "proxy-init/ignore-port-4190,4191" -j RETURN',
        '-A PROXY_INIT_REDIRECT -p tcp -m tcp --tcp-flags FIN,SYN,RST,ACK SYN -m comment --comment "proxy-init/redirect-all-incoming-to-proxy-port" -j REDIRECT --to-ports 4143',
    ]


def test_skip_inbound_ports_join_the_proxy_ports_in_one_multiport_rule(spec):
    got = rules_plan.inbound_rules(
        spec(skip_inbound_ports=PortSet((PortRange(22, 22), PortRange(8000, 8100))))
    )
    assert (
        got[0]
        .render()
        .startswith("-A PROXY_INIT_REDIRECT -p tcp -m multiport --dports 4190,4191,22,8000:8100 ")
    )


@pytest.mark.parametrize(
    ("ranges", "groups"),
    [
        ([], []),
        ([(22, 22), (25, 27), (33, 33)], [["22", "25:27", "33"]]),
        (
            [(22, 23), (25, 27), (33, 34), (35, 35), (37, 38), (50, 54), (56, 57), (60, 63)],
            [["22:23", "25:27", "33:34", "35", "37:38", "50:54", "56:57", "60:63"]],
        ),
        (
            [
                (22, 23),
                (25, 27),
                (33, 34),
                (35, 35),
                (37, 38),
                (50, 54),
                (56, 56),
                (58, 58),
                (60, 60),
                (63, 63),
                (70, 72),
            ],
            [
                ["22:23", "25:27", "33:34", "35", "37:38", "50:54", "56", "58", "60", "63"],
                ["70:72"],
            ],
        ),
        ([(p, p) for p in range(1, 17)], [[str(p) for p in range(1, 16)], ["16"]]),
    ],
)
def test_multiport_splits_at_fifteen_port_references(ranges, groups):
    assert rules_plan._multiport([PortRange(a, b) for a, b in ranges]) == groups


def test_ipv6_skip_subnets_make_no_ipv4_rules(spec):
    got = rules_plan.plan(spec(skip_subnets=(ipaddress.ip_network("fd00::/8"),))).rules()
    assert not any("fd00" in r.render() for r in got)


def test_render_restore_is_one_transaction_declaring_both_chains(spec):
    text = rules_plan.render_restore(rules_plan.plan(spec()))
    lines = text.splitlines()
    assert lines[:3] == ["*nat", ":PROXY_INIT_REDIRECT - [0:0]", ":PROXY_INIT_OUTPUT - [0:0]"]
    assert lines[-1] == "COMMIT"
