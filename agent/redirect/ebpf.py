"""The eBPF capture mode: bcc-compiled programs from bpf/, pinned under bpffs.

    outbound   cgroup/connect4 (+ connect6 for v4-mapped) on the pod's cgroup
               rewrites TCP connects to 127.0.0.1:4140; sockops on the same
               cgroup files the original destination under the client's
               (netns, ip, port); cgroup/getsockopt on the agent's cgroup
               answers SO_ORIGINAL_DST from it (agent.redirect.ebpf_origdst
               reads it directly too).
    inbound    sk_lookup on the pod's netns assigns inbound TCP to the pod's
               listener (`set_inbound_listener`); where sk_lookup cannot load,
               the pod gets the iptables inbound rules instead, and `inspect`
               and `checks` say "fallback-iptables".
    same-node  opt-in (MESHAGENT_EBPF_ACCEL=1): sockops records the proxy's
               connections that stay inside a pod's netns (app -> 127.0.0.1:4140,
               proxy -> app on the pod IP; IPv4 or v4-mapped) in a sockhash and
               sk_msg redirects small messages between their ends, until an end
               sends a big message or 256 KiB its peer does not answer
               (bpf/sk_msg.c); `maps.accel_stats` counts what it did.

Pins (all under `pin_root`, /sys/fs/bpf/meshagent):
    maps/<map>            shared by every pod; each pod is a key (maps.py)
    progs/<program>       the programs the links run
    node/<link>           getsockopt (and sockops when accelerating) on the agent's cgroup
    pods/<pod-key>/<link> connect4, connect6, sockops (pod cgroup), sk_lookup (pod netns)

Rules:
1. Programs load once per process (`install`): from the cache of compiled
   programs (`agent.redirect.ebpf_cache`, MESHAGENT_BPF_CACHE) when it holds
   them for these sources, else compiled, each file with
   `BPF(src_file=..., cflags=["-D..."])`; maps are declared pinned, so a new
   process re-opens the same maps and links already attached keep working
   while the agent restarts. By default (`compile_in_child`, env
   MESHAGENT_EBPF_COMPILE_IN_CHILD=0 to turn off) the compile and load run in
   a short-lived child (`python -m agent.redirect.ebpf compile PIN_ROOT NAME
   [CACHE_DIR]`, this module's `__main__`, whose body is
   `ebpf_compile.child_main`) that pins the program under progs/, keeps it in
   the cache and exits; this process then opens the pin. bcc's LLVM (~150 MB
   of RSS) so never stays mapped in the agent.
2. Attachments are bpf links pinned in bpffs, so they outlive the process;
   enroll on a pinned link moves it to this process's program (link update),
   unenroll and uninstall detach every link explicitly and remove the pins.
3. enroll is idempotent; unenroll removes exactly the pod's links, config
   entries, listener and original-destination entries; `uninstall` removes
   everything, maps and programs included.
4. inspect reads the kernel: pinned links and what they are attached to, map
   entries, never this object's memory (`agent.redirect.ebpf_inspect`). The
   preflight for `meshagent check` is `agent.redirect.ebpf_checks`.

Modules: this one enrolls pods (`EbpfRedirector`, the inbound fallback) on top
of `agent.redirect.ebpf_node` (bpffs, cgroup v2, programs and node links:
`install`, `uninstall`), which compiles through `agent.redirect.ebpf_compile`
(bpf/ sources, bcc, the compile child). Their public names are re-exported
here, where callers have always imported them.
"""

from __future__ import annotations

import ctypes
import logging
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from agent.errors import RedirectError
from agent.redirect import ebpf_compile, ebpf_inspect, maps, rules
from agent.redirect.ebpf_compile import (
    BPF_SRC,
    COMPILE_TIMEOUT_S,
    HEADERS_HINT,
    PROGRAMS,
    Program,
    headers_dir,
)
from agent.redirect.ebpf_inspect import netns_cookie_of
from agent.redirect.ebpf_node import (
    BPFFS,
    DEFAULT_ACCEL_MAX_MSG,
    ENV_ACCEL,
    ENV_ACCEL_MAX_MSG,
    ENV_COMPILE_IN_CHILD,
    ENV_PAIR,
    PIN_ROOT,
    EbpfNode,
    accel_from_env,
    bpffs_mounted,
    cgroup2_mount,
    ensure_bpffs,
    own_cgroup,
    pair_from_env,
)
from agent.redirect.maps import BpfError
from agent.redirect.model import CaptureSpec, CaptureState, Mode

