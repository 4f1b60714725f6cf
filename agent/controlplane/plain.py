"""The kinds a node agent reads, read by hand: metadata, Namespace, ServiceAccount, Pod.

The one reader of these documents, for the control plane and the supervisor
alike: `documents` dispatches Namespace, ServiceAccount and Pod here
(`KIND_TABLE`) and every kind's metadata (`base`); `convert_core` reads a
Deployment's pod template with `pod_template`. The supervisor learns its pods
from the manifests folder through this module alone, so it never imports
pydantic (11 MB of its RSS); the other kinds, with their pydantic
shapes, load on first use (`documents`).

Also the pieces every converter shares and pydantic does not need: `Invalid`
(a located semantic error) and `Kind` (a kind's entry in a `KIND_TABLE`).

Rules:
1. Kubernetes' types, strictly, as the API server takes them: a string field
   takes a string, a number field an integer, a flag a boolean; `key:` with
   no value (null) means unset. Unknown fields are ignored.
2. A bad field raises `Invalid(field, reason)` with its dotted path
   (`spec.containers[0].ports[1].containerPort`); `documents` locates it.
3. Pure: no I/O, and no pydantic, no `manifests_schema` (a test imports the
   supervisor and reads a folder of every kind to keep it so).
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from agent.controlplane import kinds_core as k8s
from agent.controlplane import kinds_linkerd as l5d
from agent.controlplane import resources as r

if TYPE_CHECKING:
    from collections.abc import Callable

    from agent.controlplane import kinds

T = TypeVar("T")


class Invalid(Exception):  # noqa: N818 - internal signal, becomes ManifestError
    """A bad field of a document; `field` is its dotted path, `reason` what is wrong."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(reason)
        self.field = field
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Kind:
    """One kind's entry in a `KIND_TABLE`: how to read it, the apiVersions served.

    `read(document, base)` takes the whole document (a mapping) and the fields
    `base` read from its metadata, and returns the object or raises `Invalid`.
    """

    read: Callable[[dict[str, Any], dict[str, Any]], kinds.Resource]
    versions: frozenset[str]  # accepted apiVersion values
    namespaced: bool = True


# --- fields (rule 1) ----------------------------------------------------------------------


