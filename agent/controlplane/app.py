"""The embedded control plane process: store + PKI + three gRPC servers, and its shutdown.

`ControlPlane(settings)` loads the manifests folder into a `ResourceStore`
(kept current by a `FolderWatcher`), loads the identity issuer and the
token-signing key from the identity dir, and serves, on Linkerd's ports:

    destination  8086  io.linkerd.proxy.destination.Destination
    identity     8080  io.linkerd.proxy.identity.Identity
    policy       8090  io.linkerd.proxy.inbound.InboundServerPolicies

each with `grpc.health.v1.Health` (SERVING for "" and for its service) and
server reflection.

Rules:
1. Start refuses (`PKIError`) an issuer that does not chain to `ca.crt`, or
   is missing; nothing listens then. Bad manifests never stop it: the store
   rejects only the bad documents and logs them.
2. Stop: health turns NOT_SERVING, open streams end (the servicers'
   `close()`), servers stop accepting and give in-flight calls `grace`
   seconds, then cancel; the folder watcher stops last.
3. `serve()` runs until SIGTERM or SIGINT, then stops (rule 2) and returns.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from agent._proto import destination_pb2_grpc, inbound_pb2_grpc
from agent.controlplane import destination as dst
from agent.controlplane import identity_service, servers, tokens
from agent.controlplane import kinds_linkerd as l5d
from agent.controlplane import policy as pol
from agent.controlplane.store import FolderWatcher, ResourceStore
from agent.identity.ca import load_issuer

if TYPE_CHECKING:
    from collections.abc import Callable

    from agent.config import ControlPlaneSettings

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Listener:
    name: str
    service: str
    server: grpc.aio.Server
    health: health_aio.HealthServicer
    port: int = 0


class ControlPlane:
    """The three control-plane servers over one store; see the module rules."""

    def __init__(self, settings: ControlPlaneSettings) -> None:
        self.settings = settings
        self.store = ResourceStore()
        self._watcher = FolderWatcher(settings.manifests, self.store, settings.poll_interval)
        self._listeners: list[_Listener] = []
        self._destination: servers.DestinationService | None = None
        self._policy: servers.PolicyService | None = None
        self._identity: identity_service.IdentityService | None = None

    @property
    def ports(self) -> dict[str, int]:
        """Bound ports by name (`destination`, `identity`, `policy`), after `start`."""
        return {lst.name: lst.port for lst in self._listeners}

    def _servicers(
        self,
    ) -> tuple[servers.DestinationService, servers.PolicyService, identity_service.IdentityService]:
        s = self.settings
        mesh = dst.MeshConfig(
            cluster_domain=s.cluster_domain,
            trust_domain=s.trust_domain,
            control_ns=s.controlplane_namespace,
        )
        destination = servers.DestinationService(self.store, mesh)
        policy = servers.PolicyService(
            self.store,
            pol.PolicyConfig(
                default_policy=l5d.AccessPolicy(s.default_inbound_policy),
                cluster_networks=s.cluster_networks,
                control_ns=s.controlplane_namespace,
                trust_domain=s.trust_domain,
            ),
        )
        issuer = load_issuer(s.identity_dir)  # PKIError: refuse to start (rule 1)
        key = tokens.signing_key(s.identity_dir)
        identity = identity_service.IdentityService(
            verifier=tokens.validator(
                key.public_key(),
                control_ns=s.controlplane_namespace,
                trust_domain=s.trust_domain,
            ),
            issuer=issuer,
            lifetime=timedelta(seconds=s.issuance_lifetime),
            skew=timedelta(seconds=s.clock_skew),
        )
        return destination, policy, identity

    async def start(self) -> None:
        """Load PKI and manifests, then listen. Raises `PKIError`; `OSError` if a port is taken."""
        destination, policy, identity = self._servicers()
        self._destination, self._policy, self._identity = destination, policy, identity
        self._watcher.start()
        s = self.settings
        plan: list[tuple[str, str, int, Callable[[grpc.aio.Server], None]]] = [
            (
                "destination",
                servers.DESTINATION_SERVICE,
                s.destination_port,
                lambda srv: destination_pb2_grpc.add_DestinationServicer_to_server(
                    destination, srv
                ),
            ),
            (
                "identity",
                identity_service.SERVICE,
                s.identity_port,
                lambda srv: identity_service.register(srv, identity),
            ),
            (
                "policy",
                servers.POLICY_SERVICE,
                s.policy_port,
                lambda srv: inbound_pb2_grpc.add_InboundServerPoliciesServicer_to_server(
                    policy, srv
                ),
            ),
        ]
        try:
            for name, service, port, register in plan:
                self._listeners.append(await self._listen(name, service, port, register))
        except BaseException:
            await self.stop(grace=0)
            raise
        logger.info(
            "control plane serving",
            extra={"bind": s.bind, **self.ports, "manifests": str(s.manifests)},
        )

    async def _listen(
        self,
        name: str,
        service: str,
        port: int,
        register: Callable[[grpc.aio.Server], None],
    ) -> _Listener:
        server = grpc.aio.server()
        register(server)
        health = health_aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health, server)
        reflection.enable_server_reflection(
            (
                service,
                health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                reflection.SERVICE_NAME,
            ),
            server,
        )
        host = f"[{self.settings.bind}]" if ":" in self.settings.bind else self.settings.bind
        bound = server.add_insecure_port(f"{host}:{port}")
        if bound == 0:
            raise OSError(f"{name}: cannot listen on {host}:{port}")
        await server.start()
        for svc in ("", service):
            await health.set(svc, health_pb2.HealthCheckResponse.SERVING)
        return _Listener(name=name, service=service, server=server, health=health, port=bound)

    async def stop(self, grace: float | None = None) -> None:
        """Stop serving (rule 2); `grace` defaults to the settings' shutdown grace."""
        grace = self.settings.shutdown_grace if grace is None else grace
        for lst in self._listeners:
            await lst.health.enter_graceful_shutdown()
        for servicer in (self._destination, self._policy):
            if servicer is not None:
                servicer.close()
        await asyncio.gather(*(lst.server.stop(grace) for lst in self._listeners))
        self._listeners.clear()
        self._watcher.stop()
        logger.info("control plane stopped")

    async def serve(self) -> None:
        """Start, run until SIGTERM/SIGINT, stop (rule 3)."""
        loop = asyncio.get_running_loop()
        stopping = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stopping.set)
        try:
            await self.start()
            await stopping.wait()
            logger.info("control plane shutting down")
            await self.stop()
        finally:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)
