"""Reading one pod's eBPF capture back from the kernel (`EbpfRedirector.inspect`).

Rules:
1. Everything comes from the kernel: the pod's pinned links and what they are
   attached to, and the shared maps' entries for the pod's netns cookie and IP;
   never the redirector's memory. Drift is what the kernel has that the spec
   does not plan (a link on another target, a different pod config).
2. Read-only: nothing here attaches, updates or removes anything.
3. Same-node acceleration is its own section, `extra["acceleration"]`, present
   for every eBPF-mode pod: whether the pod's config enables it, the node's
   sk_msg side (`NODE_*`), the pod's sockets in the sockhash, and the
   node-wide sk_msg counters (`maps.accel_stats`; all zero when never loaded).
   `acceleration_lines` renders it for `meshagent redirects show`.
"""

from __future__ import annotations

import contextlib
import ctypes
import socket
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agent.errors import AgentError, RedirectError
from agent.redirect import maps, netns
from agent.redirect.maps import BpfError
from agent.redirect.model import CaptureState

if TYPE_CHECKING:
    from collections.abc import Mapping

    from agent.redirect.ebpf import EbpfRedirector
    from agent.redirect.model import CaptureSpec

# extra["acceleration"]["node"]: the node's sk_msg side of same-node acceleration
NODE_ACTIVE = "active"  # sk_msg maps pinned, sockops linked on the agent's cgroup
NODE_DETACHED = "detached"  # sk_msg maps pinned (loaded once), node sockops link gone
NODE_NOT_LOADED = "not-loaded"  # sk_msg never loaded under this pin root: counters are zero


def inspect(red: EbpfRedirector, spec: CaptureSpec) -> CaptureState:
    """The pod's capture as the kernel has it.

    Raises:
        RedirectError: the pinned maps cannot be read.
    """
    links = maps.link_infos(red.pod_dir(spec))
    want = {_target_id(spec, n): n for n in links}
    drift = [
        f"link {n} attached to {i.target}, want {t}"
        for t, n in want.items()
        if (i := links[n]).target != t
    ]
    try:
        cookie: int | None = netns_cookie_of(spec.netns)
    except AgentError:
        cookie = None
    try:
        entries = _entries(red, spec, cookie)
    except BpfError as exc:
        if links:
            raise RedirectError(spec.pod, str(spec.netns), "inspect", str(exc)) from exc
        entries = _Entries()
    outbound = _direction({"connect4", "sockops"} <= links.keys() and entries.cfg_netns)
    inbound = _inbound_state(red, spec, links, entries)
    accelerate = bool(entries.cfg is not None and entries.cfg.flags & maps.F_ACCEL)
    if entries.cfg is not None:
        planned = red.pod_config(spec, inbound="sk_lookup" in links)
        if bytes(planned) != bytes(entries.cfg):
            drift.append("pod config in ma_cfg_netns differs from the spec")
    return CaptureState(
        pod=spec.pod,
        netns=str(spec.netns),
        mode=red.mode,
        inbound=inbound,
        outbound=outbound,
        skipped_ports=spec.skipped_text(accel=True),
        counters={
            "orig_dst_entries": len(entries.orig),
            "inbound_listener": int(entries.listener),
            "accel_sockets": entries.accel,
            "links": len(links),
        },
        detail=_detail(red, links, entries),
        drift=tuple(drift),
        extra={
            "links": {
                n: {"id": i.id, "prog_id": i.prog_id, "target": i.target} for n, i in links.items()
            },
            "orig_dst": entries.orig,
            "accelerate": accelerate,
            "acceleration": _acceleration(red, enabled=accelerate, sockets=entries.accel),
            "sk_lookup_error": red.sk_lookup_error,
            "pins": str(red.pod_dir(spec)),
        },
    )


def acceleration_lines(view: Mapping[str, Any]) -> list[str]:
    """`redirects show`'s text for an `extra["acceleration"]` section; pure."""
    state = "enabled" if view.get("enabled") else "disabled"
    node = view.get("node", NODE_NOT_LOADED)
    head = f"acceleration: {state} for this pod; node sk_msg {node}"
    if node == NODE_NOT_LOADED:
        return [head]
    lines = [f"{head}; {view.get('sockets', 0)} pod sockets in {maps.ACCEL_SOCKS}"]
    if view.get("error"):
        lines.append(f"acceleration counters unreadable: {view['error']}")
    lines += [
        f"acceleration counter (node) {name}: {value}"
        for name, value in view.get("counters", {}).items()
    ]
    return lines


