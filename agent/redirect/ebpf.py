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
1. Programs compile once per process (`install`), each file with
   `BPF(src_file=..., cflags=["-D..."])`; maps are declared pinned, so a new
   process re-opens the same maps and links already attached keep working
   while the agent restarts. By default (`compile_in_child`, env
   MESHAGENT_EBPF_COMPILE_IN_CHILD=0 to turn off) the compile and load run in
   a short-lived child (`python -m agent.redirect.ebpf compile PIN_ROOT NAME`)
   that pins the program under progs/ and exits; this process then opens the
   pin. bcc's LLVM (~150 MB of RSS) so never stays mapped in the agent.
2. Attachments are bpf links pinned in bpffs, so they outlive the process;
   enroll on a pinned link moves it to this process's program (link update),
   unenroll and uninstall detach every link explicitly and remove the pins.
3. enroll is idempotent; unenroll removes exactly the pod's links, config
   entries, listener and original-destination entries; `uninstall` removes
   everything, maps and programs included.
4. inspect reads the kernel: pinned links and what they are attached to, map
   entries, never this object's memory (`agent.redirect.ebpf_inspect`). The
   preflight for `meshagent check` is `agent.redirect.ebpf_checks`.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from agent.errors import PrerequisiteError, RedirectError, SettingError
from agent.redirect import ebpf_inspect, maps, rules
from agent.redirect.ebpf_inspect import netns_cookie_of
from agent.redirect.maps import BpfError, PinnedMap
from agent.redirect.model import CaptureSpec, CaptureState, Mode

if TYPE_CHECKING:
    import socket

    from agent.redirect.registry import Registry

logger = logging.getLogger(__name__)

PIN_ROOT = Path("/sys/fs/bpf/meshagent")
BPFFS = Path("/sys/fs/bpf")
BPF_SRC = Path(__file__).resolve().parents[2] / "bpf"
ENV_ACCEL = "MESHAGENT_EBPF_ACCEL"
ENV_ACCEL_MAX_MSG = "MESHAGENT_EBPF_ACCEL_MAX_MSG"
ENV_COMPILE_IN_CHILD = "MESHAGENT_EBPF_COMPILE_IN_CHILD"
COMPILE_TIMEOUT_S = 120.0
DEFAULT_ACCEL_MAX_MSG = 16 * 1024
HEADERS_HINT = "run scripts/setup (installs Debian's nearest linux-headers and links it)"


@dataclass(frozen=True, slots=True, kw_only=True)
class Program:
    """One file of bpf/: its function `ma_<name>`, program type and attach type."""

    name: str
    prog_type: int
    attach_type: int

    @property
    def func(self) -> str:
        return f"ma_{self.name}"


PROGRAMS = {
    p.name: p
    for p in (
        Program(name="connect4", prog_type=18, attach_type=10),  # CGROUP_SOCK_ADDR, INET4_CONNECT
        Program(name="connect6", prog_type=18, attach_type=11),  # CGROUP_SOCK_ADDR, INET6_CONNECT
        Program(name="getsockopt", prog_type=25, attach_type=21),  # CGROUP_SOCKOPT, GETSOCKOPT
        Program(name="sk_lookup", prog_type=30, attach_type=36),  # SK_LOOKUP, SK_LOOKUP
        Program(name="sockops", prog_type=13, attach_type=3),  # SOCK_OPS, CGROUP_SOCK_OPS
        Program(name="sk_msg", prog_type=16, attach_type=7),  # SK_MSG, SK_MSG_VERDICT
    )
}
POD_CGROUP_LINKS = ("connect4", "connect6", "sockops")


def pod_key(pod: str) -> str:
    """A bpffs-safe directory name for "namespace/name" (bpffs refuses dots)."""
    return re.sub(r"[^A-Za-z0-9_-]", "_", pod.replace("/", "_", 1))


def cgroup2_mount(mounts: str | None = None) -> Path | None:
    """Where the cgroup v2 hierarchy is mounted, from /proc/mounts."""
    text = Path("/proc/mounts").read_text() if mounts is None else mounts
    for line in text.splitlines():
        parts = line.split()
        if len(parts) > 2 and parts[2] == "cgroup2":
            return Path(parts[1])
    return None


