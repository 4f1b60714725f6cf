"""Token sources for `IdentityManager`: where a service account's Certify token comes from.

Manifests mode has no Kubernetes API server to issue tokens, so the supervisor
mints them with the embedded control plane's token-signing key
(`agent.controlplane.tokens.mint`, from its identity dir). Rules: a fresh
token per call (they are short-lived and cheap); tokens are never logged.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import TYPE_CHECKING

from agent.controlplane import tokens

if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path

    from agent.identity.manager import TokenSource


def _utcnow() -> datetime:
    return datetime.now(UTC)


def minting_source(
    identity_dir: str | Path, *, clock: Callable[[], datetime] = _utcnow
) -> TokenSource:
    """A source minting `(ns, sa)` tokens with `identity_dir`'s key (calls raise `PKIError`)."""

    def source(ns: str, sa: str) -> bytes:
        return tokens.mint(identity_dir, ns, sa, now=clock()).encode("ascii")

    return source
