"""Every kind the store holds: the `Resource` union and the `KINDS` tuple.

The manifest loader, the store and its indexes take objects of any kind, so
their union lives here, above the kind modules (`kinds_core`, `kinds_linkerd`),
which never import this module.

Rules:
1. A kind is listed in both `Resource` and `KINDS`, in the same order.
2. Pure data: no I/O; only the model's modules are imported.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeAlias

from agent.controlplane.kinds_core import (
    Deployment,
    Endpoints,
    EndpointSlice,
    Namespace,
    Pod,
    Service,
    ServiceAccount,
)
from agent.controlplane.kinds_linkerd import (
    AuthorizationPolicy,
    HTTPRoute,
    MeshTLSAuthentication,
    NetworkAuthentication,
    Server,
    ServerAuthorization,
    ServiceProfile,
)

if TYPE_CHECKING:
    from agent.controlplane.resources import Object

Resource: TypeAlias = (
    Namespace
    | Pod
    | ServiceAccount
    | Service
    | Endpoints
    | EndpointSlice
    | Deployment
    | ServiceProfile
    | Server
    | ServerAuthorization
    | AuthorizationPolicy
    | MeshTLSAuthentication
    | NetworkAuthentication
    | HTTPRoute
)

KINDS: tuple[type[Object], ...] = (
    Namespace,
    Pod,
    ServiceAccount,
    Service,
    Endpoints,
    EndpointSlice,
    Deployment,
    ServiceProfile,
    Server,
    ServerAuthorization,
    AuthorizationPolicy,
    MeshTLSAuthentication,
    NetworkAuthentication,
    HTTPRoute,
)
