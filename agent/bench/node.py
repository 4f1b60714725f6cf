"""A stand-in node agent for the bench, built from the pieces that exist today.

`python -m agent.bench.node --mode iptables|ebpf --pods FILE.json [--workers N]`
enrolls each pod of FILE (a JSON list of `{"pod", "netns", "ip", "cgroup"}`)
with the redirector of `--mode`, opens its outbound (127.0.0.1:4140) and
inbound (0.0.0.0:4143) listeners inside the pod's netns, hands them to a
`WorkerPool` running the default data path (the opaque relay to the original
destination), prints `ready` on stdout and serves until SIGTERM or SIGINT.

It stands in for `meshagent run` until `agent/supervisor.py` can be driven
from a manifests folder: no control plane, no identity, no mTLS, no HTTP
awareness. `agent.bench.setups.start_node_agent` is the one caller.

Rules:
1. On exit (signal, or an error while starting) it unenrolls every pod it
   enrolled, closes the pool (killing its workers) and, in eBPF mode,
   uninstalls its pins; the harness also removes the pin root if it crashed.
2. The eBPF pins live under `--pin-root` (one per agent), so two agents on
   this one kernel, standing for two nodes, do not share maps.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agent import aio
from agent.proxy.listener import ListenerKind, open_pod_listeners
from agent.proxy.pool import WorkerOptions, WorkerPool
from agent.redirect.annotations import build_spec
from agent.redirect.iptables import IptablesRedirector

if TYPE_CHECKING:
    from agent.redirect.model import CaptureSpec

logger = logging.getLogger(__name__)


def _redirector(mode: str, pin_root: str) -> Any:
    if mode == "iptables":
        return IptablesRedirector()
    from agent.redirect.ebpf import EbpfRedirector  # noqa: PLC0415 - bcc is heavy

    return EbpfRedirector(pin_root=Path(pin_root), accelerate=False)


def _specs(pods: list[dict[str, str]]) -> list[CaptureSpec]:
    return [
        build_spec(
            pod=p["pod"],
            netns=Path(p["netns"]),
            pod_ip=p["ip"],
            pod_annotations={},
            cgroup=Path(p["cgroup"]) if p.get("cgroup") else None,
        )
        for p in pods
    ]


async def serve(args: argparse.Namespace) -> int:
    pods = json.loads(Path(args.pods).read_text())  # noqa: ASYNC240 - once, before serving
    specs = _specs(pods)
    red = _redirector(args.mode, args.pin_root)
    # plugins=(): the opaque relay, not the data path being written (it needs a supervisor)
    options = WorkerOptions(log_level=args.worker_log_level, plugins=())
    pool = WorkerPool(args.workers, options=options)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    enrolled: list[CaptureSpec] = []
    try:
        await pool.start(ready_timeout=30)
        for spec in specs:
            listeners = open_pod_listeners(spec.netns)
            netns = str(spec.netns)
            pool.add_listener(
                listener_id=f"{spec.pod}/out",
                pod=spec.pod,
                kind=ListenerKind.OUTBOUND,
                netns=netns,
                sock=listeners.outbound,
            )
            pool.add_listener(
                listener_id=f"{spec.pod}/in",
                pod=spec.pod,
                kind=ListenerKind.INBOUND,
                netns=netns,
                sock=listeners.inbound,
            )
            red.enroll(spec)
            enrolled.append(spec)
            if args.mode == "ebpf":
                red.set_inbound_listener(spec, listeners.inbound)
        sys.stdout.write("ready\n")
        sys.stdout.flush()
        await stop.wait()
    finally:
        for spec in enrolled:
            with contextlib.suppress(Exception):
                red.unenroll(spec)
        if args.mode == "ebpf":
            with contextlib.suppress(Exception):
                red.uninstall()
        await pool.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m agent.bench.node")
    p.add_argument("--mode", choices=["iptables", "ebpf"], required=True)
    p.add_argument("--pods", required=True, metavar="FILE")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--pin-root", default="/sys/fs/bpf/meshagent-bench")
    p.add_argument("--worker-log-level", default="warning")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    return aio.run(serve(args))


if __name__ == "__main__":
    sys.exit(main())