if TYPE_CHECKING:
    import socket

    from agent.redirect.registry import Registry

logger = logging.getLogger(__name__)

__all__ = [
    "BPFFS",
    "BPF_SRC",
    "COMPILE_TIMEOUT_S",
    "DEFAULT_ACCEL_MAX_MSG",
    "ENV_ACCEL",
    "ENV_ACCEL_MAX_MSG",
    "ENV_COMPILE_IN_CHILD",
    "ENV_PAIR",
    "HEADERS_HINT",
    "PIN_ROOT",
    "POD_CGROUP_LINKS",
    "PROGRAMS",
    "EbpfRedirector",
    "InboundFallback",
    "IptablesInbound",
    "Program",
    "accel_from_env",
    "bpffs_mounted",
    "cgroup2_mount",
    "ensure_bpffs",
    "headers_dir",
    "own_cgroup",
    "pair_from_env",
    "pod_key",
    "redirector",
]

POD_CGROUP_LINKS = ("connect4", "connect6", "sockops")


def pod_key(pod: str) -> str:
    """A bpffs-safe directory name for "namespace/name" (bpffs refuses dots)."""
    return re.sub(r"[^A-Za-z0-9_-]", "_", pod.replace("/", "_", 1))


# --- inbound fallback -------------------------------------------------------------------


class InboundFallback(Protocol):
    """Inbound capture by other means, for kernels where sk_lookup cannot work."""

    def enroll_inbound(self, spec: CaptureSpec) -> None: ...

    def unenroll_inbound(self, spec: CaptureSpec) -> None: ...

    def has_inbound(self, spec: CaptureSpec) -> bool: ...


class IptablesInbound:
    """The iptables plan's inbound half (PREROUTING -> PROXY_INIT_REDIRECT) only."""

    def __init__(self) -> None:
        from agent.redirect.iptables import IptablesRedirector  # noqa: PLC0415

        self.ipt = IptablesRedirector()

    def enroll_inbound(self, spec: CaptureSpec) -> None:
        """Raises: RedirectError: iptables failed."""
        want = rules.Plan(
            chains={rules.REDIRECT_CHAIN: tuple(rules.inbound_rules(spec))},
            jumps=(rules.jump("PREROUTING"),),
        )
        tables = self.ipt.tables(spec)
        backend = self.ipt.backend_for(spec, tables)
        current = tables[backend] if backend in tables else self.ipt.read(spec, backend)
        ops = rules.reconcile(want, current)
        if ops:
            self.ipt.writer(backend).apply(spec, ops)

    def unenroll_inbound(self, spec: CaptureSpec) -> None:
        """Raises: RedirectError: iptables failed."""
        if Path(spec.netns).exists():
            tables = self.ipt.tables(spec)
            for backend in self.ipt.backends_with_rules(spec, tables):
                self.ipt.writer(backend).apply(spec, rules.removal(tables[backend]))

    def has_inbound(self, spec: CaptureSpec) -> bool:
        if not Path(spec.netns).exists():
            return False
        tables = self.ipt.tables(spec)
        return any(
            rules.REDIRECT_CHAIN in tables[b].chains
            for b in self.ipt.backends_with_rules(spec, tables)
        )


# --- the redirector ----------------------------------------------------------------------


