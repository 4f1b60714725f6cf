"""Reconcile, removal and drift against recorded `iptables-save` output; the re-exports."""

# ruff: noqa: E501 - recorded iptables-save lines are kept whole, as the kernel prints them

from __future__ import annotations

import pytest

from agent.redirect import rules, rules_plan, rules_syntax
from agent.redirect.model import PortRange, PortSet


def test_reconcile_of_an_empty_table_creates_everything(spec):
    ops = rules.reconcile(rules.plan(spec()), rules.parse_save(""))
    assert [o.kind for o in ops].count("new-chain") == 2
    appended = [o.rule.render() for o in ops if o.kind == "append" and o.rule]
    assert sorted(appended) == sorted(r.render() for r in rules.plan(spec()).rules())


def test_reconcile_of_a_matching_table_does_nothing(recorded, recorded_spec):
    assert rules.reconcile(rules.plan(recorded_spec), rules.parse_save(recorded)) == []


def test_reconcile_rewrites_only_the_chain_that_differs(spec, recorded, recorded_spec):
    changed = spec(
        skip_inbound_ports=PortSet((PortRange(22, 22),)),
        skip_outbound_ports=recorded_spec.skip_outbound_ports,
        skip_subnets=recorded_spec.skip_subnets,
    )
    ops = rules.reconcile(rules.plan(changed), rules.parse_save(recorded))
    assert {o.chain for o in ops} == {"PROXY_INIT_REDIRECT"}
    assert ops[0] == rules.Op("new-chain", "PROXY_INIT_REDIRECT")


def test_reconcile_deletes_duplicate_jumps(recorded, recorded_spec):
    dup = recorded.replace(
        "COMMIT",
        '[0:0] -A OUTPUT -m comment --comment "proxy-init/install-proxy-init-output" -j PROXY_INIT_OUTPUT\nCOMMIT',
        1,
    )
    ops = rules.reconcile(rules.plan(recorded_spec), rules.parse_save(dup))
    assert [(o.kind, o.chain, o.position) for o in ops] == [("delete", "OUTPUT", 2)]
    text = rules.render_ops(ops)
    assert (
        '-D OUTPUT -m comment --comment "proxy-init/install-proxy-init-output" -j PROXY_INIT_OUTPUT'
        in text
    )


def test_reconcile_replaces_a_stale_jump_with_another_comment(recorded, recorded_spec):
    stale = recorded.replace(
        "install-proxy-init-prerouting", "install-proxy-init-prerouting/1673045000"
    )
    ops = rules.reconcile(rules.plan(recorded_spec), rules.parse_save(stale))
    assert [o.kind for o in ops] == ["delete", "append"]
    assert ops[1].rule == rules.jump("PREROUTING")


def test_removal_deletes_jumps_then_chains_and_nothing_else(recorded):
    foreign = recorded.replace("COMMIT", "[0:0] -A OUTPUT -p udp -j RETURN\nCOMMIT", 1)
    text = rules.render_ops(rules.removal(rules.parse_save(foreign)))
    assert text == (
        "*nat\n"
        '-D PREROUTING -m comment --comment "proxy-init/install-proxy-init-prerouting" -j PROXY_INIT_REDIRECT\n'
        '-D OUTPUT -m comment --comment "proxy-init/install-proxy-init-output" -j PROXY_INIT_OUTPUT\n'
        "-F PROXY_INIT_REDIRECT\n-X PROXY_INIT_REDIRECT\n"
        "-F PROXY_INIT_OUTPUT\n-X PROXY_INIT_OUTPUT\n"
        "COMMIT\n"
    )


def test_drift_names_a_deleted_rule_and_a_missing_jump(recorded, recorded_spec):
    broken = "\n".join(
        line
        for line in recorded.splitlines()
        if "ignore-loopback" not in line and "install-proxy-init-prerouting" not in line
    )
    got = rules.drift(rules.plan(recorded_spec), rules.parse_save(broken))
    assert any("missing" in d and "ignore-loopback" in d for d in got)
    assert any("missing" in d and "install-proxy-init-prerouting" in d for d in got)


@pytest.mark.parametrize("name", rules.__all__)
def test_every_name_in_all_is_importable_from_rules_as_the_same_object(name):
    # callers reach the plan and the parser through `rules`; the split keeps that working
    homes = [m for m in (rules, rules_plan, rules_syntax) if name in vars(m)]
    assert len({id(getattr(m, name)) for m in homes}) == 1
