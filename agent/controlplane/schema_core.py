"""pydantic shapes of the core manifest documents: v1, apps/v1 and discovery.k8s.io/v1.

This module holds `DeploymentDoc`, `ServiceDoc`, `EndpointsDoc` and
`SliceDoc` with their parts, as Kubernetes names and defaults them;
`convert_core` turns each into its `kinds_core` dataclass. Namespace,
ServiceAccount, Pod and a Deployment's pod template spec are read by hand
(`plain`), without pydantic.

Rules (those of `manifests_schema`, as they apply here):
1. Only the manifest loader imports this module; no model leaves it.
2. Field validators raise `ValueError`; checks across several fields of a
   kind (a Service's ports, a Deployment's selector) live in `convert_core`.
3. Builds on `manifests_schema` only, never on `schema_linkerd`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from agent.controlplane.manifests_schema import (
    IP,
    Doc,
    Model,
    Port,
    PortValue,
    Protocol,
    Ref,
    Selector,
)
from agent.controlplane.plain import check_ip

# --- Deployment ---------------------------------------------------------------------


class TemplateMeta(Model):
    labels: dict[str, str] = {}
    annotations: dict[str, str] = {}


class Template(Model):
    metadata: TemplateMeta = TemplateMeta()
    spec: Any = None  # a pod spec: `plain.pod_template` reads it, as it reads a Pod's


class DeploymentSpec(Model):
    replicas: int = Field(1, ge=0)
    selector: Selector
    template: Template


class DeploymentDoc(Doc):
    spec: DeploymentSpec


# --- Service ------------------------------------------------------------------------


class ServicePort(Model):
    port: Port
    target_port: PortValue | None = None
    name: str = ""
    protocol: Protocol = "TCP"
    node_port: Port | None = None
    app_protocol: str = ""


class ServiceSpec(Model):
    type: Literal["ClusterIP", "NodePort", "LoadBalancer", "ExternalName"] = "ClusterIP"
    cluster_ip: str = Field("", alias="clusterIP")
    cluster_ips: list[IP] = Field([], alias="clusterIPs")
    selector: dict[str, str] = {}
    ports: list[ServicePort] = []
    external_name: str = ""
    publish_not_ready_addresses: bool = False

    @field_validator("cluster_ip")
    @classmethod
    def _cluster_ip(cls, value: str) -> str:
        return value if value == "None" else check_ip(value)


class ServiceDoc(Doc):
    spec: ServiceSpec = ServiceSpec()


# --- Endpoints and EndpointSlice ----------------------------------------------------


class EndpointsAddress(Model):
    ip: IP = Field(min_length=1)
    hostname: str = ""
    node_name: str = ""
    target_ref: Ref | None = None


class EndpointsPort(Model):
    port: Port
    name: str = ""
    protocol: Protocol = "TCP"


class Subset(Model):
    addresses: list[EndpointsAddress] = []
    not_ready_addresses: list[EndpointsAddress] = []
    ports: list[EndpointsPort] = []


class EndpointsDoc(Doc):
    subsets: list[Subset] = []


class SliceConditions(Model):
    ready: bool = True
    serving: bool = True
    terminating: bool = False


class SliceEndpoint(Model):
    addresses: list[str] = Field(min_length=1)
    conditions: SliceConditions = SliceConditions()
    hostname: str = ""
    node_name: str = ""
    zone: str = ""
    target_ref: Ref | None = None


class SlicePort(Model):
    port: Port | None = None
    name: str = ""
    protocol: Protocol = "TCP"


class SliceDoc(Doc):
    address_type: Literal["IPv4", "IPv6", "FQDN"]
    endpoints: list[SliceEndpoint] = []
    ports: list[SlicePort] = []

    @model_validator(mode="after")
    def _addresses_fit(self) -> SliceDoc:
        if self.address_type != "FQDN":
            for ep in self.endpoints:
                for addr in ep.addresses:
                    check_ip(addr)
        return self
