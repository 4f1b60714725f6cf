"""What a worker's `Need("dst", target)` resolves to, from the control plane's answers (pure).

Rules (Linkerd's outbound discovery, simplified):
1. A target is `ip:port` (an original destination) or `authority:port`.
2. For an `ip:port`, GetProfile(ip:port) comes first: a profile naming a
   service (`fqn`) means follow Get(`fqn:port`); a profile with an `endpoint`
   (a pod IP) is that single endpoint; neither means not a mesh service
   (`exists=False`: forward to the original destination).
3. For an authority, Get(authority) and GetProfile(authority) are followed
   directly.
4. Until the needed answers have arrived, there is no Destination yet (None);
   the worker keeps waiting (or times out and falls back itself).
5. A stream that failed before answering (NOT_FOUND, INVALID_ARGUMENT,
   UNAVAILABLE) means "not a mesh service" (`not_a_service`): the worker
   forwards to the original destination; a later answer replaces it.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import TYPE_CHECKING

from agent.proxy.state import Destination

if TYPE_CHECKING:
    from agent.control.cache import EndpointSet
    from agent.proxy.model import Profile


def is_ip_target(target: str) -> bool:
    """Whether `target` is `ip:port` (IPv6 in brackets)."""
    host = target.rpartition(":")[0].strip("[]")
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def port_of(target: str) -> int:
    """The port of `host:port` (80 when absent or malformed)."""
    raw = target.rpartition(":")[2]
    return int(raw) if raw.isdigit() else 80


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    """Which streams a target needs: its profile, and endpoints of `authority` if any."""

    profile_target: str
    authority: str | None  # the Get target; None while unknown or not a service


def streams_for(target: str, profile: Profile | None) -> Plan:
    """The streams `target` needs given what its profile says so far (rules 2, 3)."""
    if not is_ip_target(target):
        return Plan(profile_target=target, authority=target)
    if profile is not None and profile.fqn:
        return Plan(profile_target=target, authority=f"{profile.fqn}:{port_of(target)}")
    return Plan(profile_target=target, authority=None)


def destination(
    target: str, profile: Profile | None, endpoints: EndpointSet | None, *, profile_seen: bool
) -> Destination | None:
    """The `Destination` to push for `target`, or None while answers are missing (rule 4)."""
    plan = streams_for(target, profile)
    opaque = bool(profile and profile.opaque_protocol)
    if plan.authority is not None:
        if endpoints is None:
            return None
        return Destination(
            target=target,
            authority=plan.authority,
            exists=endpoints.exists,
            endpoints=endpoints.endpoints,
            profile=profile,
            opaque=opaque,
        )
    if not profile_seen:
        return None
    if profile is not None and profile.endpoint is not None:
        return Destination(
            target=target,
            exists=True,
            endpoints=(profile.endpoint,),
            profile=profile,
            opaque=opaque,
        )
    return Destination(target=target, exists=False, profile=profile, opaque=opaque)


def not_a_service(target: str) -> Destination:
    """What a target whose streams failed unanswered resolves to (rule 5)."""
    return Destination(target=target, exists=False)
