"""The kernel side of iptables mode: which backend, and the commands that read and write it.

`agent.redirect.iptables` decides what to change; this module runs it. The text
the commands print is read by the pure `agent.redirect.iptables_state`.

Rules:
1. One plan, two writers: `iptables-restore --noflush` (nft or legacy; the whole
   change is one atomic transaction) and python-iptables (`iptc`, libiptc, legacy
   tables only; one table commit). iptc acts on the calling thread's netns, so it
   runs inside `netns.run_in`.
2. Binaries are looked up as linkerd-init does: `iptables-<backend>-<tool>`,
   else `iptables-<tool>`. Commands run in the pod's netns through
   `netns.exec_argv`, each with a timeout (`TIMEOUT`).
3. Reading never creates anything: `iptables-save` prints only tables already
   present.
4. Every failure is a `RedirectError(pod, netns, argv, stderr)`; a failed
   restore carries the input it was given.
5. `detect_backend` with `auto` reads both backends' host rules and lets
   `iptables_state.choose_backend` pick (rule 2 there); on a tie it asks the
   plain `iptables -V` which backend it is.
"""

from __future__ import annotations

import enum
import shutil
import subprocess
from typing import TYPE_CHECKING, Any, Protocol

from agent.errors import RedirectError, SettingError
from agent.redirect import netns, rules
from agent.redirect.iptables_state import Backend, Detection, choose_backend

if TYPE_CHECKING:
    from collections.abc import Sequence
    from pathlib import Path

    from agent.redirect.model import CaptureSpec

TIMEOUT = 20.0


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
