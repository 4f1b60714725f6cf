"""The supervisor's gRPC client to a Linkerd-API control plane (asyncio shell over grpc.aio).

`ControlPlaneClient` holds the long-lived streams the node needs,
Destination.Get and GetProfile per target, InboundServerPolicies.WatchPort per
pod port, and makes Identity.Certify calls. Updates go through
`agent.control.convert` into a `StateCache`, whose `on_change` hook is how
the supervisor learns about them.

Rules:
1. A stream starts on the first `watch_*` for its key (later calls return the
   same key) and runs until `unwatch(key)` or `close()`.
2. A stream that fails or ends is opened again after a capped, jittered,
   exponential backoff (`Backoff`: 100 ms doubling to 10 s, less up to half at
   random); a stream that delivered a message starts over from the base delay.
   The gRPC channels' own reconnect backoff is capped the same way, so a
   control plane that comes back is reached within the cap.
3. While a stream is down the cache keeps serving its last state; for `Get`
   the new stream's first message replaces it (`StateCache.begin_subscription`).
4. A message that does not convert rejects only itself: endpoints are dropped
   one by one, a bad profile keeps the previous one, a bad policy becomes the
   deny-all invalid policy (linkerd2-proxy does the same). Each is logged and
   counted on its stream.
5. Requests carry the context token linkerd2-proxy sends,
   `{"ns": ..., "nodeName": ..., "pod": ...}`, and WatchPort the workload
   `{"ns": ..., "pod": ...}`.
6. Never log tokens, CSRs or keys.
"""

from __future__ import annotations

import asyncio
import enum
import json
import logging
import random
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import grpc

from agent import aio
from agent._proto import (
    destination_pb2,
    destination_pb2_grpc,
    identity_pb2,
    identity_pb2_grpc,
    inbound_pb2,
    inbound_pb2_grpc,
)
from agent.control import convert, convert_policy
from agent.control.cache import DestinationKey, Key, PolicyKey, ProfileKey, StateCache
from agent.errors import AgentError, InvalidResource
from agent.identity.manager import Certificate
from agent.policy.model import ServerPolicy

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable

logger = logging.getLogger(__name__)

CERTIFY_TIMEOUT_S = 10.0


class ControlPlaneError(AgentError):
    """A control-plane call failed: which service and method, the gRPC code and detail."""

    def __init__(self, service: str, method: str, code: str, detail: str) -> None:
        self.service = service
        self.method = method
        self.code = code
        self.detail = detail
        super().__init__(f"{service} {method}: {code}: {detail}")


