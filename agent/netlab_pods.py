"""Pod lab nodes and pods: what `agent.netlab.Lab` hands out, and pod processes.

A `LabNode` is a bridge (in the host netns or its own node netns); a `LabPod`
is a netns + veth on its node's bridge + cgroup v2 directory, and runs
processes inside itself. `LabError` is what every part of the lab raises.

Rules:
1. Processes start inside the pod's netns (`nsenter --net=`) and are moved
   into its cgroup by the child itself before it execs anything.
2. Every process a pod starts is tracked by its lab (recorded in the state
   file, `agent.netlab_state`) until it is waited for (`run`) or the lab
   closes, which kills it.
3. Sockets "in a pod" are made on a thread inside its netns
   (`agent.redirect.netns.socket_in`); nothing here imports pyroute2.
4. A node placed on CPUs (`Lab.place`) runs its pods' processes there: a process
   started in a pod takes the CPUs before it execs (so every thread and child it
   makes inherits them), and one already running is moved, every thread of every
   process in the pod's cgroup (`LabPod.move_to`).
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agent.errors import AgentError
from agent.netlab_state import host_ns
from agent.redirect import netns

if TYPE_CHECKING:
    import ipaddress
    from collections.abc import Collection, Sequence

    from agent.netlab import Lab


class LabError(AgentError):
    """The lab could not create or remove something."""

    def __init__(self, what: str, reason: str) -> None:
        self.what = what
        self.reason = reason
        super().__init__(f"lab: {what}: {reason}")


def port_open(host: str, port: int, ns_path: str | Path | None = None) -> bool:
    """A TCP connection to `host:port` succeeds within half a second (from `ns_path`'s netns)."""
    try:
        sock = netns.socket_in(ns_path) if ns_path else socket.socket()
    except OSError:
        return False
    with sock:
        sock.settimeout(0.5)
        try:
            sock.connect((host, port))
        except OSError:
            return False
    return True


@dataclass(frozen=True, slots=True, kw_only=True)
class LabNode:
    """A node: a bridge with the pods' gateway IP, in the host or its own netns."""

    name: str
    subnet: ipaddress.IPv4Network
    bridge: str
    gateway: str
    netns_name: str | None = None  # None: the bridge lives in the host netns

    @property
    def netns(self) -> str:
        """nsfs path of the netns holding the bridge."""
        return str(netns.named_path(self.netns_name)) if self.netns_name else host_ns()


class LabPod:
    """A pod: netns + veth on its node's bridge + cgroup."""

    __slots__ = ("_lab", "cgroup", "ip", "name", "netns_name", "node", "veth")

    def __init__(  # noqa: PLR0913 - plain record
        self,
        lab: Lab,
        *,
        name: str,
        node: LabNode,
        ip: str,
        netns_name: str,
        veth: str,
        cgroup: Path | None,
    ) -> None:
        self._lab = lab
        self.name = name
        self.node = node
        self.ip = ip
        self.netns_name = netns_name
        self.veth = veth
        self.cgroup = cgroup

    def __repr__(self) -> str:
        return f"LabPod({self.name!r}, ip={self.ip}, netns={self.netns_name})"

    @property
    def netns(self) -> Path:
        """nsfs path: /run/netns/<prefix>-<name>."""
        return netns.named_path(self.netns_name)

    @property
    def gateway(self) -> str:
        return self.node.gateway

    def socket(
        self, family: int = socket.AF_INET, type_: int = socket.SOCK_STREAM
    ) -> socket.socket:
        """A socket inside this pod's netns."""
        return netns.socket_in(self.netns, family, type_)

    def spawn(self, argv: Sequence[str], **popen: Any) -> subprocess.Popen[Any]:
        """Start `argv` inside the pod (netns and cgroup); the lab kills it on close.

        Raises:
            LabError: the lab closed (before, or while it started: its cgroup went).
        """
        what = f"pod {self.name}: {' '.join(argv)}"
        if self._lab.closed:
            raise LabError(what, "the lab closed")
        cgroup = self.cgroup
        cpus = self._lab.cpus_of(self.node)

        def enter_cgroup() -> None:  # runs in the child, before exec
            if cgroup is not None:
                with (cgroup / "cgroup.procs").open("w") as f:
                    f.write(str(os.getpid()))
            if cpus is not None:  # rule 4
                os.sched_setaffinity(0, cpus)

        try:
            proc = subprocess.Popen(
                [*netns.exec_argv(self.netns), *argv],
                preexec_fn=enter_cgroup,  # noqa: PLW1509 - how the child joins the cgroup
                start_new_session=True,
                **popen,
            )
        except subprocess.SubprocessError as exc:
            if not self._lab.closed:
                raise
            raise LabError(what, "the lab closed") from exc
        self._lab.track(proc)
        return proc

    def move_to(self, cpus: Collection[int]) -> int:
        """Put every thread of every process in this pod's cgroup on `cpus` (rule 4); how
        many threads moved. One that exits meanwhile is skipped.

        Raises:
            LabError: the pod has no cgroup, so its processes cannot be found.
        """
        if self.cgroup is None:
            raise LabError(f"pod {self.name}", "no cgroup: cannot find its processes to place")
        moved = 0
        for pid in (self.cgroup / "cgroup.procs").read_text().split():
            with contextlib.suppress(FileNotFoundError):
                for task in Path(f"/proc/{pid}/task").iterdir():
                    with contextlib.suppress(ProcessLookupError):
                        os.sched_setaffinity(int(task.name), cpus)
                        moved += 1
        return moved

    def run(
        self,
        argv: Sequence[str],
        *,
        check: bool = True,
        timeout: float = 30,
        input_: str | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run `argv` in the pod to completion; output as text.

        Raises:
            LabError: `check` and it exited non-zero, or it timed out, or the lab closed
                while it ran (which kills it and closes its pipes).
        """
        what = f"pod {self.name}: {' '.join(argv)}"
        proc = self.spawn(
            argv,
            stdin=subprocess.PIPE if input_ is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            out, err = proc.communicate(input_, timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            raise LabError(what, f"timed out after {timeout}s") from None
        except (OSError, ValueError) as exc:  # its pipes closed under it
            if not self._lab.closed:
                raise
            raise LabError(what, "the lab closed") from exc
        finally:
            self._lab.untrack(proc)
        if check and proc.returncode != 0:
            raise LabError(what, f"exit {proc.returncode}: {err}")
        return subprocess.CompletedProcess(list(argv), proc.returncode, out, err)
