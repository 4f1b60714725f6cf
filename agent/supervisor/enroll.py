"""Pod enrollment: what the supervisor takes and gives back for each meshed pod (asyncio shell).

`Enrollments.reconcile_once` runs one pass of `agent.pods.reconcile.plan`
over the desired pods and the enrolled ones. Per meshed pod on this node
(`Enroll`):
    1. find its netns and cgroup (`agent.pods.discover`; not found yet ->
       recorded in `pending` and retried while it stays desired),
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
    7. WatchPort each container port -> `("policy", key, port)`; any other port
       once a worker asks for its policy (`need_policy`, rule 5).
`Update` re-enrolls the redirect with the new spec (and moves the identity
when the service account changed). `Unenroll` undoes it all: listeners removed
(connections get the grace), redirect unenrolled, state deleted, identity
released, netns mount dropped.

Rules:
1. Blocking kernel work (discovery, netns sockets, iptables) runs in
   threads, never on the event loop.
2. A step that fails with `AgentError` leaves its pod in `pending` with the
   reason, and the next pass tries again.
3. Registry entries a previous run left for pods no longer desired are
   unenrolled once, when the pod source first answers (`forget_stale`).
4. The redirect mode and its redirector are chosen once, at start
   (`choose_mode`, `make_redirector`); the pool, the client, the identity
   manager and the embedded control plane arrive through `attach`
   (`Supervisor.start`), before any step runs.
5. A port the pod does not declare has a policy too (a Server may select it by
   number, the pod's default applies otherwise), as Linkerd's proxies discover
   it for any port they see traffic on: a worker's `Need` for it starts its
   WatchPort, kept while the pod stays enrolled, for at most `MAX_ASKED_PORTS`
   ports per pod (past that the node's default applies, after one wait per
   worker and port: agent.proxy.inbound rule 5).
6. In iptables mode the steps of one group of the plan (its unenrolls, its
   updates, its enrolls: `agent.pods.reconcile` rule 4, groups in that order)
   run up to `STEP_WIDTH` at a time, and so do the unenrolls at exit: each step
   touches only its own pod's netns, mount and registry entry (the registry
   takes a file lock, `iptables-restore -w` the xtables lock): the rules of 100
   pods go on in about half the time and come off in about a third. eBPF mode
   keeps one step at a time: its steps share one loaded object and its maps.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agent import aio
from agent.control.cache import PolicyKey
from agent.errors import AgentError, RegistryError, SettingError
from agent.pods import discover, reconcile
from agent.proxy import channel as ch
from agent.proxy import state
from agent.proxy.listener import ListenerKind, open_pod_listeners
from agent.redirect import annotations as capture_annotations
from agent.redirect import iptables
from agent.redirect.model import Mode

if TYPE_CHECKING:
    from agent.admin.aggregate import MetricsAggregator
    from agent.control.client import ControlPlaneClient
    from agent.controlplane.app import ControlPlane
    from agent.identity.manager import IdentityManager
    from agent.pods.model import PodSpec
    from agent.proxy.listener import PodListeners
    from agent.proxy.pool import WorkerPool
    from agent.redirect.model import CaptureSpec
    from agent.redirect.registry import Enrollment, Registry
    from agent.supervisor.settings import RunSettings

logger = logging.getLogger(__name__)

ENV_BPF_PIN_ROOT = "MESHAGENT_BPF_PIN_ROOT"
MAX_ASKED_PORTS = 64  # rule 5: undeclared ports whose policy one pod follows
STEP_WIDTH = 4  # rule 6: pods enrolled or unenrolled at once in iptables mode


def policy_need(key: object) -> tuple[str, int] | None:
    """The pod key and port of a worker's policy `Need` key (`("policy", "ns/pod",
    port)`), or None for anything else."""
    if not (isinstance(key, tuple) and len(key) == 3 and key[0] == state.POLICY):
        return None
    _, pod, port = key
    if not isinstance(pod, str) or not isinstance(port, int) or isinstance(port, bool):
        return None
    return (pod, port) if 0 < port < 65536 else None


@dataclass(slots=True, kw_only=True)
class Enrolled:
    """One pod this agent serves, and what it holds for it."""

    pod: PodSpec
    spec: CaptureSpec
    net: discover.PodNetwork
    identity: str
    listener_ids: tuple[str, ...]
    policy_keys: set[PolicyKey] = field(default_factory=set)  # its declared ports'
    asked_keys: set[PolicyKey] = field(default_factory=set)  # others', asked for (rule 5)


class Enrollments:
    """The pods desired on this node, those enrolled, those pending; see the module docstring."""

    def __init__(
        self,
        settings: RunSettings,
        *,
        registry: Registry,
        redirector: Any,
        mode: Mode,
        aggregator: MetricsAggregator,
    ) -> None:
        self.settings = settings
        self.registry = registry
        self.redirector = redirector
        self.mode = mode
        self.aggregator = aggregator
        self.pool: WorkerPool | None = None
        self.client: ControlPlaneClient | None = None
        self.identity: IdentityManager | None = None
        self.controlplane: ControlPlane | None = None
        self.desired: dict[str, PodSpec] = {}  # set by the pod source
        self.enrolled: dict[str, Enrolled] = {}
        self.pending: dict[str, str] = {}  # pod key -> why it is not enrolled yet
        self.identities: dict[tuple[str, str], str] = {}  # (ns, sa) -> identity name

    def attach(
        self,
        *,
        pool: WorkerPool,
        client: ControlPlaneClient,
        identity: IdentityManager,
        controlplane: ControlPlane | None,
    ) -> None:
        """Hand over what the steps use once `Supervisor.start` has made it (rule 4)."""
        self.pool = pool
        self.client = client
        self.identity = identity
        self.controlplane = controlplane

    @property
    def width(self) -> int:
        """How many pods' steps run at once (rule 6)."""
        return STEP_WIDTH if self.mode is Mode.IPTABLES else 1

    async def reconcile_once(self) -> None:
        """One pass of `reconcile.plan` over desired and enrolled pods (rules 2 and 6)."""
        actual = [e.pod for e in self.enrolled.values()]
        steps = reconcile.plan(self.desired.values(), actual)
        uids = [s.pod.uid for s in steps if isinstance(s, reconcile.Enroll)]
        candidates = await asyncio.to_thread(discover.scan_proc, uids) if uids else {}
        for kind in (reconcile.Unenroll, reconcile.Update, reconcile.Enroll):
            group = [s for s in steps if isinstance(s, kind)]
            await aio.at_most(self.width, [self._step(s, candidates) for s in group])
        for key in list(self.pending):
            if key not in self.desired or key in self.enrolled:
                del self.pending[key]

    async def _step(
        self, step: reconcile.Step, candidates: dict[str, list[discover.Candidate]]
    ) -> None:
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

    async def forget_stale(self) -> None:
        """Unenroll registry entries (a previous run's) for pods no longer desired (rule 3)."""
        try:
            entries = await asyncio.to_thread(self.registry.load)
        except RegistryError as exc:  # its pods' captures stay; enrolling says so again
            logger.warning("previous run's pods not read", extra={"error": str(exc)})
            return
        mine = str(self.settings.netns_dir)
        stale = [
            (pod, entry)
            for pod, entry in entries.items()
            if pod not in self.desired and str(entry.spec.netns).startswith(mine)
        ]
        await aio.at_most(self.width, [self._forget(pod, entry) for pod, entry in stale])

    async def _forget(self, pod: str, entry: Enrollment) -> None:
        logger.info("removing capture of a pod that left", extra={"pod": pod})
        try:
            await asyncio.to_thread(self.redirector.unenroll, entry.spec)
        except AgentError as exc:
            logger.warning("stale unenroll failed", extra={"pod": pod, "error": str(exc)})
        uid = entry.spec.netns.name
        await asyncio.to_thread(discover.release, uid, self.settings.netns_dir)

    async def unenroll_all(self) -> None:
        """Unenroll every enrolled pod (`--cleanup-on-exit`; rule 6)."""
        pods = [e.pod for e in self.enrolled.values()]
        await aio.at_most(self.width, [self._unenroll(pod) for pod in pods])

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

    async def _serve(self, pod: PodSpec, net: discover.PodNetwork) -> None:
        assert self.pool is not None  # noqa: S101 - set by attach()
        assert self.identity is not None  # noqa: S101 - set by attach()
        spec = capture_spec(pod, net)
        listeners: PodListeners = await asyncio.to_thread(
            open_pod_listeners,
            net.netns,
            outbound_port=spec.outbound_port,
            inbound_port=spec.inbound_port,
            copies=self.pool.n,  # one per worker (agent.proxy.listener rule 2)
            steering=self.pool.steering,  # to the worker on the connection's CPU
        )
        ids = (f"{pod.key}/{pod.uid}/outbound", f"{pod.key}/{pod.uid}/inbound")
        try:
            await asyncio.to_thread(self.redirector.enroll, spec)
            if self.mode is Mode.EBPF:  # its maps exist once the pod is enrolled
                # sk_lookup picks this socket; the kernel then picks within its group
                self.redirector.set_inbound_listener(spec, listeners.inbound[0])
        except BaseException:
            listeners.close()
            raise
        for lid, kind, socks in (
            (ids[0], ListenerKind.OUTBOUND, listeners.outbound),
            (ids[1], ListenerKind.INBOUND, listeners.inbound),
        ):
            self.pool.add_listener(
                listener_id=lid, pod=pod.key, kind=kind, netns=str(net.netns), socks=socks
            )
        ident = self.identity.acquire(pod.namespace, pod.service_account).dns_name
        self.identities[(pod.namespace, pod.service_account)] = ident
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
        assert self.pool is not None  # noqa: S101 - set by attach()
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
        assert self.client is not None  # noqa: S101 - set by attach()
        want = {PolicyKey(e.pod.namespace, e.pod.name, p) for p in e.pod.container_ports}
        for key in e.policy_keys - want:
            self.client.unwatch(key)
        for key in want - e.policy_keys:
            if key in e.asked_keys:  # followed already: now a declared port's
                e.asked_keys.discard(key)
            else:
                self.client.watch_policy(key.ns, key.pod, key.port)
        e.policy_keys = want

    def need_policy(self, key: object) -> None:
        """A worker waits for the policy of a port: follow it if the pod is enrolled and
        does not declare it (rule 5); a followed port's answer reaches every worker as
        it changes."""
        assert self.client is not None  # noqa: S101 - set by attach()
        parsed = policy_need(key)
        e = self.enrolled.get(parsed[0]) if parsed is not None else None
        if parsed is None or e is None:
            logger.debug("policy need ignored", extra={"key": repr(key)})
            return
        pk = PolicyKey(e.pod.namespace, e.pod.name, parsed[1])
        if pk in e.policy_keys or pk in e.asked_keys:
            return
        if len(e.asked_keys) >= MAX_ASKED_PORTS:
            logger.warning(
                "too many undeclared ports asked for, the node's default policy applies",
                extra={"pod": e.pod.key, "port": pk.port, "limit": MAX_ASKED_PORTS},
            )
            return
        e.asked_keys.add(pk)
        self.client.watch_policy(pk.ns, pk.pod, pk.port)
        logger.info(
            "following the policy of an undeclared port", extra={"pod": e.pod.key, "port": pk.port}
        )

    async def _update(self, old: PodSpec, new: PodSpec) -> None:
        assert self.identity is not None  # noqa: S101 - set by attach()
        e = self.enrolled[old.key]
        spec = capture_spec(new, e.net)
        await asyncio.to_thread(self.redirector.enroll, spec)
        if new.service_account != old.service_account:
            e.identity = self.identity.acquire(new.namespace, new.service_account).dns_name
            self.identities[(new.namespace, new.service_account)] = e.identity
            self.identity.release(old.namespace, old.service_account)
        e.pod, e.spec = new, spec
        self._push_pod(e)
        self._watch_policies(e)
        logger.info("pod updated", extra={"pod": new.key})

    async def _unenroll(self, pod: PodSpec) -> None:
        assert self.pool is not None  # noqa: S101 - set by attach()
        assert self.client is not None  # noqa: S101 - set by attach()
        assert self.identity is not None  # noqa: S101 - set by attach()
        e = self.enrolled.pop(pod.key, None)
        if e is None:
            return
        for lid in e.listener_ids:
            self.pool.remove_listener(lid, drain_s=self.settings.grace)
        for key in e.policy_keys | e.asked_keys:
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


def capture_spec(pod: PodSpec, net: discover.PodNetwork) -> CaptureSpec:
    """The pod's `CaptureSpec`, from its and its namespace's annotations (step 2)."""
    return capture_annotations.build_spec(
        pod=pod.key,
        netns=net.netns,
        pod_ip=pod.ip,
        pod_annotations=pod.pod_annotations,
        namespace_annotations=pod.ns_annotations,
        cgroup=net.cgroup,
        named_ports=pod.port_names,
    )


def choose_mode(redirect: str) -> Mode:
    """The mode `--redirect` names, or for `auto` the one this kernel supports (rule 4)."""
    return Mode(redirect) if redirect != "auto" else _auto_mode()


def make_redirector(
    mode: Mode, registry: Registry, *, iptables_mode: str, iptables_writer: str
) -> Any:
    """The redirector of `mode` (rule 4).

    Raises:
        SettingError: see `_ebpf_redirector`.
    """
    if mode is Mode.EBPF:
        return _ebpf_redirector(registry)
    return iptables.redirector_for(
        mode, registry=registry, iptables_mode=iptables_mode, writer=iptables_writer
    )


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