@dataclass(frozen=True, slots=True, kw_only=True)
class ContextToken:
    """Who is asking, as linkerd2-proxy tells the Destination service."""

    ns: str = ""
    node_name: str = ""
    pod: str = ""

    def to_json(self) -> str:
        """The wire form: `{"ns": ..., "nodeName": ..., "pod": ...}`."""
        return json.dumps(
            {"ns": self.ns, "nodeName": self.node_name, "pod": self.pod}, separators=(",", ":")
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class Backoff:
    """Capped exponential backoff with jitter (pure)."""

    base_s: float = 0.1
    cap_s: float = 10.0
    factor: float = 2.0
    jitter: float = 0.5  # up to this fraction of the delay is taken off at random

    def delay(self, attempt: int, rand: float) -> float:
        """Seconds to wait before attempt `attempt + 1` (`attempt` from 0), `rand` in [0, 1)."""
        ceiling = min(self.cap_s, self.base_s * self.factor ** min(attempt, 64))
        return ceiling * (1.0 - self.jitter * rand)


class StreamState(enum.Enum):
    """Where a stream is: opening, delivering, or waiting to reopen."""

    CONNECTING = "connecting"
    LIVE = "live"
    BACKOFF = "backoff"


@dataclass(frozen=True, slots=True, kw_only=True)
class StreamStatus:
    """One stream, for metrics and `config_dump`."""

    kind: str  # "destination" | "profile" | "policy"
    key: Key
    state: StreamState
    since: datetime
    reconnects: int
    messages: int
    rejected: int  # messages (or endpoints) that did not convert
    last_error: str | None


@dataclass(slots=True, kw_only=True)
class _Stream:
    kind: str
    key: Key
    state: StreamState = StreamState.CONNECTING
    since: datetime = field(default_factory=lambda: datetime.now(UTC))
    reconnects: int = 0
    messages: int = 0
    rejected: int = 0
    last_error: str | None = None
    task: asyncio.Task[None] | None = None

    def enter(self, state: StreamState) -> None:
        if state is not self.state:
            self.state = state
            self.since = datetime.now(UTC)

    def status(self) -> StreamStatus:
        return StreamStatus(
            kind=self.kind,
            key=self.key,
            state=self.state,
            since=self.since,
            reconnects=self.reconnects,
            messages=self.messages,
            rejected=self.rejected,
            last_error=self.last_error,
        )


def _channel_options(backoff: Backoff) -> list[tuple[str, Any]]:
    ms = int(backoff.base_s * 1000)
    return [
        ("grpc.initial_reconnect_backoff_ms", ms),
        ("grpc.min_reconnect_backoff_ms", ms),
        ("grpc.max_reconnect_backoff_ms", int(backoff.cap_s * 1000)),
    ]


class ControlPlaneClient:
    """Streams and calls to the control plane's three services; see the module rules."""

    def __init__(  # noqa: PLR0913 - keyword-only addresses and collaborators
        self,
        *,
        destination: str,
        identity: str,
        policy: str,
        context: ContextToken,
        cache: StateCache | None = None,
        backoff: Backoff | None = None,
        rand: Callable[[], float] = random.random,
        certify_timeout_s: float = CERTIFY_TIMEOUT_S,
    ) -> None:
        self.addrs = {"destination": destination, "identity": identity, "policy": policy}
        self.context = context
        self.cache = cache if cache is not None else StateCache()
        self.backoff = backoff or Backoff()
        self._rand = rand
        self._certify_timeout = certify_timeout_s
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._streams: dict[Key, _Stream] = {}
        self._closed = False

    # --- streams --------------------------------------------------------------------

    def watch_destination(self, target: str) -> DestinationKey:
        """Follow Destination.Get for `target` (`name:port` or `ip:port`)."""
        key = DestinationKey(target)
        request = destination_pb2.GetDestination(
            scheme="k8s", path=target, context_token=self.context.to_json()
        )
        self._start(key, "destination", lambda: self._destination().Get(request))
        return key

    def watch_profile(self, target: str, context_ns: str | None = None) -> ProfileKey:
        """Follow Destination.GetProfile for `target`, as a client in `context_ns` sees it."""
        key = ProfileKey(target, context_ns or "")
        token = self.context
        if context_ns:
            token = ContextToken(ns=context_ns, node_name=self.context.node_name)
        request = destination_pb2.GetDestination(
            scheme="k8s", path=target, context_token=token.to_json()
        )
        self._start(key, "profile", lambda: self._destination().GetProfile(request))
        return key

    def watch_policy(self, ns: str, pod: str, port: int) -> PolicyKey:
        """Follow InboundServerPolicies.WatchPort for port `port` of pod `ns/pod`."""
        key = PolicyKey(ns, pod, port)
        workload = json.dumps({"ns": ns, "pod": pod}, separators=(",", ":"))
        request = inbound_pb2.PortSpec(workload=workload, port=port)
        self._start(key, "policy", lambda: self._policy().WatchPort(request))
        return key

    def unwatch(self, key: Key) -> None:
        """Stop the stream of `key` and forget its state."""
        stream = self._streams.pop(key, None)
        if stream is not None and stream.task is not None:
            stream.task.cancel()
        self.cache.drop(key)

    def streams(self) -> list[StreamStatus]:
        """Every stream's status."""
        return [s.status() for s in self._streams.values()]

    @property
    def reconnects(self) -> int:
        """Reconnects over all streams (a counter)."""
        return sum(s.reconnects for s in self._streams.values())

    def _start(self, key: Key, kind: str, open_call: Callable[[], Any]) -> None:
        if self._closed:
            raise RuntimeError("BUG: watch on a closed ControlPlaneClient")
        if key in self._streams:
            return
        stream = _Stream(kind=kind, key=key)
        self._streams[key] = stream
        stream.task = aio.spawn(self._run(stream, open_call), name=f"control-{kind}-{key}")

    async def _run(self, stream: _Stream, open_call: Callable[[], Any]) -> None:
        attempt = 0
        while True:
            stream.enter(StreamState.CONNECTING)
            if isinstance(stream.key, DestinationKey):
                self.cache.begin_subscription(stream.key)
            try:
                got = await self._consume(stream, open_call)
            except Exception as exc:  # a bug; the stream must outlive it, so log and reopen
                logger.exception(
                    "BUG: control-plane stream failed",
                    extra={"stream": stream.kind, "key": str(stream.key)},
                )
                stream.last_error = f"BUG: {type(exc).__name__}: {exc}"
                got = False
            if got:
                attempt = 0
            delay = self.backoff.delay(attempt, self._rand())
            attempt += 1
            stream.reconnects += 1
            stream.enter(StreamState.BACKOFF)
            log = logger.warning if got or attempt == 1 else logger.debug
            log(
                "control-plane stream down; reconnecting",
                extra={
                    "stream": stream.kind,
                    "key": str(stream.key),
                    "error": stream.last_error,
                    "retry_in_s": round(delay, 3),
                },
            )
            await asyncio.sleep(delay)

    async def _consume(self, stream: _Stream, open_call: Callable[[], Any]) -> bool:
        """Read one stream to its end; True if it delivered a message."""
        got = False
        call = open_call()
        try:
            async for msg in _iterate(call):
                if not got:
                    got = True
                    stream.enter(StreamState.LIVE)
                    logger.info(
                        "control-plane stream live",
                        extra={"stream": stream.kind, "key": str(stream.key)},
                    )
                stream.messages += 1
                self._apply(stream, msg)
            stream.last_error = "stream ended by the server"
        except grpc.aio.AioRpcError as exc:
            stream.last_error = f"{exc.code().name}: {exc.details()}"
        finally:
            call.cancel()
        return got

    def _apply(self, stream: _Stream, msg: Any) -> None:
        key = stream.key
        if isinstance(key, DestinationKey):
            self._apply_endpoints(stream, key, msg)
        elif isinstance(key, ProfileKey):
            try:
                profile = convert.profile_from_proto(msg, name=key.target)
            except InvalidResource as exc:
                self._rejected(stream, exc, "profile rejected; keeping the previous one")
                return
            self.cache.set(key, profile)
        elif isinstance(key, PolicyKey):
            name = f"{key.ns}/{key.pod}:{key.port}"
            policy: ServerPolicy
            try:
                policy = convert_policy.server_policy(msg, name=name)
            except InvalidResource as exc:
                self._rejected(stream, exc, "policy rejected; denying all on this port")
                policy = ServerPolicy.invalid()
            self.cache.set(key, policy)
        else:  # pragma: no cover - streams are only made for the keys above
            raise TypeError(f"BUG: no stream kind for {key!r}")

    def _apply_endpoints(self, stream: _Stream, key: DestinationKey, msg: Any) -> None:
        try:
            update = convert.endpoints_from_update(msg, name=key.target)
        except InvalidResource as exc:
            self._rejected(stream, exc, "destination update rejected")
            return
        for bad in update.rejected:
            self._rejected(stream, bad, "endpoint rejected")
        self.cache.apply_update(key, update)

    @staticmethod
    def _rejected(stream: _Stream, exc: InvalidResource, what: str) -> None:
        stream.rejected += 1
        logger.warning(
            what,
            extra={
                "stream": stream.kind,
                "key": str(stream.key),
                "field": exc.field,
                "why": exc.reason,
            },
        )

    # --- identity -------------------------------------------------------------------

    async def certify(self, identity: str, token: bytes, csr: bytes) -> Certificate:
        """Identity.Certify: a DER CSR for `identity` -> its certificate.

        Raises `ControlPlaneError` with the gRPC code (UNAVAILABLE when the
        control plane is unreachable, DEADLINE_EXCEEDED after the timeout).
        """
        stub = identity_pb2_grpc.IdentityStub(self._channel("identity"))
        request = identity_pb2.CertifyRequest(
            identity=identity, token=token, certificate_signing_request=csr
        )
        try:
            response = await stub.Certify(request, timeout=self._certify_timeout)
        except grpc.aio.AioRpcError as exc:
            raise ControlPlaneError(
                "identity", "Certify", exc.code().name, exc.details() or ""
            ) from exc
        valid_until = (
            response.valid_until.ToDatetime(tzinfo=UTC)
            if response.HasField("valid_until")
            else None
        )
        return Certificate(
            leaf_der=response.leaf_certificate,
            intermediates_der=tuple(response.intermediate_certificates),
            valid_until=valid_until,
        )

    # --- channels and shutdown ----------------------------------------------------------

    def _channel(self, name: str) -> grpc.aio.Channel:
        channel = self._channels.get(name)
        if channel is None:
            channel = grpc.aio.insecure_channel(
                self.addrs[name], options=_channel_options(self.backoff)
            )
            self._channels[name] = channel
        return channel

    def _destination(self) -> destination_pb2_grpc.DestinationStub:
        return destination_pb2_grpc.DestinationStub(self._channel("destination"))

    def _policy(self) -> inbound_pb2_grpc.InboundServerPoliciesStub:
        return inbound_pb2_grpc.InboundServerPoliciesStub(self._channel("policy"))

    async def close(self) -> None:
        """Stop every stream and close the channels; the cache keeps its last state."""
        self._closed = True
        tasks = [s.task for s in self._streams.values() if s.task is not None]
        self._streams.clear()
        await aio.cancel_and_wait(tasks)
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()


async def _iterate(call: Any) -> AsyncIterator[Any]:
    """The messages of a server-streaming call, read with `read()` until EOF."""
    while True:
        msg = await call.read()
        if msg is grpc.aio.EOF:
            return
        yield msg