def own_cgroup() -> Path:
    """This process's cgroup v2 directory (where the agent's listeners belong).

    Raises:
        PrerequisiteError: cgroup v2 is not mounted.
    """
    root = cgroup2_mount()
    if root is None:
        raise PrerequisiteError("cgroup v2 is not mounted", "mount -t cgroup2 none /sys/fs/cgroup")
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        if line.startswith("0::"):
            return root / line[3:].lstrip("/")
    return root


def bpffs_mounted(path: Path = BPFFS) -> bool:
    return any(
        p[1] == str(path) and p[2] == "bpf"
        for p in (line.split() for line in Path("/proc/mounts").read_text().splitlines())
        if len(p) > 2
    )


def ensure_bpffs(path: Path = BPFFS) -> None:
    """Mount bpffs at `path` unless it is mounted.

    Raises:
        PrerequisiteError: the mount failed.
    """
    if bpffs_mounted(path):
        return
    done = subprocess.run(
        ["mount", "-t", "bpf", "bpf", str(path)], capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise PrerequisiteError(
            f"cannot mount bpffs at {path}: {done.stderr.strip()}", "run as root"
        )


def headers_dir() -> Path | None:
    """The kernel headers bcc compiles against, or None."""
    base = Path("/lib/modules") / os.uname().release
    for sub in ("build", "source"):
        if (base / sub / "include").is_dir():
            return base / sub
    return None


def accel_from_env(env: dict[str, str] | None = None) -> tuple[bool, int]:
    """(enabled, max message) from MESHAGENT_EBPF_ACCEL{,_MAX_MSG}.

    Raises:
        SettingError: a value that is not a boolean / a non-negative integer.
    """
    env = dict(os.environ) if env is None else env
    raw = env.get(ENV_ACCEL, "").strip().lower()
    if raw not in ("", "0", "1", "true", "false", "yes", "no", "on", "off"):
        raise SettingError(ENV_ACCEL, raw, "must be a boolean (1/0, true/false)")
    size_raw = env.get(ENV_ACCEL_MAX_MSG, str(DEFAULT_ACCEL_MAX_MSG))
    if not size_raw.isdigit():
        raise SettingError(ENV_ACCEL_MAX_MSG, size_raw, "must be a byte count")
    return raw in ("1", "true", "yes", "on"), int(size_raw)


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
        backend = self.ipt.backend_for(spec)
        ops = rules.reconcile(want, self.ipt.read(spec, backend))
        if ops:
            self.ipt.writer(backend).apply(spec, ops)

    def unenroll_inbound(self, spec: CaptureSpec) -> None:
        """Raises: RedirectError: iptables failed."""
        if Path(spec.netns).exists():
            for backend in self.ipt.backends_with_rules(spec):
                ops = rules.removal(self.ipt.read(spec, backend))
                self.ipt.writer(backend).apply(spec, ops)

    def has_inbound(self, spec: CaptureSpec) -> bool:
        if not Path(spec.netns).exists():
            return False
        return any(
            rules.REDIRECT_CHAIN in self.ipt.read(spec, b).chains
            for b in self.ipt.backends_with_rules(spec)
        )


# --- the redirector ----------------------------------------------------------------------


class EbpfRedirector:
    """The eBPF capture mode (see the module docstring)."""

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
    ) -> None:
        """`accelerate`/`accel_max_msg` default to MESHAGENT_EBPF_ACCEL{,_MAX_MSG};
        `use_sk_lookup=False` forces the iptables inbound fallback;
        `compile_in_child` defaults to MESHAGENT_EBPF_COMPILE_IN_CHILD (on).

        Raises:
            SettingError: a bad MESHAGENT_EBPF_ACCEL* value.
        """
        env_accel, env_max = accel_from_env()
        self.pin_root = pin_root
        self.agent_cgroup = agent_cgroup
        self.accelerate = env_accel if accelerate is None else accelerate
        self.accel_max_msg = env_max if accel_max_msg is None else accel_max_msg
        self.use_sk_lookup = use_sk_lookup
        self._fallback = inbound_fallback
        self.registry = registry
        self.sk_lookup_error = "" if use_sk_lookup else "disabled by configuration"
        self._bpf: dict[str, Any] = {}  # program name -> bcc BPF object
        self._fds: dict[str, int] = {}  # program name -> prog fd
        self._own_fds: list[int] = []  # fds of pins opened here (compiled in a child)
        if compile_in_child is None:
            compile_in_child = os.environ.get(ENV_COMPILE_IN_CHILD, "1").lower() not in (
                "0",
                "false",
                "no",
            )
        self.compile_in_child = compile_in_child

    # -- paths ----------------------------------------------------------------------

    @property
    def maps_dir(self) -> Path:
        return self.pin_root / "maps"

    def pod_dir(self, spec: CaptureSpec) -> Path:
        return self.pin_root / "pods" / pod_key(spec.pod)

    def open_map(self, name: str) -> PinnedMap:
        """Raises: BpfError: not pinned (the mode is not installed)."""
        return PinnedMap.open(self.maps_dir, name)

    # -- node -----------------------------------------------------------------------

    def _compile(self, prog: Program) -> None:
        if self.compile_in_child:
            self._compile_in_child(prog)
        else:
            self._compile_here(prog)

    def _compile_in_child(self, prog: Program) -> None:
        """Compile, load and pin `prog` in a child process, then open the pin here.

        Raises:
            PrerequisiteError: bcc or kernel headers missing (as the child found).
            RedirectError: the child failed to compile or load it.
        """
        argv = [sys.executable, "-m", "agent.redirect.ebpf", "compile", str(self.pin_root)]
        try:
            done = subprocess.run(
                [*argv, prog.name],
                capture_output=True,
                text=True,
                timeout=COMPILE_TIMEOUT_S,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise RedirectError("-", "-", f"bcc compile {prog.name}.c (child)", str(exc)) from exc
        if done.returncode != 0:
            try:
                err = json.loads(done.stdout.strip().splitlines()[-1])
            except (ValueError, IndexError):
                err = {"kind": "redirect", "message": done.stderr[-2000:]}
            if err.get("kind") == "prerequisite":
                raise PrerequisiteError(err.get("message", ""), err.get("hint", ""))
            raise RedirectError(
                "-", "-", err.get("action", f"bcc compile {prog.name}.c"), err.get("message", "")
            )
        try:
            fd = maps.obj_get(self.pin_root / "progs" / prog.name)
        except BpfError as exc:
            raise RedirectError("-", "-", f"open pinned {prog.name}", str(exc)) from exc
        self._own_fds.append(fd)
        self._fds[prog.name] = fd

    def _compile_here(self, prog: Program) -> None:
        try:
            from bcc import BPF  # noqa: PLC0415
        except ImportError as exc:
            raise PrerequisiteError("bcc is not importable", "run scripts/setup") from exc
        if headers_dir() is None:
            raise PrerequisiteError(
                f"no kernel headers for {os.uname().release}: bcc compiles the capture programs "
                "against /lib/modules/<release>/build",
                HEADERS_HINT,
            )
        cflags = [f'-DMA_PIN_MAPS="{self.maps_dir}"', f"-I{BPF_SRC}", "-w"]
        src = str(BPF_SRC / f"{prog.name}.c").encode()
        try:
            b = BPF(src_file=src, cflags=cflags)
        except Exception as exc:
            raise RedirectError("-", "-", f"bcc compile {prog.name}.c", str(exc)) from exc
        try:
            fn = b.load_func(prog.func.encode(), prog.prog_type, attach_type=prog.attach_type)
        except Exception as exc:
            b.close()
            raise RedirectError("-", "-", f"load {prog.func}", str(exc)) from exc
        self._bpf[prog.name] = b
        self._fds[prog.name] = fn.fd
        maps.obj_pin(fn.fd, self.pin_root / "progs" / prog.name)

    def _load(self, name: str, *, optional: bool = False) -> bool:
        if name in self._fds:
            return True
        try:
            self._compile(PROGRAMS[name])
        except RedirectError as exc:
            if not optional:
                raise
            logger.warning("program not loaded", extra={"program": name, "reason": exc.stderr})
            return False
        return True

    def install(self) -> None:
        """Load and pin the programs and maps, attach the node links; idempotent.

        Raises:
            PrerequisiteError: bcc, headers, bpffs or cgroup v2 missing.
            RedirectError: a program failed to compile or load.
            BpfError: an attach was refused.
        """
        if BPFFS in self.pin_root.parents:
            ensure_bpffs()
        for sub in ("maps", "progs", "node", "pods"):
            (self.pin_root / sub).mkdir(parents=True, exist_ok=True)
        for name in ("connect4", "getsockopt", "sockops"):
            self._load(name)
        self._load("connect6", optional=True)
        if self.use_sk_lookup and not self._load("sk_lookup", optional=True):
            self.sk_lookup_error = "sk_lookup program failed to load on this kernel"
        node = self.pin_root / "node"
        cgroup = self.agent_cgroup or own_cgroup()
        maps.ensure_link(
            node / "getsockopt", self._fds["getsockopt"], cgroup, PROGRAMS["getsockopt"].attach_type
        )
        if self.accelerate:
            self._load("sk_msg")
            maps.ensure_link(
                node / "sockops", self._fds["sockops"], cgroup, PROGRAMS["sockops"].attach_type
            )
            with self.open_map(maps.ACCEL_SOCKS) as m:
                ret = maps.libbpf().bpf_prog_attach(
                    self._fds["sk_msg"], m.fd, PROGRAMS["sk_msg"].attach_type, 0
                )
                maps.check(ret, "bpf_prog_attach", "sk_msg -> ma_accel_socks")
        else:
            maps.remove_link(node / "sockops")
            self._detach_sk_msg()

    def _detach_sk_msg(self) -> None:
        with (
            maps.pinned(self.pin_root / "progs" / "sk_msg") as prog,
            maps.pinned(self.maps_dir / maps.ACCEL_SOCKS) as m,
        ):
            if prog is not None and m is not None:
                maps.libbpf().bpf_prog_detach2(prog, m, PROGRAMS["sk_msg"].attach_type)

    def close(self) -> None:
        """Release this process's handles; pinned programs, maps and links stay."""
        for b in self._bpf.values():
            b.close()
        for fd in self._own_fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._bpf.clear()
        self._own_fds.clear()
        self._fds.clear()

    def uninstall(self) -> None:
        """Remove everything: every pod's links, node links, programs, maps, pins."""
        pods = self.pin_root / "pods"
        if pods.is_dir():
            for d in pods.iterdir():
                self._remove_pod_dir(d)
        for pin in (self.pin_root / "node").glob("*"):
            maps.remove_link(pin)
        self._detach_sk_msg()
        for sub in ("progs", "maps"):
            for pin in (self.pin_root / sub).glob("*"):
                pin.unlink()
        for sub in ("node", "pods", "progs", "maps", ""):
            with contextlib.suppress(FileNotFoundError):
                (self.pin_root / sub).rmdir()
        self.close()
        logger.info("ebpf capture uninstalled", extra={"pins": str(self.pin_root)})

    def _remove_pod_dir(self, d: Path) -> None:
        for pin in d.glob("*"):
            maps.remove_link(pin)
        with contextlib.suppress(FileNotFoundError):
            d.rmdir()

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
        """
        if spec.cgroup is None:
            raise RedirectError(
                spec.pod, str(spec.netns), "enroll", "eBPF mode needs the pod's cgroup"
            )
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


def _say(obj: dict[str, str]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def _compile_main(argv: list[str]) -> int:
    """`python -m agent.redirect.ebpf compile PIN_ROOT NAME`: compile, load and pin
    one program under PIN_ROOT/progs (rule 1); on failure a JSON line on stdout."""
    if len(argv) != 3 or argv[0] != "compile" or argv[2] not in PROGRAMS:
        _say({"kind": "redirect", "message": f"usage: compile PIN_ROOT NAME: {argv}"})
        return 2
    red = EbpfRedirector(pin_root=Path(argv[1]), accelerate=False, compile_in_child=False)
    try:
        red._compile_here(PROGRAMS[argv[2]])  # noqa: SLF001 - the child half of _compile
    except PrerequisiteError as exc:
        _say({"kind": "prerequisite", "message": exc.what, "hint": exc.hint})
        return 1
    except RedirectError as exc:
        action = exc.argv if isinstance(exc.argv, str) else " ".join(exc.argv)
        _say({"kind": "redirect", "action": action, "message": exc.stderr})
        return 1
    finally:
        red.close()
    return 0


if __name__ == "__main__":
    sys.exit(_compile_main(sys.argv[1:]))
