"""Pod lab: pods on this machine for tests and the sandbox.

A pod is a network namespace with an `eth0` on a node bridge (default route via
the bridge's gateway IP, `lo` up) and, for eBPF, a cgroup v2 directory. A node
is a bridge, either in the host netns (reachable from the host) or inside its
own "node" netns (isolated; nodes are joined with `Lab.link`, which routes each
node's pod subnet to the other, so pods on two nodes reach each other).

This module is the builder (`Lab`: nodes, pods, links, close) and the lab's
public face: what it hands out and how pods run processes are in
`agent.netlab_pods`, the state file and the removal of what it records in
`agent.netlab_state`; their public names are re-exported here.

Rules:
1. A `Lab` owns everything it creates and records each thing in a JSON state
   file under /run/meshagent/lab/ *before* creating it; `close()` (and, after a
   crash, `Lab.cleanup_recorded(prefix)`) removes it all in reverse order:
   processes first (by PID, checked against their start time), then cgroups,
   links and namespaces, carrying on past individual failures.
2. Names fit 15-character interface names: the prefix is at most 8 characters
   and interfaces are `<prefix><kind><n>`; namespaces are `<prefix>-<name>`
   (so `ip netns exec <prefix>-<name>` works) and cgroups are
   `<cgroup2 mount>/meshagent/<prefix>-<name>`.
3. Processes start inside the pod's netns and join its cgroup before they
   exec anything (`agent.netlab_pods` rule 1).
4. All netlink work runs through `agent.redirect.netns.run_in`, never on an
   event loop thread.
5. The records change and are written under one lock: pods start processes from
   several threads at once (tests run `pod.run` through `asyncio.to_thread`).
6. `place(node, cpus)` confines a node's pods to `cpus`, as a real node has its own:
   what its pods start from then on, and what they run already
   (`agent.netlab_pods` rule 4); `None` lifts it.
7. `on_cpu(cpu, fn, *args)` runs `fn` in a thread of this process pinned to `cpu`:
   a connection it makes over a pod's loopback or veth is taken in on that CPU, which
   is what the proxy's steering (agent.proxy.placement) goes by; `allowed_cpus(pid)`
   reads back where a process may run, as the kernel lists it.
8. A node's bridge gets a fixed MAC address when it is made (`bridge_mac`). One
   without takes its lowest port's, so it changes as pods join; a pod that resolved
   its gateway before then keeps sending to the old address, now one of the bridge's
   ports', and the bridge hands such frames up marked as another host's, which IP
   drops (seen: the bench's twin pods, made first on their nodes, could not reach
   the other node for over 10 s once the meshed pods had joined).
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import re
import subprocess
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self, TypeVar

from agent import netlab_state
from agent.netlab_pods import LabError, LabNode, LabPod, port_open
from agent.netlab_state import (
    CGROUP_PARENT,
    STATE_DIR,
    ipr_do,
    kill_popen,
    start_time,
    teardown,
    write_state,
)
from agent.redirect import netns

if TYPE_CHECKING:
    from collections.abc import Callable, Collection, Iterator

__all__ = [
    "CGROUP_PARENT",
    "LAB_POOL",
    "LINK_POOL",
    "STATE_DIR",
    "Lab",
    "LabError",
    "LabNode",
    "LabPod",
    "cgroup2_root",
    "lab",
    "port_open",
    "start_time",
]

logger = logging.getLogger(__name__)

LAB_POOL = ipaddress.IPv4Network("10.200.0.0/16")  # where free /24 node subnets come from
LINK_POOL = ipaddress.IPv4Network("100.64.0.0/16")  # /30 transfer nets between nodes
_PREFIX_RE = re.compile(r"^[a-z][a-z0-9]{0,7}$")
_NAME_RE = re.compile(r"^[a-z0-9]([a-z0-9-]{0,40}[a-z0-9])?$")


def cgroup2_root(mounts: str | None = None) -> Path | None:
    """Where the unified (v2) cgroup hierarchy is mounted, from /proc/mounts."""
    if mounts is None:
        mounts = Path("/proc/mounts").read_text()
    for line in mounts.splitlines():
        parts = line.split()
        if len(parts) >= 3 and parts[2] == "cgroup2":
            return Path(parts[1])
    return None


def bridge_mac() -> str:
    """A random locally administered unicast MAC address for a node's bridge (rule 8)."""
    octets = bytearray(os.urandom(6))
    octets[0] = (octets[0] & 0xFC) | 0x02  # locally administered, not multicast
    return ":".join(f"{b:02x}" for b in octets)


