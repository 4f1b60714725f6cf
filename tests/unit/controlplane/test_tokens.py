"""Service-account tokens of the embedded control plane: mint, verify, refuse."""

from __future__ import annotations

import base64
import json
import stat
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent.controlplane import tokens
from agent.controlplane.tokens import TokenError, TokenReason
from agent.identity.csr import new_key
from agent.identity.names import Identity

NOW = datetime(2030, 1, 2, 3, 4, 5, tzinfo=UTC)


def _parts(token: str):
    def dec(part):
        return json.loads(base64.urlsafe_b64decode(part + "=" * (-len(part) % 4)))

    h, c, s = token.split(".")
    return dec(h), dec(c), s


def _enc(obj) -> str:
    return base64.urlsafe_b64encode(json.dumps(obj).encode()).rstrip(b"=").decode()


def _reason(token, key, **kwargs) -> TokenReason:
    with pytest.raises(TokenError) as info:
        tokens.verify(token, key, now=kwargs.pop("now", NOW), **kwargs)
    return info.value.reason


@pytest.fixture
def key(tmp_path):
    return tokens.signing_key(tmp_path)


def test_minted_token_verifies_to_its_service_account(tmp_path):
    token = tokens.mint(tmp_path, "shop", "web", now=NOW)
    key = tokens.signing_key(tmp_path)
    assert tokens.verify(token, key, now=NOW) == ("shop", "web")
    assert tokens.verify(token.encode(), key.public_key(), now=NOW) == ("shop", "web")


def test_signing_key_is_created_once_with_mode_0600(tmp_path):
    first = tokens.signing_key(tmp_path)
    path = tmp_path / tokens.SIGNING_KEY
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert tokens.signing_key(tmp_path).private_numbers() == first.private_numbers()


def test_claims_look_like_a_projected_service_account_token(tmp_path):
    token = tokens.mint(tmp_path, "shop", "web", now=NOW, pod={"name": "web-1", "uid": "u1"})
    header, claims, _ = _parts(token)
    assert header["alg"] == "ES256"
    assert header["kid"] == tokens.key_id(tokens.signing_key(tmp_path))
    assert claims["sub"] == "system:serviceaccount:shop:web"
    assert claims["aud"] == ["identity.l5d.io"]
    assert claims["iss"] == "https://kubernetes.default.svc.cluster.local"
    assert claims["iat"] == claims["nbf"] == int(NOW.timestamp())
    assert claims["exp"] - claims["iat"] == 86400
    k8s = claims["kubernetes.io"]
    assert k8s["namespace"] == "shop"
    assert k8s["serviceaccount"]["name"] == "web"
    assert k8s["pod"] == {"name": "web-1", "uid": "u1"}


def test_signature_is_raw_64_bytes_as_jws_es256_requires(tmp_path):
    _, _, sig = _parts(tokens.mint(tmp_path, "shop", "web", now=NOW))
    assert len(base64.urlsafe_b64decode(sig + "=" * (-len(sig) % 4))) == 64


def test_only_the_signing_key_mints_valid_tokens(tmp_path, key):
    forged = tokens.encode(new_key(), tokens.token_claims("shop", "web", now=NOW))
    assert _reason(forged, key) is TokenReason.BAD_SIGNATURE


def test_changed_claims_break_the_signature(tmp_path, key):
    token = tokens.mint(tmp_path, "shop", "web", now=NOW)
    h, _, s = token.split(".")
    _, claims, _ = _parts(token)
    claims["sub"] = "system:serviceaccount:kube-system:admin"
    assert _reason(f"{h}.{_enc(claims)}.{s}", key) is TokenReason.BAD_SIGNATURE


def test_alg_none_is_refused(tmp_path, key):
    token = tokens.mint(tmp_path, "shop", "web", now=NOW)
    _, c, _ = token.split(".")
    assert _reason(f"{_enc({'alg': 'none'})}.{c}.", key) is TokenReason.BAD_SIGNATURE


def test_expired_token_is_refused(tmp_path, key):
    token = tokens.mint(tmp_path, "shop", "web", now=NOW, lifetime=timedelta(minutes=10))
    assert tokens.verify(token, key, now=NOW + timedelta(minutes=9)) == ("shop", "web")
    assert _reason(token, key, now=NOW + timedelta(minutes=10)) is TokenReason.EXPIRED


def test_token_from_the_future_is_refused(tmp_path, key):
    token = tokens.mint(tmp_path, "shop", "web", now=NOW + timedelta(hours=1))
    assert _reason(token, key) is TokenReason.NOT_YET_VALID


def test_token_for_another_audience_is_refused(tmp_path, key):
    token = tokens.mint(tmp_path, "shop", "web", now=NOW, audience=("kubernetes",))
    assert _reason(token, key) is TokenReason.WRONG_AUDIENCE
    assert tokens.verify(token, key, audience="kubernetes", now=NOW) == ("shop", "web")


@pytest.mark.parametrize(
    "token",
    ["", "abc", "a.b", "a.b.c.d", "!!.??.**", f"{_enc([1])}.{_enc({})}.", "\u00e9.a.b"],
)
def test_malformed_tokens_are_refused_as_malformed(key, token):
    assert _reason(token, key) is TokenReason.MALFORMED


@pytest.mark.parametrize(
    "claims",
    [
        {"sub": "system:serviceaccount:shop:web", "aud": ["identity.l5d.io"]},  # no exp
        {"sub": "system:node:n1", "aud": ["identity.l5d.io"], "exp": 9e9},
        {"sub": "system:serviceaccount:Shop:web", "aud": ["identity.l5d.io"], "exp": 9e9},
        {
            "sub": "system:serviceaccount:shop:web",
            "aud": ["identity.l5d.io"],
            "exp": 9e9,
            "kubernetes.io": {"namespace": "other", "serviceaccount": {"name": "web"}},
        },
    ],
    ids=["no-exp", "not-a-service-account", "bad-namespace", "claims-disagree"],
)
def test_well_signed_but_malformed_claims_are_malformed(key, claims):
    assert _reason(tokens.encode(key, claims), key) is TokenReason.MALFORMED


def test_validator_turns_a_token_into_a_mesh_identity(tmp_path, key):
    validate = tokens.validator(key, trust_domain="example.org")
    token = tokens.mint(tmp_path, "shop", "web", now=NOW)
    assert validate(token.encode(), NOW) == Identity(
        sa="web", ns="shop", trust_domain="example.org"
    )


@given(st.text(max_size=200))
def test_any_text_raises_only_token_error(text):
    key = KEY_FOR_FUZZ
    with pytest.raises(TokenError):
        tokens.verify(text, key, now=NOW)


KEY_FOR_FUZZ = new_key()