def _at(path: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else key


def _type_name(value: object) -> str:
    return "null" if value is None else type(value).__name__


def _mapping(value: object, path: str, *, required: bool = False) -> dict[str, Any]:
    """`value` as a mapping: {} when unset, unless `required`."""
    if value is None:
        if required:
            raise Invalid(path, "required")
        return {}
    if not isinstance(value, dict):
        raise Invalid(path, f"expected a mapping, not {_type_name(value)}")
    return value


def _list(parent: dict[str, Any], key: str, path: str) -> list[Any]:
    value = parent.get(key)
    if value is None:
        return []
    if not isinstance(value, list):
        raise Invalid(_at(path, key), f"expected a list, not {_type_name(value)}")
    return value


def _typed(parent: dict[str, Any], key: str, path: str, kind: type[T], what: str) -> T | None:
    """`parent[key]` if it is a `kind` (a boolean is no integer), None when unset."""
    value = parent.get(key)
    if value is None:
        return None
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise Invalid(_at(path, key), f"expected {what}, not {_type_name(value)}")
    return value


def _str(parent: dict[str, Any], key: str, path: str, *, required: bool = False) -> str:
    value = _typed(parent, key, path, str, "a string")
    if required and not value:
        raise Invalid(_at(path, key), "required")
    return value or ""


def _bool(parent: dict[str, Any], key: str, path: str) -> bool:
    return _typed(parent, key, path, bool, "true or false") or False


def _port(parent: dict[str, Any], key: str, path: str) -> int:
    value = _typed(parent, key, path, int, "a port number")
    if value is None:
        raise Invalid(_at(path, key), "required")
    try:
        return r.check_port(value)
    except ValueError as exc:
        raise Invalid(_at(path, key), str(exc)) from None


def _choice(parent: dict[str, Any], key: str, path: str, choices: tuple[str, ...]) -> str:
    value = _str(parent, key, path) or choices[0]
    if value not in choices:
        allowed = ", ".join(choices)
        raise Invalid(_at(path, key), f"{value!r} is not one of {allowed}")
    return value


def check_ip(value: str) -> str:
    """`value` if empty or an IP address; raises `ValueError` otherwise."""
    if value:
        try:
            ipaddress.ip_address(value)
        except ValueError:
            raise ValueError(f"{value!r} is not an IP address") from None
    return value


def _ip(parent: dict[str, Any], key: str, path: str, *, required: bool = False) -> str:
    try:
        return check_ip(_str(parent, key, path, required=required))
    except ValueError as exc:
        raise Invalid(_at(path, key), str(exc)) from None


def _str_map(parent: dict[str, Any], key: str, path: str) -> dict[str, str]:
    where = _at(path, key)
    out = _mapping(parent.get(key), where)
    for name, value in out.items():
        if not isinstance(name, str):
            raise Invalid(where, f"a key must be a string, not {_type_name(name)} ({name!r})")
        if not isinstance(value, str):
            raise Invalid(_at(where, str(name)), f"expected a string, not {_type_name(value)}")
    return out


# --- metadata -------------------------------------------------------------------------------


def _check_annotations(annotations: dict[str, str]) -> None:
    if (ports := annotations.get(r.OPAQUE_PORTS_ANNOTATION)) is not None:
        try:
            r.parse_port_list(ports)
        except ValueError as exc:
            raise Invalid("metadata.annotations", f"{r.OPAQUE_PORTS_ANNOTATION}: {exc}") from None
    policy = annotations.get(r.DEFAULT_INBOUND_POLICY_ANNOTATION)
    if policy is not None and policy not in {p.value for p in l5d.AccessPolicy}:
        raise Invalid(
            "metadata.annotations",
            f"{r.DEFAULT_INBOUND_POLICY_ANNOTATION}: unknown policy {policy!r}",
        )


def base(doc: dict[str, Any], *, namespaced: bool, source: r.Source) -> dict[str, Any]:
    """The fields every object takes from `metadata` (name, namespace, uid, labels,
    annotations) and `source`; a namespaced object without a namespace is in "default".
    """
    meta = _mapping(doc.get("metadata"), "metadata", required=True)
    name = _str(meta, "name", "metadata", required=True)
    namespace = _str(meta, "namespace", "metadata")
    uid = _str(meta, "uid", "metadata")
    labels = _str_map(meta, "labels", "metadata")
    annotations = _str_map(meta, "annotations", "metadata")
    _check_annotations(annotations)
    return {
        "name": name,
        "namespace": (namespace or "default") if namespaced else "",
        "uid": uid,
        "labels": r.FrozenMap(labels),
        "annotations": r.FrozenMap(annotations),
        "source": source,
    }


# --- pods -----------------------------------------------------------------------------------

_PROTOCOLS = ("TCP", "UDP", "SCTP")
_PHASES = tuple(p.value for p in k8s.PodPhase)


def _container_port(raw: object, path: str) -> r.ContainerPort:
    port = _mapping(raw, path)
    name = _str(port, "name", path)
    if name:
        try:
            r.check_port_name(name)
        except ValueError as exc:
            raise Invalid(_at(path, "name"), str(exc)) from None
    return r.ContainerPort(
        container_port=_port(port, "containerPort", path),
        name=name,
        protocol=_choice(port, "protocol", path, _PROTOCOLS),
    )


def _container(raw: object, path: str) -> r.Container:
    container = _mapping(raw, path)
    ports_path = _at(path, "ports")
    return r.Container(
        name=_str(container, "name", path, required=True),
        image=_str(container, "image", path),
        ports=tuple(
            _container_port(p, _at(ports_path, i))
            for i, p in enumerate(_list(container, "ports", path))
        ),
    )


@dataclass(frozen=True, slots=True)
class PodTemplateSpec:
    """What a pod spec holds that the mesh reads (a Pod's and a Deployment template's)."""

    service_account: str
    node_name: str
    hostname: str
    subdomain: str
    host_network: bool
    containers: tuple[r.Container, ...]


def pod_template(raw: object, path: str) -> PodTemplateSpec:
    """A pod spec at `path` (`spec`, `spec.template.spec`); a pod needs a container."""
    spec = _mapping(raw, path, required=True)
    containers = _list(spec, "containers", path)
    where = _at(path, "containers")
    if not containers:
        raise Invalid(where, "a pod needs at least one container")
    return PodTemplateSpec(
        service_account=(
            _str(spec, "serviceAccountName", path)
            or _str(spec, "serviceAccount", path)  # deprecated; Kubernetes still reads it
            or "default"
        ),
        node_name=_str(spec, "nodeName", path),
        hostname=_str(spec, "hostname", path),
        subdomain=_str(spec, "subdomain", path),
        host_network=_bool(spec, "hostNetwork", path),
        containers=tuple(_container(c, _at(where, i)) for i, c in enumerate(containers)),
    )


def _pod_status(raw: object) -> k8s.PodStatus:
    status = _mapping(raw, "status")
    pod_ip = _ip(status, "podIP", "status")
    ips = tuple(
        _ip(_mapping(item, f"status.podIPs[{i}]"), "ip", f"status.podIPs[{i}]", required=True)
        for i, item in enumerate(_list(status, "podIPs", "status"))
    )
    ready = False
    for i, item in enumerate(_list(status, "conditions", "status")):
        where = f"status.conditions[{i}]"
        condition = _mapping(item, where)
        kind = _str(condition, "type", where, required=True)
        value = _str(condition, "status", where, required=True)
        ready = ready or (kind == "Ready" and value == "True")
    ips = ips or ((pod_ip,) if pod_ip else ())
    return k8s.PodStatus(
        phase=k8s.PodPhase(_choice(status, "phase", "status", _PHASES)),
        pod_ip=pod_ip or (ips[0] if ips else ""),
        pod_ips=ips,
        host_ip=_ip(status, "hostIP", "status"),
        ready=ready,
    )


def _pod(doc: dict[str, Any], fields: dict[str, Any]) -> k8s.Pod:
    spec = pod_template(doc.get("spec"), "spec")
    return k8s.Pod(
        **fields,
        service_account=spec.service_account,
        node_name=spec.node_name,
        hostname=spec.hostname,
        subdomain=spec.subdomain,
        host_network=spec.host_network,
        containers=spec.containers,
        status=_pod_status(doc.get("status")),
    )


# --- kind table -----------------------------------------------------------------------------


KIND_TABLE: dict[str, Kind] = {
    "Namespace": Kind(lambda _d, b: k8s.Namespace(**b), frozenset({"v1"}), namespaced=False),
    "ServiceAccount": Kind(lambda _d, b: k8s.ServiceAccount(**b), frozenset({"v1"})),
    "Pod": Kind(_pod, frozenset({"v1"})),
}