def _acceleration(red: EbpfRedirector, *, enabled: bool, sockets: int) -> dict[str, Any]:
    if not (red.maps_dir / maps.ACCEL_STATS).exists():
        node = NODE_NOT_LOADED
    elif "sockops" in maps.link_infos(red.pin_root / "node"):
        node = NODE_ACTIVE
    else:
        node = NODE_DETACHED
    out: dict[str, Any] = {"enabled": enabled, "node": node, "sockets": sockets}
    try:
        out["counters"] = maps.accel_stats(red.maps_dir)
    except BpfError as exc:
        out["counters"] = {}
        out["error"] = str(exc)
    return out


def _target_id(spec: CaptureSpec, link: str) -> int:
    if link == "sk_lookup":
        return Path(spec.netns).stat().st_ino
    return spec.cgroup.stat().st_ino if spec.cgroup is not None else 0


def _entries(red: EbpfRedirector, spec: CaptureSpec, cookie: int | None) -> _Entries:
    ip = maps.ip_be(spec.pod_ip)
    out = _Entries()
    with red.open_map(maps.CFG_BY_NETNS) as m:
        out.cfg = m.lookup(ctypes.c_uint64(cookie)) if cookie is not None else None
        out.cfg_netns = out.cfg is not None
    with red.open_map(maps.CFG_BY_IP) as m:
        out.cfg_ip = m.lookup(ctypes.c_uint32(ip)) is not None
    with red.open_map(maps.LISTENERS) as m:
        out.listener = m.lookup(ctypes.c_uint32(ip)) is not None
    with red.open_map(maps.ORIG_DST) as m:
        out.orig = sorted(
            f"{maps.ip_str(k.ip)}:{k.port} -> {':'.join(map(str, maps.orig_dst_addr(v)))}"
            for k, v in m.items()
            if k.netns == cookie
        )
    with red.open_map(maps.ACCEL_SOCKS) as m:
        out.accel = sum(1 for k in m.key_list() if k.netns == cookie)
    return out


def _inbound_state(
    red: EbpfRedirector, spec: CaptureSpec, links: dict[str, maps.LinkInfo], e: _Entries
) -> str:
    if "sk_lookup" in links and e.cfg_ip:
        return "captured" if e.listener else "no-listener"
    if "sk_lookup" not in links and not e.cfg_ip:
        try:
            if red.inbound_fallback().has_inbound(spec):
                return "fallback-iptables"
        except AgentError:
            pass
        return "missing"
    return "partial"


def _detail(red: EbpfRedirector, links: dict[str, maps.LinkInfo], e: _Entries) -> str:
    lines = [f"link {n}: id {i.id} prog {i.prog_id} target {i.target}" for n, i in links.items()]
    for name in maps.MAP_TYPES:
        with contextlib.suppress(BpfError), red.open_map(name) as m:
            info = maps.obj_info(m.fd)
            map_id = struct.unpack_from("<I", info, 4)[0]
            lines.append(f"map {name}: id {map_id} entries {sum(1 for _ in m.key_list())}")
    lines += [f"orig_dst {o}" for o in e.orig]
    return "\n".join(lines)


@dataclass(slots=True)
class _Entries:
    """What the shared maps hold for one pod."""

    cfg: maps.PodConfigC | None = None
    cfg_netns: bool = False
    cfg_ip: bool = False
    listener: bool = False
    orig: list[str] = field(default_factory=list)
    accel: int = 0


def _direction(ok: object) -> str:
    return "captured" if ok else "missing"


def netns_cookie_of(path: str | Path) -> int:
    """The cookie of the network namespace at `path`.

    Raises:
        NetnsError: the namespace cannot be entered.
    """
    sock = netns.socket_in(path, socket.AF_INET, socket.SOCK_DGRAM)
    with sock:
        return maps.netns_cookie(sock)
