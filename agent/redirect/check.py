"""Preflight (`meshagent check`) and per-pod capture verification.

Rules:
1. Every check returns a `CheckResult(name, ok, detail, hint)`; a check never
   raises, a failure is a result with a reason and a hint.
2. Netfilter features are tested for real: a throwaway netns gets a rule using
   each feature (nat table, REDIRECT, mark, comment, multiport) in each
   installed backend, and is removed again.
3. eBPF checks come from `agent.redirect.ebpf_checks.checks()` when that module
   imports; `--redirect auto` picks ebpf only when all of those pass.
4. `verify_pod` sends real probe connections through a pod's capture: from
   inside the pod to a test address (outbound) and from the host to the pod IP
   (inbound), into temporary listeners on the proxy ports when none is there,
   and checks that the original destination was recovered.
"""

from __future__ import annotations

import contextlib
import errno
import os
import platform
import secrets
import select
import shutil
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from agent.errors import AgentError
from agent.redirect import netns
from agent.redirect.orig_dst import Lookup, original_dst

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

    from agent.redirect.model import CaptureSpec, PortSet

MIN_KERNEL = (4, 19)
PROBE_TIMEOUT = 2.0


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckResult:
    """One preflight or verification line."""

    name: str
    ok: bool
    detail: str = ""
    hint: str = ""


def _guard(name: str, fn: Callable[[], CheckResult]) -> CheckResult:
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - a check reports, it never raises
        return CheckResult(name=name, ok=False, detail=f"check crashed: {exc}", hint="report a bug")


# --- node preflight --------------------------------------------------------------


def check_kernel() -> CheckResult:
    release = platform.release()
    parts = release.split(".")
    try:
        version = (int(parts[0]), int("".join(c for c in parts[1] if c.isdigit()) or 0))
    except (IndexError, ValueError):
        return CheckResult(name="kernel version", ok=False, detail=release, hint="unparseable")
    ok = version >= MIN_KERNEL
    return CheckResult(
        name="kernel version",
        ok=ok,
        detail=f"{release} (need >= {MIN_KERNEL[0]}.{MIN_KERNEL[1]})",
        hint="" if ok else "upgrade the node kernel",
    )


def check_cgroup2() -> CheckResult:
    from agent.netlab import cgroup2_root  # noqa: PLC0415

    root = cgroup2_root()
    return CheckResult(
        name="cgroup v2 mounted",
        ok=root is not None,
        detail=f"cgroup2 at {root}" if root else "no cgroup2 mount in /proc/mounts",
        hint="" if root else "mount -t cgroup2 none /sys/fs/cgroup/unified (needed for eBPF mode)",
    )


def check_backends() -> list[CheckResult]:
    from agent.redirect import iptables_backend  # noqa: PLC0415

    have = iptables_backend.available_backends()
    out = [
        CheckResult(
            name="iptables backends present",
            ok=bool(have),
            detail=", ".join(b.value for b in have) or "none",
            hint="" if have else "install iptables (apt-get install iptables)",
        )
    ]
    if have:
        det = iptables_backend.detect_backend("auto")
        out.append(
            CheckResult(
                name="host iptables backend", ok=True, detail=f"{det.backend.value}: {det.reason}"
            )
        )
    return out


def check_iptc() -> CheckResult:
    try:
        import iptc  # noqa: F401, PLC0415
    except Exception as exc:  # noqa: BLE001 - import of a C binding may fail many ways
        return CheckResult(
            name="python-iptables (iptc writer)",
            ok=False,
            detail=str(exc),
            hint="set IPTABLES_LIBDIR/XTABLES_LIBDIR to the legacy libiptc libraries,"
            " or use the restore writer",
        )
    return CheckResult(name="python-iptables (iptc writer)", ok=True, detail="libiptc loaded")


