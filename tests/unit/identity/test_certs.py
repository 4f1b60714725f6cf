"""Certificate shapes and facts: renewal time, key types, `describe`."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec, ed448, ed25519, rsa
from cryptography.x509.oid import NameOID

from agent.identity import certs


def test_renewal_is_at_70_percent_of_the_lifetime():
    now = datetime.now(UTC)
    assert certs.renew_at(now, now + timedelta(hours=24)) == now + timedelta(hours=16.8)


def test_key_type_names_each_kind_of_public_key():
    assert certs.key_type(ec.generate_private_key(ec.SECP384R1()).public_key()) == "ECDSA P-384"
    assert certs.key_type(rsa.generate_private_key(65537, 2048).public_key()) == "RSA 2048"
    assert certs.key_type(ed25519.Ed25519PrivateKey.generate().public_key()) == "Ed25519"
    assert certs.key_type(ed448.Ed448PrivateKey.generate().public_key()) == "Ed448"
    assert certs.key_type(object()) == "object"


def test_describe_a_leaf_without_sans_and_with_a_ski():
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "bare")])
    start = datetime(2030, 1, 1, tzinfo=UTC)
    cert = (
        certs.cert_builder(name, name, key.public_key(), start, start + timedelta(hours=1))
        .add_extension(certs.key_usage(signing=False), critical=True)
        .sign(key, hashes.SHA256())
    )
    info = certs.describe(cert)
    assert info["subject"] == info["issuer"] == "CN=bare"
    assert (info["dns_names"], info["uris"]) == ([], [])
    assert (info["is_ca"], info["path_length"]) == (False, None)
    assert info["key_type"] == "ECDSA P-256"
    assert info["not_before"].startswith("2030-01-01")
    ski = cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    assert certs.aki(cert).key_identifier == ski.digest
