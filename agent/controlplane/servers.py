"""grpc.aio servicers: Destination (Get, GetProfile) and InboundServerPolicies (GetPort, WatchPort).

Thin shells over the pure `destination` and `policy` modules.

Rules:
1. A stream follows the store: it computes its answer from the newest
   snapshot on start and after every change (changes that race are coalesced),
   and writes only when the answer changed.
2. Requests are checked before anything is sent. Bad paths and workloads are
   INVALID_ARGUMENT, a pod the store does not hold NOT_FOUND, each with a
   message saying what is wrong (Linkerd's wording where it has one:
   "Invalid authority: ...", "Invalid workload: ...", "unknown server").
   An unknown Service on Get is not an error: the stream says
   `no_endpoints{exists:false}` and follows the store until it appears.
3. `close()` ends every open stream (graceful shutdown): the streams return,
   so the server can stop without waiting out its grace period.
4. One log line per stream start and end, with the path or workload.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING

import grpc

from agent._proto import destination_pb2, destination_pb2_grpc, inbound_pb2, inbound_pb2_grpc
from agent.controlplane import destination as dst
from agent.controlplane import policy as pol
from agent.controlplane import profiles

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from agent.controlplane.store import ResourceStore, Snapshot

logger = logging.getLogger(__name__)

DESTINATION_SERVICE = "io.linkerd.proxy.destination.Destination"
POLICY_SERVICE = "io.linkerd.proxy.inbound.InboundServerPolicies"


class _Streams:
    """Snapshot iterators for open streams, all of which `close()` ends."""

    def __init__(self, store: ResourceStore) -> None:
        self._store = store
        self._wakes: set[asyncio.Event] = set()
        self._closed = False

    def close(self) -> None:
        self._closed = True
        for wake in list(self._wakes):
            wake.set()

    @property
    def closed(self) -> bool:
        return self._closed

    async def snapshots(self) -> AsyncIterator[Snapshot]:
        """The current snapshot, then the newest after each change, until `close()`."""
        loop = asyncio.get_running_loop()
        wake = asyncio.Event()

        def on_change(_: Snapshot) -> None:
            with contextlib.suppress(RuntimeError):  # the loop is gone: so is this stream
                loop.call_soon_threadsafe(wake.set)

        unsubscribe = self._store.subscribe(on_change)
        self._wakes.add(wake)
        try:
            last = -1
            while not self._closed:
                snap = self._store.snapshot()
                if snap.generation != last:
                    last = snap.generation
                    yield snap
                    continue
                await wake.wait()
                wake.clear()
        finally:
            self._wakes.discard(wake)
            unsubscribe()


def _peer(context: grpc.aio.ServicerContext) -> str:
    try:
        return str(context.peer())
    except Exception:  # noqa: BLE001 - a peer string is only for the log line
        return "?"


class DestinationService(destination_pb2_grpc.DestinationServicer):
    """`io.linkerd.proxy.destination.Destination` over a resource store."""

    def __init__(self, store: ResourceStore, mesh: dst.MeshConfig) -> None:
        self._store = store
        self._mesh = mesh
        self._streams = _Streams(store)

    def close(self) -> None:
        """End every open stream (rule 3)."""
        self._streams.close()

    async def Get(  # noqa: N802 - the gRPC method name
        self, request: destination_pb2.GetDestination, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[destination_pb2.Update]:
        """Stream endpoint updates for a path (destination.py rule 1)."""
        try:
            target = dst.Target.parse(request.path)
            dst.resolve(self._store.snapshot(), target, self._mesh)
        except dst.InvalidTarget as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            return
        token = dst.ContextToken.parse(request.context_token)
        log = {"path": request.path, "context_ns": token.ns, "peer": _peer(context)}
        logger.debug("destination get started", extra=log)
        current: dst.EndpointSet | None = None
        try:
            async for snap in self._streams.snapshots():
                try:
                    new = dst.resolve(snap, target, self._mesh)
                except dst.InvalidTarget:
                    new = dst.NOT_FOUND  # it became an ExternalName service: nothing to resolve
                for update in dst.diff(current, new):
                    yield update
                current = new
        finally:
            logger.debug("destination get ended", extra=log)

    async def GetProfile(  # noqa: N802 - the gRPC method name
        self, request: destination_pb2.GetDestination, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[destination_pb2.DestinationProfile]:
        """Stream the profile of a path (destination.py rules 3 and 4)."""
        token = dst.ContextToken.parse(request.context_token)
        try:
            lookup = profiles.profile_lookup(dst.Target.parse(request.path), self._mesh)
        except dst.InvalidTarget as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            return
        first = profiles.profile(self._store.snapshot(), lookup, token, self._mesh)
        if first is None and lookup.service is not None:
            name = lookup.service
            await context.abort(
                grpc.StatusCode.NOT_FOUND, f"Service {name.name}.{name.namespace} not found"
            )
            return
        log = {"path": request.path, "context_ns": token.ns, "peer": _peer(context)}
        logger.debug("destination profile started", extra=log)
        sent: destination_pb2.DestinationProfile | None = None
        try:
            async for snap in self._streams.snapshots():
                prof = profiles.profile(snap, lookup, token, self._mesh)
                if prof is None or prof == sent:
                    continue  # a deleted Service keeps its last profile until it returns
                sent = prof
                yield prof
        finally:
            logger.debug("destination profile ended", extra=log)


class PolicyService(inbound_pb2_grpc.InboundServerPoliciesServicer):
    """`io.linkerd.proxy.inbound.InboundServerPolicies` over a resource store."""

    def __init__(self, store: ResourceStore, config: pol.PolicyConfig) -> None:
        self._store = store
        self._config = config
        self._streams = _Streams(store)

    def close(self) -> None:
        """End every open stream (rule 3)."""
        self._streams.close()

    async def _check(
        self, request: inbound_pb2.PortSpec, context: grpc.aio.ServicerContext
    ) -> tuple[pol.Workload, int] | None:
        try:
            workload = pol.Workload.parse(request.workload)
        except pol.InvalidWorkload as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            return None
        except pol.UnknownWorkload as exc:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
            return None
        if not 0 < request.port < 65536:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"Invalid port: {request.port}")
            return None
        return workload, request.port

    async def GetPort(  # noqa: N802 - the gRPC method name
        self, request: inbound_pb2.PortSpec, context: grpc.aio.ServicerContext
    ) -> inbound_pb2.Server:
        """The policy of one workload port now."""
        checked = await self._check(request, context)
        if checked is None:
            return inbound_pb2.Server()  # pragma: no cover - abort raises
        workload, port = checked
        try:
            return pol.inbound_server(self._store.snapshot(), workload, port, self._config)
        except pol.UnknownWorkload as exc:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
            return inbound_pb2.Server()  # pragma: no cover - abort raises

    async def WatchPort(  # noqa: N802 - the gRPC method name
        self, request: inbound_pb2.PortSpec, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[inbound_pb2.Server]:
        """The policy of one workload port, again whenever it changes; ends if the pod goes."""
        checked = await self._check(request, context)
        if checked is None:
            return
        workload, port = checked
        try:
            pol.decide(self._store.snapshot(), workload, port, self._config)
        except pol.UnknownWorkload as exc:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
            return
        log = {"workload": f"{workload.namespace}/{workload.pod}", "port": port}
        logger.debug("policy watch started", extra=log)
        sent: inbound_pb2.Server | None = None
        try:
            async for snap in self._streams.snapshots():
                try:
                    server = pol.inbound_server(snap, workload, port, self._config)
                except pol.UnknownWorkload:
                    logger.info("policy watch ended: pod deleted", extra=log)
                    return
                if server != sent:
                    sent = server
                    yield server
        finally:
            logger.debug("policy watch ended", extra=log)