@contextlib.contextmanager
def throwaway_netns() -> Iterator[Path]:
    """A temporary named netns with lo up, removed on exit."""
    from pyroute2 import netns as pnetns  # noqa: PLC0415

    name = f"macheck-{os.getpid()}-{secrets.token_hex(2)}"
    pnetns.create(name)
    path = netns.named_path(name)
    try:
        subprocess.run(
            [*netns.exec_argv(path), "ip", "link", "set", "lo", "up"], check=True, timeout=10
        )
        yield path
    finally:
        pnetns.remove(name)


_FEATURES = {
    "nat table": "-A OUTPUT -p tcp -j RETURN",
    "REDIRECT target": "-A OUTPUT -p tcp -j REDIRECT --to-ports 4140",
    "mark match": "-A OUTPUT -m mark --mark 0x539 -j RETURN",
    "comment match": '-A OUTPUT -m comment --comment "proxy-init/check" -j RETURN',
    "multiport match": "-A OUTPUT -p tcp -m multiport --dports 22,1000:2000 -j RETURN",
}


def check_netfilter() -> list[CheckResult]:
    """Each needed netfilter feature, applied for real in a throwaway netns."""
    from agent.redirect import iptables_backend  # noqa: PLC0415

    results: list[CheckResult] = []
    try:
        cm = throwaway_netns()
        path = cm.__enter__()
    except Exception as exc:  # noqa: BLE001
        return [
            CheckResult(
                name="network namespaces usable",
                ok=False,
                detail=str(exc),
                hint="needs root (CAP_SYS_ADMIN) and /run/netns writable",
            )
        ]
    try:
        results.append(
            CheckResult(name="network namespaces usable", ok=True, detail="created, lo up")
        )
        for backend in iptables_backend.available_backends():
            restore = iptables_backend.binary(backend, "restore")
            for feature, rule in _FEATURES.items():
                text = f"*nat\n{rule}\nCOMMIT\n"
                done = subprocess.run(
                    [*netns.exec_argv(path), restore],
                    input=text,
                    capture_output=True,
                    text=True,
                    timeout=10,
                    check=False,
                )
                ok = done.returncode == 0
                results.append(
                    CheckResult(
                        name=f"{feature} ({backend.value})",
                        ok=ok,
                        detail="applied in a throwaway netns" if ok else done.stderr.strip(),
                        hint="" if ok else f"load the kernel module for {feature} (nf_nat, xt_*)",
                    )
                )
    finally:
        cm.__exit__(None, None, None)
    return results


def ebpf_checks() -> list[CheckResult] | None:
    """The eBPF helper's checks, or None when its module is absent."""
    try:
        from agent.redirect import ebpf_checks  # noqa: PLC0415
    except ImportError:
        return None
    try:
        return list(ebpf_checks.checks())
    except Exception as exc:  # noqa: BLE001
        return [CheckResult(name="ebpf checks", ok=False, detail=f"crashed: {exc}", hint="")]


def node_checks() -> list[CheckResult]:
    """Every iptables-mode preflight check (the eBPF ones are separate)."""
    out = [_guard("kernel version", check_kernel), _guard("cgroup v2 mounted", check_cgroup2)]
    try:
        out += check_backends()
    except Exception as exc:  # noqa: BLE001
        out.append(CheckResult(name="iptables backends present", ok=False, detail=str(exc)))
    out.append(_guard("python-iptables (iptc writer)", check_iptc))
    out += check_netfilter()
    return out


def auto_mode(ebpf: list[CheckResult] | None) -> tuple[str, str]:
    """What `--redirect auto` picks, and why."""
    if ebpf is None:
        return "iptables", "eBPF mode is not available in this build"
    failed = [c.name for c in ebpf if not c.ok]
    if not ebpf or failed:
        return "iptables", "eBPF checks failed: " + (", ".join(failed) or "no checks")
    return "ebpf", "all eBPF checks passed"


# --- per-pod verification -----------------------------------------------------------


def _gateway_of(path: Path) -> str | None:
    def read() -> str:
        return Path("/proc/thread-self/net/route").read_text()

    for line in netns.run_in(path, read).splitlines()[1:]:
        f = line.split()
        if len(f) > 2 and f[1] == "00000000" and f[2] != "00000000":
            return socket.inet_ntoa(int(f[2], 16).to_bytes(4, "little"))
    return None


