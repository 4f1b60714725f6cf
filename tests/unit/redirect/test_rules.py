"""The rule plan against recorded `iptables-save` output, parsing, reconcile, drift."""

# ruff: noqa: E501 - recorded iptables-save lines are kept whole, as the kernel prints them

from __future__ import annotations

import ipaddress
from pathlib import Path

import pytest

from agent.redirect import rules
from agent.redirect.model import CaptureSpec, PortRange, PortSet


def spec(**kw) -> CaptureSpec:
    return CaptureSpec(pod="shop/web", netns=Path("/run/netns/web"), pod_ip="10.0.0.5", **kw)


# Recorded with iptables-nft-save -c (v1.8.9) after enrolling a pod with
# skip-outbound-ports=22,1000-2000 and skip-subnets=10.9.0.0/16 (shared with test_iptables_state.py).
RECORDED = (Path(__file__).parent / "recorded-nft-save.txt").read_text()

RECORDED_SPEC = spec(
    skip_outbound_ports=PortSet((PortRange(22, 22), PortRange(1000, 2000))),
    skip_subnets=(ipaddress.ip_network("10.9.0.0/16"),),
)


def rule_lines(text: str) -> list[str]:
    return [line[line.index("-A ") :] for line in text.splitlines() if "-A " in line]


def test_plan_renders_exactly_as_iptables_save_prints_it():
    assert [r.render() for r in rules.plan(RECORDED_SPEC).rules()] == rule_lines(RECORDED)


def test_default_plan_is_linkerd_inits_rules_with_a_mark_instead_of_a_uid():
    got = [r.render() for r in rules.plan(spec()).rules()]
    assert got == [
        '-A PREROUTING -m comment --comment "proxy-init/install-proxy-init-prerouting" -j PROXY_INIT_REDIRECT',
        '-A OUTPUT -m comment --comment "proxy-init/install-proxy-init-output" -j PROXY_INIT_OUTPUT',
        '-A PROXY_INIT_OUTPUT -m mark --mark 0x539 -m comment --comment "proxy-init/ignore-proxy-mark" -j RETURN',
        '-A PROXY_INIT_OUTPUT -o lo -m comment --comment "proxy-init/ignore-loopback" -j RETURN',
        '-A PROXY_INIT_OUTPUT -p tcp -m tcp --tcp-flags FIN,SYN,RST,ACK SYN -m comment --comment "proxy-init/redirect-all-outgoing-to-proxy-port" -j REDIRECT --to-ports 4140',
        '-A PROXY_INIT_REDIRECT -p tcp -m multiport --dports 4190,4191 -m comment --comment "proxy-init/ignore-port-4190,4191" -j RETURN',
        '-A PROXY_INIT_REDIRECT -p tcp -m tcp --tcp-flags FIN,SYN,RST,ACK SYN -m comment --comment "proxy-init/redirect-all-incoming-to-proxy-port" -j REDIRECT --to-ports 4143',
    ]


