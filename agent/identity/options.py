"""Flags of `meshagent certs` and their `MESHAGENT_*` mirrors (agent.config rules).

Each option parses its raw value and raises `ValueError(reason)`, which
`agent.config.resolve` turns into a `SettingError` naming the flag or variable.
"""

from __future__ import annotations

from datetime import timedelta

from agent.config import Option, parse_seconds
from agent.identity.names import DEFAULT_TRUST_DOMAIN, check_subdomain

MIN_LIFETIME = timedelta(minutes=1)  # shorter, a trust anchor or issuer expires unused


def parse_lifetime(raw: str) -> timedelta:
    """A duration of at least `MIN_LIFETIME`: `87600h`, `24h`, `90m`, `3600`."""
    lifetime = timedelta(seconds=parse_seconds(raw))
    if lifetime < MIN_LIFETIME:
        raise ValueError(f"lifetime must be at least 1m: {raw!r} would expire before it is used")
    return lifetime


def parse_trust_domain(raw: str) -> str:
    """A DNS-1123 subdomain such as `cluster.local`."""
    return check_subdomain("trust domain", raw)


ROOT_LIFETIME = Option(
    flag="--lifetime", parse=parse_lifetime, default="87600h", help="validity of the trust anchor"
)
ISSUER_LIFETIME = Option(
    flag="--lifetime", parse=parse_lifetime, default="8760h", help="validity of the issuer"
)
TRUST_DOMAIN = Option(
    flag="--trust-domain",
    parse=parse_trust_domain,
    default=DEFAULT_TRUST_DOMAIN,
    help="trust domain of the mesh",
)
CREATE_ROOT = (ROOT_LIFETIME, TRUST_DOMAIN)
CREATE_ISSUER = (ISSUER_LIFETIME,)
