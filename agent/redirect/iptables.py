"""iptables capture mode: the shell around `agent.redirect.rules`.

Rules:
1. One plan, two writers: `iptables-restore --noflush` (nft or legacy; the whole
   change is one atomic transaction) and python-iptables (`iptc`, libiptc, legacy
   tables only; one table commit). iptc acts on the calling thread's netns, so it
   runs inside `netns.run_in`.
2. The backend (nft or legacy) is chosen as linkerd-init's `--iptables-mode`
   does, `auto` by default: kubelet canary chains in the host's mangle table
   first, then whichever backend holds more host rules; on a tie (a bare host)
   whichever backend the plain `iptables` command is (linkerd-init picks legacy
   there; we follow the host's own default instead).
3. Never mix backends in one netns: with `auto`, a pod whose rules already live
   in one backend stays there; enrolling in a backend removes ours from the other.
4. enroll = read the kernel, `rules.reconcile`, write only the difference, read
   back and compare: twice leaves the same rules, a restarted agent adds no
   duplicates, unchanged chains keep their counters. NAT applies to new
   connections only, so established ones are never reset.
5. unenroll removes exactly the jumps and chains the plan adds, in every backend.
6. inspect reads `iptables-save -c` of the pod's netns: state, counters, drift.
"""

from __future__ import annotations

import enum
import logging
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from agent.errors import RedirectError, SettingError
from agent.redirect import netns, rules
from agent.redirect.model import CaptureSpec, CaptureState, Mode
from agent.redirect.registry import REGISTRY_PATH, Enrollment, Registry

if TYPE_CHECKING:
    from collections.abc import Sequence

logger = logging.getLogger(__name__)

TIMEOUT = 20.0


class Backend(enum.Enum):
    """Where iptables rules live in the kernel."""

    NFT = "nft"
    LEGACY = "legacy"


class WriterKind(enum.Enum):
    """How rules are written."""

    RESTORE = "restore"  # iptables-restore --noflush
    IPTC = "iptc"  # python-iptables (legacy only)


def binary(backend: Backend, tool: str) -> str:
    """`iptables-<backend>-<tool>`, else `iptables-<tool>` (as linkerd-init looks them up)."""
    for name in (f"iptables-{backend.value}-{tool}", f"iptables-{tool}"):
        if shutil.which(name):
            return name
    raise RedirectError("-", "-", f"iptables-{backend.value}-{tool}", "not found on PATH")


def available_backends() -> tuple[Backend, ...]:
    """Backends whose save and restore binaries exist."""
    return tuple(
        b
        for b in Backend
        if shutil.which(f"iptables-{b.value}-save") and shutil.which(f"iptables-{b.value}-restore")
    )


