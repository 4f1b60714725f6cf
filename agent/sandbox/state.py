"""The sandbox's record of what it made (`state.json`), the processes in it, and their removal.

`down` works from this record alone, also after a crash (`agent.sandbox.run`
rule 1), so everything `up` makes goes in it; each function under "removing"
undoes one kind of record. `SandboxError`, which every sandbox step raises,
lives here because this is the lowest module of the sandbox's shell
(`agent.sandbox.build` and `agent.sandbox.run` import it).

Rules:
1. The record is saved after every change, atomically (a temporary file
   renamed over `STATE_FILE`), so a crash leaves the last whole record.
2. `spawn` records each process with its PID, start time and final command line
   (once `nsenter` / `ip netns exec` has exec'd it: the PID stays the same). A spawn
   interrupted before that (Ctrl-C, SIGTERM) kills the process it started, which no
   record would find.
3. A recorded process is ours only while its start time and command line still
   match the record (`ours`); `kill_recorded` signals no other, so a reused PID
   is never killed.
4. Removing goes on past a failure and returns it as a line, so that `down`
   removes all it can; only `rm_cgroup` raises (`OSError`: still busy after 5 s).
5. Each sandbox's logs start empty (`rotate_logs`, before `up` builds): the last
   sandbox's move to `logs.previous/`, so a failed run can still be read after
   the next `up`, and one run's lines never sit above another's.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agent.errors import AgentError
from agent.netlab import start_time

if TYPE_CHECKING:
    from collections.abc import Sequence

SANDBOX_DIR = Path("/run/meshagent/sandbox")
STATE_FILE = SANDBOX_DIR / "state.json"
REPO = Path(__file__).resolve().parents[2]
AGENT_NETNS_DIR = Path("/run/meshagent/netns")


class SandboxError(AgentError):
    """The sandbox could not be built, inspected or removed; `hint` says how to fix it."""

    def __init__(self, what: str, reason: str, hint: str = "") -> None:
        self.what = what
        self.reason = reason
        self.hint = hint
        super().__init__(f"sandbox: {what}: {reason}" + (f"\n  hint: {hint}" if hint else ""))


# --- state -------------------------------------------------------------------------


def logs_dir() -> Path:
    """Where the sandbox's processes log, one file each."""
    return SANDBOX_DIR / "logs"


def rotate_logs() -> None:
    """Move the last sandbox's logs to `logs.previous/`, replacing older ones (rule 5).

    Raises:
        SandboxError: they could not be moved.
    """
    logs = logs_dir()
    previous = logs.with_name("logs.previous")
    if not logs.exists():
        return
    try:
        if previous.exists():
            shutil.rmtree(previous)
        logs.rename(previous)
    except OSError as exc:
        raise SandboxError(
            str(logs), f"cannot move the last sandbox's logs aside: {exc}", f"remove {logs}"
        ) from exc


def load_state() -> dict[str, Any] | None:
    """The recorded state, or None when no sandbox is recorded.

    Raises:
        SandboxError: the state file exists but cannot be read or parsed.
    """
    try:
        data = json.loads(STATE_FILE.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise SandboxError(str(STATE_FILE), f"unreadable: {exc}", "remove it by hand") from exc
    if not isinstance(data, dict):
        raise SandboxError(
            str(STATE_FILE), "not a sandbox record (not a JSON object)", "remove it by hand"
        )
    return data


class State:
    """The record `down` works from; saved after every change."""

    def __init__(self, data: dict[str, Any]) -> None:
        self.data = data

    def save(self) -> None:
        SANDBOX_DIR.mkdir(parents=True, exist_ok=True)
        tmp = STATE_FILE.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1))
        tmp.replace(STATE_FILE)

    def add(self, key: str, item: Any) -> None:
        self.data.setdefault(key, []).append(item)
        self.save()


