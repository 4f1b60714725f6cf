"""The node's share of eBPF mode: bpffs and cgroup v2, the programs, the node links.

`EbpfNode` owns what every pod shares (see `agent.redirect.ebpf` for the pin
layout); `agent.redirect.ebpf.EbpfRedirector` is an `EbpfNode` that enrolls pods.

Rules:
1. Programs load once per process (`install`): from the cache of compiled
   programs when it holds them for these sources (`agent.redirect.ebpf_cache`,
   env MESHAGENT_BPF_CACHE), else compiled, in a child by default
   (`agent.redirect.ebpf_compile`, env MESHAGENT_EBPF_COMPILE_IN_CHILD=0 to
   turn off), which keeps them in the cache; `loaded_from` says which.
   Each is pinned under progs/, and its fd is kept here (`_fds`) until
   `close`. Maps are declared pinned, so a new process re-opens the same
   maps, and links already attached keep working while the agent restarts.
2. `install` is idempotent: the node links (getsockopt on the agent's cgroup;
   sockops and the sk_msg attachment when accelerating) are ensured, and
   removed when acceleration is off. connect6 and sk_lookup are optional: a
   kernel that cannot load them runs without (`sk_lookup_error` says why).
3. Links are pinned in bpffs, so they outlive the process; `uninstall` detaches
   every link explicitly (every pod's too) and removes every pin and directory.
4. `close` releases this process's handles only; pins stay.
5. `install` first checks the maps already pinned against this version's struct
   sizes (`maps.abi_mismatches`; bpf/include/meshagent.h's MA_ABI changes them):
   bcc would reuse a pinned map of another size, and the verifier refuse the
   program with "Permission denied". A mismatch is a `PrerequisiteError` that
   names the maps and the way out.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
from pathlib import Path
from typing import Any

from agent.errors import PrerequisiteError, RedirectError, SettingError
from agent.redirect import ebpf_cache, ebpf_compile, maps
from agent.redirect.ebpf_compile import PROGRAMS, Program
from agent.redirect.maps import PinnedMap

logger = logging.getLogger(__name__)

PIN_ROOT = Path("/sys/fs/bpf/meshagent")
BPFFS = Path("/sys/fs/bpf")
ENV_ACCEL = "MESHAGENT_EBPF_ACCEL"
ENV_ACCEL_MAX_MSG = "MESHAGENT_EBPF_ACCEL_MAX_MSG"
ENV_PAIR = "MESHAGENT_EBPF_PAIR"  # the paired relay, with acceleration (agent.proxy.pairing)
ENV_COMPILE_IN_CHILD = "MESHAGENT_EBPF_COMPILE_IN_CHILD"
DEFAULT_ACCEL_MAX_MSG = 16 * 1024


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


def accel_from_env(env: dict[str, str] | None = None) -> tuple[bool, int]:
    """(enabled, max message) from MESHAGENT_EBPF_ACCEL{,_MAX_MSG}.

    Raises:
        SettingError: a value that is not a boolean / a non-negative integer.
    """
    env = dict(os.environ) if env is None else env
    enabled = _env_bool(env, ENV_ACCEL, default=False)
    size_raw = env.get(ENV_ACCEL_MAX_MSG, str(DEFAULT_ACCEL_MAX_MSG))
    if not size_raw.isdigit():
        raise SettingError(ENV_ACCEL_MAX_MSG, size_raw, "must be a byte count")
    return enabled, int(size_raw)


def pair_from_env(env: dict[str, str] | None = None) -> bool:
    """MESHAGENT_EBPF_PAIR: whether workers pair opaque same-node relays for sk_msg to
    carry (agent.proxy.pairing), where acceleration is on; on unless 0, false, no or off.

    Raises:
        SettingError: a value that is not a boolean.
    """
    return _env_bool(dict(os.environ) if env is None else env, ENV_PAIR, default=True)


def _env_bool(env: dict[str, str], name: str, *, default: bool) -> bool:
    """A boolean setting: 1/0, true/false, yes/no, on/off; `default` when unset or empty.

    Raises:
        SettingError: anything else.
    """
    raw = env.get(name, "").strip().lower()
    if raw in ("1", "true", "yes", "on"):
        return True
    if raw in ("0", "false", "no", "off"):
        return False
    if raw:
        raise SettingError(name, raw, "must be a boolean (1/0, true/false)")
    return default


def compile_in_child_from_env() -> bool:
    """MESHAGENT_EBPF_COMPILE_IN_CHILD: on unless 0, false or no."""
    return os.environ.get(ENV_COMPILE_IN_CHILD, "1").lower() not in ("0", "false", "no")


class EbpfNode:
    """Programs, maps and node links under `pin_root`, shared by every pod."""

    def __init__(  # noqa: PLR0913 - keyword-only settings
        self,
        *,
        pin_root: Path,
        agent_cgroup: Path | None,
        accelerate: bool,
        use_sk_lookup: bool,
        compile_in_child: bool | None,
        cache_dir: Path | bool | None = True,
    ) -> None:
        """`compile_in_child` defaults to MESHAGENT_EBPF_COMPILE_IN_CHILD (on);
        `cache_dir` True means MESHAGENT_BPF_CACHE's, None or False no cache."""
        self.pin_root = pin_root
        self.agent_cgroup = agent_cgroup
        self.accelerate = accelerate
        self.use_sk_lookup = use_sk_lookup
        self.sk_lookup_error = "" if use_sk_lookup else "disabled by configuration"
        self._bpf: dict[str, Any] = {}  # program name -> bcc BPF object
        self._fds: dict[str, int] = {}  # program name -> prog fd
        self._own_fds: list[int] = []  # fds of pins opened here (compiled in a child)
        if compile_in_child is None:
            compile_in_child = compile_in_child_from_env()
        self.compile_in_child = compile_in_child
        if cache_dir is True:
            cache_dir = ebpf_cache.cache_dir_from_env()
        self.cache_dir: Path | None = cache_dir or None
        self._key: str | None = None
        self.loaded_from: dict[str, str] = {}  # program name -> "cache" | "compiled"

    @property
    def maps_dir(self) -> Path:
        return self.pin_root / "maps"

    def open_map(self, name: str) -> PinnedMap:
        """Raises: BpfError: not pinned (the mode is not installed)."""
        return PinnedMap.open(self.maps_dir, name)

    # -- programs -------------------------------------------------------------------

    def _compile(self, prog: Program) -> None:
        if self._from_cache(prog):
            self.loaded_from[prog.name] = "cache"
            return
        if self.compile_in_child:
            self._compile_in_child(prog)
        else:
            self._compile_here(prog)
        self.loaded_from[prog.name] = "compiled"

    def _from_cache(self, prog: Program) -> bool:
        """Load `prog` from the cache and pin it; False on a miss (then it compiles)."""
        if self.cache_dir is None:
            return False
        try:
            self._key = self._key or ebpf_compile.source_key()
            entry = ebpf_cache.lookup(self.cache_dir, self._key, prog.name)
            fd = ebpf_cache.load_entry(entry, self.maps_dir)
        except (ebpf_cache.CacheMiss, OSError) as exc:
            logger.debug("compiled program not in cache", extra={"program": prog.name, "why": exc})
            return False
        self._own_fds.append(fd)
        self._fds[prog.name] = fd
        maps.obj_pin(fd, self.pin_root / "progs" / prog.name)
        return True

    def _compile_in_child(self, prog: Program) -> None:
        """Raises: PrerequisiteError, RedirectError (`ebpf_compile.compile_in_child`)."""
        fd = ebpf_compile.compile_in_child(prog, self.pin_root, self.cache_dir)
        self._own_fds.append(fd)
        self._fds[prog.name] = fd

    def _compile_here(self, prog: Program) -> None:
        """Raises: PrerequisiteError, RedirectError (`ebpf_compile.load`); BpfError (pin)."""
        b, fd = ebpf_compile.load(prog, self.maps_dir)
        self._bpf[prog.name] = b
        self._fds[prog.name] = fd
        maps.obj_pin(fd, self.pin_root / "progs" / prog.name)
        ebpf_compile.remember(b, prog, self.cache_dir, self._key)

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

    # -- node -----------------------------------------------------------------------

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
        self._check_pinned_maps()
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

    def _check_pinned_maps(self) -> None:
        """Rule 5: maps another version pinned with other struct sizes are refused here,
        with what to do, rather than by the verifier, which would answer "Permission
        denied" when a program reads past a smaller value.

        Raises:
            PrerequisiteError: a pinned map's key or value size differs from this version's.
        """
        sizes = {}
        for pin in sorted(self.maps_dir.iterdir()) if self.maps_dir.is_dir() else ():
            with maps.pinned(pin) as fd:
                if fd is not None:
                    spec = ebpf_cache.map_spec_of(fd)
                    sizes[pin.name] = (spec.key_size, spec.value_size)
        wrong = maps.abi_mismatches(sizes)
        if wrong:
            raise PrerequisiteError(
                f"the eBPF maps pinned under {self.maps_dir} are another meshagent version's "
                f"({'; '.join(wrong)})",
                f"stop the agent that pinned them with cleanup, or remove {self.pin_root} "
                "(its pods are captured again when enrolled), or give this agent another "
                "MESHAGENT_BPF_PIN_ROOT",
            )

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
