"""Pure: what `iptables-save` text says about the host's backend and a pod's capture.

`agent.redirect.iptables_backend` runs the commands that print this text and
`agent.redirect.iptables` acts on the answers; nothing here runs anything.

Rules:
1. No I/O: text in, values out. The plain `iptables` command's backend is an
   argument (`default`), read by the shell.
2. The backend choice follows linkerd-init's `--iptables-mode auto`: kubelet
   canary chains first (nft, then legacy), then whichever backend holds more
   host rules, then `default` (linkerd-init picks legacy there; we follow the
   host's own `iptables`), and legacy when even that is unknown.
3. A pod's state comes from `iptables-save -c` of its netns against
   `rules.plan(spec)`, per direction: "captured" (jump and chain exactly as
   planned), "drift" (both there, the chain differs), "partial" (some of it),
   "missing" (none of it). Counters are the packets and bytes of our REDIRECT
   rules and the packets of our RETURN rules.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from agent.redirect import rules
from agent.redirect.model import CaptureSpec, CaptureState, Mode


class Backend(enum.Enum):
    """Where iptables rules live in the kernel."""

    NFT = "nft"
    LEGACY = "legacy"


# --- backend detection --------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Detection:
    """Which backend the host uses, and why."""

    backend: Backend
    reason: str


def _has_kube_chains(text: str) -> bool:
    return "KUBE-IPTABLES-HINT" in text or "KUBE-KUBELET-CANARY" in text


def _count_rules(text: str) -> int:
    return sum(1 for line in text.splitlines() if line.startswith(("-", "[")))


def choose_backend(*, nft_save: str, legacy_save: str, default: Backend | None = None) -> Detection:
    """Pure: pick the host's backend from both backends' full iptables-save output."""
    if _has_kube_chains(nft_save):
        return Detection(backend=Backend.NFT, reason="kubelet canary chains in nft mangle table")
    if _has_kube_chains(legacy_save):
        return Detection(backend=Backend.LEGACY, reason="kubelet canary chains in legacy tables")
    n_nft, n_legacy = _count_rules(nft_save), _count_rules(legacy_save)
    if n_nft != n_legacy:
        backend = Backend.NFT if n_nft > n_legacy else Backend.LEGACY
        return Detection(
            backend=backend,
            reason=f"more host rules in {backend.value} ({n_nft} nft, {n_legacy} legacy)",
        )
    if default is not None:
        return Detection(
            backend=default, reason=f"no host rules in either; `iptables` is {default.value}"
        )
    return Detection(backend=Backend.LEGACY, reason="no host rules in either; legacy by default")


# --- a pod's capture state ---------------------------------------------------------


def state_from_save(
    spec: CaptureSpec, text: str, *, backend: Backend, mixed: bool = False
) -> CaptureState:
    """Pure: a CaptureState from `iptables-save -c` text of the pod's netns."""
    table = rules.parse_save(text)
    want = rules.plan(spec)
    drift = rules.drift(want, table)
    if mixed:
        drift.append("rules present in both nft and legacy backends")
    counters: dict[str, int] = {}
    states = {}
    for direction, builtin, chain in (
        ("inbound", "PREROUTING", rules.REDIRECT_CHAIN),
        ("outbound", "OUTPUT", rules.OUTPUT_CHAIN),
    ):
        states[direction] = _direction_state(table, want, builtin, chain)
        counters |= _direction_counters(table, direction, chain)
    return CaptureState(
        pod=spec.pod,
        netns=str(spec.netns),
        mode=Mode.IPTABLES,
        inbound=states["inbound"],
        outbound=states["outbound"],
        skipped_ports=spec.skipped_text(accel=False),
        counters=counters,
        detail=nat_section(text),
        drift=tuple(drift),
        extra={"backend": backend.value},
    )


def _direction_state(table: rules.SavedTable, want: rules.Plan, builtin: str, chain: str) -> str:
    """captured, drift, partial or missing: `chain` and the jump to it from `builtin`."""
    jump = rules.jump(builtin).render()
    has_jump = any(r.text == jump for r in table.rules)
    chain_rules = table.in_chain(chain)
    planned = [r.render() for r in want.chains[chain]]
    if chain not in table.chains or not has_jump:
        return "missing" if not chain_rules and not has_jump else "partial"
    if [r.text for r in chain_rules] == planned:
        return "captured"
    return "drift"


def _direction_counters(table: rules.SavedTable, direction: str, chain: str) -> dict[str, int]:
    """Packets and bytes our REDIRECT rules in `chain` took, packets its RETURN rules skipped."""
    chain_rules = table.in_chain(chain)
    redirect = [r for r in chain_rules if r.rule is not None and r.rule.target == "REDIRECT"]
    skipped = [r for r in chain_rules if r.rule is not None and r.rule.target == "RETURN"]
    return {
        f"{direction}_packets": sum(r.packets for r in redirect),
        f"{direction}_bytes": sum(r.bytes for r in redirect),
        f"{direction}_skipped_packets": sum(r.packets for r in skipped),
    }


def nat_section(text: str) -> str:
    """The `*nat` ... `COMMIT` part of iptables-save output, as printed."""
    out: list[str] = []
    inside = False
    for line in text.splitlines():
        if line.startswith("*"):
            inside = line == "*nat"
        if inside:
            out.append(line)
            if line == "COMMIT":
                inside = False
    return "\n".join(out)