def _cmdline(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    return raw.decode(errors="replace").split("\0")[:-1]


def ours(rec: dict[str, Any]) -> bool:
    """The recorded process is still running, and is still the one we started."""
    pid = rec["pid"]
    if start_time(pid) != rec.get("start"):
        return False
    return _cmdline(pid) == rec.get("argv")


# --- processes ---------------------------------------------------------------------


def spawn(  # noqa: PLR0913 - one process, fully described
    state: State,
    argv: Sequence[str],
    *,
    role: str,
    name: str,
    log: Path,
    netns_argv: Sequence[str] = (),
    cgroup: Path | None = None,
    env: dict[str, str] | None = None,
) -> subprocess.Popen[bytes]:
    """Start `argv` (behind `netns_argv`, in `cgroup`), logging to `log`, and record it (rule 2)."""
    full = [*netns_argv, *argv]

    def enter_cgroup() -> None:  # in the child, before exec
        if cgroup is not None:
            (cgroup / "cgroup.procs").write_text(str(os.getpid()))

    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as out:
        proc = subprocess.Popen(
            full,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            preexec_fn=enter_cgroup,  # noqa: PLW1509 - how the child joins the pod's cgroup
            start_new_session=True,
            env={**os.environ, **(env or {})},
            cwd=REPO,
        )
    try:
        # nsenter / ip netns exec exec the command: same PID; record the final argv once
        # visible.
        deadline = time.monotonic() + 5
        argv_now = _cmdline(proc.pid)
        while (
            time.monotonic() < deadline
            and argv_now is not None
            and argv_now[: len(argv)] != list(argv)
        ):
            time.sleep(0.01)
            argv_now = _cmdline(proc.pid)
        state.add(
            "procs",
            {
                "pid": proc.pid,
                "start": start_time(proc.pid),
                "argv": argv_now,
                "role": role,
                "name": name,
                "log": str(log),
            },
        )
    except BaseException:  # interrupted before it was recorded: `down` would not know it
        proc.kill()
        proc.wait()
        raise
    return proc


def kill_recorded(procs: list[dict[str, Any]]) -> list[str]:
    """SIGTERM, then SIGKILL, the recorded processes still ours (rule 3); returns the errors."""
    errors = []
    alive = [p for p in procs if ours(p)]
    for rec in alive:
        with contextlib.suppress(ProcessLookupError):
            os.kill(rec["pid"], 15)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(ours(p) for p in alive):
        time.sleep(0.05)
    for rec in alive:
        if ours(rec):
            with contextlib.suppress(ProcessLookupError):
                os.kill(rec["pid"], 9)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(ours(p) for p in alive):
        time.sleep(0.05)
    errors += [
        f"process {p['pid']} ({p['role']} {p['name']}) did not die" for p in alive if ours(p)
    ]
    # Reap our own children, if we started them (foreground up).
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass
    return errors


# --- removing ----------------------------------------------------------------------


def release_agent_netns(uids: list[str]) -> list[str]:
    """Unmount the agents' netns bind mounts of our pods (they keep namespaces alive)."""
    errors = []
    for uid in uids:
        path = AGENT_NETNS_DIR / uid
        if not path.exists():
            continue
        proc = subprocess.run(
            ["umount", "-l", str(path)], capture_output=True, text=True, check=False
        )
        if proc.returncode != 0 and os.path.ismount(path):
            errors.append(f"umount {path}: {proc.stderr.strip()}")
        with contextlib.suppress(OSError):
            path.unlink()
    return errors


def uninstall_bpf(pin_roots: list[str]) -> list[str]:
    """Remove the eBPF programs, maps, links and pins the agents left (a killed one leaves all)."""
    errors = []
    for raw in pin_roots:
        root = Path(raw)
        if not root.exists():
            continue
        from agent.redirect.ebpf import EbpfRedirector  # noqa: PLC0415 - eBPF mode only

        try:
            EbpfRedirector(pin_root=root, accelerate=False).uninstall()
        except (AgentError, OSError) as exc:
            errors.append(f"bpf pins {root}: {exc}")
    return errors


def rm_cgroup(path: Path) -> None:
    """Kill what is left in the cgroup and remove it.

    Raises:
        OSError: it could not be removed within 5 s.
    """
    if not path.exists():
        return
    with contextlib.suppress(OSError):
        (path / "cgroup.kill").write_text("1")
    deadline = time.monotonic() + 5
    while path.exists():
        try:
            path.rmdir()
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def forget(data: dict[str, Any]) -> None:
    """Remove the state file, generated manifests and the PKI `up` made."""
    for path in (STATE_FILE, SANDBOX_DIR / "manifests", SANDBOX_DIR / "identity"):
        if path.is_dir():
            if data.get("identity_dir") == str(path) or path.name == "manifests":
                shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
