"""What the supervisor knows about a meshed pod on this node (pure, no I/O).

Rules:
1. A `PodSpec` is the desired state of one meshed pod, as a pod source saw it:
   frozen and hashable, so sets of them can be diffed (`agent.pods.reconcile`).
2. Mappings are stored as sorted tuples of pairs (hashable); read them back
   through the `dict`-returning properties.
3. `key` ("namespace/name") names a pod across its lifetime; `uid` names one
   incarnation: the same key with a new uid is a new pod (new netns, new IP).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Mapping

Pairs = tuple[tuple[str, str], ...]


def pairs(mapping: Mapping[str, str] | None) -> Pairs:
    """A mapping as a sorted tuple of pairs."""
    return tuple(sorted((mapping or {}).items()))


@dataclass(frozen=True, slots=True, kw_only=True)
class PodSpec:
    """One meshed pod this node should serve."""

    namespace: str
    name: str
    uid: str
    ip: str
    node: str = ""
    service_account: str = "default"
    annotations: Pairs = ()  # the pod's own
    namespace_annotations: Pairs = ()
    labels: Pairs = ()
    container_ports: tuple[int, ...] = ()  # sorted, TCP only
    named_ports: Pairs = ()  # container port name -> number (as text)

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"

    @property
    def pod_annotations(self) -> dict[str, str]:
        return dict(self.annotations)

    @property
    def ns_annotations(self) -> dict[str, str]:
        return dict(self.namespace_annotations)

    @property
    def port_names(self) -> dict[str, int]:
        return {name: int(port) for name, port in self.named_ports}
