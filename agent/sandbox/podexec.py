"""`meshagent sandbox exec POD -- CMD`: run a command as if inside a sandbox pod.

Like `kubectl exec`: the command joins the pod's cgroup (so eBPF capture,
which is attached to the pod's cgroup, applies to it exactly as to the pod's
own processes) and its network namespace through `ip netns exec` (so
`/etc/netns/<pod>/hosts` makes service names resolve). A plain
`ip netns exec` from the host stays in the host's cgroup, which eBPF mode
does not capture.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agent.errors import AgentError

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence


class PodNotFoundError(AgentError):
    """No pod of the running sandbox matches the reference."""

    def __init__(self, ref: str, known: Sequence[str]) -> None:
        self.ref = ref
        super().__init__(
            f"no sandbox pod {ref!r} (pods: {', '.join(known) or 'none; is the sandbox up?'})"
        )


def find_pod(state: Mapping[str, Any], ref: str) -> dict[str, Any]:
    """The pod record for `ref`: `ns/name`, `name`, or a unique name prefix (`shop/web`).

    Raises:
        PodNotFoundError: nothing, or more than one pod, matches.
    """
    pods: list[dict[str, Any]] = list(state.get("pods") or [])
    ns, _, name = ref.rpartition("/")
    keys = [f"{p['namespace']}/{p['name']}" for p in pods]
    exact = [p for p in pods if p["name"] == name and ns in ("", p["namespace"])]
    if len(exact) == 1:
        return exact[0]
    prefix = [p for p in pods if p["name"].startswith(name) and ns in ("", p["namespace"])]
    if len(prefix) == 1:
        return prefix[0]
    raise PodNotFoundError(ref, keys)


def argv_for(pod: Mapping[str, Any], command: Sequence[str]) -> list[str]:
    """The argv that enters the pod's network namespace and runs `command`."""
    return ["ip", "netns", "exec", str(pod["netns"]), *command]


def exec_in_pod(pod: Mapping[str, Any], command: Sequence[str]) -> None:
    """Join the pod's cgroup, then replace this process with `command` in its netns.

    Raises:
        AgentError: the pod's cgroup cannot be joined.
    """
    if not command:
        raise AgentError("sandbox exec: no command given (use: sandbox exec POD -- CMD ...)")
    cgroup = pod.get("cgroup")
    if cgroup:
        try:
            (Path(cgroup) / "cgroup.procs").write_text(f"{os.getpid()}\n")
        except OSError as exc:
            raise AgentError(f"sandbox exec: cannot join cgroup {cgroup}: {exc}") from exc
    argv = argv_for(pod, command)
    os.execvp(argv[0], argv)  # noqa: S606 - replaces this process, as kubectl exec would
