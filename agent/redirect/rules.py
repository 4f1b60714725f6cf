"""The iptables rule plan: CaptureSpec -> ordered nat rules, and back from iptables-save.

Pure: no I/O. `agent.redirect.iptables` runs the shells.

The plan is what linkerd-init programs (linkerd2-proxy-init `pkg/iptables`),
with its chain names and `proxy-init/...` comments, so tools and people who
know Linkerd read it unchanged:

    nat PREROUTING -> PROXY_INIT_REDIRECT
        RETURN  tcp to the proxy's own ports (4190, 4191) and skip-inbound-ports
        RETURN  from each skip-subnet
        REDIRECT every other tcp to the inbound port (4143)
    nat OUTPUT -> PROXY_INIT_OUTPUT
        RETURN  sockets carrying PROXY_MARK (the proxy's own; Linkerd uses a UID,
                but the node proxy runs as root in the host)
        RETURN  out via lo
        RETURN  tcp to skip-outbound-ports
        RETURN  to each skip-subnet
        REDIRECT every other tcp to the outbound port (4140)

Rules:
1. A rule renders exactly as `iptables-save` prints it (header options in its
   fixed order -s -d -i -o -p, then matches, then target), so plan and kernel
   compare as text and table tests use recorded `iptables-save` output.
2. Multiport takes at most 15 port references per rule (a range counts two);
   longer lists split into several rules, as linkerd-init does.
3. Only IPv4 subnets become rules here (this is the iptables, not ip6tables,
   plan); IPv6 entries of skip-subnets are ignored.
4. `reconcile(plan, actual)` returns the smallest list of operations that makes
   the kernel match the plan: a chain already equal is left alone (its counters
   too), a chain that differs is rewritten whole, duplicate or stale jumps are
   deleted. `removal(actual)` removes exactly what the plan adds.
"""

from __future__ import annotations

import ipaddress
import re
import shlex
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from agent.redirect.model import CaptureSpec, PortRange

if TYPE_CHECKING:
    from collections.abc import Iterable, Sequence

TABLE = "nat"
REDIRECT_CHAIN = "PROXY_INIT_REDIRECT"
OUTPUT_CHAIN = "PROXY_INIT_OUTPUT"
OUR_CHAINS = (REDIRECT_CHAIN, OUTPUT_CHAIN)
JUMPS = {"PREROUTING": REDIRECT_CHAIN, "OUTPUT": OUTPUT_CHAIN}
BUILTIN_CHAINS = ("PREROUTING", "INPUT", "OUTPUT", "POSTROUTING")
MULTIPORT_LIMIT = 15
COMMENT_PREFIX = "proxy-init/"

Option = tuple[str, str]  # ("dports", "22,80"); a key starting "!" is negated