def test_skip_inbound_ports_join_the_proxy_ports_in_one_multiport_rule():
    got = rules.inbound_rules(
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
    assert rules._multiport([PortRange(a, b) for a, b in ranges]) == groups


def test_ipv6_skip_subnets_make_no_ipv4_rules():
    got = rules.plan(spec(skip_subnets=(ipaddress.ip_network("fd00::/8"),))).rules()
    assert not any("fd00" in r.render() for r in got)


def test_parse_save_reads_chains_rules_and_counters():
    table = rules.parse_save(RECORDED)
    assert table.chains["PROXY_INIT_OUTPUT"] == "-"
    assert table.chains["PREROUTING"] == "ACCEPT"
    redirect = table.in_chain("PROXY_INIT_OUTPUT")[-1]
    assert (redirect.packets, redirect.bytes, redirect.position) == (3, 180, 5)
    assert redirect.rule is not None
    assert redirect.rule.target_options == (("to-ports", "4140"),)
    assert redirect.rule.comment == "proxy-init/redirect-all-outgoing-to-proxy-port"


@pytest.mark.parametrize(
    "line",
    [
        '-A PROXY_INIT_OUTPUT -m mark --mark 0x539 -m comment --comment "proxy-init/ignore-proxy-mark" -j RETURN',
        "-A OUTPUT ! -d 127.0.0.1/32 -p tcp -m tcp ! --dport 22 -j DNAT --to-destination 10.0.0.1:80",
        "-A PREROUTING -i eth0 -p udp -m udp --dport 53 -j REDIRECT --to-ports 5353",
        "-A POSTROUTING -s 10.0.0.0/8 -j MASQUERADE",
        "-A X -m comment --comment plain_word-1 -j RETURN",
        '-A X -m comment --comment "with \\"quotes\\" inside" -j RETURN',
    ],
)
def test_parse_rule_round_trips(line):
    parsed = rules.parse_rule(line)
    assert parsed is not None
    assert parsed.render() == line


def test_parse_rule_gives_none_for_what_it_does_not_model():
    assert rules.parse_rule("-I OUTPUT -j X") is None
    assert rules.parse_rule("-A OUTPUT -p") is None
    assert rules.parse_rule('-A OUTPUT -m comment --comment "unterminated -j X') is None


def test_reconcile_of_an_empty_table_creates_everything():
    ops = rules.reconcile(rules.plan(spec()), rules.parse_save(""))
    assert [o.kind for o in ops].count("new-chain") == 2
    appended = [o.rule.render() for o in ops if o.kind == "append" and o.rule]
    assert sorted(appended) == sorted(r.render() for r in rules.plan(spec()).rules())


def test_reconcile_of_a_matching_table_does_nothing():
    assert rules.reconcile(rules.plan(RECORDED_SPEC), rules.parse_save(RECORDED)) == []


def test_reconcile_rewrites_only_the_chain_that_differs():
    changed = spec(
        skip_inbound_ports=PortSet((PortRange(22, 22),)),
        skip_outbound_ports=RECORDED_SPEC.skip_outbound_ports,
        skip_subnets=RECORDED_SPEC.skip_subnets,
    )
    ops = rules.reconcile(rules.plan(changed), rules.parse_save(RECORDED))
    assert {o.chain for o in ops} == {"PROXY_INIT_REDIRECT"}
    assert ops[0] == rules.Op("new-chain", "PROXY_INIT_REDIRECT")


def test_reconcile_deletes_duplicate_jumps():
    dup = RECORDED.replace(
        "COMMIT",
        '[0:0] -A OUTPUT -m comment --comment "proxy-init/install-proxy-init-output" -j PROXY_INIT_OUTPUT\nCOMMIT',
        1,
    )
    ops = rules.reconcile(rules.plan(RECORDED_SPEC), rules.parse_save(dup))
    assert [(o.kind, o.chain, o.position) for o in ops] == [("delete", "OUTPUT", 2)]
    text = rules.render_ops(ops)
    assert (
        '-D OUTPUT -m comment --comment "proxy-init/install-proxy-init-output" -j PROXY_INIT_OUTPUT'
        in text
    )


def test_reconcile_replaces_a_stale_jump_with_another_comment():
    stale = RECORDED.replace(
        "install-proxy-init-prerouting", "install-proxy-init-prerouting/1673045000"
    )
    ops = rules.reconcile(rules.plan(RECORDED_SPEC), rules.parse_save(stale))
    assert [o.kind for o in ops] == ["delete", "append"]
    assert ops[1].rule == rules.jump("PREROUTING")


def test_removal_deletes_jumps_then_chains_and_nothing_else():
    foreign = RECORDED.replace("COMMIT", "[0:0] -A OUTPUT -p udp -j RETURN\nCOMMIT", 1)
    text = rules.render_ops(rules.removal(rules.parse_save(foreign)))
    assert text == (
        "*nat\n"
        '-D PREROUTING -m comment --comment "proxy-init/install-proxy-init-prerouting" -j PROXY_INIT_REDIRECT\n'
        '-D OUTPUT -m comment --comment "proxy-init/install-proxy-init-output" -j PROXY_INIT_OUTPUT\n'
        "-F PROXY_INIT_REDIRECT\n-X PROXY_INIT_REDIRECT\n"
        "-F PROXY_INIT_OUTPUT\n-X PROXY_INIT_OUTPUT\n"
        "COMMIT\n"
    )


def test_render_restore_is_one_transaction_declaring_both_chains():
    text = rules.render_restore(rules.plan(spec()))
    lines = text.splitlines()
    assert lines[:3] == ["*nat", ":PROXY_INIT_REDIRECT - [0:0]", ":PROXY_INIT_OUTPUT - [0:0]"]
    assert lines[-1] == "COMMIT"


def test_drift_names_a_deleted_rule_and_a_missing_jump():
    broken = "\n".join(
        line
        for line in RECORDED.splitlines()
        if "ignore-loopback" not in line and "install-proxy-init-prerouting" not in line
    )
    got = rules.drift(rules.plan(RECORDED_SPEC), rules.parse_save(broken))
    assert any("missing" in d and "ignore-loopback" in d for d in got)
    assert any("missing" in d and "install-proxy-init-prerouting" in d for d in got)