def _run(argv: list[str], *, pod: str, ns: str, input_: str | None = None) -> str:
    try:
        done = subprocess.run(
            argv, input=input_, capture_output=True, text=True, timeout=TIMEOUT, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise RedirectError(pod, ns, argv, str(exc)) from exc
    if done.returncode != 0:
        detail = done.stderr or done.stdout
        if input_:
            detail += "\n--- input ---\n" + input_
        raise RedirectError(pod, ns, argv, detail)
    return done.stdout


def save(
    ns_path: str | Path | None, backend: Backend, *, counters: bool = False, pod: str = "-"
) -> str:
    """`iptables-<backend>-save [-c]` in a netns (None: this process's netns).

    Only tables already present are printed, so reading creates nothing.

    Raises:
        RedirectError: the command failed.
    """
    argv = [binary(backend, "save"), *(["-c"] if counters else [])]
    if ns_path is not None:
        argv = [*netns.exec_argv(ns_path), *argv]
    return _run(argv, pod=pod, ns=str(ns_path or "host"))


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


def plain_iptables_backend() -> Backend | None:
    """What the plain `iptables` command is (`iptables -V` says nf_tables or legacy)."""
    try:
        out = subprocess.run(
            ["iptables", "-V"], capture_output=True, text=True, timeout=5, check=False
        ).stdout
    except OSError:
        return None
    if "nf_tables" in out:
        return Backend.NFT
    if "legacy" in out:
        return Backend.LEGACY
    return None


def detect_backend(requested: str = "auto") -> Detection:
    """The backend to use on this host (`requested`: auto, nft or legacy).

    Raises:
        SettingError: `requested` is not auto/nft/legacy.
        RedirectError: no iptables backend is installed.
    """
    if requested != "auto":
        try:
            return Detection(backend=Backend(requested), reason="requested")
        except ValueError:
            raise SettingError(
                "--iptables-mode", requested, "must be auto, nft or legacy"
            ) from None
    have = available_backends()
    if not have:
        raise RedirectError("-", "host", "iptables-*-save", "no iptables backend installed")
    if len(have) == 1:
        return Detection(backend=have[0], reason=f"only {have[0].value} is installed")
    texts = {b: _safe_save(b) for b in have}
    return choose_backend(
        nft_save=texts[Backend.NFT],
        legacy_save=texts[Backend.LEGACY],
        default=plain_iptables_backend(),
    )


def _safe_save(backend: Backend) -> str:
    try:
        return save(None, backend)
    except RedirectError:
        return ""


# --- writers ----------------------------------------------------------------------


class Writer(Protocol):
    """Applies `rules.Op`s to one netns in one backend."""

    backend: Backend
    kind: WriterKind

    def apply(self, spec: CaptureSpec, ops: Sequence[rules.Op]) -> None: ...


class RestoreWriter:
    """`iptables-restore --noflush`: all ops in one atomic transaction."""

    kind = WriterKind.RESTORE

    def __init__(self, backend: Backend) -> None:
        self.backend = backend

    def apply(self, spec: CaptureSpec, ops: Sequence[rules.Op]) -> None:
        """Raises: RedirectError."""
        argv = [
            *netns.exec_argv(spec.netns),
            binary(self.backend, "restore"),
            "--noflush",
            "-w",
            "5",
        ]
        _run(argv, pod=spec.pod, ns=str(spec.netns), input_=rules.render_ops(ops))


class IptcWriter:
    """python-iptables (libiptc): legacy tables, one commit, inside the netns."""

    kind = WriterKind.IPTC
    backend = Backend.LEGACY

    def apply(self, spec: CaptureSpec, ops: Sequence[rules.Op]) -> None:
        """Raises: RedirectError."""
        try:
            netns.run_in(spec.netns, lambda: _iptc_apply(ops))
        except Exception as exc:  # iptc raises IPTCError, ValueError, ctypes errors
            if isinstance(exc, RedirectError):
                raise
            raise RedirectError(spec.pod, str(spec.netns), "iptc", str(exc)) from exc


def _iptc_rule(iptc: Any, rule: rules.Rule) -> Any:
    r = iptc.Rule()
    for attr, value in (
        ("src", rule.source),
        ("dst", rule.destination),
        ("in_interface", rule.in_interface),
        ("out_interface", rule.out_interface),
        ("protocol", rule.protocol),
    ):
        if value:
            setattr(r, attr, value)
    for m in rule.matches:
        match = r.create_match(m.name)
        for key, value in m.options:
            neg = key.startswith("!")
            words = value.split(" ") if key != "comment" else [value]
            words[0] = ("!" if neg else "") + words[0]
            match.set_parameter(key.removeprefix("!"), words if len(words) > 1 else words[0])
    target = r.create_target(rule.target)
    for key, value in rule.target_options:
        target.set_parameter(key, value)
    return r


def _iptc_apply(ops: Sequence[rules.Op]) -> None:
    import iptc  # noqa: PLC0415 - loads libiptc; only this writer needs it

    table = iptc.Table(iptc.Table.NAT, autocommit=False)
    table.refresh()  # a fresh libiptc handle, in this thread's netns
    try:
        for op in ops:
            if op.kind == "new-chain":
                if table.is_chain(op.chain):
                    table.flush_entries(op.chain)
                else:
                    table.create_chain(op.chain)
        # Delete by position, highest first, so earlier positions stay valid.
        deletes = sorted((op for op in ops if op.kind == "delete"), key=lambda o: -o.position)
        for op in deletes:
            chain = iptc.Chain(table, op.chain)
            kernel_rules = chain.rules
            victim = kernel_rules[op.position - 1]
            chain.delete_rule(victim)
        for op in ops:
            if op.kind == "append" and op.rule is not None:
                iptc.Chain(table, op.chain).append_rule(_iptc_rule(iptc, op.rule))
        for op in ops:
            if op.kind == "delete-chain":
                table.flush_entries(op.chain)
                table.delete_chain(op.chain)
        table.commit()
    finally:
        table.close()


# --- the redirector ------------------------------------------------------------------


class IptablesRedirector:
    """The iptables capture mode (the default), as linkerd-init programs it."""

    mode = Mode.IPTABLES

    def __init__(
        self,
        *,
        iptables_mode: str = "auto",
        writer: str = "restore",
        registry: Registry | None = None,
    ) -> None:
        """`iptables_mode`: auto|nft|legacy; `writer`: restore|iptc.

        Raises:
            SettingError: a bad value, or iptc with nft.
        """
        try:
            self.writer_kind = WriterKind(writer)
        except ValueError:
            raise SettingError("--iptables-writer", writer, "must be restore or iptc") from None
        if iptables_mode not in ("auto", "nft", "legacy"):
            raise SettingError("--iptables-mode", iptables_mode, "must be auto, nft or legacy")
        if self.writer_kind is WriterKind.IPTC and iptables_mode == "nft":
            raise SettingError("--iptables-writer", writer, "iptc writes legacy tables only")
        self.requested = "legacy" if self.writer_kind is WriterKind.IPTC else iptables_mode
        self.registry = registry
        self._detected: Detection | None = None

    def detection(self) -> Detection:
        """The host backend (detected once per redirector)."""
        if self._detected is None:
            self._detected = detect_backend(self.requested)
        return self._detected

    def writer(self, backend: Backend) -> Writer:
        if self.writer_kind is WriterKind.IPTC and backend is Backend.LEGACY:
            return IptcWriter()
        return RestoreWriter(backend)

    def read(
        self, spec: CaptureSpec, backend: Backend, *, counters: bool = False
    ) -> rules.SavedTable:
        """The pod's nat table in `backend`, as the kernel has it."""
        return rules.parse_save(save(spec.netns, backend, counters=counters, pod=spec.pod))

    def backends_with_rules(self, spec: CaptureSpec) -> list[Backend]:
        """Backends that hold any of our chains or jumps in the pod's netns."""
        return [b for b in available_backends() if rules.ours(self.read(spec, b))]

    def backend_for(self, spec: CaptureSpec) -> Backend:
        """Where this pod's rules go: where they already are (auto), else the host's."""
        existing = self.backends_with_rules(spec)
        if self.requested == "auto" and len(existing) == 1:
            return existing[0]
        return self.detection().backend

    def enroll(self, spec: CaptureSpec) -> None:
        """Program (or reconcile) the pod's capture; idempotent.

        Raises:
            RedirectError: a command failed, or the kernel does not match the plan after.
        """
        backend = self.backend_for(spec)
        for other in self.backends_with_rules(spec):
            if other is not backend:
                logger.info(
                    "removing rules from other backend",
                    extra={"pod": spec.pod, "backend": other.value},
                )
                self._remove(spec, other)
        want = rules.plan(spec)
        ops = rules.reconcile(want, self.read(spec, backend))
        if ops:
            self.writer(backend).apply(spec, ops)
        left = rules.drift(want, self.read(spec, backend))
        if left:
            raise RedirectError(spec.pod, str(spec.netns), "verify", "; ".join(left))
        logger.info(
            "pod enrolled" if ops else "pod already enrolled",
            extra={"pod": spec.pod, "backend": backend.value, "changes": len(ops)},
        )
        if self.registry is not None:
            self.registry.put(
                Enrollment(
                    spec=spec,
                    mode=self.mode,
                    backend=backend.value,
                    writer=self.writer(backend).kind.value,
                )
            )

    def _remove(self, spec: CaptureSpec, backend: Backend) -> int:
        ops = rules.removal(self.read(spec, backend))
        if ops:
            self.writer(backend).apply(spec, ops)
        return len(ops)

    def unenroll(self, spec: CaptureSpec) -> None:
        """Remove exactly what enroll added, in every backend.

        Raises:
            RedirectError: a command failed.
        """
        if Path(spec.netns).exists():
            for backend in self.backends_with_rules(spec):
                self._remove(spec, backend)
        if self.registry is not None:
            self.registry.remove(spec.pod)
        logger.info("pod unenrolled", extra={"pod": spec.pod})

    def inspect(self, spec: CaptureSpec) -> CaptureState:
        """The pod's capture as the kernel has it, with counters and drift.

        Raises:
            RedirectError: the netns cannot be read.
        """
        existing = self.backends_with_rules(spec)
        backend = existing[0] if existing else self.backend_for(spec)
        text = save(spec.netns, backend, counters=True, pod=spec.pod)
        return state_from_save(spec, text, backend=backend, mixed=len(existing) > 1)


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
        jump = rules.jump(builtin).render()
        has_jump = any(r.text == jump for r in table.rules)
        chain_rules = table.in_chain(chain)
        planned = [r.render() for r in want.chains[chain]]
        if chain not in table.chains or not has_jump:
            states[direction] = "missing" if not chain_rules and not has_jump else "partial"
        elif [r.text for r in chain_rules] == planned:
            states[direction] = "captured"
        else:
            states[direction] = "drift"
        redirect = [r for r in chain_rules if r.rule is not None and r.rule.target == "REDIRECT"]
        skipped = [r for r in chain_rules if r.rule is not None and r.rule.target == "RETURN"]
        counters[f"{direction}_packets"] = sum(r.packets for r in redirect)
        counters[f"{direction}_bytes"] = sum(r.bytes for r in redirect)
        counters[f"{direction}_skipped_packets"] = sum(r.packets for r in skipped)
    skipped_ports = []
    inbound_skip = ",".join(
        [str(p) for p in spec.proxy_ports] + [str(r) for r in spec.skip_inbound_ports.ranges]
    )
    skipped_ports.append(f"in:{inbound_skip}")
    if spec.skip_outbound_ports:
        skipped_ports.append(f"out:{spec.skip_outbound_ports}")
    if spec.skip_subnets:
        skipped_ports.append("subnets:" + ",".join(str(s) for s in spec.skip_subnets))
    return CaptureState(
        pod=spec.pod,
        netns=str(spec.netns),
        mode=Mode.IPTABLES,
        inbound=states["inbound"],
        outbound=states["outbound"],
        skipped_ports=" ".join(skipped_ports),
        counters=counters,
        detail=nat_section(text),
        drift=tuple(drift),
        extra={"backend": backend.value},
    )


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


# --- listing (for `meshagent redirects`) ---------------------------------------------


def redirector_for(
    mode: Mode, *, registry: Registry | None, iptables_mode: str = "auto", writer: str = "restore"
) -> Any:
    """The Redirector for `mode`. eBPF comes from `agent.redirect.ebpf.redirector()`.

    Raises:
        SettingError: bad iptables settings, or eBPF mode missing from this build.
    """
    if mode is Mode.IPTABLES:
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
    import dataclasses  # noqa: PLC0415

    return dataclasses.replace(state, **changes)


def _inspect_entry(entry: Enrollment, registry: Registry) -> CaptureState:
    spec = entry.spec
    if not Path(spec.netns).exists():
        return CaptureState(
            pod=spec.pod,
            netns=str(spec.netns),
            mode=entry.mode,
            inbound="gone",
            outbound="gone",
            drift=("netns no longer exists",),
        )
    try:
        red = redirector_for(
            entry.mode,
            registry=registry,
            iptables_mode=entry.backend or "auto",
            writer=entry.writer or "restore",
        )
        if entry.mode is Mode.EBPF:
            # Inspect as the agent that enrolled the pod: under its pin root (the sandbox
            # gives each node one) and with its acceleration setting, both recorded, not
            # this process's environment.
            pin_root = entry.extra.get("pin_root")
            kwargs: dict[str, Any] = {"registry": registry}
            if pin_root:
                kwargs["pin_root"] = Path(pin_root)
            if isinstance(entry.extra.get("accelerate"), bool):
                kwargs["accelerate"] = entry.extra["accelerate"]
            red = type(red)(**kwargs)
        return red.inspect(spec)  # type: ignore[no-any-return]
    except (RedirectError, SettingError) as exc:
        return CaptureState(
            pod=spec.pod,
            netns=str(spec.netns),
            mode=entry.mode,
            inbound="unknown",
            outbound="unknown",
            drift=(str(exc),),
        )


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
