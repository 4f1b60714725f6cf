"""Workload identity names, as Linkerd spells them (pure).

A meshed workload is named by its Kubernetes service account:

    DNS SAN:  {sa}.{ns}.serviceaccount.identity.{control-ns}.{trust-domain}
    URI SAN:  spiffe://{trust-domain}/ns/{ns}/sa/{sa}

Rules:
1. `sa`, `ns` and `control_ns` are DNS-1123 labels (what Linkerd's token
   validator demands of a service account username); the trust domain is a
   DNS-1123 subdomain. Anything else raises `IdentityNameError`, which names
   the field, the value and the reason.
2. No I/O here; the rest of the identity code builds on these names.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from agent.errors import AgentError

DEFAULT_CONTROL_NS = "linkerd"
DEFAULT_TRUST_DOMAIN = "cluster.local"

_INFIX = ".serviceaccount.identity."
_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_MAX_LABEL = 63
_MAX_SUBDOMAIN = 253


class IdentityNameError(AgentError, ValueError):
    """A name is not a valid identity or identity part."""

    def __init__(self, field: str, value: str, reason: str) -> None:
        self.field = field
        self.value = value
        self.reason = reason
        super().__init__(f"identity {field} {value!r}: {reason}")


def check_label(field: str, value: str) -> str:
    """Return `value` if it is a DNS-1123 label, else raise `IdentityNameError`."""
    if not value:
        raise IdentityNameError(field, value, "must not be empty")
    if len(value) > _MAX_LABEL:
        raise IdentityNameError(field, value, f"longer than {_MAX_LABEL} characters")
    if not _LABEL.fullmatch(value):
        raise IdentityNameError(
            field,
            value,
            "not a DNS-1123 label (lower-case letters, digits and '-', "
            "starting and ending with a letter or digit)",
        )
    return value


def check_subdomain(field: str, value: str) -> str:
    """Return `value` if it is a DNS-1123 subdomain, else raise `IdentityNameError`."""
    if not value:
        raise IdentityNameError(field, value, "must not be empty")
    if len(value) > _MAX_SUBDOMAIN:
        raise IdentityNameError(field, value, f"longer than {_MAX_SUBDOMAIN} characters")
    for label in value.split("."):
        try:
            check_label(field, label)
        except IdentityNameError:
            raise IdentityNameError(
                field, value, f"label {label!r} is not a DNS-1123 label"
            ) from None
    return value


@dataclass(frozen=True, slots=True, kw_only=True)
class Identity:
    """A workload identity: one Kubernetes service account in one mesh."""

    sa: str
    ns: str
    control_ns: str = DEFAULT_CONTROL_NS
    trust_domain: str = DEFAULT_TRUST_DOMAIN

    def __post_init__(self) -> None:
        check_label("service account", self.sa)
        check_label("namespace", self.ns)
        check_label("control-plane namespace", self.control_ns)
        check_subdomain("trust domain", self.trust_domain)

    @property
    def dns_name(self) -> str:
        """The DNS SAN: `sa.ns.serviceaccount.identity.control-ns.trust-domain`."""
        return f"{self.sa}.{self.ns}{_INFIX}{self.control_ns}.{self.trust_domain}"

    @property
    def spiffe_uri(self) -> str:
        """The URI SAN: `spiffe://trust-domain/ns/ns/sa/sa`."""
        return f"spiffe://{self.trust_domain}/ns/{self.ns}/sa/{self.sa}"

    @property
    def username(self) -> str:
        """The Kubernetes username of the service account."""
        return f"system:serviceaccount:{self.ns}:{self.sa}"

    def __str__(self) -> str:
        return self.dns_name


def parse_dns_name(name: str) -> Identity:
    """Parse a Linkerd DNS-form identity.

    Raises `IdentityNameError` when `name` is not of the form
    `sa.ns.serviceaccount.identity.control-ns.trust-domain` or a part is invalid.
    """
    head, infix, tail = name.partition(_INFIX)
    if not infix:
        raise IdentityNameError("name", name, f"does not contain {_INFIX.strip('.')!r}")
    sa_ns = head.split(".")
    if len(sa_ns) != 2:
        raise IdentityNameError("name", name, "must start with exactly '<sa>.<ns>.'")
    control_ns, dot, trust_domain = tail.partition(".")
    if not dot:
        raise IdentityNameError("name", name, "must end with '<control-ns>.<trust-domain>'")
    return Identity(sa=sa_ns[0], ns=sa_ns[1], control_ns=control_ns, trust_domain=trust_domain)
