"""IdentityManager: node-made keys, Certify with the SA token, renew at 70%, retry, fail closed."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

import pytest
from cryptography import x509

from agent.errors import PKIError
from agent.identity import ca
from agent.identity.csr import check_csr, make_csr, new_key
from agent.identity.manager import Certificate, IdentityManager
from agent.identity.names import Identity, IdentityNameError

T0 = datetime(2030, 1, 1, tzinfo=UTC)
WEB = "web.shop.serviceaccount.identity.linkerd.cluster.local"


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> datetime:
        return self.now


@pytest.fixture(scope="module")
def issuer(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")
    now = T0 - timedelta(days=1)
    ca.create_root(d / "root", now=now)
    ca.create_issuer(d / "identity", d / "root", now=now)
    return ca.load_issuer(d / "identity", now=T0)


class FakeControlPlane:
    """A certifier that checks the CSR and token and signs with a real test issuer."""

    def __init__(self, issuer, clock, lifetime=timedelta(hours=24)) -> None:
        self.issuer, self.clock, self.lifetime = issuer, clock, lifetime
        self.calls: list[tuple[str, bytes]] = []
        self.public_keys: list = []
        self.fail: Exception | None = None

    async def certify(self, identity: str, token: bytes, csr: bytes) -> Certificate:
        self.calls.append((identity, token))
        if self.fail is not None:
            raise self.fail
        info = check_csr(csr, identity)
        self.public_keys.append(info.public_key)
        sa_ns = identity.split(".")[:2]
        leaf, chain, until = self.issuer.sign_leaf(
            info, Identity(sa=sa_ns[0], ns=sa_ns[1]), now=self.clock(), lifetime=self.lifetime
        )
        return Certificate(leaf_der=leaf, intermediates_der=tuple(chain), valid_until=until)


@pytest.fixture
def env(issuer):
    clock = Clock()
    cp = FakeControlPlane(issuer, clock)
    changes: list = []
    mgr = IdentityManager(
        certifier=cp.certify,
        token_source=lambda ns, sa: f"token-for-{ns}/{sa}".encode(),
        bundle=issuer.bundle,
        clock=clock,
        on_change=lambda key, value: changes.append((key, value)),
    )
    return mgr, cp, clock, changes


async def test_a_new_service_account_is_certified_with_its_token_and_a_csr_naming_it(env):
    mgr, cp, clock, changes = env
    identity = mgr.acquire("shop", "web")
    assert identity.dns_name == WEB
    assert mgr.tls_material("shop", "web") is None
    assert not mgr.ready()
    assert mgr.next_due() == T0
    await mgr.run_due(clock.now)
    assert cp.calls == [(WEB, b"token-for-shop/web")]
    m = mgr.tls_material("shop", "web")
    assert m is not None
    assert mgr.ready("shop", "web")
    assert mgr.ready()
    assert m.identity == WEB
    assert m.bundle_pem == cp.issuer.bundle.pem
    leaf, issuer_cert = x509.load_pem_x509_certificates(m.cert_chain_pem)
    assert leaf.public_key() == m.key.public_key()
    assert issuer_cert == cp.issuer.cert
    assert m.expiry == leaf.not_valid_after_utc == T0 + timedelta(hours=24)
    assert m.not_before == leaf.not_valid_before_utc
    assert changes == [(("shop", "web"), m)]


async def test_renewal_happens_at_70_percent_of_the_lifetime_with_the_same_key(env):
    mgr, cp, clock, _ = env
    mgr.acquire("shop", "web")
    await mgr.run_due(clock.now)
    first = mgr.tls_material("shop", "web")
    renew = ca.renew_at(first.not_before, first.expiry)
    assert renew == first.not_before + (first.expiry - first.not_before) * 0.7
    (status,) = mgr.status()
    assert status.renew_at == renew == status.next_attempt == mgr.next_due()
    clock.now = renew - timedelta(seconds=1)
    await mgr.run_due(clock.now)
    assert len(cp.calls) == 1
    clock.now = renew
    await mgr.run_due(clock.now)
    assert len(cp.calls) == 2
    second = mgr.tls_material("shop", "web")
    assert second.expiry == renew + timedelta(hours=24)
    assert second.key is first.key
    assert cp.public_keys[0] == cp.public_keys[1]
    assert mgr.status()[0].renewals == 2


async def test_failures_retry_with_capped_exponential_backoff_and_keep_serving(env):
    mgr, cp, clock, changes = env
    mgr.acquire("shop", "web")
    await mgr.run_due(clock.now)
    good = mgr.tls_material("shop", "web")
    clock.now = ca.renew_at(good.not_before, good.expiry)
    cp.fail = ConnectionError("control plane down")
    delays = []
    for _ in range(9):
        await mgr.run_due(clock.now)
        nxt = mgr.status()[0].next_attempt
        delays.append((nxt - clock.now).total_seconds())
        clock.now = nxt
    assert delays == [1, 2, 4, 8, 16, 32, 60, 60, 60]
    status = mgr.status()[0]
    assert (status.failures, status.consecutive_failures) == (9, 9)
    assert "control plane down" in status.last_error
    assert mgr.tls_material("shop", "web") is good  # still valid: still served
    cp.fail = None
    await mgr.run_due(clock.now)
    status = mgr.status()[0]
    assert status.consecutive_failures == 0
    assert status.failures == 9
    assert status.last_error is None
    assert mgr.tls_material("shop", "web") is not good
    assert len(changes) == 2


async def test_expiry_without_renewal_fails_closed_and_tells_the_supervisor(env):
    mgr, cp, clock, changes = env
    mgr.acquire("shop", "web")
    await mgr.run_due(clock.now)
    expiry = mgr.tls_material("shop", "web").expiry
    cp.fail = PKIError("issuer", "expired")
    clock.now = expiry - timedelta(seconds=1)
    await mgr.run_due(clock.now)
    assert mgr.ready()
    assert mgr.next_due() <= expiry
    clock.now = expiry
    assert mgr.tls_material("shop", "web") is None  # at once, even before run_due
    assert not mgr.ready("shop", "web")
    assert not mgr.ready()
    await mgr.run_due(clock.now)
    assert changes[-1] == (("shop", "web"), None)
    assert mgr.status()[0].ready is False


async def test_one_key_per_service_account_and_release_forgets_it(env):
    mgr, _, clock, changes = env
    mgr.acquire("shop", "web")
    mgr.acquire("shop", "web")  # a second pod of the same service account
    mgr.acquire("shop", "api")
    await mgr.run_due(clock.now)
    web, api = mgr.tls_material("shop", "web"), mgr.tls_material("shop", "api")
    assert web.key is not api.key
    assert mgr.accounts() == [("shop", "api"), ("shop", "web")]
    mgr.release("shop", "web")
    assert mgr.tls_material("shop", "web") is web
    mgr.release("shop", "web")
    assert mgr.tls_material("shop", "web") is None
    assert mgr.accounts() == [("shop", "api")]
    assert changes[-1] == (("shop", "web"), None)
    mgr.release("shop", "web")  # unknown: nothing happens
    assert len(changes) == 3


async def test_key_never_appears_in_reprs_or_status(env):
    mgr, _, clock, _ = env
    mgr.acquire("shop", "web")
    await mgr.run_due(clock.now)
    m = mgr.tls_material("shop", "web")
    texts = [repr(m), repr(mgr), repr(mgr.status()), str(m.summary()), repr(mgr._accounts)]
    for text in texts:
        assert "EllipticCurve" not in text
        assert "ECPrivateKey" not in text
        assert "key=" not in text
    assert set(m.summary()) == {"identity", "not_before", "expiry"}


async def test_a_leaf_for_another_key_is_refused(env, issuer):
    mgr, cp, clock, _ = env

    async def wrong_key(identity, token, csr):
        return await cp.certify(identity, token, make_csr(new_key(), Identity(sa="web", ns="shop")))

    mgr._certifier = wrong_key
    mgr.acquire("shop", "web")
    await mgr.run_due(clock.now)
    assert mgr.tls_material("shop", "web") is None
    assert "another key" in mgr.status()[0].last_error


async def test_a_certifier_that_hangs_times_out_and_is_retried(issuer):
    clock = Clock()
    started = asyncio.Event()

    async def hang(identity, token, csr):
        started.set()
        await asyncio.sleep(3600)

    mgr = IdentityManager(
        certifier=hang,
        token_source=lambda _ns, _sa: b"t",
        bundle=issuer.bundle,
        clock=clock,
        certify_timeout_s=0.05,
    )
    mgr.acquire("shop", "web")
    await mgr.run_due(clock.now)
    assert started.is_set()
    status = mgr.status()[0]
    assert status.failures == 1
    assert status.last_error.startswith("TimeoutError")
    assert status.next_attempt == T0 + timedelta(seconds=1)


async def test_refresh_failure_before_renewal_time_retries_no_later_than_renewal(env):
    mgr, cp, clock, _ = env
    mgr._retry_base = timedelta(hours=20)
    mgr._retry_cap = timedelta(hours=20)
    mgr.acquire("shop", "web")
    await mgr.run_due(clock.now)
    m = mgr.tls_material("shop", "web")
    cp.fail = ConnectionError("down")
    assert await mgr.refresh("shop", "web") is m
    assert mgr.status()[0].next_attempt == ca.renew_at(m.not_before, m.expiry)


async def test_invalid_service_account_name_is_refused(env):
    mgr, *_ = env
    with pytest.raises(IdentityNameError):
        mgr.acquire("shop", "Not_A_Label")
    assert mgr.accounts() == []
