"""The iptables rule plan: CaptureSpec -> the ordered nat rules that capture a pod.

Pure: no I/O. `agent.redirect.iptables` runs the shells; `agent.redirect.rules`
reconciles the plan with the kernel.

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
1. Multiport takes at most 15 port references per rule (a range counts two);
   longer lists split into several rules, as linkerd-init does.
2. Only IPv4 subnets become rules here (this is the iptables, not ip6tables,
   plan); IPv6 entries of skip-subnets are ignored.
3. `Plan.rules()` lists the rules in the order iptables-save prints them
   (jumps first, then our chains by name), so plan and kernel compare as text.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import TYPE_CHECKING

from agent.redirect.model import CaptureSpec, PortRange
from agent.redirect.rules_syntax import Match, Rule

if TYPE_CHECKING:
    from collections.abc import Iterable

REDIRECT_CHAIN = "PROXY_INIT_REDIRECT"
OUTPUT_CHAIN = "PROXY_INIT_OUTPUT"
OUR_CHAINS = (REDIRECT_CHAIN, OUTPUT_CHAIN)
JUMPS = {"PREROUTING": REDIRECT_CHAIN, "OUTPUT": OUTPUT_CHAIN}
BUILTIN_CHAINS = ("PREROUTING", "INPUT", "OUTPUT", "POSTROUTING")
MULTIPORT_LIMIT = 15
COMMENT_PREFIX = "proxy-init/"


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
