"""Every enrolled pod, in any mode, as the kernel has it: `meshagent redirects` and its flags.

The CLI and the supervisor reach these through `agent.redirect.iptables`, which
re-exports them (they lived there first); this module imports that one only
inside functions, so the re-export makes no import cycle.

Rules:
1. The registry says which pods were enrolled and how (mode, backend, writer,
   pin root); their state always comes from the kernel, through the mode's
   redirector `inspect`, never from the registry.
2. One bad pod never fails the listing: a pod whose netns is gone is "gone";
   one whose inspect fails is "unknown", with the error as its drift.
3. With `scan`, a netns under `scan_dir` that holds our chains but is not in the
   registry is listed too, with the drift "not in the registry".
4. An eBPF pod is inspected as the agent that enrolled it: under its recorded
   pin root and with its recorded acceleration setting, not this process's
   environment. `agent.redirect.ebpf` is imported only for eBPF mode.
5. The flags (--registry, --iptables-mode, --iptables-writer) go through
   `agent.config`, so each mirrors its MESHAGENT_* variable.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.errors import RedirectError, SettingError
from agent.redirect import netns
from agent.redirect.model import CaptureSpec, CaptureState, Mode
from agent.redirect.registry import REGISTRY_PATH, Enrollment, Registry


def redirector_for(
    mode: Mode, *, registry: Registry | None, iptables_mode: str = "auto", writer: str = "restore"
) -> Any:
    """The Redirector for `mode`. eBPF comes from `agent.redirect.ebpf.redirector()`.

    Raises:
        SettingError: bad iptables settings, or eBPF mode missing from this build.
    """
    if mode is Mode.IPTABLES:
        from agent.redirect.iptables import IptablesRedirector  # noqa: PLC0415 - see docstring

        return IptablesRedirector(iptables_mode=iptables_mode, writer=writer, registry=registry)
    try:
        from agent.redirect import ebpf  # noqa: PLC0415
    except ImportError:
        raise SettingError(
            "--mode", mode.value, "eBPF mode is not available in this build"
        ) from None
    return ebpf.redirector(registry=registry)


def list_enrolled(
    registry: Registry, *, scan_dir: Path = netns.NETNS_RUN_DIR, scan: bool = True
) -> list[CaptureState]:
    """Every enrolled pod as the kernel has it: registry entries, plus any netns
    under `scan_dir` holding our chains that the registry does not know."""
    states: list[CaptureState] = []
    known: set[str] = set()
    for entry in registry.load().values():
        known.add(str(entry.spec.netns))
        states.append(_inspect_entry(entry, registry))
    if not scan or not scan_dir.is_dir():
        return states
    from agent.redirect.iptables import IptablesRedirector  # noqa: PLC0415 - see docstring

    ipt = IptablesRedirector(registry=None)
    for path in sorted(scan_dir.iterdir()):
        if str(path) in known:
            continue
        spec = CaptureSpec(pod=f"?/{path.name}", netns=path, pod_ip="")
        try:
            if not ipt.backends_with_rules(spec):
                continue
            state = ipt.inspect(spec)
        except RedirectError:
            continue
        states.append(_with(state, drift=(*state.drift, "not in the registry")))
    return states


def _with(state: CaptureState, **changes: Any) -> CaptureState:
    return dataclasses.replace(state, **changes)


def _unreadable(entry: Enrollment, state: str, why: str) -> CaptureState:
    """The row of an enrolled pod whose rules cannot be read: both sides `state`."""
    spec = entry.spec
    return CaptureState(
        pod=spec.pod,
        netns=str(spec.netns),
        mode=entry.mode,
        inbound=state,
        outbound=state,
        drift=(why,),
    )


def _inspect_entry(entry: Enrollment, registry: Registry) -> CaptureState:
    spec = entry.spec
    if not Path(spec.netns).exists():
        return _unreadable(entry, "gone", "netns no longer exists")
    try:
        red = redirector_for(
            entry.mode,
            registry=registry,
            iptables_mode=entry.backend or "auto",
            writer=entry.writer or "restore",
        )
        if entry.mode is Mode.EBPF:
            red = type(red)(**_ebpf_kwargs(entry, registry))
        return red.inspect(spec)  # type: ignore[no-any-return]
    except (RedirectError, SettingError) as exc:
        return _unreadable(entry, "unknown", str(exc))


def _ebpf_kwargs(entry: Enrollment, registry: Registry) -> dict[str, Any]:
    """The eBPF redirector's settings as the enrolling agent had them (rule 4)."""
    # Inspect as the agent that enrolled the pod: under its pin root (the sandbox
    # gives each node one) and with its acceleration setting, both recorded, not
    # this process's environment.
    pin_root = entry.extra.get("pin_root")
    kwargs: dict[str, Any] = {"registry": registry}
    if pin_root:
        kwargs["pin_root"] = Path(pin_root)
    if isinstance(entry.extra.get("accelerate"), bool):
        kwargs["accelerate"] = entry.extra["accelerate"]
    return kwargs


# --- CLI settings ---------------------------------------------------------------------


def _options() -> list[Any]:
    from agent import config  # noqa: PLC0415

    return [
        config.Option(
            flag="--registry",
            parse=config.parse_path,
            default=str(REGISTRY_PATH),
            help="registry of enrolled pods",
        ),
        config.Option(
            flag="--iptables-mode",
            parse=config.choice("auto", "nft", "legacy"),
            default="auto",
            help="iptables backend (as linkerd-init's --iptables-mode)",
        ),
        config.Option(
            flag="--iptables-writer",
            parse=config.choice("restore", "iptc"),
            default="restore",
            help="rule writer: iptables-restore, or python-iptables (legacy only)",
        ),
    ]


@dataclass(frozen=True, slots=True, kw_only=True)
class RedirectSettings:
    """Flags of `meshagent redirects`."""

    registry: Registry
    iptables_mode: str
    iptables_writer: str


def add_options(parser: Any) -> None:
    """Declare --registry, --iptables-mode, --iptables-writer on an argparse parser."""
    from agent import config  # noqa: PLC0415

    config.add_options(parser, _options())


def resolve_settings(args: Any, env: Any) -> RedirectSettings:
    """Raises: SettingError."""
    from agent import config  # noqa: PLC0415

    values = config.resolve(args, env, _options())
    return RedirectSettings(
        registry=Registry(values["registry"]),
        iptables_mode=values["iptables_mode"],
        iptables_writer=values["iptables_writer"],
    )


# --- one pod ------------------------------------------------------------------------


def require(registry: Registry, pod: str) -> Enrollment:
    """The registry entry of `pod`.

    Raises:
        RedirectError: the pod is not enrolled.
    """
    entry = registry.get(pod)
    if entry is None:
        raise RedirectError(pod, "-", "lookup", f"not enrolled (registry {registry.path})")
    return entry


def state_row(state: CaptureState) -> dict[str, Any]:
    """One `redirects list` row."""
    c = state.counters
    return {
        "pod": state.pod,
        "netns": state.netns,
        "mode": state.mode.value,
        "inbound": state.inbound,
        "outbound": state.outbound,
        "skipped": state.skipped_ports,
        "in_packets": c.get("inbound_packets", 0),
        "out_packets": c.get("outbound_packets", 0),
        "in_bytes": c.get("inbound_bytes", 0),
        "out_bytes": c.get("outbound_bytes", 0),
        "backend": state.extra.get("backend", ""),
        "drift": "; ".join(state.drift),
    }


def inspect_enrolled(registry: Registry, pod: str) -> CaptureState:
    """Raises: RedirectError (not enrolled)."""
    return _inspect_entry(require(registry, pod), registry)
