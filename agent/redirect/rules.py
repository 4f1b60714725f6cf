"""Reconcile the iptables plan with the kernel: operations, removal, ours, drift.

Pure: no I/O. `agent.redirect.iptables` reads the table (`parse_save`) and
applies what this module returns. The plan is built in
`agent.redirect.rules_plan`, one rule's text is read and written in
`agent.redirect.rules_syntax`; both are re-exported here (`__all__`), so
`rules.plan`, `rules.parse_save`, `rules.Rule`, ... keep working for callers.

Rules:
1. `reconcile(plan, actual)` returns the smallest list of operations that makes
   the kernel match the plan: a chain already equal is left alone (its counters
   too), a chain that differs is rewritten whole, duplicate or stale jumps are
   deleted.
2. `removal(actual)` removes exactly what the plan adds: every jump to our
   chains, then our chains; rules of others are never touched.
3. `render_ops` writes one `iptables-restore --noflush` transaction, deleting a
   chain only after the rules that jump to it.
4. Plan and kernel compare as rendered text (`Rule.render`), never as
   counters.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from agent.redirect.rules_plan import (
    BUILTIN_CHAINS,
    COMMENT_PREFIX,
    JUMPS,
    MULTIPORT_LIMIT,
    OUR_CHAINS,
    OUTPUT_CHAIN,
    REDIRECT_CHAIN,
    SYN,
    Plan,
    inbound_rules,
    jump,
    outbound_rules,
    plan,
    render_restore,
)
from agent.redirect.rules_syntax import (
    TABLE,
    Match,
    Option,
    Rule,
    SavedRule,
    SavedTable,
    parse_rule,
    parse_save,
)

if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = [
    "BUILTIN_CHAINS",
    "COMMENT_PREFIX",
    "JUMPS",
    "MULTIPORT_LIMIT",
    "OUR_CHAINS",
    "OUTPUT_CHAIN",
    "REDIRECT_CHAIN",
    "SYN",
    "TABLE",
    "Match",
    "Op",
    "Option",
    "Plan",
    "Rule",
    "SavedRule",
    "SavedTable",
    "drift",
    "inbound_rules",
    "jump",
    "ours",
    "outbound_rules",
    "parse_rule",
    "parse_save",
    "plan",
    "reconcile",
    "removal",
    "render_ops",
    "render_restore",
]


@dataclass(frozen=True, slots=True)
class Op:
    """One change to the nat table.

    kind: "new-chain" (create or flush a chain of ours), "append" (rule),
    "delete" (rule, matched by its exact spec), "delete-chain" (flush + delete).
    """

    kind: str
    chain: str
    rule: Rule | None = None
    text: str = ""  # for "delete": the `-A` line as the kernel printed it
    position: int = 0  # for "delete": 1-based index in the chain when read


def _is_our_jump(r: SavedRule) -> bool:
    if r.chain in OUR_CHAINS:
        return False
    if r.rule is not None:
        return r.rule.target in OUR_CHAINS
    return bool(re.search(r"-j (PROXY_INIT_REDIRECT|PROXY_INIT_OUTPUT)\b", r.text))


def reconcile(p: Plan, actual: SavedTable) -> list[Op]:
    """Operations that make `actual` equal to the plan; [] when it already is."""
    ops: list[Op] = []
    for chain, want in p.chains.items():
        have = [r.text for r in actual.in_chain(chain)]
        if chain in actual.chains and have == [r.render() for r in want]:
            continue
        ops.append(Op("new-chain", chain))
        ops += [Op("append", chain, r) for r in want]
    wanted_jumps = {j.render() for j in p.jumps}
    seen: set[str] = set()
    for r in actual.rules:
        if not _is_our_jump(r):
            continue
        if r.text in wanted_jumps and r.text not in seen:
            seen.add(r.text)
            continue
        ops.append(Op("delete", r.chain, r.rule, r.text, r.position))
    ops += [Op("append", j.chain, j) for j in p.jumps if j.render() not in seen]
    return ops


def removal(actual: SavedTable) -> list[Op]:
    """Operations that remove every jump to our chains, then our chains."""
    ops = [
        Op("delete", r.chain, r.rule, r.text, r.position) for r in actual.rules if _is_our_jump(r)
    ]
    ops += [Op("delete-chain", c) for c in OUR_CHAINS if c in actual.chains]
    return ops


def render_ops(ops: Sequence[Op]) -> str:
    """Operations as one `iptables-restore --noflush` transaction."""
    lines = ["*nat"]
    lines += [f":{op.chain} - [0:0]" for op in ops if op.kind == "new-chain"]
    for op in ops:
        if op.kind == "delete":
            text = op.rule.render() if op.rule is not None else op.text
            lines.append("-D" + text[2:])
    for op in ops:
        if op.kind == "append" and op.rule is not None:
            lines.append(op.rule.render())
    # A chain is deleted after the rules that jump to it are gone.
    for op in ops:
        if op.kind == "delete-chain":
            lines += [f"-F {op.chain}", f"-X {op.chain}"]
    lines.append("COMMIT")
    return "\n".join(lines) + "\n"


def ours(actual: SavedTable) -> list[str]:
    """Every rule and chain of ours present in `actual` (empty after removal)."""
    found = [f":{c}" for c in OUR_CHAINS if c in actual.chains]
    found += [r.text for r in actual.rules if r.chain in OUR_CHAINS or _is_our_jump(r)]
    return found


def drift(p: Plan, actual: SavedTable) -> list[str]:
    """Human-readable differences between plan and kernel ([] when equal)."""
    out: list[str] = []
    for chain, want in p.chains.items():
        if chain not in actual.chains:
            out.append(f"chain {chain} missing")
            continue
        have = [r.text for r in actual.in_chain(chain)]
        want_text = [r.render() for r in want]
        out += [f"missing: {t}" for t in want_text if t not in have]
        out += [f"unexpected: {t}" for t in have if t not in want_text]
        if not out and have != want_text:
            out.append(f"chain {chain} rules out of order")
    for j in p.jumps:
        n = sum(1 for r in actual.rules if r.text == j.render())
        if n == 0:
            out.append(f"missing: {j.render()}")
        elif n > 1:
            out.append(f"duplicate x{n}: {j.render()}")
    return out
