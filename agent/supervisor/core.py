"""`meshagent run`: the per-node supervisor (asyncio shell).

Ties together the pod source, discovery, capture, the worker pool, the
control-plane client, the identity manager and the admin server
(DESIGN.md "Processes on a node"). `Supervisor` owns the lifecycle and the
worker channel; its parts live beside it:
    `enroll`   the pods: desired, enrolled, pending, and the steps between
               (capture, in-pod listeners, identity, policy watches),
    `targets`  the destinations workers asked for and the streams each follows,
    `dump`     the admin server's read-only views (`/config_dump`, `/metrics`),
    `resolve`  what a destination resolves to (pure).

Rules:
1. The pod source sets the desired pods; every change (and every `RETRY_S`
   while a pod is pending) runs one reconcile pass (`Enrollments`).
   Workers' needs go to `Targets`; each cache change reaches the policy
   pushes here and the targets after the cache call has returned.
2. SIGTERM/SIGINT: workers drain up to `--grace`, then everything closes;
   redirects stay programmed (as Linkerd keeps iptables across proxy
   restarts), so a restarted agent finds them in the registry and
   reconciles (re-enrolling is idempotent; entries for pods no longer
   desired are removed at start). `--cleanup-on-exit` unenrolls everything.
3. Blocking kernel work (discovery, netns sockets, iptables, the sweep of
   switched-off accelerated sockets, `agent.redirect.accel_sweep`) runs in
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
from typing import TYPE_CHECKING, Any

from agent import aio, native
from agent.admin import controls
from agent.admin.aggregate import Exposition, MetricsAggregator
from agent.admin.node import NodeMetrics, measure_loop_lag
from agent.admin.server import AdminServer
from agent.admin.tap import TapHub
from agent.control.cache import PolicyKey, StateCache
from agent.control.client import ContextToken, ControlPlaneClient
from agent.control.tokens import minting_source
from agent.identity.chain import load_trust_bundle
from agent.identity.manager import IdentityManager
from agent.identity.tls import seal
from agent.pods.source import ManifestPodSource
from agent.proxy import channel as ch
from agent.proxy import placement, state
from agent.proxy.pool import WorkerOptions, WorkerPool, h2_lanes_for
from agent.redirect.model import Mode
from agent.redirect.registry import Registry
from agent.supervisor import dump
from agent.supervisor.enroll import Enrollments, choose_mode, make_redirector
from agent.supervisor.targets import Targets

if TYPE_CHECKING:
    from agent.controlplane.app import ControlPlane
    from agent.identity.manager import TlsMaterial as IdTls
    from agent.supervisor.settings import RunSettings

logger = logging.getLogger(__name__)

RETRY_S = 1.0  # pods not found yet are retried this often


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
        self.mode = choose_mode(settings.redirect)
        self.redirector: Any = make_redirector(
            self.mode, self.registry, iptables_mode=iptables_mode, iptables_writer=iptables_writer
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
        self.pods = Enrollments(
            settings,
            registry=self.registry,
            redirector=self.redirector,
            mode=self.mode,
            aggregator=self.aggregator,
        )
        self.targets = Targets(self.cache)
        self._seen_desired = False
        self._wake = asyncio.Event()
        self._stopping = asyncio.Event()
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
                h2_upgrade=s.h2_upgrade,
                io_uring=s.io_uring,
                slice_s=s.worker_slice,
                h2_lanes=h2_lanes_for(s.workers),
                plugins=s.worker_plugins,
                log_level=s.log_level,
                cpus=(
                    placement.slot_cpus(os.sched_getaffinity(0), s.workers)
                    if s.cpu_placement != "off"
                    else ()
                ),
                pin=s.cpu_placement in {"pin", "bind"},
                steer=s.cpu_placement != "bind",
                pair_maps=self._pair_maps(),
            ),
            on_need=self._on_need,
            on_stats=self._on_stats,
            on_metrics=self._on_metrics,
            on_tap=self._on_tap,
            on_exit=self._on_worker_exit,
        )
        self.targets.attach(client=self.client, pool=self.pool)
        self.pods.attach(
            pool=self.pool,
            client=self.client,
            identity=self.identity,
            controlplane=self.controlplane,
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
            aio.spawn(
                measure_loop_lag(self.node_metrics.set_loop_lag, busy=self._serving),
                name="loop-lag",
            ),
            aio.spawn(self.targets.watch_unanswered(), name="unanswered-targets"),
        ]
        if self.mode is Mode.EBPF and getattr(self.redirector, "accelerate", False):
            from agent.redirect import accel_sweep, sockqueue  # noqa: PLC0415 - eBPF accel only

            pool = self.pool
            queues = sockqueue.Queues(self._pod_places, lambda: pool.pids)
            sweeper = accel_sweep.Sweeper(self.redirector.maps_dir, queues)
            self._tasks.append(aio.spawn(accel_sweep.run(sweeper), name="accel-sweep"))
        compiled = native.state()  # what the workers load (agent.native rule 1)
        logger.info(
            "agent started",
            extra={
                "node": s.node,
                "mode": self.mode.value,
                "workers": s.workers,
                "cpu_placement": s.cpu_placement,
                "native": compiled,
            },
        )
        if compiled == "stale":
            logger.warning(
                "the compiled request path is older than its sources: the workers run them "
                "as plain Python (slower); rebuild with `python -m agent.native build`",
                extra={"build": str(native.BUILD_DIR)},
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
            await self.pods.unenroll_all()
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
            self.pods.desired = {p.key: p for p in desired}
            if not self._seen_desired:
                self._seen_desired = True
                await self.pods.forget_stale()
            self._wake.set()

    async def _reconcile_loop(self) -> None:
        while True:
            timeout = RETRY_S if self.pods.pending else None
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout)
            self._wake.clear()
            await self.reconcile_once()

    async def reconcile_once(self) -> None:
        """One pass of `reconcile.plan` over desired and enrolled pods."""
        await self.pods.reconcile_once()
        self._update_gauges()

    def _on_need(self, worker_id: int, need: ch.Need) -> None:
        """A worker waits for a value: a port's policy (enroll rule 5) or a destination."""
        if need.kind == state.POLICY:
            self.pods.need_policy(need.key)
        else:
            self.targets.need(worker_id, need)

    # --- control plane -> workers ----------------------------------------------------

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
            asyncio.get_running_loop().call_soon(self.targets.refresh_for, key)

    def _on_identity(self, key: tuple[str, str], material: IdTls | None) -> None:
        if self.pool is None:
            return
        self._cp_answered = self._cp_answered or material is not None
        name = self.pods.identities.get(key)
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

    def _serving(self) -> bool:
        """Whether traffic flows: the loop-lag probe's busy test. An idle node's
        supervisor then wakes once a second for it instead of ten times."""
        return self.pool is not None and self.pool.serving

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

    # --- admin ------------------------------------------------------------------------

    def _pod_places(self) -> list[Any]:
        """Each enrolled pod's netns and cgroup (`sockqueue.Place`), for the sweep's thread:
        `list()` copies the values in one step, so the loop may change the dict meanwhile."""
        from agent.redirect.sockqueue import Place  # noqa: PLC0415 - eBPF acceleration only

        return [
            Place(netns=e.spec.netns, cgroup=e.spec.cgroup)
            for e in list(self.pods.enrolled.values())
        ]

    def _pair_maps(self) -> str:
        """Where workers find the paired relay's maps: with eBPF acceleration, unless
        MESHAGENT_EBPF_PAIR turns it off."""
        if self.mode is Mode.EBPF and getattr(self.redirector, "pair", False):
            return str(self.redirector.maps_dir)
        return ""

    def _node_info(self) -> state.NodeInfo:
        s = self.settings
        return state.NodeInfo(
            name=s.node,
            cluster_domain=s.cluster_domain,
            control_ns=s.controlplane_namespace,
            trust_domain=s.trust_domain,
        )

    def _update_gauges(self) -> None:
        enrolled = len(self.pods.enrolled)
        self.node_metrics.set_enrolled_pods(self.mode.value, enrolled)
        self.node_metrics.set_listeners("outbound", enrolled)
        self.node_metrics.set_listeners("inbound", enrolled)

    def _ready(self) -> controls.Readiness:
        """Rule 4: each readiness check, as of now."""
        missing = [k for k in self.pods.desired if k not in self.pods.enrolled]
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
        return dump.metrics_text(self)

    def config_dump(self) -> dict[str, Any]:
        """The agent's state for `/config_dump` (no keys; the admin server scrubs too)."""
        return dump.config_dump(self)
