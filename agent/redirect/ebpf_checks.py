"""Preflight for the eBPF capture mode (`meshagent check`): what this node lacks.

Rules:
1. Each result says what is missing and how to get it (`CheckResult.hint`).
2. Probes load a two-instruction program of each type through libbpf and close
   it at once; nothing is attached or pinned, and bcc is only imported.
"""

from __future__ import annotations

import ctypes
import os

from agent.redirect import ebpf_cache, maps
from agent.redirect.check import CheckResult
from agent.redirect.ebpf_compile import HEADERS_HINT, PROGRAMS, Program, headers_dir, source_key
from agent.redirect.ebpf_node import BPFFS, bpffs_mounted, cgroup2_mount

# Tiny programs: `r0 = 1; exit` (1 is "allow" for cgroup hooks, SK_PASS for the others).
_TINY = bytes.fromhex("b7000000010000009500000000000000")


def probe_program(prog: Program) -> str:
    """ "" if the kernel loads a program of `prog`'s type and attach type, else why not."""
    opts = ebpf_cache.LoadOpts(ctypes.sizeof(ebpf_cache.LoadOpts), 0, prog.attach_type)
    insns = ctypes.create_string_buffer(_TINY, len(_TINY))
    fd = maps.libbpf().bpf_prog_load(
        prog.prog_type, b"ma_probe", b"GPL", insns, len(_TINY) // 8, ctypes.byref(opts)
    )
    if fd < 0:
        return os.strerror(-fd)
    os.close(fd)
    return ""


def _cache_check() -> CheckResult:
    """Whether an agent starting now loads its programs or compiles them (informational)."""
    name = "compiled program cache"
    cache_dir = ebpf_cache.cache_dir_from_env()
    if cache_dir is None:
        detail = f"off ({ebpf_cache.ENV_CACHE}): every start compiles each program"
        return CheckResult(name=name, ok=True, detail=detail)
    try:
        have = ebpf_cache.cached(cache_dir, source_key(), list(PROGRAMS))
    except OSError as exc:  # bpf/ unreadable: the compile will say so too
        return CheckResult(name=name, ok=True, detail=f"{cache_dir}: cannot key the sources: {exc}")
    detail = f"{cache_dir}: {len(have)} of {len(PROGRAMS)} programs kept for these sources"
    hint = "" if have else "the first eBPF start compiles each (about 1 s) and keeps it here"
    return CheckResult(name=name, ok=True, detail=detail, hint=hint)


def checks() -> list[CheckResult]:
    """Preflight for `meshagent check`: each line says what is missing and how to get it."""
    out = []
    try:
        import bcc  # noqa: F401, PLC0415
    except ImportError as exc:
        out.append(
            CheckResult(name="bcc importable", ok=False, detail=str(exc), hint="run scripts/setup")
        )
    else:
        out.append(CheckResult(name="bcc importable", ok=True, detail="bcc"))
    hdr = headers_dir()
    release = os.uname().release
    out.append(
        CheckResult(name="kernel headers", ok=True, detail=str(hdr))
        if hdr is not None
        else CheckResult(
            name="kernel headers",
            ok=False,
            detail=f"no /lib/modules/{release}/build: bcc compiles the capture programs against it",
            hint=HEADERS_HINT,
        )
    )
    mounted = bpffs_mounted()
    out.append(
        CheckResult(
            name="bpffs mounted",
            ok=True,
            detail=str(BPFFS) if mounted else f"not mounted; the agent mounts it at {BPFFS}",
        )
    )
    cg = cgroup2_mount()
    out.append(
        CheckResult(
            name="cgroup v2 mounted",
            ok=cg is not None,
            detail=str(cg or "no cgroup2 mount in /proc/mounts"),
            hint="" if cg else "mount -t cgroup2 none /sys/fs/cgroup/unified",
        )
    )
    out.append(_cache_check())
    for prog in PROGRAMS.values():
        why = probe_program(prog)
        hint = ""
        if why and prog.name == "sk_lookup":
            hint = "inbound capture falls back to iptables rules for each pod"
        elif why:
            hint = "this kernel lacks the program type; use --redirect iptables"
        out.append(
            CheckResult(
                name=f"bpf program {prog.name}", ok=not why, detail=why or "loads", hint=hint
            )
        )
    return out
