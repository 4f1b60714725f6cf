"""Pod lab state: the JSON record of what a lab created, and its removal.

`agent.netlab.Lab` records each thing here before creating it; this module
writes those records, undoes them (at `close()`, or later from the file after a
crash) and finds the labs whose owner is gone.

Rules:
1. A lab's state file is `<state_dir>/<prefix>.json`: `{"prefix", "owner":
   {"pid", "start"}, "records": [...]}`, replaced atomically (write a `.tmp`,
   rename). A record is `{"kind": "proc", "pid", "start"}`, `{"kind": "netns",
   "name"}`, `{"kind": "link", "name", "netns", "peer_netns"}` (a veth's
   `peer_netns`: where its other end is; None for a bridge) or `{"kind": "cgroup",
   "path"}`.
2. Teardown kills processes first (by PID, only if the PID's start time still
   matches the record: never someone else's process), then undoes the other
   records newest first, carrying on past individual failures and returning
   them as text. A link one of whose ends is in a namespace the records remove
   goes with that namespace (`with_netns`): the kernel removes a namespace's
   devices, and both ends of a veth, in one batch, where deleting each veth
   waits for the network to quiesce (about 33 ms a link here: 3.6 s of a
   100-pod lab's 3.8 s). Teardown then waits until those links are gone, up to
   `LINK_GONE_S` (a namespace something else still holds stays), and deletes
   what is left itself.
3. A PID is identified by (pid, start time in clock ticks); an owner whose pair
   no longer matches is gone, and its lab is stale.
4. All netlink work runs through `agent.redirect.netns.run_in` (`ipr_do`);
   pyroute2 is imported there, lazily (it is heavy).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from agent.redirect import netns

if TYPE_CHECKING:
    from collections.abc import Callable

T = TypeVar("T")

STATE_DIR = Path("/run/meshagent/lab")
CGROUP_PARENT = "meshagent"


def start_time(pid: int) -> int | None:
    """Field 22 of /proc/PID/stat: start time in clock ticks (identifies a PID)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


def host_ns() -> str:
    """nsfs path of this process's netns (the host's, for the lab)."""
    return f"/proc/{os.getpid()}/ns/net"


def ipr_do(path: str, fn: Callable[[Any], T]) -> T:
    """Run `fn(IPRoute)` inside the namespace at `path`."""

    def inside() -> T:
        from pyroute2 import IPRoute  # noqa: PLC0415 - heavy import, lab only

        with IPRoute() as ipr:
            return fn(ipr)

    return netns.run_in(path, inside)


def write_state(path: Path, prefix: str, records: list[dict[str, Any]]) -> None:
    """Replace the state file at `path`, this process as the owner (rule 1)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    owner = {"pid": os.getpid(), "start": start_time(os.getpid())}
    tmp.write_text(json.dumps({"prefix": prefix, "owner": owner, "records": records}))
    tmp.replace(path)


def cleanup_recorded(prefix: str, *, state_dir: Path = STATE_DIR) -> list[str]:
    """Remove what a lab (e.g. a crashed run) recorded; returns the errors."""
    path = state_dir / f"{prefix}.json"
    try:
        state = json.loads(path.read_text())
    except FileNotFoundError:
        return []
    except (OSError, ValueError) as exc:
        return [f"{path}: {exc}"]
    errors = teardown(state.get("records", []))
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    return errors


def cleanup_stale(*, state_dir: Path = STATE_DIR) -> list[str]:
    """Clean every recorded lab whose owning process is gone."""
    errors: list[str] = []
    for path in sorted(state_dir.glob("*.json")):
        try:
            owner = json.loads(path.read_text()).get("owner", {})
        except (OSError, ValueError):
            owner = {}
        pid = owner.get("pid")
        if pid and start_time(pid) == owner.get("start"):
            continue  # still running
        errors += cleanup_recorded(path.stem, state_dir=state_dir)
    return errors


def kill_popen(proc: subprocess.Popen[Any]) -> None:
    """Kill a process this run started, wait for it and close its pipes."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5)
    for stream in (proc.stdin, proc.stdout, proc.stderr):
        if stream is not None:
            with contextlib.suppress(OSError):
                stream.close()


