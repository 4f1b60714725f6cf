"""Label sets into series: what the workers' recorder counts each call under.

`LabelSets` is the base of `agent.admin.observe.Observer`. It turns the label
dict a data-path call passes (with the connection it came on, `record.CONN`)
into the series of `agent.admin.metrics.WorkerMetrics` that count it, and
interns them. None of it runs per request once a label set is known: the
recorder finds the series again in its own caches (`observe` rule 4); what is
here runs for a new label set, per TCP connection, or for a tap event.

Rules:
1. Labels follow `agent.admin.metrics`: the pod the traffic belongs to
   (outbound: the pod whose listener accepted, from `record.CONN`; inbound:
   the pod named in the data path's labels), its service account and owner
   (from the `("pod", key)` PodInfo), `direction`, `authority` (outbound
   only: an inbound Host header is client-chosen, so unbounded), `target_addr`,
   `tls` with `server_id`/`client_id`, `dst_*` from the endpoint's metric
   labels, `srv_*`/`route_*`/`authz_*` from the policy decision.
2. The same-node path is two proxies in one: an HTTP request an outbound
   router sends to a pod on this node is also counted as that pod's inbound
   traffic (tls "true", client_id = the caller's identity, which the kernel
   vouched for), as it would be with a sidecar on each side.
3. Series are interned: HTTP ones in `_http` by (pod, direction, labels), TCP
   ones in `_tcp` by (pod, direction, target, tls), authorization counters in
   `_authz` (filled by `_authz_counter`, looked up per request by the
   observer's `_authz_cell`); a pod's metadata once per PodInfo object; an
   endpoint's identity and labels once per (authority, address). A label set
   seen before is looked up by its identity first (`_http_ids`, `_authz_ids`):
   label sets are treated as immutable once passed, as the connections' caches
   already did.
   `forget_departed` drops the series of pods no longer enrolled and bumps
   `gen`, so whatever holds resolved series (connection caches, bound
   handles) resolves them again.
4. What cannot be resolved (no PodInfo, an address no Destination lists, no
   original destination) resolves to the labels known without it, never to
   an error; anything that still raises is the caller's to catch
   (`observe` rule 4).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, Final

from agent.admin.families import OWNER_KINDS
from agent.admin.metrics import (
    Counter,
    HttpSeries,
    PodMeta,
    Ref,
    TcpSeries,
    Tls,
    WorkerMetrics,
    dst_labels,
)
from agent.proxy.state import POD, POD_IP, PodInfo

if TYPE_CHECKING:
    from collections.abc import Mapping

    from agent.proxy.accept import Conn
    from agent.proxy.record import Labels
    from agent.proxy.worker import Worker

SVC_AUTHORITY: Final = re.compile(r"^([^.]+)\.([^.]+)\.svc\.[^:]*:(\d+)$")
_TLS_LOOPBACK: Final = Tls.no_identity("loopback")  # an outbound connection's, made once
IDS_MAX: Final = 1024  # label sets remembered by identity (each table); cleared whole when full


class LabelSets:
    """One worker's label sets and the series they were resolved into (the module rules)."""

    def __init__(self, worker: Worker, metrics: WorkerMetrics | None = None) -> None:
        self.worker = worker
        self.m = metrics or WorkerMetrics(worker.worker_id)
        self._pods: dict[str, tuple[Any, PodMeta]] = {}
        self._http: dict[tuple[Any, ...], list[HttpSeries]] = {}
        self._tcp: dict[tuple[Any, ...], TcpSeries] = {}
        self._authz: dict[tuple[Any, ...], Counter] = {}
        # Rule 3's lookups by a label set's identity first: the data path's label sets are
        # shared objects (agent.proxy.outbound rule 5, the authorization's merged labels),
        # so a new connection's are found without hashing their items. An entry holds its
        # label set, whose id is in the key.
        self._http_ids: dict[tuple[int, str, str], tuple[Labels, list[HttpSeries]]] = {}
        self._authz_ids: dict[tuple[int, bool, bool, str], tuple[Labels, Counter]] = {}
        self._endpoints: dict[tuple[str, str], tuple[str | None, tuple[tuple[str, str], ...]]] = {}
        self.gen = 0  # bumped when interned series are dropped (per-connection caches, handles)

    # --- pods -------------------------------------------------------------------------

    def pod_meta(self, key: str) -> PodMeta:
        """Labels of the pod `ns/name` (from its PodInfo; cached while that is unchanged)."""
        info = self.worker.state.get((POD, key))
        cached = self._pods.get(key)
        if cached is not None and cached[0] is info:
            return cached[1]
        ns, _, name = key.partition("/")
        if isinstance(info, PodInfo):
            kind, owner = _owner(info)
            meta = PodMeta(
                namespace=info.namespace,
                pod=info.name,
                serviceaccount=info.service_account,
                owner_kind=kind,
                owner_name=owner,
            )
        else:
            meta = PodMeta(namespace=ns, pod=name)
        self._pods[key] = (info, meta)
        return meta

    def _pod_info(self, key: str) -> PodInfo | None:
        info = self.worker.state.get((POD, key))
        return info if isinstance(info, PodInfo) else None

    def _own_pod(self, conn: Conn | None, labels: Labels) -> str:
        return own_pod(conn_pod(conn), labels)

    def forget_departed(self) -> list[str]:
        """Drop the series of pods no longer enrolled here; their keys."""
        gone = [k for k in self._pods if k != "/" and (POD, k) not in self.worker.state]
        for key in gone:
            ns, _, name = key.partition("/")
            self.m.forget_pod(ns, name)
            del self._pods[key]
        if gone:  # re-intern everything (the recorder's caches may name them)
            self.gen += 1
            self._http.clear()
            self._tcp.clear()
            self._authz.clear()
            self._http_ids.clear()
            self._authz_ids.clear()
        return gone

    # --- label sets --------------------------------------------------------------------

    def _http_series(self, conn: Conn | None, direction: str, labels: Labels) -> list[HttpSeries]:
        ikey = (id(labels), direction, conn_pod(conn))
        hit = self._http_ids.get(ikey)
        if hit is not None and hit[0] is labels:
            return hit[1]
        pod_key = self._own_pod(conn, labels) if direction == "inbound" else conn_pod(conn)
        key = (pod_key, direction, tuple(labels.items()))
        found = self._http.get(key)
        if found is None:
            found = self._http[key] = self._new_http(pod_key, direction, labels)
        if len(self._http_ids) >= IDS_MAX:
            self._http_ids.clear()
        self._http_ids[ikey] = (labels, found)
        return found

    def _new_http(self, pod_key: str, direction: str, labels: Labels) -> list[HttpSeries]:
        pod = self.pod_meta(pod_key)
        if direction == "inbound":
            in_target, in_tls = self._inbound_target(pod_key, labels)
            return [
                self.m.http(pod, direction="inbound", authority="", target=in_target, tls=in_tls)
            ]
        authority = labels.get("authority", "")
        dst_addr = labels.get("dst_addr", "")
        target = parse_addr(dst_addr) if dst_addr else None
        hop = labels.get("hop")
        server_id, ep_labels = self._endpoint(authority, dst_addr)
        dst = dst_labels({**_service_dst(authority), **dict(ep_labels)})
        tls: Tls | None = None
        peer: PodInfo | None = None
        if hop == "local" and target is not None:
            peer_key = self.worker.state.get((POD_IP, target[0]))
            peer = self._pod_info(peer_key) if isinstance(peer_key, str) else None
            tls = Tls.established(peer.identity) if peer is not None else Tls(state="true")
        elif hop == "mtls":
            tls = Tls.established(server_id or "")
        elif hop == "plain":
            tls = Tls.no_identity("not_provided_by_service_discovery")
        out = [
            self.m.http(
                pod, direction="outbound", authority=authority, target=target, tls=tls, dst=dst
            )
        ]
        if "rt_route" in labels:
            out.append(
                self.m.route(pod, direction="outbound", dst=authority, rt_route=labels["rt_route"])
            )
        if peer is not None and target is not None:  # rule 2
            src = self._pod_info(pod_key)
            client_tls = Tls.established(src.identity) if src else Tls.no_identity("loopback")
            out.append(
                self.m.http(
                    self.pod_meta(peer.key),
                    direction="inbound",
                    authority="",
                    target=target,
                    tls=client_tls,
                )
            )
        return out

    def _inbound_target(
        self, pod_key: str, labels: Labels
    ) -> tuple[tuple[str, int] | None, Tls | None]:
        port = labels.get("target_port", "")
        info = self._pod_info(pod_key)
        target = (info.ip, int(port)) if info is not None and port.isdigit() else None
        if "tls" not in labels:
            return target, None
        if labels["tls"] == "true":
            return target, Tls.established(labels.get("client_id", ""))
        return target, Tls.no_identity("no_tls_from_remote")

    def _endpoint(
        self, authority: str, dst_addr: str
    ) -> tuple[str | None, tuple[tuple[str, str], ...]]:
        """The tls identity and metric labels of endpoint `dst_addr` of `authority`."""
        if not dst_addr:
            return None, ()
        key = (authority, dst_addr)
        found = self._endpoints.get(key)
        if found is not None:
            return found
        from agent.proxy.plane import plane_of  # noqa: PLC0415 - the worker's plane, lazily

        result: tuple[str | None, tuple[tuple[str, str], ...]] = (None, ())
        for entry in plane_of(self.worker).dsts.values():
            for ep in entry.dst.endpoints:
                if f"{ep.addr[0]}:{ep.addr[1]}" == dst_addr:
                    result = (ep.tls_identity, tuple(sorted(ep.labels.items())))
                    break
        self._endpoints[key] = result
        return result

    def _tcp_series(self, conn: Conn | None, direction: str, labels: Labels) -> TcpSeries:
        if direction == "inbound":
            pod_key = self._own_pod(conn, labels)
            target, tls = self._inbound_target(pod_key, labels)
        else:
            pod_key = conn_pod(conn)
            target, tls = _orig_dst(conn), _TLS_LOOPBACK
        # per connection: the key holds Tls's fields, not the frozen dataclass, whose
        # `__hash__` and `__eq__` run interpreted (agent.native rule 5)
        tls_key = None if tls is None else (tls.state, tls.peer_id, tls.reason)
        key = (pod_key, direction, target, tls_key)
        found = self._tcp.get(key)
        if found is None:
            found = self._tcp[key] = self.m.tcp(
                self.pod_meta(pod_key),
                direction=direction,
                peer="src",
                target=target or ("0.0.0.0", 0),
                tls=tls or Tls.no_identity("not_provided_by_remote"),
            )
        return found

    def _authz_counter(
        self, accepted_by: str, labels: Labels, allowed: bool, http: bool
    ) -> Counter:
        """The counter of an authorization on traffic accepted by the listener of pod
        `accepted_by` (`conn_pod`)."""
        pod_key = own_pod(accepted_by, labels)
        target, tls = self._inbound_target(pod_key, labels)
        if tls is None:  # the same-node path: the caller is the connection's pod
            src = self._pod_info(accepted_by)
            tls = Tls.established(src.identity) if src else Tls.no_identity("loopback")
        server = _ref(labels, "srv") or Ref(group="", kind="default", name="unknown")
        pod = self.pod_meta(pod_key)
        authz = _ref(labels, "authz")
        if http:
            return self.m.http_authz(
                pod,
                allowed=allowed,
                target=target,
                tls=tls,
                server=server,
                route=_ref(labels, "route"),
                authz=authz,
            )
        return self.m.tcp_authz(
            pod, allowed=allowed, target=target, tls=tls, server=server, authz=authz
        )


