"""Workload credentials for every service account on this node, kept certified.

`IdentityManager` holds, per service account present on the node, one ECDSA
P-256 key made here, and the certificate Identity.Certify issued for it.
`TlsMaterial` is what the supervisor pushes to workers, which build their TLS
contexts from it with `agent.identity.tls`.

Rules:
1. A key is generated on the node when its service account first appears and
   kept, in memory only, until the account's last user leaves (`release`);
   every CSR for the account is made with it. Keys, CSRs and tokens are never
   logged, and no `repr` here shows a key.
2. Certify is called with the account's DNS identity, a token from the
   injected `token_source(ns, sa)` and a DER CSR whose single DNS SAN is that
   identity. The certifier is injected (`ControlPlaneClient.certify` in the
   supervisor, a local signer in tests).
3. A certificate is renewed at 70% of its lifetime (`agent.identity.ca.renew_at`).
   A failed attempt is retried after a capped exponential backoff, but never
   later than the renewal time would have been, so a failing control plane
   is retried well before expiry.
4. Fail closed: from a certificate's notAfter on, `tls_material` returns None,
   the account is not ready, and `on_change(key, None)` tells the supervisor.
5. Time is injected (`clock`): decisions take `now`; `run_due(now)` does all
   work due at `now`, and `run()` is only a loop that sleeps until the next
   due time, so tests drive renewal without sleeping.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding

from agent.errors import PKIError
from agent.identity.ca import renew_at
from agent.identity.csr import make_csr, new_key
from agent.identity.names import (
    DEFAULT_CONTROL_NS,
    DEFAULT_TRUST_DOMAIN,
    Identity,
)
from agent.identity.tls import chain_pem

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric import ec

    from agent.identity.chain import TrustBundle

logger = logging.getLogger(__name__)

RETRY_BASE = timedelta(seconds=1)
RETRY_CAP = timedelta(minutes=1)
CERTIFY_TIMEOUT_S = 30.0
_MAX_SLEEP_S = 60.0  # re-read the clock at least this often (suspend, clock steps)
_DER = Encoding.DER


@dataclass(frozen=True, slots=True, kw_only=True)
class Certificate:
    """What Identity.Certify answered: DER leaf, DER intermediates (issuer first)."""

    leaf_der: bytes
    intermediates_der: tuple[bytes, ...] = ()
    valid_until: datetime | None = None


Certifier = Callable[[str, bytes, bytes], Awaitable[Certificate]]
"""(identity, token, DER CSR) -> the certificate; raises on refusal or transport error."""

TokenSource = Callable[[str, str], bytes]
"""(namespace, service account) -> a service-account token for Certify."""


@dataclass(frozen=True, slots=True, kw_only=True)
class TlsMaterial:
    """A service account's credentials, ready for `agent.identity.tls` contexts."""

    identity: str  # the DNS-like identity (SNI and peer name)
    cert_chain_pem: bytes  # leaf then intermediates
    key: ec.EllipticCurvePrivateKey = field(repr=False, compare=False)
    bundle_pem: bytes  # trust anchors
    not_before: datetime
    expiry: datetime  # the leaf's notAfter

    def summary(self) -> dict[str, Any]:
        """What `/config_dump` may show: no key."""
        return {
            "identity": self.identity,
            "not_before": self.not_before.isoformat(),
            "expiry": self.expiry.isoformat(),
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class IdentityStatus:
    """One service account's identity state, for metrics, `/ready` and `config_dump`."""

    ns: str
    sa: str
    identity: str
    ready: bool
    expiry: datetime | None
    renew_at: datetime | None
    next_attempt: datetime
    renewals: int  # successful Certify calls
    failures: int  # failed Certify calls, in total
    consecutive_failures: int
    last_error: str | None


@dataclass(slots=True, kw_only=True)
class _Account:
    identity: Identity
    key: ec.EllipticCurvePrivateKey = field(repr=False)
    users: int = 1
    material: TlsMaterial | None = None
    due: datetime  # next Certify attempt
    renewals: int = 0
    failures: int = 0
    consecutive: int = 0
    last_error: str | None = None
    announced: bool = False  # on_change last saw material (not None)
    busy: bool = False


def _utcnow() -> datetime:
    return datetime.now(UTC)


class IdentityManager:
    """Keys and certificates per service account; see the module rules."""

    def __init__(  # noqa: PLR0913 - keyword-only collaborators and settings
        self,
        *,
        certifier: Certifier,
        token_source: TokenSource,
        bundle: TrustBundle,
        control_ns: str = DEFAULT_CONTROL_NS,
        trust_domain: str = DEFAULT_TRUST_DOMAIN,
        clock: Callable[[], datetime] = _utcnow,
        on_change: Callable[[tuple[str, str], TlsMaterial | None], None] | None = None,
        retry_base: timedelta = RETRY_BASE,
        retry_cap: timedelta = RETRY_CAP,
        certify_timeout_s: float = CERTIFY_TIMEOUT_S,
    ) -> None:
        self._certifier = certifier
        self._tokens = token_source
        self._bundle_pem = bundle.pem
        self._control_ns = control_ns
        self._trust_domain = trust_domain
        self._clock = clock
        self._on_change = on_change
        self._retry_base = retry_base
        self._retry_cap = retry_cap
        self._timeout = certify_timeout_s
        self._accounts: dict[tuple[str, str], _Account] = {}
        self._wake: asyncio.Event | None = None

    def __repr__(self) -> str:
        return f"IdentityManager(accounts={sorted(self._accounts)})"

    # --- accounts -------------------------------------------------------------------

    def acquire(self, ns: str, sa: str) -> Identity:
        """A pod of `ns/sa` is on the node: make its key on first use (rule 1).

        Returns its identity; raises `IdentityNameError` for an invalid name.
        """
        key = (ns, sa)
        account = self._accounts.get(key)
        if account is not None:
            account.users += 1
            return account.identity
        identity = Identity(
            sa=sa, ns=ns, control_ns=self._control_ns, trust_domain=self._trust_domain
        )
        self._accounts[key] = _Account(identity=identity, key=new_key(), due=self._clock())
        logger.info("service account added", extra={"identity": identity.dns_name})
        self._poke()
        return identity

    def release(self, ns: str, sa: str) -> None:
        """A pod of `ns/sa` left; the last one forgets the key and certificate."""
        account = self._accounts.get((ns, sa))
        if account is None:
            return
        account.users -= 1
        if account.users > 0:
            return
        del self._accounts[(ns, sa)]
        logger.info("service account removed", extra={"identity": account.identity.dns_name})
        if account.announced:
            self._announce((ns, sa), None)

    def accounts(self) -> list[tuple[str, str]]:
        """The `(ns, sa)` pairs held."""
        return sorted(self._accounts)

    # --- reading --------------------------------------------------------------------

    def tls_material(self, ns: str, sa: str) -> TlsMaterial | None:
        """Current credentials of `ns/sa`, or None if none or expired (rule 4)."""
        account = self._accounts.get((ns, sa))
        if account is None or account.material is None:
            return None
        if self._clock() >= account.material.expiry:
            return None
        return account.material

    def ready(self, ns: str | None = None, sa: str | None = None) -> bool:
        """Whether `ns/sa` (or, with no arguments, every account) has valid credentials."""
        if ns is not None and sa is not None:
            return self.tls_material(ns, sa) is not None
        return all(self.tls_material(n, s) is not None for n, s in self._accounts)

    def status(self) -> list[IdentityStatus]:
        """Every account's state (no secrets)."""
        now = self._clock()
        out = []
        for (ns, sa), a in sorted(self._accounts.items()):
            m = a.material
            out.append(
                IdentityStatus(
                    ns=ns,
                    sa=sa,
                    identity=a.identity.dns_name,
                    ready=m is not None and now < m.expiry,
                    expiry=m.expiry if m else None,
                    renew_at=renew_at(m.not_before, m.expiry) if m else None,
                    next_attempt=a.due,
                    renewals=a.renewals,
                    failures=a.failures,
                    consecutive_failures=a.consecutive,
                    last_error=a.last_error,
                )
            )
        return out

    def next_due(self) -> datetime | None:
        """The earliest time some work is due (a Certify attempt or an expiry)."""
        times = [a.due for a in self._accounts.values()]
        times += [a.material.expiry for a in self._accounts.values() if a.announced and a.material]
        return min(times, default=None)

    # --- work -----------------------------------------------------------------------

    async def run_due(self, now: datetime) -> None:
        """Expire what expired at `now`, then certify every account due at `now`."""
        for key, a in list(self._accounts.items()):
            if a.announced and a.material is not None and now >= a.material.expiry:
                a.announced = False
                logger.warning(
                    "certificate expired; identity not ready",
                    extra={
                        "identity": a.identity.dns_name,
                        "expiry": a.material.expiry.isoformat(),
                    },
                )
                self._announce(key, None)
        due = [(k, a) for k, a in self._accounts.items() if a.due <= now and not a.busy]
        await asyncio.gather(*(self._certify(k, a) for k, a in due))

    async def refresh(self, ns: str, sa: str) -> TlsMaterial | None:
        """Certify `ns/sa` now, whatever its schedule; the new material or None on failure."""
        account = self._accounts.get((ns, sa))
        if account is None:
            return None
        await self._certify((ns, sa), account)
        return self.tls_material(ns, sa)

    async def run(self) -> None:
        """Do due work forever, sleeping until the next due time (start with `agent.aio.spawn`)."""
        self._wake = asyncio.Event()
        while True:
            await self.run_due(self._clock())
            nxt = self.next_due()
            delay = _MAX_SLEEP_S
            if nxt is not None:
                delay = min(_MAX_SLEEP_S, max(0.0, (nxt - self._clock()).total_seconds()))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=delay)
            self._wake.clear()

    def _poke(self) -> None:
        if self._wake is not None:
            self._wake.set()

    async def _certify(self, key: tuple[str, str], account: _Account) -> None:
        account.busy = True
        name = account.identity.dns_name
        try:
            token = self._tokens(account.identity.ns, account.identity.sa)
            csr = make_csr(account.key, account.identity)
            cert = await asyncio.wait_for(self._certifier(name, token, csr), self._timeout)
            material = self._material(account, cert)
        except Exception as exc:  # noqa: BLE001 - refusals, PKIError, timeouts, transport errors
            self._failed(account, exc)
        else:
            self._succeeded(key, account, material)
        finally:
            account.busy = False

    def _material(self, account: _Account, cert: Certificate) -> TlsMaterial:
        name = account.identity.dns_name
        try:
            leaf = (
                x509.load_pem_x509_certificate(cert.leaf_der)
                if cert.leaf_der.lstrip().startswith(b"-----BEGIN")
                else x509.load_der_x509_certificate(cert.leaf_der)
            )
        except ValueError as exc:
            raise PKIError(name, f"Certify answered an unparsable leaf: {exc}") from exc
        if leaf.public_key() != account.key.public_key():
            raise PKIError(name, "Certify answered a leaf for another key")
        sans = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        if name not in sans.get_values_for_type(x509.DNSName):
            raise PKIError(name, "Certify answered a leaf for another identity")
        leaf_der = leaf.public_bytes(_DER)
        return TlsMaterial(
            identity=name,
            cert_chain_pem=chain_pem(leaf_der, [_der(c) for c in cert.intermediates_der]),
            key=account.key,
            bundle_pem=self._bundle_pem,
            not_before=leaf.not_valid_before_utc,
            expiry=leaf.not_valid_after_utc,
        )

    def _succeeded(self, key: tuple[str, str], account: _Account, material: TlsMaterial) -> None:
        if self._accounts.get(key) is not account:
            return  # released while Certify was in flight
        account.material = material
        account.due = renew_at(material.not_before, material.expiry)
        account.renewals += 1
        account.consecutive = 0
        account.last_error = None
        account.announced = True
        logger.info(
            "certified",
            extra={
                "identity": material.identity,
                "expiry": material.expiry.isoformat(),
                "renew_at": account.due.isoformat(),
            },
        )
        self._announce(key, material)

    def _announce(self, key: tuple[str, str], material: TlsMaterial | None) -> None:
        if self._on_change is None:
            return
        try:
            self._on_change(key, material)
        except Exception:  # the supervisor's bug must not stop renewals
            logger.exception("BUG: identity on_change failed", extra={"account": "/".join(key)})

    def _failed(self, account: _Account, exc: BaseException) -> None:
        now = self._clock()
        delay = min(self._retry_cap, self._retry_base * (2**account.consecutive))
        account.consecutive += 1
        account.failures += 1
        account.last_error = f"{type(exc).__name__}: {exc}"
        retry = now + delay
        if account.material is not None:
            # Rule 3: an early failure (`refresh`) never pushes the next try past renewal time.
            renew = renew_at(account.material.not_before, account.material.expiry)
            if renew > now:
                retry = min(retry, renew)
        account.due = retry
        logger.warning(
            "certify failed",
            extra={
                "identity": account.identity.dns_name,
                "error": account.last_error,
                "retry_at": retry.isoformat(),
            },
        )


def _der(cert: bytes) -> bytes:
    """An intermediate as DER, whether the control plane sent DER or PEM."""
    if cert.lstrip().startswith(b"-----BEGIN"):
        return x509.load_pem_x509_certificate(cert).public_bytes(_DER)
    return cert
