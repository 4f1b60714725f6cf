"""CSRs: what a proxy sends, and every way check_csr refuses one."""

from __future__ import annotations

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import NameOID
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.identity.csr import CSRError, CSRReason, check_csr, make_csr, new_key
from agent.identity.names import Identity

WEB = Identity(sa="web", ns="shop")
KEY = new_key()
GOOD = make_csr(KEY, WEB)


WEB_SAN = (x509.DNSName(WEB.dns_name),)


def _csr(key, *, cn=WEB.dns_name, sans=WEB_SAN) -> bytes:
    builder = x509.CertificateSigningRequestBuilder().subject_name(
        x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)] if cn else [])
    )
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(list(sans)), critical=False)
    return builder.sign(key, hashes.SHA256()).public_bytes(serialization.Encoding.DER)


def _reason(data: bytes, expected: str = WEB.dns_name) -> CSRReason:
    with pytest.raises(CSRError) as info:
        check_csr(data, expected)
    return info.value.reason


def test_new_key_is_p256():
    assert isinstance(KEY.curve, ec.SECP256R1)


def test_made_csr_names_only_the_identity_and_passes_its_own_check():
    csr = x509.load_der_x509_csr(GOOD)
    san = csr.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert list(san) == [x509.DNSName(WEB.dns_name)]
    info = check_csr(GOOD, WEB.dns_name)
    assert info.dns_name == WEB.dns_name
    assert info.public_key.public_numbers() == KEY.public_key().public_numbers()


def test_pem_csr_is_accepted_like_der():
    pem = x509.load_der_x509_csr(GOOD).public_bytes(serialization.Encoding.PEM)
    assert check_csr(pem, WEB.dns_name).dns_name == WEB.dns_name


def test_csr_without_common_name_is_accepted():
    assert check_csr(_csr(KEY, cn=""), WEB.dns_name).dns_name == WEB.dns_name


@pytest.mark.parametrize("data", [b"", b"not a csr", b"-----BEGIN CERTIFICATE REQUEST-----\nAAAA"])
def test_garbage_is_unparsable(data):
    assert _reason(data) is CSRReason.UNPARSABLE


def test_rsa_key_is_wrong_key_type():
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    assert _reason(_csr(key)) is CSRReason.WRONG_KEY_TYPE


def test_p384_key_is_wrong_key_type():
    assert _reason(_csr(ec.generate_private_key(ec.SECP384R1()))) is CSRReason.WRONG_KEY_TYPE


def test_altered_csr_has_bad_signature():
    tampered = GOOD.replace(b"web.shop", b"wex.shop")
    assert tampered != GOOD
    assert _reason(tampered, "wex.shop.serviceaccount.identity.linkerd.cluster.local") is (
        CSRReason.BAD_SIGNATURE
    )


@pytest.mark.parametrize(
    ("cn", "sans"),
    [
        (WEB.dns_name, (x509.DNSName("api.shop.serviceaccount.identity.linkerd.cluster.local"),)),
        (WEB.dns_name, (x509.DNSName(WEB.dns_name), x509.DNSName("other.example"))),
        (WEB.dns_name, ()),
        (
            WEB.dns_name,
            (x509.DNSName(WEB.dns_name), x509.UniformResourceIdentifier(WEB.spiffe_uri)),
        ),
        ("someone-else", (x509.DNSName(WEB.dns_name),)),
    ],
    ids=["other-identity", "two-dns-names", "no-san", "extra-uri", "common-name-differs"],
)
def test_names_other_than_exactly_the_identity_are_a_mismatch(cn, sans):
    assert _reason(_csr(KEY, cn=cn, sans=sans)) is CSRReason.IDENTITY_MISMATCH


def test_valid_csr_for_another_identity_is_a_mismatch():
    other = make_csr(KEY, Identity(sa="api", ns="shop"))
    assert _reason(other) is CSRReason.IDENTITY_MISMATCH


def test_error_message_names_the_reason():
    with pytest.raises(CSRError, match=r"identity mismatch.*not the requested identity"):
        check_csr(make_csr(KEY, Identity(sa="api", ns="shop")), WEB.dns_name)


@settings(max_examples=200)
@given(st.binary(max_size=600))
def test_random_bytes_raise_only_csr_error(data):
    with pytest.raises(CSRError):
        check_csr(data, WEB.dns_name)


@settings(max_examples=300)
@given(pos=st.integers(min_value=0, max_value=len(GOOD) - 1), byte=st.integers(0, 255))
def test_one_changed_byte_is_refused_or_still_names_the_identity(pos, byte):
    data = GOOD[:pos] + bytes([byte]) + GOOD[pos + 1 :]
    try:
        info = check_csr(data, WEB.dns_name)
    except CSRError:
        return
    assert info.dns_name == WEB.dns_name  # e.g. the byte was unchanged or not signed