def _kill_recorded(pid: int, start: int | None) -> None:
    if start is None or start_time(pid) != start:
        return  # gone, or the PID now belongs to someone else
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    # Wait until it is dead (gone or a zombie); whoever is its parent reaps it.
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and _alive(pid):
        time.sleep(0.01)


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


LINK_GONE_S = 2.0  # rule 2: how long teardown waits for links to go with a namespace


def with_netns(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The link records that go with a namespace the records remove (rule 2)."""
    removed = {r["name"] for r in records if r["kind"] == "netns"}
    return [
        r
        for r in records
        if r["kind"] == "link" and (r.get("netns") in removed or r.get("peer_netns") in removed)
    ]


def teardown(records: list[dict[str, Any]]) -> list[str]:
    """Undo `records`: processes first, then the rest newest first (rule 2)."""
    errors: list[str] = []
    procs = [r for r in records if r["kind"] == "proc"]
    going = with_netns(records)
    deferred = {id(r) for r in going}
    rest = [r for r in records if r["kind"] != "proc" and id(r) not in deferred]
    for rec in reversed(procs):
        _kill_recorded(rec["pid"], rec.get("start"))
    for rec in reversed(rest):
        _undo(rec, errors)
    left = _await_gone(going, LINK_GONE_S)
    for rec in left:
        _undo(rec, errors)
    return errors


def _undo(rec: dict[str, Any], errors: list[str]) -> None:
    try:
        _UNDO[rec["kind"]](rec)
    except Exception as exc:  # noqa: BLE001 - carry on; report every failure
        errors.append(f"{rec}: {exc}")


def _await_gone(links: list[dict[str, Any]], within: float) -> list[dict[str, Any]]:
    """The `links` still there after up to `within` seconds."""
    deadline = time.monotonic() + within
    left = links
    while left:
        left = [r for r in left if _link_present(r)]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    return left


def _link_present(rec: dict[str, Any]) -> bool:
    path = _link_ns(rec)
    if path is None:
        return False
    try:
        return bool(ipr_do(path, lambda ipr: ipr.link_lookup(ifname=rec["name"])))
    except Exception:  # noqa: BLE001 - a namespace gone meanwhile: so is the link
        return False


def _link_ns(rec: dict[str, Any]) -> str | None:
    """The nsfs path of the namespace `rec`'s link is in, None once that is gone."""
    ns_name = rec.get("netns")
    if ns_name and not netns.named_path(ns_name).exists():
        return None
    return str(netns.named_path(ns_name)) if ns_name else host_ns()


def _undo_cgroup(rec: dict[str, Any]) -> None:
    path = Path(rec["path"])
    if not path.exists():
        return
    # Processes the lab's processes started are in here too: they are ours.
    with contextlib.suppress(OSError):
        (path / "cgroup.kill").write_text("1")
    deadline = time.monotonic() + 5
    while True:
        try:
            path.rmdir()
        except OSError as exc:
            if exc.errno == errno.ENOENT:
                return
            if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                raise
            time.sleep(0.02)
        else:
            _drop_empty_parent(path.parent)
            return


def _drop_empty_parent(parent: Path) -> None:
    """Remove the shared `meshagent` cgroup parent once its last lab child is gone."""
    if parent.name != CGROUP_PARENT:
        return
    with contextlib.suppress(OSError):  # not empty (another lab, an agent): keep it
        parent.rmdir()


def _undo_link(rec: dict[str, Any]) -> None:
    path = _link_ns(rec)
    if path is None:
        return  # went with its namespace

    def delete(ipr: Any) -> None:
        found = ipr.link_lookup(ifname=rec["name"])
        if found:
            ipr.link("del", index=found[0])

    ipr_do(path, delete)


def _undo_netns(rec: dict[str, Any]) -> None:
    from pyroute2 import netns as pnetns  # noqa: PLC0415

    if netns.named_path(rec["name"]).exists():
        pnetns.remove(rec["name"])


_UNDO: dict[str, Callable[[dict[str, Any]], None]] = {
    "cgroup": _undo_cgroup,
    "link": _undo_link,
    "netns": _undo_netns,
}
