"""The supervisor's read-only views for the admin server: `/config_dump` and `/metrics` text.

`Supervisor.config_dump` and `Supervisor.metrics_text` delegate here; each
view is a function of the supervisor that reads its parts (enrolled pods,
targets, streams, identities, workers, cached policies).

Rules:
1. A view changes nothing the agent does. The one write is `metrics_text`
   setting the node gauges that are sampled at scrape time (workers, stream
   states, reconnects, certificate counts) just before rendering.
2. `config_dump` holds no keys or tokens (DESIGN.md "Identity"): certificates
   appear by identity, expiry and counts. The admin server scrubs fields named
   like secrets as well (`agent.admin.controls.scrub`), so a field that is not
   one must not be named like one ("target", not "key").
3. Before `Supervisor.start` has made a part, its section is empty.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from agent.proxy import state
    from agent.supervisor.core import Supervisor
    from agent.supervisor.enroll import Enrolled


def metrics_text(sup: Supervisor) -> str:
    """Prometheus text: node and agent families, and the workers' merged ones (rule 1)."""
    nm = sup.node_metrics
    if sup.pool is not None:
        nm.set_workers({w.worker_id: w.pid for w in sup.pool.workers})
        up = sum(1 for w in sup.pool.workers if w.ready)
        nm.set_worker_counts(desired=sup.pool.n, up=up)
    if sup.client is not None:
        by_kind: dict[str, list[Any]] = {}
        for st in sup.client.streams():
            by_kind.setdefault(st.kind, []).append(st)
        for kind, streams in by_kind.items():
            nm.set_stream_state(kind, all(st.state.value == "live" for st in streams))
            nm.set_reconnects(kind, sum(st.reconnects for st in streams))
    if sup.identity is not None:
        for ident in sup.identity.status():
            nm.set_cert_totals(ident.identity, renewals=ident.renewals, failures=ident.failures)
    return sup.exposition.render()


def config_dump(sup: Supervisor) -> dict[str, Any]:
    """The agent's state for `/config_dump` (rule 2: no keys)."""
    return {
        "node": sup.settings.node,
        "mode": sup.mode.value,
        "pods": [_pod_dump(e) for e in sup.pods.enrolled.values()],
        "pending": dict(sup.pods.pending),
        "destinations": {t: _dst_dump(x.pushed) for t, x in sup.targets.by_name.items()},
        "streams": [
            # "target", not "key": the admin server scrubs fields named like secrets
            {
                "kind": s.kind,
                "target": str(s.key),
                "state": s.state.value,
                "messages": s.messages,
            }
            for s in (sup.client.streams() if sup.client else [])
        ],
        "identities": [
            {"identity": st.identity, "ready": st.ready, "expiry": str(st.expiry)}
            for st in (sup.identity.status() if sup.identity else [])
        ],
        "workers": [
            {"id": w.worker_id, "pid": w.pid, "ready": w.ready, "cpu": w.cpu, "pinned": w.pinned}
            for w in (sup.pool.workers if sup.pool else [])
        ],
        "listeners": sup.pool.listener_ids if sup.pool else [],
        "policies": _policies_dump(sup),
        "certificates": [
            {
                "identity": st.identity,
                "namespace": st.ns,
                "serviceaccount": st.sa,
                "ready": st.ready,
                "expiry": st.expiry,
                "renew_at": st.renew_at,
                "renewals": st.renewals,
                "failures": st.failures,
                "last_error": st.last_error,
            }
            for st in (sup.identity.status() if sup.identity else [])
        ],
    }


def _policies_dump(sup: Supervisor) -> dict[str, Any]:
    """`ns/pod:port` -> the inbound policy the agent holds (None: no answer yet)."""
    out: dict[str, Any] = {}
    for e in sup.pods.enrolled.values():
        for key in sorted(e.policy_keys | e.asked_keys, key=lambda k: k.port):
            out[f"{key.ns}/{key.pod}:{key.port}"] = sup.cache.policy(key)
    return out


def _pod_dump(e: Enrolled) -> dict[str, Any]:
    return {
        "pod": e.pod.key,
        "uid": e.pod.uid,
        "ip": e.pod.ip,
        "netns": str(e.net.netns),
        "cgroup": str(e.net.cgroup) if e.net.cgroup else None,
        "identity": e.identity,
        "serviceaccount": e.pod.service_account,
        "ports": list(e.pod.container_ports),
        "listeners": list(e.listener_ids),
    }


def _dst_dump(d: state.Destination | None) -> Any:
    if d is None:
        return None
    return {
        "authority": d.authority,
        "exists": d.exists,
        "endpoints": [f"{ep.addr[0]}:{ep.addr[1]}" for ep in d.endpoints],
        "opaque": d.opaque,
        "endpoint_details": [
            {
                "addr": f"{ep.addr[0]}:{ep.addr[1]}",
                "weight": ep.weight,
                "identity": ep.tls_identity,
                "node": ep.node,
                "labels": dict(ep.labels),
                "protocol_hint": ep.protocol_hint,
                "opaque_transport_port": ep.opaque_transport_port,
            }
            for ep in d.endpoints
        ],
        "profile": d.profile,
    }
