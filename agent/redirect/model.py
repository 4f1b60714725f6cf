"""What capture needs to know about one pod, and what any capture mode offers.

Pure data; no I/O. `CaptureSpec` is built from a pod and its namespace's
annotations (agent.redirect.annotations) and handed to a `Redirector`
(iptables or eBPF). `CaptureState` is what a redirector reads back from the
kernel, so `meshagent redirects` shows the kernel's truth, drift included.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from agent.config import ADMIN_PORT, CONTROL_PORT, INBOUND_PORT, OUTBOUND_PORT

if TYPE_CHECKING:
    import ipaddress
    from pathlib import Path

# Sockets the proxy opens for a pod carry this mark; capture skips them
# (the node proxy runs as root in the host, so a UID rule cannot tell it apart).
PROXY_MARK = 0x539


@dataclass(frozen=True, slots=True)
class PortRange:
    """An inclusive port range; a single port has first == last."""

    first: int
    last: int

    def __post_init__(self) -> None:
        if not (0 < self.first <= self.last < 65536):
            raise ValueError(f"bad port range {self.first}-{self.last}")

    def __contains__(self, port: object) -> bool:
        return isinstance(port, int) and self.first <= port <= self.last

    def __str__(self) -> str:
        return str(self.first) if self.first == self.last else f"{self.first}-{self.last}"


@dataclass(frozen=True, slots=True)
class PortSet:
    """A set of ports given as ranges, as Linkerd annotations write them."""

    ranges: tuple[PortRange, ...] = ()

    def __contains__(self, port: object) -> bool:
        return any(port in r for r in self.ranges)

    def __bool__(self) -> bool:
        return bool(self.ranges)

    def __str__(self) -> str:
        return ",".join(str(r) for r in self.ranges)


class Mode(enum.Enum):
    """How a pod's traffic is captured."""

    IPTABLES = "iptables"
    EBPF = "ebpf"


@dataclass(frozen=True, slots=True, kw_only=True)
class CaptureSpec:
    """Everything a redirector needs to capture one pod."""

    pod: str  # "namespace/name"
    netns: Path  # nsfs path, e.g. /run/netns/NAME or /proc/PID/ns/net
    pod_ip: str
    cgroup: Path | None = None  # cgroup v2 directory (eBPF mode)
    inbound_port: int = INBOUND_PORT
    outbound_port: int = OUTBOUND_PORT
    proxy_ports: tuple[int, ...] = (CONTROL_PORT, ADMIN_PORT)  # never captured inbound
    skip_inbound_ports: PortSet = field(default_factory=PortSet)
    skip_outbound_ports: PortSet = field(default_factory=PortSet)
    skip_subnets: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...] = ()
    opaque_ports: PortSet = field(default_factory=PortSet)
    skip_accel_ports: PortSet = field(default_factory=PortSet)  # eBPF same-node acceleration
    mark: int = PROXY_MARK

    def skipped_text(self, *, accel: bool) -> str:
        """What capture lets through, as `meshagent redirects` shows it: "in:PORTS
        [out:PORTS] [subnets:NETS]", and with `accel` (a mode that accelerates)
        "[accel:PORTS]"."""
        inbound = ",".join(
            [str(p) for p in self.proxy_ports] + [str(r) for r in self.skip_inbound_ports.ranges]
        )
        out = [f"in:{inbound}"]
        if self.skip_outbound_ports:
            out.append(f"out:{self.skip_outbound_ports}")
        if self.skip_subnets:
            out.append("subnets:" + ",".join(str(s) for s in self.skip_subnets))
        if accel and self.skip_accel_ports:
            out.append(f"accel:{self.skip_accel_ports}")
        return " ".join(out)


@dataclass(frozen=True, slots=True, kw_only=True)
class CaptureState:
    """A pod's capture as read back from the kernel."""

    pod: str
    netns: str
    mode: Mode
    inbound: str  # "captured", "missing", "partial", "fallback-iptables", ...
    outbound: str
    skipped_ports: str = ""
    counters: dict[str, int] = field(default_factory=dict)  # packets/bytes, map entries...
    detail: str = ""  # iptables-save text, or programs/maps listing
    drift: tuple[str, ...] = ()  # what differs from the plan
    extra: dict[str, Any] = field(default_factory=dict)


class Redirector(Protocol):
    """A capture mode. Implementations are thin shells over the kernel.

    enroll is idempotent (twice leaves the same state) and never resets
    connections the pod already has; unenroll removes exactly what enroll
    added; inspect reads the kernel, not memory.
    """

    mode: Mode

    def enroll(self, spec: CaptureSpec) -> None: ...

    def unenroll(self, spec: CaptureSpec) -> None: ...

    def inspect(self, spec: CaptureSpec) -> CaptureState: ...