class Lab:
    """Creates nodes and pods and removes all of them, even after failures."""

    def __init__(self, prefix: str, *, state_dir: Path = STATE_DIR) -> None:
        if not _PREFIX_RE.match(prefix):
            raise LabError(f"prefix {prefix!r}", "must match [a-z][a-z0-9]{0,7}")
        self.prefix = prefix
        self.state_file = state_dir / f"{prefix}.json"
        self.nodes: dict[str, LabNode] = {}
        self.pods: dict[str, LabPod] = {}
        self._records: list[dict[str, Any]] = []
        self._lock = threading.Lock()  # rule 5
        self._procs: dict[int, subprocess.Popen[Any]] = {}
        self._cpus: dict[str, frozenset[int]] = {}  # node name -> its CPUs (rule 6)
        self._seq = 0
        self._links = 0
        self._closed = False
        if self.state_file.exists():
            raise LabError(str(self.state_file), "a lab with this prefix exists; clean it first")
        self._save()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- records -----------------------------------------------------------

    def _save(self) -> None:
        with self._lock:
            write_state(self.state_file, self.prefix, self._records)

    def _record(self, **rec: Any) -> None:
        with self._lock:
            self._records.append(rec)
            write_state(self.state_file, self.prefix, self._records)

    # --- placement (rule 6) -------------------------------------------------

    def place(self, node: LabNode, cpus: Collection[int] | None) -> None:
        """Run `node`'s pods on `cpus` (None: anywhere this process may run).

        Raises:
            LabError: `cpus` is empty or names a CPU this process may not use, or a pod of
                the node has no cgroup.
        """
        allowed = os.sched_getaffinity(0)
        chosen = frozenset(allowed if cpus is None else cpus)
        if not chosen or not chosen <= allowed:
            raise LabError(
                f"node {node.name}", f"cpus {sorted(chosen)} not within {sorted(allowed)}"
            )
        if cpus is None:
            self._cpus.pop(node.name, None)
        else:
            self._cpus[node.name] = chosen
        for pod in self.pods.values():
            if pod.node.name == node.name:
                pod.move_to(chosen)

    @property
    def closed(self) -> bool:
        """`close` ran (or runs now, from another thread)."""
        return self._closed

    def cpus_of(self, node: LabNode) -> frozenset[int] | None:
        """The CPUs `node` is placed on, or None."""
        return self._cpus.get(node.name)

    def track(self, proc: subprocess.Popen[Any]) -> None:
        self._procs[proc.pid] = proc
        self._record(kind="proc", pid=proc.pid, start=start_time(proc.pid))

    def untrack(self, proc: subprocess.Popen[Any]) -> None:
        self._procs.pop(proc.pid, None)
        with self._lock:
            self._records = [
                r for r in self._records if not (r["kind"] == "proc" and r["pid"] == proc.pid)
            ]
            write_state(self.state_file, self.prefix, self._records)

    def _next(self) -> int:
        self._seq += 1
        return self._seq

    # --- nodes and pods ----------------------------------------------------

    def free_subnet(self) -> ipaddress.IPv4Network:
        """A /24 from 10.200.0.0/16 that no host route or node of this lab uses."""
        used: set[ipaddress.IPv4Network | ipaddress.IPv6Network] = {
            n.subnet for n in self.nodes.values()
        }
        routes = subprocess.run(
            ["ip", "-4", "route", "show"], capture_output=True, text=True, check=False
        ).stdout
        for word in routes.split():
            with contextlib.suppress(ValueError):
                used.add(ipaddress.ip_network(word, strict=False))
        start = (os.getpid() * 7 + len(self.nodes) * 13) % 256
        for k in range(256):
            candidate = ipaddress.IPv4Network(f"10.200.{(start + k) % 256}.0/24")
            if not any(candidate.overlaps(u) for u in used if u.prefixlen > 0):
                return candidate
        raise LabError("free_subnet", "no free /24 left in 10.200.0.0/16")

    def node(self, name: str, subnet: str | None = None, *, isolated: bool = False) -> LabNode:
        """A bridge with gateway = first host of `subnet` (default: a free /24).

        `isolated` puts the bridge inside its own node netns (join nodes with
        `link`); otherwise it lives in the host netns and the host reaches pods.

        Raises:
            LabError: bad name/subnet, or netlink refused.
        """
        self._check_name(name, self.nodes)
        net = ipaddress.ip_network(subnet) if subnet else self.free_subnet()
        if not isinstance(net, ipaddress.IPv4Network) or net.prefixlen > 29:
            raise LabError(f"node {name}", f"subnet {net} must be IPv4 with room for pods")
        ns_name = f"{self.prefix}-n-{name}" if isolated else None
        node = LabNode(
            name=name,
            subnet=net,
            bridge=f"{self.prefix}b{self._next()}",
            gateway=str(net.network_address + 1),
            netns_name=ns_name,
        )
        if ns_name:
            self._make_netns(ns_name)
            self._set_up_lo(node.netns)
            self._sysctl(node.netns, "net/ipv4/ip_forward", "1")
        self._record(kind="link", name=node.bridge, netns=ns_name)

        def make_bridge(ipr: Any) -> None:
            ipr.link("add", ifname=node.bridge, kind="bridge", address=bridge_mac())  # rule 8
            idx = ipr.link_lookup(ifname=node.bridge)[0]
            ipr.addr("add", index=idx, address=node.gateway, prefixlen=net.prefixlen)
            ipr.link("set", index=idx, state="up")

        self._netlink(f"node {name}", node.netns, make_bridge)
        self.nodes[name] = node
        return node

    def pod(self, node: LabNode, name: str, ip: str | None = None) -> LabPod:
        """A pod on `node` with `ip` (default: the next free address of the subnet).

        Raises:
            LabError: bad name/IP, or netlink refused.
        """
        self._check_name(name, self.pods)
        addr = ipaddress.ip_address(ip) if ip else self._next_ip(node)
        if addr not in node.subnet or str(addr) == node.gateway:
            raise LabError(f"pod {name}", f"ip {addr} is not a free host of {node.subnet}")
        ns_name = f"{self.prefix}-{name}"
        veth = f"{self.prefix}v{self._next()}"
        self._make_netns(ns_name)
        self._record(kind="link", name=veth, netns=node.netns_name, peer_netns=ns_name)

        def make_veth(ipr: Any) -> None:
            ipr.link("add", ifname=veth, kind="veth", peer={"ifname": "eth0", "net_ns_fd": ns_name})
            idx = ipr.link_lookup(ifname=veth)[0]
            br = ipr.link_lookup(ifname=node.bridge)[0]
            ipr.link("set", index=idx, master=br, state="up")

        def inside(ipr: Any) -> None:
            eth = ipr.link_lookup(ifname="eth0")[0]
            ipr.addr("add", index=eth, address=str(addr), prefixlen=node.subnet.prefixlen)
            ipr.link("set", index=eth, state="up")
            ipr.link("set", index=ipr.link_lookup(ifname="lo")[0], state="up")
            ipr.route("add", dst="0.0.0.0/0", gateway=node.gateway)

        self._netlink(f"pod {name}", node.netns, make_veth)
        self._netlink(f"pod {name}", str(netns.named_path(ns_name)), inside)
        cgroup = self._make_cgroup(ns_name)
        pod = LabPod(
            self, name=name, node=node, ip=str(addr), netns_name=ns_name, veth=veth, cgroup=cgroup
        )
        self.pods[name] = pod
        return pod

    def link(self, a: LabNode, b: LabNode) -> None:
        """Join two isolated nodes by a veth pair and route their pod subnets.

        Raises:
            LabError: a node is not isolated, or netlink refused.
        """
        if not (a.netns_name and b.netns_name):
            raise LabError(f"link {a.name}-{b.name}", "only isolated nodes can be linked")
        self._links += 1
        k = self._links
        transfer = list(LINK_POOL.subnets(new_prefix=30))[k]
        ip_a, ip_b = str(transfer.network_address + 1), str(transfer.network_address + 2)
        end_a, end_b = f"{self.prefix}l{k}a", f"{self.prefix}l{k}b"
        self._record(kind="link", name=end_a, netns=a.netns_name, peer_netns=b.netns_name)
        b_ns = b.netns_name

        def make_pair(ipr: Any) -> None:
            ipr.link("add", ifname=end_a, kind="veth", peer={"ifname": end_b, "net_ns_fd": b_ns})

        def configure(end: str, mine: str, peer_ip: str, other: LabNode) -> Callable[[Any], None]:
            def fn(ipr: Any) -> None:
                idx = ipr.link_lookup(ifname=end)[0]
                ipr.addr("add", index=idx, address=mine, prefixlen=30)
                ipr.link("set", index=idx, state="up")
                ipr.route("add", dst=str(other.subnet), gateway=peer_ip)

            return fn

        self._netlink(f"link {a.name}-{b.name}", a.netns, make_pair)
        self._netlink(f"link {a.name}", a.netns, configure(end_a, ip_a, ip_b, b))
        self._netlink(f"link {b.name}", b.netns, configure(end_b, ip_b, ip_a, a))

    # --- helpers -----------------------------------------------------------

    def _check_name(self, name: str, taken: dict[str, Any]) -> None:
        if not _NAME_RE.match(name):
            raise LabError(f"name {name!r}", "use lowercase letters, digits and '-'")
        if name in taken:
            raise LabError(f"name {name!r}", "already used in this lab")

    def _next_ip(self, node: LabNode) -> ipaddress.IPv4Address:
        used = {p.ip for p in self.pods.values() if p.node == node} | {node.gateway}
        for host in node.subnet.hosts():
            if str(host) not in used:
                return host
        raise LabError(f"node {node.name}", f"subnet {node.subnet} is full")

    def _netlink(self, what: str, path: str, fn: Callable[[Any], None]) -> None:
        try:
            ipr_do(path, fn)
        except Exception as exc:  # pyroute2 raises NetlinkError, OSError, IndexError...
            raise LabError(what, f"netlink: {exc}") from exc

    def _make_netns(self, name: str) -> None:
        from pyroute2 import netns as pnetns  # noqa: PLC0415

        if netns.named_path(name).exists():
            raise LabError(f"netns {name}", "already exists")
        self._record(kind="netns", name=name)
        try:
            pnetns.create(name)
        except OSError as exc:
            raise LabError(f"netns {name}", str(exc)) from exc

    def _set_up_lo(self, path: str) -> None:
        def up(ipr: Any) -> None:
            ipr.link("set", index=ipr.link_lookup(ifname="lo")[0], state="up")

        self._netlink("lo", path, up)

    def _sysctl(self, path: str, key: str, value: str) -> None:
        # /proc/sys/net follows the netns of the thread that opens it.
        netns.run_in(path, lambda: Path("/proc/sys", key).write_text(value))

    def _make_cgroup(self, name: str) -> Path | None:
        root = cgroup2_root()
        if root is None:
            return None
        path = root / CGROUP_PARENT / name
        (root / CGROUP_PARENT).mkdir(exist_ok=True)
        self._record(kind="cgroup", path=str(path))
        path.mkdir()
        return path

    # --- teardown ----------------------------------------------------------

    def close(self) -> None:
        """Kill the lab's processes and remove everything it created. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for proc in list(self._procs.values()):  # other threads may still start some
            kill_popen(proc)
        errors = teardown(self._records)
        self._records = []
        self._procs.clear()
        with contextlib.suppress(FileNotFoundError):
            self.state_file.unlink()
        for err in errors:
            logger.warning("lab cleanup: %s", err, extra={"lab": self.prefix})

    @classmethod
    def cleanup_recorded(cls, prefix: str, *, state_dir: Path = STATE_DIR) -> list[str]:
        """Remove what a lab (e.g. a crashed run) recorded; returns the errors."""
        return netlab_state.cleanup_recorded(prefix, state_dir=state_dir)

    @classmethod
    def cleanup_stale(cls, *, state_dir: Path = STATE_DIR) -> list[str]:
        """Clean every recorded lab whose owning process is gone."""
        return netlab_state.cleanup_stale(state_dir=state_dir)


_T = TypeVar("_T")


@contextlib.contextmanager
def lab(prefix: str) -> Iterator[Lab]:
    """`with lab("t1") as lb:` -- a Lab closed on exit, whatever happened."""
    lb = Lab(prefix)
    try:
        yield lb
    finally:
        lb.close()


def on_cpu(cpu: int, fn: Callable[..., _T], *args: Any, timeout: float = 10.0) -> _T:
    """`fn(*args)` in a thread that runs on `cpu` only (rule 7): its result, or its
    exception raised here.

    Raises:
        TimeoutError: `fn` did not return within `timeout` seconds.
    """
    out: list[_T] = []
    failed: list[BaseException] = []

    def run() -> None:
        try:
            os.sched_setaffinity(0, {cpu})  # this thread only
            out.append(fn(*args))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            failed.append(exc)

    thread = threading.Thread(target=run, name=f"on-cpu-{cpu}", daemon=True)
    thread.start()
    thread.join(timeout)
    if failed:
        raise failed[0]
    if not out:
        raise TimeoutError(f"{fn!r} did not return within {timeout} s on CPU {cpu}")
    return out[0]


def allowed_cpus(pid: int) -> str:
    """The CPUs process `pid` may run on, as /proc lists them (`0-1`, `3`): rule 7."""
    status = Path(f"/proc/{pid}/status").read_text()
    return next(ln.split()[1] for ln in status.splitlines() if ln.startswith("Cpus_allowed_list"))
