"""Pod sources: where the supervisor learns which meshed pods this node serves.

A source is an async iterator of *desired sets*: each item is the complete
set of `PodSpec`s the node should serve now (level-triggered, like a
Kubernetes informer's list; the supervisor diffs it with `reconcile.plan`).

`ManifestPodSource(dir, node_name)` (`--pods-from manifests:DIR`) reads the
manifests folder the embedded control plane reads (agent.controlplane.store)
and yields, after every change, its Pods that:
    - are on this node (`spec.nodeName` == node_name),
    - have an IP (`status.podIP`) and are not Succeeded/Failed, not hostNetwork,
    - are meshed: `linkerd.io/inject: enabled` on the pod or its namespace
      (`agent.controlplane.endpoints.is_meshed`).
A Kubernetes source will yield the same sets from a watch.

Rules:
1. `pods_of(snapshot, node)` is pure: a store snapshot in, a set out.
2. Two snapshots with the same desired set yield once (no churn for
   unrelated manifest changes such as a Service edit).
3. Watching the folder itself, the source reads only Pods and Namespaces
   (`KINDS`): the supervisor never imports pydantic (11 MB of RSS) and
   leaves the other kinds' errors to the control plane, which reads them all.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from agent.controlplane import kinds_core as k8s
from agent.controlplane.store import FolderWatcher, ResourceStore
from agent.pods.model import PodSpec, pairs

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from agent.controlplane.endpoints import Catalog

logger = logging.getLogger(__name__)

Desired = frozenset[PodSpec]

# What `pods_of` reads. Watching the folder itself, the source loads only these,
# whose reader (`agent.controlplane.plain`) needs no pydantic (rule 3).
KINDS = frozenset({"Pod", "Namespace"})


class PodSource(Protocol):
    """Yields the complete desired set after every change."""

    def desired(self) -> AsyncIterator[Desired]: ...

    def close(self) -> None: ...


def pod_spec(pod: k8s.Pod, namespace: k8s.Namespace | None) -> PodSpec:
    """The `PodSpec` of a store Pod."""
    ports = sorted(
        {p.container_port for c in pod.containers for p in c.ports if p.protocol == "TCP"}
    )
    named = {p.name: str(p.container_port) for c in pod.containers for p in c.ports if p.name}
    return PodSpec(
        namespace=pod.namespace,
        name=pod.name,
        uid=pod.uid,
        ip=pod.ip,
        node=pod.node_name,
        service_account=pod.service_account or "default",
        annotations=pairs(pod.annotations),
        namespace_annotations=pairs(namespace.annotations if namespace else None),
        labels=pairs(pod.labels),
        container_ports=tuple(ports),
        named_ports=pairs(named),
    )


def pods_of(catalog: Catalog, node: str) -> Desired:
    """The meshed, running pods of `node` in a store snapshot (rule 1)."""
    out: set[PodSpec] = set()
    for pod in catalog.of_kind(k8s.Pod):
        if pod.node_name != node or not pod.ip or pod.terminal or pod.host_network:
            continue
        if not catalog.is_meshed(pod):
            continue
        out.add(pod_spec(pod, catalog.pod_namespace(pod)))
    return frozenset(out)


class ManifestPodSource:
    """Pods of a manifests folder on this node; see the module docstring.

    Pass `store` to share one already kept current (the embedded control
    plane's); otherwise the source watches `directory` itself.
    """

    def __init__(
        self,
        directory: str | Path,
        node: str,
        *,
        store: ResourceStore | None = None,
        poll_interval: float = 0.2,
    ) -> None:
        self.directory = Path(directory)
        self.node = node
        self._own = store is None
        self.store = store if store is not None else ResourceStore()
        self._watcher = (
            FolderWatcher(self.directory, self.store, poll_interval, only=KINDS)
            if self._own
            else None
        )
        self._started = False

    async def desired(self) -> AsyncIterator[Desired]:
        """Every distinct desired set, the current one first (rule 2)."""
        if self._watcher is not None and not self._started:
            self._started = True
            self._watcher.start()
        last: Desired | None = None
        async with self.store.changes() as stream:
            async for snap in stream:
                current = pods_of(snap, self.node)
                if current != last:
                    last = current
                    yield current

    def close(self) -> None:
        """Stop watching the folder (if this source watches it)."""
        if self._watcher is not None:
            self._watcher.stop()
