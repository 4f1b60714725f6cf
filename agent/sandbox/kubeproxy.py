"""kube-proxy for the sandbox: ClusterIP -> endpoint DNAT in each node's netns.

`rules(plan, node)` (pure) renders an `iptables-restore` nat table; `apply`
loads it into the node's network namespace.

Rules:
1. As kube-proxy's iptables mode: `SANDBOX-SERVICES` jumps per Service port to
   `SANDBOX-SVC-*`, which picks an endpoint with `statistic --mode random`
   (probability 1/(n-i) for the i-th of n) and jumps to `SANDBOX-SEP-*`, which
   DNATs. PREROUTING (traffic from pods) and OUTPUT (processes in the node
   netns) both enter `SANDBOX-SERVICES`.
2. The rules live in the node's netns, never the pod's: a meshed pod's
   outbound connection is captured in the pod's netns (PROXY_INIT_OUTPUT or
   cgroup/connect4) before any packet leaves it, and the proxy connects to
   endpoint IPs directly, so only unmeshed pods' traffic meets these rules.
3. Hairpin: when a pod reaches a Service whose chosen endpoint is on the same
   node bridge, the reply would skip the node and so the un-DNAT; such
   connections are masqueraded to the node's gateway (kube-proxy does the same
   for hairpin traffic).
4. A Service port without endpoints REJECTs (kube-proxy's "no endpoints").
"""

from __future__ import annotations

import hashlib
import subprocess
from typing import TYPE_CHECKING

from agent.errors import AgentError
from agent.redirect import netns

if TYPE_CHECKING:
    from agent.sandbox.cluster import ClusterPlan, NodeSpec, ServicePortPlan

SERVICES_CHAIN = "SANDBOX-SERVICES"
POSTROUTING_CHAIN = "SANDBOX-POSTROUTING"


class KubeProxyError(AgentError):
    """iptables-restore refused the sandbox's service rules."""

    def __init__(self, node: str, stderr: str) -> None:
        self.node = node
        self.stderr = stderr
        super().__init__(f"kube-proxy rules for node {node}: iptables-restore: {stderr.strip()}")


def _chain(prefix: str, *parts: str) -> str:
    digest = hashlib.sha256("/".join(parts).encode()).hexdigest()[:12].upper()
    return f"{prefix}-{digest}"


def _service_rules(sp: ServicePortPlan) -> tuple[list[str], list[str]]:
    proto = sp.protocol.lower()
    svc = _chain("SANDBOX-SVC", sp.namespace, sp.service, sp.name, str(sp.port))
    chains = [svc]
    comment = f'-m comment --comment "{sp.namespace}/{sp.service}:{sp.name or sp.port}"'
    lines = [
        (
            f"-A {SERVICES_CHAIN} -d {sp.cluster_ip}/32 -p {proto} -m {proto} --dport {sp.port} "
            f"{comment} -j {svc}"
        )
    ]
    if not sp.backends:
        lines.append(f"-A {svc} -p {proto} -j REJECT")
        return chains, lines
    n = len(sp.backends)
    for i, be in enumerate(sp.backends):
        sep = _chain("SANDBOX-SEP", svc, be.ip, str(be.port))
        chains.append(sep)
        if i < n - 1:
            lines.append(
                f"-A {svc} -m statistic --mode random --probability {1 / (n - i):.10f} -j {sep}"
            )
        else:
            lines.append(f"-A {svc} -j {sep}")
        lines.append(f"-A {sep} -p {proto} -m {proto} -j DNAT --to-destination {be.ip}:{be.port}")
    return chains, lines


def rules(plan: ClusterPlan, node: NodeSpec) -> str:
    """The nat table for `node`'s netns, as `iptables-restore` reads it."""
    chains = [SERVICES_CHAIN, POSTROUTING_CHAIN]
    body: list[str] = [
        f"-A PREROUTING -j {SERVICES_CHAIN}",
        f"-A OUTPUT -j {SERVICES_CHAIN}",
        f"-A POSTROUTING -j {POSTROUTING_CHAIN}",
        (
            f"-A {POSTROUTING_CHAIN} -s {node.pod_cidr} -d {node.pod_cidr} "
            "-m conntrack --ctstate DNAT -j MASQUERADE"
        ),
    ]
    for sp in plan.service_ports:
        new_chains, lines = _service_rules(sp)
        chains += new_chains
        body += lines
    head = [
        "*nat",
        ":PREROUTING ACCEPT [0:0]",
        ":INPUT ACCEPT [0:0]",
        ":OUTPUT ACCEPT [0:0]",
        ":POSTROUTING ACCEPT [0:0]",
    ]
    head += [f":{c} - [0:0]" for c in chains]
    return "\n".join([*head, *body, "COMMIT", ""])


def apply(node_netns: str, node: str, text: str, *, binary: str = "iptables-restore") -> None:
    """Load `text` into the nat table of the namespace at `node_netns`.

    Raises:
        KubeProxyError: iptables-restore failed.
    """
    proc = subprocess.run(
        [*netns.exec_argv(node_netns), binary],
        input=text,
        capture_output=True,
        text=True,
        check=False,
        timeout=30,
    )
    if proc.returncode != 0:
        raise KubeProxyError(node, proc.stderr or f"exit {proc.returncode}")