class EbpfRedirector(EbpfNode):
    """The eBPF capture mode (see the module docstring): an `EbpfNode` that enrolls pods."""

    mode = Mode.EBPF

    def __init__(  # noqa: PLR0913 - every knob is a setting
        self,
        *,
        pin_root: Path = PIN_ROOT,
        agent_cgroup: Path | None = None,
        accelerate: bool | None = None,
        accel_max_msg: int | None = None,
        use_sk_lookup: bool = True,
        inbound_fallback: InboundFallback | None = None,
        registry: Registry | None = None,
        compile_in_child: bool | None = None,
        cache_dir: Path | bool | None = True,
    ) -> None:
        """`accelerate`/`accel_max_msg` default to MESHAGENT_EBPF_ACCEL{,_MAX_MSG};
        `use_sk_lookup=False` forces the iptables inbound fallback;
        `compile_in_child` defaults to MESHAGENT_EBPF_COMPILE_IN_CHILD (on);
        `cache_dir`, compiled programs kept between processes, to MESHAGENT_BPF_CACHE's.

        Raises:
            SettingError: a bad MESHAGENT_EBPF_ACCEL* or MESHAGENT_EBPF_PAIR value.
        """
        env_accel, env_max = accel_from_env()
        super().__init__(
            pin_root=pin_root,
            agent_cgroup=agent_cgroup,
            accelerate=env_accel if accelerate is None else accelerate,
            use_sk_lookup=use_sk_lookup,
            compile_in_child=compile_in_child,
            cache_dir=cache_dir,
        )
        self.accel_max_msg = env_max if accel_max_msg is None else accel_max_msg
        self.pair = self.accelerate and pair_from_env()  # workers pair opaque relays
        self._fallback = inbound_fallback
        self.registry = registry

    def pod_dir(self, spec: CaptureSpec) -> Path:
        return self.pin_root / "pods" / pod_key(spec.pod)

    # -- pods -----------------------------------------------------------------------

    def pod_config(self, spec: CaptureSpec, *, inbound: bool) -> maps.PodConfigC:
        try:
            return maps.pod_config(
                spec,
                inbound=inbound,
                accel=self.accelerate,
                accel_max_msg=self.accel_max_msg,
            )
        except ValueError as exc:
            raise RedirectError(spec.pod, str(spec.netns), "pod config", str(exc)) from exc

    def enroll(self, spec: CaptureSpec) -> None:
        """Capture the pod; idempotent, never touches its existing connections.

        Raises:
            RedirectError: no cgroup in the spec, a program or attach failed.
            PrerequisiteError: see `install`.
            RegistryError: the registry's file is not one; checked before the kernel is
                touched, so no capture is left that nothing records.
        """
        if spec.cgroup is None:
            raise RedirectError(
                spec.pod, str(spec.netns), "enroll", "eBPF mode needs the pod's cgroup"
            )
        if self.registry is not None:
            self.registry.check()
        self.install()
        steer = "sk_lookup" in self._fds
        cookie = netns_cookie_of(spec.netns)
        cfg = self.pod_config(spec, inbound=steer)
        self._forget_config(spec, keep_cookie=cookie)
        with self.open_map(maps.CFG_BY_NETNS) as m:
            m.update(ctypes.c_uint64(cookie), cfg)
        if steer:
            with self.open_map(maps.CFG_BY_IP) as m:
                m.update(ctypes.c_uint32(cfg.pod_ip), cfg)
        pod_dir = self.pod_dir(spec)
        pod_dir.mkdir(parents=True, exist_ok=True)
        try:
            for name in POD_CGROUP_LINKS:
                if name in self._fds:
                    maps.ensure_link(
                        pod_dir / name, self._fds[name], spec.cgroup, PROGRAMS[name].attach_type
                    )
            inbound = self._enroll_inbound(spec, pod_dir, steer=steer)
        except (BpfError, OSError) as exc:
            raise RedirectError(spec.pod, str(spec.netns), "attach", str(exc)) from exc
        logger.info("pod enrolled", extra={"pod": spec.pod, "mode": "ebpf", "inbound": inbound})
        self._record(spec, inbound)

    def _enroll_inbound(self, spec: CaptureSpec, pod_dir: Path, *, steer: bool) -> str:
        if steer:
            try:
                maps.ensure_link(
                    pod_dir / "sk_lookup", self._fds["sk_lookup"], Path(spec.netns), 36
                )
            except BpfError as exc:
                self.sk_lookup_error = f"sk_lookup attach failed: {exc}"
                with self.open_map(maps.CFG_BY_IP) as m:
                    m.delete(ctypes.c_uint32(maps.ip_be(spec.pod_ip)))
            else:
                return "captured"
        fallback = self.inbound_fallback()
        fallback.enroll_inbound(spec)
        logger.warning(
            "inbound falls back to iptables",
            extra={"pod": spec.pod, "reason": self.sk_lookup_error},
        )
        return "fallback-iptables"

    def inbound_fallback(self) -> InboundFallback:
        if self._fallback is None:
            self._fallback = IptablesInbound()
        return self._fallback

    def _record(self, spec: CaptureSpec, inbound: str) -> None:
        if self.registry is None:
            return
        from agent.redirect.registry import Enrollment  # noqa: PLC0415

        extra = {
            "inbound": inbound,
            "accelerate": self.accelerate,
            "pins": str(self.pod_dir(spec)),
            "pin_root": str(self.pin_root),  # `redirects list` inspects with the same root
        }
        self.registry.put(Enrollment(spec=spec, mode=self.mode, extra=extra))

    def _forget_config(self, spec: CaptureSpec, *, keep_cookie: int | None = None) -> list[int]:
        """Delete the pod's config entries (but `keep_cookie`'s); the netns cookies dropped."""
        ip = maps.ip_be(spec.pod_ip)
        dropped = []
        with self.open_map(maps.CFG_BY_NETNS) as m:
            for key, cfg in m.items():
                if cfg.pod_ip == ip and key.value != keep_cookie:
                    m.delete(key)
                    dropped.append(int(key.value))
        if keep_cookie is None:
            with self.open_map(maps.CFG_BY_IP) as m:
                m.delete(ctypes.c_uint32(ip))
        return dropped

    def unenroll(self, spec: CaptureSpec) -> None:
        """Remove the pod's links, pins, config, listener and original-destination entries.

        Raises:
            RedirectError: the iptables fallback rules could not be removed.
        """
        pod_dir = self.pod_dir(spec)
        had_sk_lookup = (pod_dir / "sk_lookup").exists()
        self._remove_pod_dir(pod_dir)
        if self.maps_dir.is_dir():
            cookies = set(self._forget_config(spec))
            with self.open_map(maps.LISTENERS) as m:
                m.delete(ctypes.c_uint32(maps.ip_be(spec.pod_ip)))
            with self.open_map(maps.ORIG_DST) as m:
                for key in m.key_list():
                    if key.netns in cookies:
                        m.delete(key)
        if not had_sk_lookup and (
            self._fallback is not None or not self.use_sk_lookup or self.sk_lookup_error
        ):
            self.inbound_fallback().unenroll_inbound(spec)
        if self.registry is not None:
            self.registry.remove(spec.pod)
        logger.info("pod unenrolled", extra={"pod": spec.pod, "mode": "ebpf"})

    def set_inbound_listener(self, spec: CaptureSpec, sock: socket.socket) -> None:
        """Make `sock` (listening, in the pod's netns) the target of sk_lookup.

        Raises:
            RedirectError: the map refused the socket (not a TCP listener?).
        """
        try:
            with self.open_map(maps.LISTENERS) as m:
                m.update(ctypes.c_uint32(maps.ip_be(spec.pod_ip)), ctypes.c_uint64(sock.fileno()))
        except BpfError as exc:
            raise RedirectError(
                spec.pod, str(spec.netns), "set inbound listener", str(exc)
            ) from exc

    def inspect(self, spec: CaptureSpec) -> CaptureState:
        """The pod's capture as the kernel has it (`agent.redirect.ebpf_inspect`).

        Raises:
            RedirectError: the pinned maps cannot be read.
        """
        return ebpf_inspect.inspect(self, spec)


def redirector(*, registry: Registry | None = None) -> EbpfRedirector:
    """The eBPF Redirector with settings from MESHAGENT_EBPF_* (for the CLI and `run`).

    Raises:
        SettingError: a bad MESHAGENT_EBPF_ACCEL* value.
    """
    return EbpfRedirector(registry=registry)


if __name__ == "__main__":
    sys.exit(ebpf_compile.child_main(sys.argv[1:]))