def _listener(path: Path, port: int) -> socket.socket | None:
    """A temporary listener on 0.0.0.0:port in the pod, or None if the port is taken."""
    sock = netns.socket_in(path)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("0.0.0.0", port))
        sock.listen(8)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            return None
        raise
    return sock


def _probe(
    name: str,
    connect: Callable[[], socket.socket],
    listener: socket.socket | None,
    expect: tuple[str, int],
    lookup: Lookup | None,
) -> CheckResult:
    token = secrets.token_bytes(8)
    try:
        client = connect()
    except OSError as exc:
        return CheckResult(
            name=name,
            ok=False,
            detail=f"connect to {expect[0]}:{expect[1]} failed: {exc}",
            hint="capture rules missing or the probe port/subnet is skipped",
        )
    with client:
        if listener is None:
            return CheckResult(
                name=name,
                ok=True,
                detail="reached the existing listener on the proxy port"
                " (original destination not checked)",
            )
        client.sendall(token)
        ready, _, _ = select.select([listener], [], [], PROBE_TIMEOUT)
        if not ready:
            return CheckResult(
                name=name,
                ok=False,
                detail="connected, but not to the proxy listener",
                hint="capture is not redirecting this connection",
            )
        conn, _ = listener.accept()
        with conn:
            conn.settimeout(PROBE_TIMEOUT)
            got = conn.recv(len(token))
            try:
                dst = original_dst(conn, lookup=lookup)
            except AgentError as exc:
                return CheckResult(
                    name=name, ok=False, detail=str(exc), hint="no original destination"
                )
    ok = got == token and dst == expect
    return CheckResult(
        name=name,
        ok=ok,
        detail=f"reached proxy listener, original destination {dst[0]}:{dst[1]}"
        + ("" if dst == expect else f" (expected {expect[0]}:{expect[1]})"),
        hint="" if ok else "original destination not recovered",
    )


def _free_port(spec: CaptureSpec, skip: PortSet, preferred: int) -> int:
    avoid: set[int] = {spec.inbound_port, spec.outbound_port, *spec.proxy_ports}
    candidates: list[int] = [preferred, *range(20000, 20100)]
    for port in candidates:
        if port not in avoid and port not in skip:
            return port
    return preferred


def verify_pod(
    spec: CaptureSpec,
    *,
    probe: tuple[str, int] | None = None,
    inbound_port: int | None = None,
    lookup: Lookup | None = None,
) -> list[CheckResult]:
    """Probe the pod's outbound and inbound capture for real."""
    path = Path(spec.netns)
    if probe is None:
        gateway = _gateway_of(path) or "192.0.2.1"
        probe = (gateway, _free_port(spec, spec.skip_outbound_ports, 9))
    port_in = inbound_port or _free_port(spec, spec.skip_inbound_ports, 80)

    def out_connect() -> socket.socket:
        sock = netns.socket_in(path)
        sock.settimeout(PROBE_TIMEOUT)
        try:
            sock.connect(probe)
        except OSError:
            sock.close()
            raise
        return sock

    def in_connect() -> socket.socket:
        return socket.create_connection((spec.pod_ip, port_in), timeout=PROBE_TIMEOUT)

    results = []
    for name, port, connect, expect in (
        ("outbound", spec.outbound_port, out_connect, probe),
        ("inbound", spec.inbound_port, in_connect, (spec.pod_ip, port_in)),
    ):
        listener = None
        try:
            listener = _listener(path, port)
            results.append(_probe(name, connect, listener, expect, lookup))
        except Exception as exc:  # noqa: BLE001
            results.append(CheckResult(name=name, ok=False, detail=f"probe failed: {exc}"))
        finally:
            if listener is not None:
                listener.close()
    return results


def tools_present() -> list[str]:
    """External tools this mode shells out to that are missing."""
    return [t for t in ("nsenter", "ip") if shutil.which(t) is None]
