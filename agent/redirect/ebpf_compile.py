"""The eBPF mode's programs: what bpf/ holds, and compiling and loading them with bcc.

`agent.redirect.ebpf_node` decides when to compile and keeps the results; this
module does the compiling, here or in a child, and is the child's body.

Rules:
1. One file of bpf/ per program (`bpf/<name>.c`, function `ma_<name>`), compiled
   with `BPF(src_file=..., cflags=["-D..."])`, never text substitution; the
   maps are declared pinned under `MA_PIN_MAPS`, so every program and every
   process opens the same maps.
2. In a child by default: `python -m agent.redirect.ebpf compile PIN_ROOT NAME
   [CACHE_DIR]` (the command is `CHILD_MODULE`; its `__main__` calls
   `child_main`) compiles, loads and pins one program under PIN_ROOT/progs,
   keeps it in CACHE_DIR (rule 5) and exits; the parent opens the pin. bcc's
   LLVM (~150 MB of RSS) so never stays mapped in the agent.
3. The child reports a failure as one JSON line on stdout (`kind`
   "prerequisite" or "redirect", `message`, and `hint` or `action`), and the
   parent raises the same error the compile would have raised in-process.
4. bcc is imported only inside `load`, when a program is compiled here.
5. What compiles is kept (`remember`, in the child or here) in the cache of
   compiled programs when one is given (`agent.redirect.ebpf_cache`), so the
   next process loads it without compiling; a program that cannot be kept is
   logged, never an error.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from agent.errors import PrerequisiteError, RedirectError
from agent.redirect import ebpf_cache, maps
from agent.redirect.maps import BpfError

logger = logging.getLogger(__name__)

BPF_SRC = Path(__file__).resolve().parents[2] / "bpf"
CHILD_MODULE = "agent.redirect.ebpf"
COMPILE_TIMEOUT_S = 120.0
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


def headers_dir() -> Path | None:
    """The kernel headers bcc compiles against, or None."""
    base = Path("/lib/modules") / os.uname().release
    for sub in ("build", "source"):
        if (base / sub / "include").is_dir():
            return base / sub
    return None


def load(prog: Program, maps_dir: Path) -> tuple[Any, int]:
    """Compile bpf/<name>.c here and load `ma_<name>`: (the bcc BPF object, the prog fd).

    The caller owns the object (closing it unloads the program unless pinned).

    Raises:
        PrerequisiteError: bcc or kernel headers missing.
        RedirectError: the compile or the load failed.
    """
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
    cflags = [f'-DMA_PIN_MAPS="{maps_dir}"', f"-I{BPF_SRC}", "-w"]
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
    return b, fn.fd


def source_key() -> str:
    """The cache key of bpf/ compiled on this kernel with these headers and bcc."""
    return ebpf_cache.source_key(BPF_SRC, headers_dir())


def remember(bpf: Any, prog: Program, cache_dir: Path | None, key: str | None = None) -> None:
    """Keep what bcc compiled (`bpf`) in `cache_dir`, if any (rule 5)."""
    if cache_dir is None:
        return
    try:
        entry = ebpf_cache.entry_from_bcc(
            bpf,
            key=key or source_key(),
            program=prog.name,
            prog_type=prog.prog_type,
            attach_type=prog.attach_type,
        )
        ebpf_cache.store(cache_dir, entry)
    except (OSError, ValueError, BpfError) as exc:
        logger.warning("compiled program not cached", extra={"program": prog.name, "reason": exc})


def compile_in_child(prog: Program, pin_root: Path, cache_dir: Path | None = None) -> int:
    """Compile, load and pin `prog` in a child process, then open the pin here: its fd.
    With `cache_dir` the child also keeps what it compiled there (rule 5).

    Raises:
        PrerequisiteError: bcc or kernel headers missing (as the child found).
        RedirectError: the child failed to compile or load it.
    """
    argv = [sys.executable, "-m", CHILD_MODULE, "compile", str(pin_root), prog.name]
    if cache_dir is not None:
        argv.append(str(cache_dir))
    try:
        done = subprocess.run(
            argv,
            capture_output=True,
            text=True,
            timeout=COMPILE_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise RedirectError("-", "-", f"bcc compile {prog.name}.c (child)", str(exc)) from exc
    if done.returncode != 0:
        _raise_child_error(prog, done)
    try:
        return maps.obj_get(pin_root / "progs" / prog.name)
    except BpfError as exc:
        raise RedirectError("-", "-", f"open pinned {prog.name}", str(exc)) from exc


def _raise_child_error(prog: Program, done: subprocess.CompletedProcess[str]) -> NoReturn:
    """The child's failure (rule 3) as the error the compile raises in-process."""
    try:
        err = json.loads(done.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        err = {"kind": "redirect", "message": done.stderr[-2000:]}
    if err.get("kind") == "prerequisite":
        raise PrerequisiteError(err.get("message", ""), err.get("hint", ""))
    raise RedirectError(
        "-", "-", err.get("action", f"bcc compile {prog.name}.c"), err.get("message", "")
    )


# --- the child ------------------------------------------------------------------------


def _say(obj: dict[str, str]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def child_main(argv: list[str]) -> int:
    """`python -m agent.redirect.ebpf compile PIN_ROOT NAME [CACHE_DIR]`: compile, load
    and pin one program under PIN_ROOT/progs (rule 2), and keep it in CACHE_DIR (rule 5);
    on failure a JSON line on stdout."""
    if len(argv) not in (3, 4) or argv[0] != "compile" or argv[2] not in PROGRAMS:
        _say({"kind": "redirect", "message": f"usage: compile PIN_ROOT NAME [CACHE_DIR]: {argv}"})
        return 2
    pin_root, prog = Path(argv[1]), PROGRAMS[argv[2]]
    cache_dir = Path(argv[3]) if len(argv) == 4 else None
    loaded = None
    try:
        loaded, fd = load(prog, pin_root / "maps")
        maps.obj_pin(fd, pin_root / "progs" / prog.name)
        remember(loaded, prog, cache_dir)
    except PrerequisiteError as exc:
        _say({"kind": "prerequisite", "message": exc.what, "hint": exc.hint})
        return 1
    except RedirectError as exc:
        action = exc.argv if isinstance(exc.argv, str) else " ".join(exc.argv)
        _say({"kind": "redirect", "action": action, "message": exc.stderr})
        return 1
    finally:
        if loaded is not None:
            loaded.close()
    return 0
