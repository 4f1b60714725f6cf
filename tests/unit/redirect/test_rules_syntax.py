"""Reading `iptables-save` text back: rules round-trip, counters and chains are read."""

# ruff: noqa: E501 - recorded iptables-save lines are kept whole, as the kernel prints them

from __future__ import annotations

import pytest

from agent.redirect import rules_syntax


def test_parse_save_reads_chains_rules_and_counters(recorded):
    table = rules_syntax.parse_save(recorded)
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
    parsed = rules_syntax.parse_rule(line)
    assert parsed is not None
    assert parsed.render() == line


def test_parse_rule_gives_none_for_what_it_does_not_model():
    assert rules_syntax.parse_rule("-I OUTPUT -j X") is None
    assert rules_syntax.parse_rule("-A OUTPUT -p") is None
    assert rules_syntax.parse_rule('-A OUTPUT -m comment --comment "unterminated -j X') is None
