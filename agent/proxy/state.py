"""The state the supervisor pushes to workers: keys and value types.

Rules:
1. The supervisor alone fills this state (from pod sources, the control plane
   and the identity manager) with `StateUpdate(key, value)`; workers only read
   it (`WorkerState`) and ask for missing keys with `Need(kind, key)`.
2. Keys are tuples whose first item is the kind below; values are the frozen
   dataclasses here or the domain types of agent.proxy.model / agent.policy.model.
   Never protobuf.
3. Private keys travel only over the supervisor<->worker socketpair (our own
   processes), as PKCS#8 DER bytes, and never appear in repr or logs.

Keys:
    ("pod", "ns/name")            -> PodInfo           every enrolled pod on this node
    ("pod-ip", ip)                -> "ns/name"         pods on this node by IP (same-node path)
    ("dst", "ip:port")            -> Destination       outbound target by original destination
    ("dst", "name.ns.svc...:port")-> Destination       outbound target by authority
                                                       (l5d-dst-override)
    ("policy", "ns/name", port)   -> ServerPolicy      inbound policy of a pod port (WatchPort)
    ("tls", identity)             -> TlsMaterial       certificate + key of one service account
    ("trust",)                    -> bytes             trust bundle PEM (anchors)
    ("node",)                     -> NodeInfo          this node

Additions (data path, agent.proxy.inbound): `NodeInfo.default_inbound_policy`
and `NodeInfo.cluster_networks` say which of Linkerd's default policies an
inbound port uses until its `("policy", ...)` value arrives (Linkerd's
`config.linkerd.io/default-inbound-policy`, default `all-unauthenticated`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from agent.policy.model import DEFAULT_CLUSTER_NETWORKS

if TYPE_CHECKING:
    from agent.proxy.model import Endpoint, Profile

POD = "pod"
POD_IP = "pod-ip"
DST = "dst"
POLICY = "policy"
TLS = "tls"
TRUST = "trust"
NODE = "node"

StateKind = Literal["pod", "pod-ip", "dst", "policy", "tls", "trust", "node"]


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeInfo:
    """The node this agent runs on."""

    name: str
    cluster_domain: str = "cluster.local"
    control_ns: str = "linkerd"
    trust_domain: str = "cluster.local"
    # Used by inbound until a port's policy arrives; one of DEFAULT_POLICY_NAMES.
    default_inbound_policy: str = "all-unauthenticated"
    cluster_networks: tuple[str, ...] = DEFAULT_CLUSTER_NETWORKS


@dataclass(frozen=True, slots=True, kw_only=True)
class PodInfo:
    """An enrolled (meshed) pod on this node, as the data path needs it."""

    namespace: str
    name: str
    uid: str = ""
    ip: str
    netns: str  # nsfs path; sockets for this pod are created there
    service_account: str = "default"
    identity: str  # DNS-like identity of the service account
    node: str = ""
    owner_labels: dict[str, str] = field(default_factory=dict, hash=False)  # deployment=..., etc.
    opaque_ports: frozenset[int] = frozenset()
    skip_inbound_ports: frozenset[int] = frozenset()
    # "namespace/name", made once: a property was an interpreted call per connection
    key: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "key", f"{self.namespace}/{self.name}")


@dataclass(frozen=True, slots=True, kw_only=True)
class Destination:
    """What the control plane says about one outbound target.

    `exists=False`: not a service of the mesh (Linkerd would forward to the
    original destination); `exists=True` with no endpoints: fail fast.
    """

    target: str  # the key it answers: "ip:port" or "authority:port"
    authority: str = ""  # fully qualified service name with port, when a service
    exists: bool = False
    endpoints: tuple[Endpoint, ...] = ()
    profile: Profile | None = None
    opaque: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class TlsMaterial:
    """One service account's workload certificate, for mTLS in workers."""

    identity: str
    cert_chain_pem: bytes  # leaf then intermediates
    key_pem: bytes = field(repr=False)  # PKCS#8 PEM encrypted with key_password; never logged
    key_password: bytes = field(repr=False)  # one-time random password of key_pem
    trust_pem: bytes = field(repr=False)
    not_after: float  # unix seconds; past it, no new mTLS (fail closed)
