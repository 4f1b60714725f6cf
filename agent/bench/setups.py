"""The bench's setups: who sits between the client pod and the server.

Setups (each a context manager yielding a `Target`; `SETUPS` names them all):
    direct, direct-xnode          client -> server, no proxy
    haproxy-tcp, haproxy-http     HAProxy in the client pod's netns (the
                                  position of meshagent's outbound listener)
    haproxy-tls                   HAProxy in `cli` -> mTLS -> HAProxy in `srv2`
                                  (mode tcp)
    haproxy-tls-h1, haproxy-tls-h2
                                  the same in mode http (parsed on both hops),
                                  HTTP/1.1 or h2 between: the L7 peers of the
                                  -xnode setups
    python-floor                  `agent.bench.floor` where HAProxy runs: the
                                  least a Python relay does (HTTP loads only)
    python-floor-tls              the floor on haproxy-tls's two hops (mTLS)
    meshagent-{iptables,ebpf}     `meshagent run` on `a` meshing `cli`, `srv`:
                                  outbound -> same-node inbound, no TLS
    meshagent-{mode}-xnode        `meshagent run` on `a` (cli) and on `b`
                                  (srv2): outbound -> mTLS -> inbound, with
                                  the default `--h2-upgrade auto`
    meshagent-ebpf-accel          as meshagent-ebpf, the agent run with
                                  MESHAGENT_EBPF_ACCEL=1 (sockops + sk_msg
                                  between same-node socket pairs)
    meshagent-ebpf-h2-xnode       as meshagent-ebpf-xnode, the agents run with
                                  MESHAGENT_H2_UPGRADE=on (HTTP/1 upgraded to
                                  h2 streams between the proxies)
    meshagent-ebpf-h1-xnode       ... with MESHAGENT_H2_UPGRADE=off (HTTP/1
                                  inside mTLS only)
The meshagent setups (node agents) are here; the topology they all run on
(`build_topology`, `Target`, pod tuning, the work directory) is in
`agent.bench.topology`, the direct, HAProxy and floor setups (and `make_certs`)
in `agent.bench.peers`; their public names are re-exported here. All
meshagent setups share one `meshagent controlplane` (`agent.bench.mesh`); bench
pods are lab pods named `pod<UID>` so the agents discover them.

Rules:
1. Every meshagent setup starts its agents through `start_node_agent`, the one
   place that knows how a node agent is started.
2. Only processes started here are stopped (agents by `NodeAgent.stop`); the
   lab kills whatever is left when it closes.
3. `Target.roots` are the node agents: their workers count as the proxy's
   (`Target.proxy_pids`), read when asked, since workers may be replaced.
"""

from __future__ import annotations

import contextlib
import os
from typing import TYPE_CHECKING

from agent.bench import report
from agent.bench.peers import (
    SERVER_NAME,
    direct,
    direct_xnode,
    haproxy_one_hop,
    haproxy_tls,
    haproxy_tls_h1,
    haproxy_tls_h2,
    make_certs,
    python_floor,
    python_floor_tls,
)
from agent.bench.topology import (
    ECHO_PORT,
    HTTP_PORT,
    IPERF_PORT,
    POD_SYSCTLS,
    PROXY_HTTP_PORT,
    PROXY_IPERF_PORT,
    BenchError,
    SetupFn,
    Target,
    Topology,
    build_topology,
    new_workdir,
    per_node,
    remove_workdir,
    wait_answer,
    wait_port,
)

if TYPE_CHECKING:
    from collections.abc import Iterator

    from agent.bench.mesh import NodeAgent

__all__ = [
    "ENV_ACCEL",
    "HTTP_PORT",
    "IPERF_PORT",
    "POD_SYSCTLS",
    "PROXY_HTTP_PORT",
    "PROXY_IPERF_PORT",
    "SERVER_NAME",
    "SETUPS",
    "BenchError",
    "SetupFn",
    "Target",
    "Topology",
    "build_topology",
    "direct",
    "direct_xnode",
    "haproxy_tls",
    "haproxy_tls_h1",
    "haproxy_tls_h2",
    "make_certs",
    "new_workdir",
    "python_floor",
    "remove_workdir",
    "start_node_agent",
]


ENV_ACCEL = "MESHAGENT_EBPF_ACCEL"  # agent.redirect.ebpf.ENV_ACCEL (bcc stays out of the bench)
ENV_H2_UPGRADE = "MESHAGENT_H2_UPGRADE"  # `meshagent run --h2-upgrade`


