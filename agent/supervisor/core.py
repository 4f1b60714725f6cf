"""`meshagent run`: the per-node supervisor (asyncio shell).

Ties together the pod source, discovery, capture, the worker pool, the
control-plane client, the identity manager and the admin server
(DESIGN.md "Processes on a node").

Per meshed pod on this node (`Enroll`):
    1. find its netns and cgroup (`agent.pods.discover`; not found yet ->
       retried every `RETRY_S` while it stays desired),
    2. build its `CaptureSpec` from pod + namespace annotations,
    3. open its outbound (127.0.0.1:4140) and inbound (0.0.0.0:4143)
       listeners inside its netns and hand them to the pool (and, in eBPF
       mode, the inbound one to `EbpfRedirector.set_inbound_listener`),
    4. enroll the redirect (after the listeners exist, so no connection is
       redirected to a closed port),
    5. push `("pod", key)` -> PodInfo and `("pod-ip", ip)` -> key,
    6. acquire its service account in the `IdentityManager` (Certify with a
       token minted from the control plane's identity dir: manifests mode has
       no API server to issue tokens, `agent.control.tokens.minting_source`),
    7. WatchPort each container port -> `("policy", key, port)`.
`Unenroll` undoes it all: listeners removed (connections get the grace),
redirect unenrolled, state deleted, identity released, netns mount dropped.

Rules:
1. Workers' `Need("dst", ("dst", target))` opens GetProfile (then Get) streams
   and pushes `("dst", target)` -> Destination whenever an answer changes
   (`agent.supervisor.resolve`). Streams stay open; the client reconnects
   with backoff and the last state keeps being served meanwhile.
   1b. A target whose stream fails before its first answer (NOT_FOUND,
   INVALID_ARGUMENT, control plane unreachable) gets `exists=False` within
   `UNANSWERED_CHECK_S`, so workers forward at once instead of waiting out
   their timeout; a later answer replaces it.
2. SIGTERM/SIGINT: workers drain up to `--grace`, then everything closes;
   redirects stay programmed (as Linkerd keeps iptables across proxy
   restarts), so a restarted agent finds them in the registry and
   reconciles (re-enrolling is idempotent; entries for pods no longer
   desired are removed at start). `--cleanup-on-exit` unenrolls everything.
3. Blocking kernel work (discovery, netns sockets, iptables) runs in
   threads, never on the event loop.
4. /ready: redirects (every desired pod enrolled), workers (all up),
   certificates (every service account holds a valid one), control plane
   (answered at least once; the embedded one counts once started).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agent import aio
from agent.admin import controls
from agent.admin.aggregate import Exposition, MetricsAggregator
from agent.admin.node import NodeMetrics, measure_loop_lag
from agent.admin.server import AdminServer
from agent.admin.tap import TapHub
from agent.control.cache import DestinationKey, PolicyKey, ProfileKey, StateCache
from agent.control.client import ContextToken, ControlPlaneClient, StreamState
from agent.control.tokens import minting_source
from agent.errors import AgentError, SettingError
from agent.identity.chain import load_trust_bundle
from agent.identity.manager import IdentityManager
from agent.identity.manager import TlsMaterial as IdTls
from agent.identity.tls import seal
from agent.pods import discover, reconcile
from agent.pods.source import ManifestPodSource
from agent.proxy import channel as ch
from agent.proxy import state
from agent.proxy.listener import ListenerKind, open_pod_listeners
from agent.proxy.pool import WorkerOptions, WorkerPool
from agent.redirect import annotations as capture_annotations
from agent.redirect import iptables
from agent.redirect.model import Mode
from agent.redirect.registry import Registry
from agent.supervisor import resolve

if TYPE_CHECKING:
    from agent.controlplane.app import ControlPlane
    from agent.pods.model import PodSpec
    from agent.proxy.listener import PodListeners
    from agent.redirect.model import CaptureSpec
    from agent.supervisor.settings import RunSettings

logger = logging.getLogger(__name__)

RETRY_S = 1.0  # pods not found yet are retried this often
UNANSWERED_CHECK_S = 0.05  # how often targets with failed, unanswered streams are looked for
ENV_BPF_PIN_ROOT = "MESHAGENT_BPF_PIN_ROOT"


@dataclass(slots=True, kw_only=True)
class Enrolled:
    """One pod this agent serves, and what it holds for it."""

    pod: PodSpec
    spec: CaptureSpec
    net: discover.PodNetwork
    identity: str
    listener_ids: tuple[str, ...]
    policy_keys: set[PolicyKey] = field(default_factory=set)


@dataclass(slots=True)
class _Target:
    """A destination workers asked for, and the streams it follows."""

    profile: ProfileKey
    endpoints: DestinationKey | None = None
    pushed: state.Destination | None = None


class Supervisor:
    """The node agent; see the module docstring."""

    def __init__(
        self,
        settings: RunSettings,
        *,
        registry: Registry | None = None,
        iptables_mode: str = "auto",
        iptables_writer: str = "restore",
    ) -> None:
        self.settings = settings
        self.registry = registry or Registry()
        self.mode = Mode(settings.redirect) if settings.redirect != "auto" else _auto_mode()
        self.redirector: Any = (
            _ebpf_redirector(self.registry)
            if self.mode is Mode.EBPF
            else iptables.redirector_for(
                self.mode,
                registry=self.registry,
                iptables_mode=iptables_mode,
                writer=iptables_writer,
            )
        )
        self.gate = controls.ReadinessGate()
        self.node_metrics = NodeMetrics()
        self.aggregator = MetricsAggregator()
        self.exposition = Exposition(self.aggregator)
        self.exposition.add_source(self.node_metrics.families)
        self.tap = TapHub()
        self.tap.on_change = self._on_tap_change
        self.cache = StateCache(on_change=self._on_cache_change)
        self.controlplane: ControlPlane | None = None
        self.client: ControlPlaneClient | None = None
        self.identity: IdentityManager | None = None
        self.pool: WorkerPool | None = None
        self.admin: AdminServer | None = None
        self.source: ManifestPodSource | None = None
        self.enrolled: dict[str, Enrolled] = {}
        self.pending: dict[str, str] = {}  # pod key -> why it is not enrolled yet
        self._desired: dict[str, PodSpec] = {}
        self._seen_desired = False
        self._wake = asyncio.Event()
        self._stopping = asyncio.Event()
        self._targets: dict[str, _Target] = {}
        self._identities: dict[tuple[str, str], str] = {}
        self._cp_answered = False
        self._tasks: list[asyncio.Task[Any]] = []

    # --- lifecycle ------------------------------------------------------------------

    async def start(self) -> None:
        """Start every component; pods are enrolled in the background.

        Raises:
            AgentError: bad PKI, ports taken, workers that do not start.
        """
        s = self.settings
        addrs = await self._start_control_plane()
        self.client = ControlPlaneClient(
            destination=addrs["destination"],
            identity=addrs["identity"],
            policy=addrs["policy"],
            context=ContextToken(ns="", node_name=s.node),
            cache=self.cache,
        )
        assert s.identity_dir is not None  # noqa: S101 - set by start()
        assert s.trust_anchors is not None  # noqa: S101 - set by start()
        bundle = load_trust_bundle(s.trust_anchors)
        self.identity = IdentityManager(
            certifier=self.client.certify,
            token_source=minting_source(s.identity_dir),
            bundle=bundle,
            control_ns=s.controlplane_namespace,
            trust_domain=s.trust_domain,
            on_change=self._on_identity,
        )
        self.pool = WorkerPool(
            s.workers,
            options=WorkerOptions(
                grace_s=s.grace,
                plugins=s.worker_plugins,
                log_level=s.log_level,
            ),
            on_need=self._on_need,
            on_stats=self._on_stats,
            on_metrics=self._on_metrics,
            on_tap=self._on_tap,
            on_exit=self._on_worker_exit,
        )
        self.pool.broadcast(ch.StateUpdate(key=(state.NODE,), value=self._node_info()))
        self.pool.broadcast(ch.StateUpdate(key=(state.TRUST,), value=bundle.pem))
        await self.pool.start()
        self.gate.set(controls.WORKERS, ok=True)
        host, port = s.admin_addr
        self.admin = AdminServer(
            host=host,
            port=port,
            metrics=self.metrics_text,
            ready=self._ready,
            config_dump=self.config_dump,
            tap=self.tap,
        )
        await self.admin.start()
        self.source = ManifestPodSource(
            s.manifests,
            s.node,
            store=self.controlplane.store if self.controlplane is not None else None,
        )
        self._tasks = [
            aio.spawn(self.identity.run(), name="identity"),
            aio.spawn(self._pods_loop(), name="pod-source"),
            aio.spawn(self._reconcile_loop(), name="reconcile"),
            aio.spawn(measure_loop_lag(self.node_metrics.set_loop_lag), name="loop-lag"),
            aio.spawn(self._unanswered_loop(), name="unanswered-targets"),
        ]
        logger.info(
            "agent started",
            extra={"node": s.node, "mode": self.mode.value, "workers": s.workers},
        )

    async def _start_control_plane(self) -> dict[str, str]:
        s = self.settings
        if not s.embedded:
            return s.addresses()
        from agent.config import ControlPlaneSettings  # noqa: PLC0415 - only when embedded
        from agent.controlplane.app import ControlPlane  # noqa: PLC0415

        assert s.identity_dir is not None  # noqa: S101 - set by start()
        cp = ControlPlane(
            ControlPlaneSettings(
                manifests=s.manifests,
                identity_dir=s.identity_dir,
                bind="127.0.0.1",
                destination_port=0,
                identity_port=0,
                policy_port=0,
                cluster_domain=s.cluster_domain,
                trust_domain=s.trust_domain,
                controlplane_namespace=s.controlplane_namespace,
            )
        )
        await cp.start()
        self.controlplane = cp
        self._cp_answered = True
        return {name: f"127.0.0.1:{port}" for name, port in cp.ports.items()}

    async def run(self) -> int:
        """Start, serve until SIGTERM/SIGINT, stop (rule 2); the exit status."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stopping.set)
        try:
            await self.start()
            await self._stopping.wait()
            logger.info("agent shutting down", extra={"grace": self.settings.grace})
        finally:
            await self.stop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)
        return 0

    def request_stop(self) -> None:
        self._stopping.set()

    async def stop(self) -> None:
        """Drain workers, then close everything (rule 2); idempotent enough to call twice."""
        await aio.cancel_and_wait(self._tasks)
        self._tasks = []
        if self.source is not None:
            self.source.close()
        if self.pool is not None:
            await self.pool.drain(self.settings.grace)
        if self.settings.cleanup_on_exit:
            for key in list(self.enrolled):
                await self._unenroll(self.enrolled[key].pod)
            if self.mode is Mode.EBPF:  # programs, maps, node links and pins too
                await asyncio.to_thread(self.redirector.uninstall)
        elif self.mode is Mode.EBPF:
            self.redirector.close()  # pinned programs and links keep capturing (rule 2)
        if self.client is not None:
            await self.client.close()
        if self.controlplane is not None:
            await self.controlplane.stop(grace=0)
        if self.admin is not None:
            await self.admin.close()
        logger.info("agent stopped")

    # --- pods -------------------------------------------------------------------------

    async def _pods_loop(self) -> None:
        assert self.source is not None  # noqa: S101 - set by start()
        async for desired in self.source.desired():
            self._desired = {p.key: p for p in desired}
            if not self._seen_desired:
                self._seen_desired = True
                await self._forget_stale_enrollments()
            self._wake.set()

    async def _reconcile_loop(self) -> None:
        while True:
            timeout = RETRY_S if self.pending else None
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout)
            self._wake.clear()
            await self.reconcile_once()

    async def reconcile_once(self) -> None:
        """One pass of `reconcile.plan` over desired and enrolled pods."""
        actual = [e.pod for e in self.enrolled.values()]
        steps = reconcile.plan(self._desired.values(), actual)
        uids = [s.pod.uid for s in steps if isinstance(s, reconcile.Enroll)]
        candidates = await asyncio.to_thread(discover.scan_proc, uids) if uids else {}
        for step in steps:
            try:
                if isinstance(step, reconcile.Unenroll):
                    await self._unenroll(step.pod)
                elif isinstance(step, reconcile.Update):
                    await self._update(step.old, step.new)
                else:
                    await self._enroll(step.pod, candidates)
            except AgentError as exc:
                pod = step.new if isinstance(step, reconcile.Update) else step.pod
                self.pending[pod.key] = str(exc)
                logger.warning("pod step failed", extra={"pod": pod.key, "error": str(exc)})
        for key in list(self.pending):
            if key not in self._desired or key in self.enrolled:
                del self.pending[key]
        self._update_gauges()

    async def _forget_stale_enrollments(self) -> None:
        """Unenroll registry entries (a previous run's) for pods no longer desired."""
        entries = await asyncio.to_thread(self.registry.load)
        mine = str(self.settings.netns_dir)
        for pod, entry in entries.items():
            if pod in self._desired or not str(entry.spec.netns).startswith(mine):
                continue
            logger.info("removing capture of a pod that left", extra={"pod": pod})
            try:
                await asyncio.to_thread(self.redirector.unenroll, entry.spec)
            except AgentError as exc:
                logger.warning("stale unenroll failed", extra={"pod": pod, "error": str(exc)})
            uid = entry.spec.netns.name
            await asyncio.to_thread(discover.release, uid, self.settings.netns_dir)

    async def _enroll(self, pod: PodSpec, candidates: dict[str, list[discover.Candidate]]) -> None:
        net = await asyncio.to_thread(
            discover.discover,
            pod.uid,
            pod.ip,
            candidates=candidates,
            netns_dir=self.settings.netns_dir,
        )
        if isinstance(net, discover.NotFound):
            if self.pending.get(pod.key) != net.reason:
                logger.info("pod not found yet", extra={"pod": pod.key, "reason": net.reason})
            self.pending[pod.key] = net.reason
            return
        try:
            await self._serve(pod, net)
        except BaseException:
            await asyncio.to_thread(discover.release, pod.uid, self.settings.netns_dir)
            raise

    def _capture_spec(self, pod: PodSpec, net: discover.PodNetwork) -> CaptureSpec:
        return capture_annotations.build_spec(
            pod=pod.key,
            netns=net.netns,
            pod_ip=pod.ip,
            pod_annotations=pod.pod_annotations,
            namespace_annotations=pod.ns_annotations,
            cgroup=net.cgroup,
            named_ports=pod.port_names,
        )

    async def _serve(self, pod: PodSpec, net: discover.PodNetwork) -> None:
        assert self.pool is not None  # noqa: S101 - set by start()
        assert self.identity is not None  # noqa: S101 - set by start()
        spec = self._capture_spec(pod, net)
        listeners: PodListeners = await asyncio.to_thread(
            open_pod_listeners,
            net.netns,
            outbound_port=spec.outbound_port,
            inbound_port=spec.inbound_port,
        )
        ids = (f"{pod.key}/{pod.uid}/outbound", f"{pod.key}/{pod.uid}/inbound")
        try:
            await asyncio.to_thread(self.redirector.enroll, spec)
            if self.mode is Mode.EBPF:  # its maps exist once the pod is enrolled
                self.redirector.set_inbound_listener(spec, listeners.inbound)
        except BaseException:
            listeners.close()
            raise
        for lid, kind, sock in (
            (ids[0], ListenerKind.OUTBOUND, listeners.outbound),
            (ids[1], ListenerKind.INBOUND, listeners.inbound),
        ):
            self.pool.add_listener(
                listener_id=lid, pod=pod.key, kind=kind, netns=str(net.netns), sock=sock
            )
        ident = self.identity.acquire(pod.namespace, pod.service_account).dns_name
        self._identities[(pod.namespace, pod.service_account)] = ident
        entry = Enrolled(pod=pod, spec=spec, net=net, identity=ident, listener_ids=ids)
        self.enrolled[pod.key] = entry
        self._push_pod(entry)
        self._watch_policies(entry)
        self.pending.pop(pod.key, None)
        logger.info(
            "pod enrolled",
            extra={"pod": pod.key, "ip": pod.ip, "netns": str(net.netns_id), "identity": ident},
        )

    def _push_pod(self, e: Enrolled) -> None:
        assert self.pool is not None  # noqa: S101 - set by start()
        pod = e.pod
        info = state.PodInfo(
            namespace=pod.namespace,
            name=pod.name,
            uid=pod.uid,
            ip=pod.ip,
            netns=str(e.net.netns),
            service_account=pod.service_account,
            identity=e.identity,
            node=self.settings.node,
            opaque_ports=_ports(e.spec.opaque_ports, pod.container_ports),
            skip_inbound_ports=_ports(e.spec.skip_inbound_ports, pod.container_ports),
            owner_labels=self._owner_labels(pod),
        )
        self.pool.broadcast(ch.StateUpdate(key=(state.POD, pod.key), value=info))
        self.pool.broadcast(ch.StateUpdate(key=(state.POD_IP, pod.ip), value=pod.key))

    def _watch_policies(self, e: Enrolled) -> None:
        assert self.client is not None  # noqa: S101 - set by start()
        want = {PolicyKey(e.pod.namespace, e.pod.name, p) for p in e.pod.container_ports}
        for key in e.policy_keys - want:
            self.client.unwatch(key)
        for key in want - e.policy_keys:
            self.client.watch_policy(key.ns, key.pod, key.port)
        e.policy_keys = want

    async def _update(self, old: PodSpec, new: PodSpec) -> None:
        assert self.identity is not None  # noqa: S101 - set by start()
        e = self.enrolled[old.key]
        spec = self._capture_spec(new, e.net)
        await asyncio.to_thread(self.redirector.enroll, spec)
        if new.service_account != old.service_account:
            e.identity = self.identity.acquire(new.namespace, new.service_account).dns_name
            self._identities[(new.namespace, new.service_account)] = e.identity
            self.identity.release(old.namespace, old.service_account)
        e.pod, e.spec = new, spec
        self._push_pod(e)
        self._watch_policies(e)
        logger.info("pod updated", extra={"pod": new.key})

    async def _unenroll(self, pod: PodSpec) -> None:
        assert self.pool is not None  # noqa: S101 - set by start()
        assert self.client is not None  # noqa: S101 - set by start()
        assert self.identity is not None  # noqa: S101 - set by start()
        e = self.enrolled.pop(pod.key, None)
        if e is None:
            return
        for lid in e.listener_ids:
            self.pool.remove_listener(lid, drain_s=self.settings.grace)
        for key in e.policy_keys:
            self.client.unwatch(key)
        self.pool.broadcast(ch.StateDelete(key=(state.POD, pod.key)))
        self.pool.broadcast(ch.StateDelete(key=(state.POD_IP, pod.ip)))
        self.identity.release(pod.namespace, pod.service_account)
        with contextlib.suppress(AttributeError):
            self.aggregator.forget_pod(pod.namespace, pod.name)
        try:
            await asyncio.to_thread(self.redirector.unenroll, e.spec)
        finally:
            await asyncio.to_thread(discover.release, pod.uid, self.settings.netns_dir)
        logger.info("pod unenrolled", extra={"pod": pod.key})

    # --- control plane -> workers ----------------------------------------------------

    def _on_need(self, worker_id: int, need: ch.Need) -> None:
        key = need.key
        if need.kind != state.DST or not (isinstance(key, tuple) and len(key) == 2):
            logger.debug("need ignored", extra={"worker": worker_id, "key": repr(key)})
            return
        target = str(key[1])
        t = self._targets.get(target)
        if t is not None:
            if t.pushed is not None and self.pool is not None:
                self.pool.broadcast(ch.StateUpdate(key=(state.DST, target), value=t.pushed))
            return
        assert self.client is not None  # noqa: S101 - set by start()
        plan = resolve.streams_for(target, None)
        t = _Target(profile=self.client.watch_profile(plan.profile_target))
        self._targets[target] = t
        if plan.authority is not None:
            t.endpoints = self.client.watch_destination(plan.authority)
        self._refresh_target(target, t)

    async def _unanswered_loop(self) -> None:
        """Rule 1b: targets whose streams failed before any answer are not mesh services."""
        while True:
            await asyncio.sleep(UNANSWERED_CHECK_S)
            if self.client is None or self.pool is None:
                continue
            waiting = {n: t for n, t in self._targets.items() if t.pushed is None}
            if not waiting:
                continue
            failed = {
                st.key
                for st in self.client.streams()
                if st.state is StreamState.BACKOFF and st.messages == 0
            }
            for name, t in waiting.items():
                if t.profile in failed or (t.endpoints is not None and t.endpoints in failed):
                    t.pushed = resolve.not_a_service(name)
                    logger.info(
                        "destination unanswered, forwarding as not a mesh service",
                        extra={"target": name},
                    )
                    self.pool.broadcast(ch.StateUpdate(key=(state.DST, name), value=t.pushed))

    def _refresh_target(self, target: str, t: _Target) -> None:
        assert self.client is not None  # noqa: S101 - set by start()
        assert self.pool is not None  # noqa: S101 - set by start()
        profile = self.cache.profile(t.profile)
        plan = resolve.streams_for(target, profile)
        want = DestinationKey(plan.authority) if plan.authority is not None else None
        if want != t.endpoints:
            if t.endpoints is not None and not _shared(self._targets, t.endpoints, target):
                self.client.unwatch(t.endpoints)
            t.endpoints = self.client.watch_destination(plan.authority) if plan.authority else None
        eps = self.cache.endpoints(t.endpoints) if t.endpoints is not None else None
        dst = resolve.destination(target, profile, eps, profile_seen=profile is not None)
        if dst is not None and dst != t.pushed:
            t.pushed = dst
            self.pool.broadcast(ch.StateUpdate(key=(state.DST, target), value=dst))

    def _on_cache_change(self, key: Any, value: Any) -> None:
        self._cp_answered = self._cp_answered or value is not None
        if isinstance(key, PolicyKey):
            if self.pool is not None:
                skey = (state.POLICY, f"{key.ns}/{key.pod}", key.port)
                msg: ch.StateUpdate | ch.StateDelete = (
                    ch.StateDelete(key=skey)
                    if value is None
                    else ch.StateUpdate(key=skey, value=value)
                )
                self.pool.broadcast(msg)
            return
        # on_change runs inside the cache call; touch streams after it returns.
        with contextlib.suppress(RuntimeError):
            asyncio.get_running_loop().call_soon(self._refresh_for, key)

    def _refresh_for(self, key: Any) -> None:
        for target, t in list(self._targets.items()):
            if key in (t.profile, t.endpoints):
                self._refresh_target(target, t)

    def _on_identity(self, key: tuple[str, str], material: IdTls | None) -> None:
        if self.pool is None:
            return
        self._cp_answered = self._cp_answered or material is not None
        name = self._identities.get(key)
        if material is None:
            if name is not None:
                self.pool.broadcast(ch.StateDelete(key=(state.TLS, name)))
            return
        sealed = seal(material.key)  # workers open it with `ssl` alone (no cryptography)
        value = state.TlsMaterial(
            identity=material.identity,
            cert_chain_pem=material.cert_chain_pem,
            key_pem=sealed.pem,
            key_password=sealed.password,
            trust_pem=material.bundle_pem,
            not_after=material.expiry.timestamp(),
        )
        self.pool.broadcast(ch.StateUpdate(key=(state.TLS, material.identity), value=value))
        self.node_metrics.set_cert_expiry(material.identity, material.expiry.timestamp())

    def _on_stats(self, stats: ch.Stats) -> None:
        pass  # the pool keeps the latest per worker (`WorkerInfo.stats`)

    # --- observability ------------------------------------------------------------------

    def _on_metrics(self, msg: ch.Metrics) -> None:
        self.aggregator.update(msg.snapshot)

    def _on_worker_exit(self, worker_id: int, pid: int) -> None:
        """Fold a dead worker's counts into the retired base (its last report came first)."""
        if self.aggregator.live_workers.get(worker_id) == pid:
            self.aggregator.retire(worker_id)
        if self.pool is not None and not self._stopping.is_set():
            self.node_metrics.inc_worker_restarts()

    def _on_tap(self, msg: ch.TapEvents) -> None:
        for event in msg.events:
            self.tap.publish(event)

    def _on_tap_change(self, pods: frozenset[str]) -> None:
        if self.pool is None:
            return
        key = ("tap",)
        self.pool.broadcast(
            ch.StateUpdate(key=key, value=pods) if pods else ch.StateDelete(key=key)
        )

    def _owner_labels(self, pod: PodSpec) -> dict[str, str]:
        """`deployment=NAME` of the pod: the Deployment whose selector matches it, or the
        name minus its ReplicaSet hash and suffix (`web-7d4b9c-x2x` -> `web`)."""
        labels = dict(pod.labels)
        if self.controlplane is not None:
            from agent.controlplane import kinds_core as k8s  # noqa: PLC0415 - embedded only

            snap = self.controlplane.store.snapshot()
            for dep in snap.of_kind(k8s.Deployment, pod.namespace):
                sel = dep.selector
                if (sel.match_labels or sel.match_expressions) and sel.matches(labels):
                    return {"deployment": dep.name}
        template_hash = labels.get("pod-template-hash")
        marker = f"-{template_hash}-"
        if template_hash and marker in pod.name:
            return {"deployment": pod.name.rsplit(marker, 1)[0]}
        return {}

    # --- admin ------------------------------------------------------------------------

    def _node_info(self) -> state.NodeInfo:
        s = self.settings
        return state.NodeInfo(
            name=s.node,
            cluster_domain=s.cluster_domain,
            control_ns=s.controlplane_namespace,
            trust_domain=s.trust_domain,
        )

    def _update_gauges(self) -> None:
        self.node_metrics.set_enrolled_pods(self.mode.value, len(self.enrolled))
        self.node_metrics.set_listeners("outbound", len(self.enrolled))
        self.node_metrics.set_listeners("inbound", len(self.enrolled))

    def _ready(self) -> controls.Readiness:
        missing = [k for k in self._desired if k not in self.enrolled]
        self.gate.set(
            controls.REDIRECTS,
            ok=self._seen_desired and not missing,
            reason=f"not enrolled yet: {', '.join(sorted(missing))}" if missing else "",
        )
        pool_ok = self.pool is not None and all(w.ready for w in self.pool.workers)
        pool_ok = pool_ok and self.pool is not None and len(self.pool.workers) == self.pool.n
        self.gate.set(controls.WORKERS, ok=pool_ok)
        self.gate.set(controls.CERTIFICATES, ok=self.identity is not None and self.identity.ready())
        self.gate.set(controls.CONTROL_PLANE, ok=self._cp_answered)
        return self.gate.check()

    def metrics_text(self) -> str:
        """Prometheus text: node and agent families, and the workers' merged ones."""
        nm = self.node_metrics
        if self.pool is not None:
            nm.set_workers({w.worker_id: w.pid for w in self.pool.workers})
            up = sum(1 for w in self.pool.workers if w.ready)
            nm.set_worker_counts(desired=self.pool.n, up=up)
        if self.client is not None:
            by_kind: dict[str, list[Any]] = {}
            for st in self.client.streams():
                by_kind.setdefault(st.kind, []).append(st)
            for kind, streams in by_kind.items():
                nm.set_stream_state(kind, all(st.state.value == "live" for st in streams))
                nm.set_reconnects(kind, sum(st.reconnects for st in streams))
        if self.identity is not None:
            for ident in self.identity.status():
                nm.set_cert_totals(ident.identity, renewals=ident.renewals, failures=ident.failures)
        return self.exposition.render()

    def config_dump(self) -> dict[str, Any]:
        """The agent's state for `/config_dump` (no keys; the admin server scrubs too)."""
        return {
            "node": self.settings.node,
            "mode": self.mode.value,
            "pods": [_pod_dump(e) for e in self.enrolled.values()],
            "pending": dict(self.pending),
            "destinations": {t: _dst_dump(x.pushed) for t, x in self._targets.items()},
            "streams": [
                # "target", not "key": the admin server scrubs fields named like secrets
                {
                    "kind": s.kind,
                    "target": str(s.key),
                    "state": s.state.value,
                    "messages": s.messages,
                }
                for s in (self.client.streams() if self.client else [])
            ],
            "identities": [
                {"identity": st.identity, "ready": st.ready, "expiry": str(st.expiry)}
                for st in (self.identity.status() if self.identity else [])
            ],
            "workers": [
                {"id": w.worker_id, "pid": w.pid, "ready": w.ready}
                for w in (self.pool.workers if self.pool else [])
            ],
            "listeners": self.pool.listener_ids if self.pool else [],
            "policies": self._policies_dump(),
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
                for st in (self.identity.status() if self.identity else [])
            ],
        }

    def _policies_dump(self) -> dict[str, Any]:
        """`ns/pod:port` -> the inbound policy the agent holds (None: no answer yet)."""
        out: dict[str, Any] = {}
        for e in self.enrolled.values():
            for key in sorted(e.policy_keys, key=lambda k: k.port):
                out[f"{key.ns}/{key.pod}:{key.port}"] = self.cache.policy(key)
        return out


