"""iptables capture mode: the redirector around `agent.redirect.rules`.

This module decides what to change in a pod's netns; the commands that read and
write it are `agent.redirect.iptables_backend`, reading the kernel's text back is
the pure `agent.redirect.iptables_state`, and listing every enrolled pod for
`meshagent redirects` is `agent.redirect.enrolled`. Their public names are
re-exported here, where callers have always imported them.

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

import logging
from pathlib import Path

from agent.errors import RedirectError, SettingError
from agent.redirect import rules
from agent.redirect.enrolled import (
    RedirectSettings,
    add_options,
    inspect_enrolled,
    list_enrolled,
    redirector_for,
    require,
    resolve_settings,
    state_row,
)
from agent.redirect.iptables_backend import (
    TIMEOUT,
    IptcWriter,
    RestoreWriter,
    Writer,
    WriterKind,
    available_backends,
    binary,
    detect_backend,
    plain_iptables_backend,
    save,
)
from agent.redirect.iptables_state import (
    Backend,
    Detection,
    choose_backend,
    nat_section,
    state_from_save,
)
from agent.redirect.model import CaptureSpec, CaptureState, Mode
from agent.redirect.registry import Enrollment, Registry

logger = logging.getLogger(__name__)

__all__ = [
    "TIMEOUT",
    "Backend",
    "Detection",
    "IptablesRedirector",
    "IptcWriter",
    "RedirectSettings",
    "RestoreWriter",
    "Writer",
    "WriterKind",
    "add_options",
    "available_backends",
    "binary",
    "choose_backend",
    "detect_backend",
    "inspect_enrolled",
    "list_enrolled",
    "nat_section",
    "plain_iptables_backend",
    "redirector_for",
    "require",
    "resolve_settings",
    "save",
    "state_from_save",
    "state_row",
]


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

    def tables(self, spec: CaptureSpec) -> dict[Backend, rules.SavedTable]:
        """The pod's nat table in every available backend (one save each)."""
        return {b: self.read(spec, b) for b in available_backends()}

    def backends_with_rules(
        self, spec: CaptureSpec, tables: dict[Backend, rules.SavedTable] | None = None
    ) -> list[Backend]:
        """Backends that hold any of our chains or jumps in the pod's netns (in `tables`,
        when the caller has just read them)."""
        tables = self.tables(spec) if tables is None else tables
        return [b for b, table in tables.items() if rules.ours(table)]

    def backend_for(
        self, spec: CaptureSpec, tables: dict[Backend, rules.SavedTable] | None = None
    ) -> Backend:
        """Where this pod's rules go: where they already are (auto), else the host's."""
        existing = self.backends_with_rules(spec, tables)
        if self.requested == "auto" and len(existing) == 1:
            return existing[0]
        return self.detection().backend

    def enroll(self, spec: CaptureSpec) -> None:
        """Program (or reconcile) the pod's capture; idempotent. The kernel is read once
        per backend before the change and once after it, to verify.

        Raises:
            RedirectError: a command failed, or the kernel does not match the plan after.
            RegistryError: the registry's file is not one; checked before the kernel is
                touched, so no capture is left that nothing records.
        """
        if self.registry is not None:
            self.registry.check()
        tables = self.tables(spec)
        backend = self.backend_for(spec, tables)
        for other in self.backends_with_rules(spec, tables):
            if other is not backend:
                logger.info(
                    "removing rules from other backend",
                    extra={"pod": spec.pod, "backend": other.value},
                )
                self._remove(spec, other, tables[other])
        want = rules.plan(spec)
        current = tables[backend] if backend in tables else self.read(spec, backend)
        ops = rules.reconcile(want, current)
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

    def _remove(
        self, spec: CaptureSpec, backend: Backend, table: rules.SavedTable | None = None
    ) -> int:
        ops = rules.removal(self.read(spec, backend) if table is None else table)
        if ops:
            self.writer(backend).apply(spec, ops)
        return len(ops)

    def unenroll(self, spec: CaptureSpec) -> None:
        """Remove exactly what enroll added, in every backend.

        Raises:
            RedirectError: a command failed.
        """
        if Path(spec.netns).exists():
            tables = self.tables(spec)
            for backend in self.backends_with_rules(spec, tables):
                self._remove(spec, backend, tables[backend])
        if self.registry is not None:
            self.registry.remove(spec.pod)
        logger.info("pod unenrolled", extra={"pod": spec.pod})

    def inspect(self, spec: CaptureSpec) -> CaptureState:
        """The pod's capture as the kernel has it, with counters and drift.

        Raises:
            RedirectError: the netns cannot be read.
        """
        tables = self.tables(spec)
        existing = self.backends_with_rules(spec, tables)
        backend = existing[0] if existing else self.backend_for(spec, tables)
        text = save(spec.netns, backend, counters=True, pod=spec.pod)
        return state_from_save(spec, text, backend=backend, mixed=len(existing) > 1)
