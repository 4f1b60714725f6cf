"""One nat rule as `iptables-save` prints it, both ways: Rule -> text, text -> Rule.

Pure: no I/O. `agent.redirect.rules_plan` builds Rules, `agent.redirect.rules`
compares them with what `parse_save` reads back from the kernel.

Rules:
1. A rule renders exactly as `iptables-save` prints it (header options in its
   fixed order -s -d -i -o -p, then matches, then target), so plan and kernel
   compare as text and table tests use recorded `iptables-save` output.
2. `parse_rule` is the inverse of `Rule.render` for the syntax modelled here;
   a line using anything else parses to None and is kept as text
   (`SavedRule.text`), never guessed at.
3. Counters (`iptables-save -c`) are read into `SavedRule`, never into the
   rule's text, so equal rules compare equal whatever their counters.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field

TABLE = "nat"  # the table capture programs

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