def _ebpf_redirector(registry: Registry) -> Any:
    """The eBPF redirector, pinned under MESHAGENT_BPF_PIN_ROOT (default /sys/fs/bpf/meshagent).

    Agents sharing a machine (the sandbox's nodes, tests) each take their own pin root.

    Raises:
        SettingError: a bad MESHAGENT_EBPF_* value, or eBPF mode missing from this build.
    """
    try:
        from agent.redirect import ebpf  # noqa: PLC0415 - bcc is slow to import
    except ImportError:
        raise SettingError(
            "--redirect", "ebpf", "eBPF mode is not available in this build"
        ) from None
    raw = os.environ.get(ENV_BPF_PIN_ROOT, "").strip()
    pin_root = Path(raw) if raw else ebpf.PIN_ROOT
    if not pin_root.is_absolute() or ebpf.BPFFS not in pin_root.parents:
        raise SettingError(ENV_BPF_PIN_ROOT, raw, f"must be a directory under {ebpf.BPFFS}")
    return ebpf.EbpfRedirector(pin_root=pin_root, registry=registry)


def _auto_mode() -> Mode:
    from agent.redirect import check  # noqa: PLC0415 - only for --redirect auto

    mode, reason = check.auto_mode(check.ebpf_checks())
    logger.info("redirect mode chosen", extra={"mode": mode, "reason": reason})
    return Mode(mode)


def _ports(ports: Any, candidates: tuple[int, ...]) -> frozenset[int]:
    """The ports of a `PortSet` among a pod's ports and the well-known opaque ones."""
    universe = set(candidates)
    for r in getattr(ports, "ranges", ()):
        if r.last - r.first < 4096:
            universe.update(range(r.first, r.last + 1))
    return frozenset(p for p in universe if p in ports)


def _shared(targets: dict[str, _Target], key: DestinationKey, but: str) -> bool:
    return any(t.endpoints == key for name, t in targets.items() if name != but)


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