def parse_addr(text: str) -> tuple[str, int] | None:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        return None
    return host.strip("[]"), int(port)


def _owner(info: PodInfo) -> tuple[str, str]:
    for kind, name in sorted(info.owner_labels.items()):
        if kind in OWNER_KINDS and name:
            return kind, name
    return "", ""


def own_pod(accepted_by: str, labels: Labels) -> str:
    """The pod an inbound label set names, else `accepted_by` (`conn_pod`)."""
    if "namespace" in labels and "pod" in labels:
        return f"{labels['namespace']}/{labels['pod']}"
    return accepted_by


def conn_pod(conn: Conn | None) -> str:
    return conn.listener.pod if conn is not None else "/"


def _orig_dst(conn: Conn | None) -> tuple[str, int] | None:
    if conn is None:
        return None
    if conn.target is not None:  # the handler asked already: no interpreted call
        return conn.target
    from agent.proxy import accept  # noqa: PLC0415 - in the worker only

    try:
        return accept.target_of(conn)
    except Exception:  # noqa: BLE001 - a label is not worth failing for
        return None


def _service_dst(authority: str) -> dict[str, str]:
    """`namespace`/`service` of a Service authority (the endpoint's labels may repeat them)."""
    match = SVC_AUTHORITY.match(authority) if authority else None
    if match is None:
        return {}
    return {"namespace": match.group(2), "service": match.group(1)}


def _ref(labels: Mapping[str, str], prefix: str) -> Ref | None:
    kind = labels.get(f"{prefix}_kind")
    if kind is None:
        return None
    return Ref(
        group=labels.get(f"{prefix}_group", ""), kind=kind, name=labels.get(f"{prefix}_name", "")
    )