def start_node_agent(  # noqa: PLR0913 - keyword-only settings
    topo: Topology,
    roles: list[str],
    mode: str,
    *,
    node: str,
    name: str,
    workers: int | None = None,
    accel: bool = False,
    upgrade: str = "auto",
) -> NodeAgent:
    """Start `meshagent run` on lab node `node` meshing the bench pods `roles` (mode:
    iptables|ebpf), with the run's shared control plane; returns once it is ready.
    `accel` runs an eBPF agent with MESHAGENT_EBPF_ACCEL=1; every other eBPF agent
    runs with it off, whatever the caller's environment says; so does `upgrade`
    (MESHAGENT_H2_UPGRADE: when HTTP/1 goes upgraded to h2 between the proxies).
    `workers`: default `per_node(1)`, a node's share of the machine when the bench
    runs one node (topology rule 4).

    Raises:
        MeshError: it exited or did not become ready within 60 s.
    """
    level = os.environ.get("MESHAGENT_BENCH_AGENT_LOG", "warning")
    env = {ENV_ACCEL: "1" if accel else "0"} if mode == "ebpf" else {}
    env[ENV_H2_UPGRADE] = upgrade
    count = per_node(1) if workers is None else workers
    cpus = topo.lab.cpus_of(topo.lab.nodes[node])
    return topo.mesh.start_agent(
        roles, mode, node=node, name=name, workers=count, log_level=level, env=env, cpus=cpus
    )


_UPGRADE_FLAVOURS = {"auto": "", "on": "-h2", "off": "-h1"}
_UPGRADE_SAYS = {"auto": "when busy", "on": "always", "off": "never"}


def _meshagent(mode: str, *, xnode: bool, accel: bool = False, upgrade: str = "auto") -> SetupFn:
    @contextlib.contextmanager
    def setup(topo: Topology) -> Iterator[Target]:
        flavour = f"{mode}-accel" if accel else mode + _UPGRADE_FLAVOURS[upgrade]
        name = f"meshagent-{flavour}" + ("-xnode" if xnode else "")
        with contextlib.ExitStack() as stack:
            if xnode:
                plan = [(["cli"], topo.a.name), (["srv2"], topo.b.name)]
                server = topo.srv2
            else:
                plan = [(["cli", "srv"], topo.a.name)]
                server = topo.srv
            agents = []
            workers = per_node(len(plan))
            for roles, node in plan:
                agent = start_node_agent(
                    topo,
                    roles,
                    mode,
                    node=node,
                    name=f"{flavour}-{node}",
                    workers=workers,
                    accel=accel,
                    upgrade=upgrade,
                )
                stack.callback(agent.stop)
                agents.append(agent)
            # the first request pays for resolution (and, cross-node, the mTLS handshake)
            first = wait_answer(topo.cli, server.ip, HTTP_PORT)
            wait_port(topo.cli, server.ip, IPERF_PORT)
            path = "outbound -> mTLS -> inbound (other node)" if xnode else "outbound -> inbound"
            if accel:
                path += "; sockops + sk_msg acceleration on (MESHAGENT_EBPF_ACCEL=1)"
            if xnode:
                says = _UPGRADE_SAYS[upgrade]
                path += f"; HTTP/1 upgraded to h2 {says} ({ENV_H2_UPGRADE}={upgrade})"
            yield Target(
                setup=name,
                client=topo.cli,
                host=server.ip,
                http_port=HTTP_PORT,
                echo_port=ECHO_PORT,
                iperf_port=IPERF_PORT,
                hops=2,
                mtls=xnode,
                roots=[a.pid for a in agents],
                agents=agents,
                accel_maps=(agents[0].pin_root / "maps" if accel and agents[0].pin_root else None),
                notes=(
                    f"meshagent run ({mode}, {workers} workers per node): {path}; "
                    f"first request {first * 1000:.0f} ms"
                ),
            )

    return setup


SETUPS: dict[str, SetupFn] = {
    "direct": direct,
    "haproxy-tcp": haproxy_one_hop("tcp"),
    "haproxy-http": haproxy_one_hop("http"),
    "python-floor": python_floor,
    "meshagent-iptables": _meshagent("iptables", xnode=False),
    "meshagent-ebpf": _meshagent("ebpf", xnode=False),
    "meshagent-ebpf-accel": _meshagent("ebpf", xnode=False, accel=True),
    "direct-xnode": direct_xnode,
    "haproxy-tls": haproxy_tls,
    "haproxy-tls-h1": haproxy_tls_h1,
    "haproxy-tls-h2": haproxy_tls_h2,
    "python-floor-tls": python_floor_tls,
    "meshagent-iptables-xnode": _meshagent("iptables", xnode=True),
    "meshagent-ebpf-xnode": _meshagent("ebpf", xnode=True),
    "meshagent-ebpf-h2-xnode": _meshagent("ebpf", xnode=True, upgrade="on"),
    "meshagent-ebpf-h1-xnode": _meshagent("ebpf", xnode=True, upgrade="off"),
}


def nodes_of(setup: str) -> int:
    """How many nodes `setup`'s path spans (`report.cross_node`): its proxies get
    `per_node` of that many workers each and, placed (`agent.bench.topology` rule 5), each
    node its share of the CPUs."""
    return 2 if report.cross_node(setup) else 1