@dataclass(frozen=True, slots=True, kw_only=True)
class Match:
    """`-m NAME --opt value ...`."""

    name: str
    options: tuple[Option, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class Rule:
    """One rule of the nat table, in the shape iptables-save prints it."""

    chain: str
    target: str
    source: str = ""
    destination: str = ""
    in_interface: str = ""
    out_interface: str = ""
    protocol: str = ""
    matches: tuple[Match, ...] = ()
    target_options: tuple[Option, ...] = ()

    @property
    def comment(self) -> str:
        for m in self.matches:
            if m.name == "comment":
                return dict(m.options).get("comment", "")
        return ""

    def spec(self) -> str:
        """The rule without `-A CHAIN`: what follows the chain in iptables-save."""
        parts: list[str] = []
        for flag, value in (
            ("-s", self.source),
            ("-d", self.destination),
            ("-i", self.in_interface),
            ("-o", self.out_interface),
            ("-p", self.protocol),
        ):
            if value:
                parts += _negatable(flag, value)
        for m in self.matches:
            parts += ["-m", m.name]
            for key, value in m.options:
                parts += _option(key, value)
        parts += ["-j", self.target]
        for key, value in self.target_options:
            parts += _option(key, value)
        return " ".join(parts)

    def render(self) -> str:
        """`-A CHAIN ...` exactly as iptables-save prints it."""
        return f"-A {self.chain} {self.spec()}"


def _negatable(flag: str, value: str) -> list[str]:
    if value.startswith("!"):
        return ["!", flag, value[1:]]
    return [flag, value]


_NO_QUOTE = frozenset("_-0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")


def _save_string(value: str) -> str:
    """Quote a string as iptables-save does (xtables_save_string)."""
    if value and all(c in _NO_QUOTE for c in value):
        return value
    return '"' + "".join("\\" + c if c in "\"\\'" else c for c in value) + '"'


def _option(key: str, value: str) -> list[str]:
    neg = key.startswith("!")
    name = key.removeprefix("!")
    if name == "comment":
        value = _save_string(value)
    out = ["!"] if neg else []
    out.append(f"--{name}")
    if value:
        out.append(value)
    return out


# --- the plan ------------------------------------------------------------------


def _comment(text: str) -> Match:
    return Match(name="comment", options=(("comment", COMMENT_PREFIX + text),))


def _multiport(ranges: Iterable[PortRange]) -> list[list[str]]:
    """Destinations grouped so that each group has at most 15 port references."""
    groups: list[list[str]] = []
    current: list[str] = []
    used = 0
    for r in ranges:
        cost = 1 if r.first == r.last else 2
        if current and used + cost > MULTIPORT_LIMIT:
            groups.append(current)
            current, used = [], 0
        current.append(str(r.first) if r.first == r.last else f"{r.first}:{r.last}")
        used += cost
    if current:
        groups.append(current)
    return groups


def _ignore_ports(chain: str, ranges: Iterable[PortRange]) -> list[Rule]:
    return [
        Rule(
            chain=chain,
            protocol="tcp",
            matches=(
                Match(name="multiport", options=(("dports", ",".join(group)),)),
                _comment("ignore-port-" + ",".join(group)),
            ),
            target="RETURN",
        )
        for group in _multiport(ranges)
    ]


def _v4_subnets(spec: CaptureSpec) -> list[str]:
    return [s.with_prefixlen for s in spec.skip_subnets if isinstance(s, ipaddress.IPv4Network)]


# `--syn`: only a connection's first packet is redirected. A pod enrolled while
# running may have connections conntrack never saw (no nat rule existed, so the
# netns did not track); their next packet would be picked up mid-stream as a
# new connection and redirected, breaking it. Matching SYN leaves them alone.
SYN = Match(name="tcp", options=(("tcp-flags", "FIN,SYN,RST,ACK SYN"),))


def _redirect(chain: str, port: int, what: str) -> Rule:
    return Rule(
        chain=chain,
        protocol="tcp",
        matches=(SYN, _comment(f"redirect-all-{what}-to-proxy-port")),
        target="REDIRECT",
        target_options=(("to-ports", str(port)),),
    )


def jump(builtin: str) -> Rule:
    """The rule that sends `builtin` (PREROUTING or OUTPUT) into our chain."""
    ours = JUMPS[builtin]
    name = "prerouting" if builtin == "PREROUTING" else "output"
    return Rule(chain=builtin, matches=(_comment(f"install-proxy-init-{name}"),), target=ours)


def inbound_rules(spec: CaptureSpec) -> list[Rule]:
    """PROXY_INIT_REDIRECT, in order."""
    proxy = [PortRange(p, p) for p in spec.proxy_ports]
    rules = _ignore_ports(REDIRECT_CHAIN, [*proxy, *spec.skip_inbound_ports.ranges])
    rules += [
        Rule(
            chain=REDIRECT_CHAIN,
            source=cidr,
            matches=(_comment(f"ignore-subnet-{cidr}"),),
            target="RETURN",
        )
        for cidr in _v4_subnets(spec)
    ]
    rules.append(_redirect(REDIRECT_CHAIN, spec.inbound_port, "incoming"))
    return rules


def outbound_rules(spec: CaptureSpec) -> list[Rule]:
    """PROXY_INIT_OUTPUT, in order."""
    rules = [
        Rule(
            chain=OUTPUT_CHAIN,
            matches=(
                Match(name="mark", options=(("mark", hex(spec.mark)),)),
                _comment("ignore-proxy-mark"),
            ),
            target="RETURN",
        ),
        Rule(
            chain=OUTPUT_CHAIN,
            out_interface="lo",
            matches=(_comment("ignore-loopback"),),
            target="RETURN",
        ),
    ]
    rules += _ignore_ports(OUTPUT_CHAIN, spec.skip_outbound_ports.ranges)
    rules += [
        Rule(
            chain=OUTPUT_CHAIN,
            destination=cidr,
            matches=(_comment(f"ignore-subnet-{cidr}"),),
            target="RETURN",
        )
        for cidr in _v4_subnets(spec)
    ]
    rules.append(_redirect(OUTPUT_CHAIN, spec.outbound_port, "outgoing"))
    return rules


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    """Everything capture adds to a pod's nat table."""

    chains: dict[str, tuple[Rule, ...]]  # our chain -> its rules, in order
    jumps: tuple[Rule, ...]  # one per built-in chain

    def rules(self) -> list[Rule]:
        """Jumps first, then our chains' rules by chain name, as iptables-save lists them."""
        return [*self.jumps, *(r for c in sorted(OUR_CHAINS) for r in self.chains[c])]


def plan(spec: CaptureSpec) -> Plan:
    """The ordered rules that capture `spec`'s pod."""
    return Plan(
        chains={
            REDIRECT_CHAIN: tuple(inbound_rules(spec)),
            OUTPUT_CHAIN: tuple(outbound_rules(spec)),
        },
        jumps=(jump("PREROUTING"), jump("OUTPUT")),
    )


def render_restore(p: Plan) -> str:
    """The plan as one `iptables-restore --noflush` transaction (fresh netns)."""
    lines = ["*nat", *(f":{c} - [0:0]" for c in OUR_CHAINS)]
    lines += [r.render() for r in p.rules()]
    lines.append("COMMIT")
    return "\n".join(lines) + "\n"


# --- reading iptables-save back -------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class SavedRule:
    """A rule as iptables-save printed it, with counters if `-c` was given."""

    rule: Rule | None  # None when the line uses syntax we do not model
    chain: str
    text: str  # `-A CHAIN ...` as printed (counters stripped)
    packets: int = 0
    bytes: int = 0
    position: int = 0  # 1-based index within its chain


@dataclass(frozen=True, slots=True, kw_only=True)
class SavedTable:
    """One table of iptables-save output."""

    name: str
    chains: dict[str, str] = field(default_factory=dict)  # chain -> policy ("-" if user)
    rules: tuple[SavedRule, ...] = ()

    def in_chain(self, chain: str) -> list[SavedRule]:
        return [r for r in self.rules if r.chain == chain]


_COUNTERS = re.compile(r"^\[(\d+):(\d+)\]\s+")


def parse_save(text: str, table: str = TABLE) -> SavedTable:
    """The `table` section of `iptables-save [-c]` output (empty if absent)."""
    current = ""
    chains: dict[str, str] = {}
    rules: list[SavedRule] = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("*"):
            current = line[1:]
            continue
        if current != table or line == "COMMIT":
            continue
        if line.startswith(":"):
            name, policy, *_ = line[1:].split()
            chains[name] = policy
            continue
        packets = nbytes = 0
        m = _COUNTERS.match(line)
        if m:
            packets, nbytes = int(m.group(1)), int(m.group(2))
            line = line[m.end() :]
        if line.startswith("-A "):
            rule = parse_rule(line)
            chain = line.split()[1]
            text_ = rule.render() if rule is not None else line
            position = sum(1 for r in rules if r.chain == chain) + 1
            rules.append(
                SavedRule(
                    rule=rule,
                    chain=chain,
                    text=text_,
                    packets=packets,
                    bytes=nbytes,
                    position=position,
                )
            )
    return SavedTable(name=table, chains=chains, rules=tuple(rules))


_HEADER = {
    "-s": "source",
    "-d": "destination",
    "-i": "in_interface",
    "-o": "out_interface",
    "-p": "protocol",
}


def parse_rule(line: str) -> Rule | None:  # noqa: C901 - one pass over the tokens
    """`-A CHAIN ...` -> Rule, or None if the line uses syntax we do not model."""
    try:
        tokens = shlex.split(line)
    except ValueError:
        return None
    if len(tokens) < 2 or tokens[0] != "-A":
        return None
    fields: dict[str, str] = {}
    matches: list[tuple[str, list[Option]]] = []
    jump_: list[tuple[str, list[Option]]] = []
    current: list[Option] | None = None  # options of the last -m or -j
    i, neg = 2, False
    while i < len(tokens):
        tok, nxt = tokens[i], tokens[i + 1] if i + 1 < len(tokens) else None
        if tok == "!":
            neg, i = True, i + 1
            continue
        if nxt is None and not tok.startswith("--"):
            return None
        if tok in _HEADER and nxt is not None:
            fields[_HEADER[tok]] = ("!" if neg else "") + nxt
            current, i = None, i + 2
        elif tok in ("-m", "--match", "-j", "--jump") and nxt is not None:
            current = []
            (jump_ if tok in ("-j", "--jump") else matches).append((nxt, current))
            i += 2
        elif tok.startswith("--") and current is not None:
            j = i + 1
            while j < len(tokens) and not _is_flag(tokens[j]):
                j += 1  # a value may be several words: --tcp-flags FIN,SYN,RST,ACK SYN
            current.append((("!" if neg else "") + tok[2:], " ".join(tokens[i + 1 : j])))
            i = j
        else:
            return None
        neg = False
    if len(jump_) != 1:
        return None
    return Rule(
        chain=tokens[1],
        target=jump_[0][0],
        matches=tuple(Match(name=n, options=tuple(o)) for n, o in matches),
        target_options=tuple(jump_[0][1]),
        **fields,
    )


def _is_flag(word: str) -> bool:
    return word == "!" or (word.startswith("-") and not word[1:2].isdigit())


# --- reconcile ---------------------------------------------------------------------


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
