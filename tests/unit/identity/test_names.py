"""Identity names: Linkerd's DNS and SPIFFE forms, validation, parsing."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent.errors import AgentError
from agent.identity.names import Identity, IdentityNameError, parse_dns_name

labels = st.from_regex(r"[a-z0-9]([-a-z0-9]{0,20}[a-z0-9])?", fullmatch=True)


def test_default_names_match_linkerd_forms():
    ident = Identity(sa="web", ns="shop")
    assert ident.dns_name == "web.shop.serviceaccount.identity.linkerd.cluster.local"
    assert ident.spiffe_uri == "spiffe://cluster.local/ns/shop/sa/web"
    assert ident.username == "system:serviceaccount:shop:web"
    assert str(ident) == ident.dns_name


def test_custom_control_ns_and_trust_domain_appear_in_both_names():
    ident = Identity(sa="api", ns="prod", control_ns="mesh", trust_domain="example.org")
    assert ident.dns_name == "api.prod.serviceaccount.identity.mesh.example.org"
    assert ident.spiffe_uri == "spiffe://example.org/ns/prod/sa/api"


@pytest.mark.parametrize(
    ("field", "kwargs"),
    [
        ("service account", {"sa": "Web", "ns": "shop"}),
        ("service account", {"sa": "web_1", "ns": "shop"}),
        ("service account", {"sa": "", "ns": "shop"}),
        ("service account", {"sa": "-web", "ns": "shop"}),
        ("namespace", {"sa": "web", "ns": "a" * 64}),
        ("namespace", {"sa": "web", "ns": "shop."}),
        ("control-plane namespace", {"sa": "web", "ns": "shop", "control_ns": "l.d"}),
        ("trust domain", {"sa": "web", "ns": "shop", "trust_domain": "cluster..local"}),
        ("trust domain", {"sa": "web", "ns": "shop", "trust_domain": "Cluster.local"}),
    ],
)
def test_invalid_parts_are_refused_naming_the_field(field, kwargs):
    with pytest.raises(IdentityNameError) as info:
        Identity(**kwargs)
    assert info.value.field == field
    assert field in str(info.value)
    assert isinstance(info.value, AgentError)


def test_label_of_63_characters_is_accepted_and_64_refused():
    assert Identity(sa="a" * 63, ns="x").sa == "a" * 63
    with pytest.raises(IdentityNameError, match="longer than 63"):
        Identity(sa="a" * 64, ns="x")


def test_parse_dns_name_recovers_all_parts():
    ident = parse_dns_name("web.shop.serviceaccount.identity.linkerd.cluster.local")
    assert ident == Identity(sa="web", ns="shop")
    other = parse_dns_name("a.b.serviceaccount.identity.mesh.example.org")
    assert (other.control_ns, other.trust_domain) == ("mesh", "example.org")


@pytest.mark.parametrize(
    "name",
    [
        "web.shop.cluster.local",
        "web.serviceaccount.identity.linkerd.cluster.local",
        "a.web.shop.serviceaccount.identity.linkerd.cluster.local",
        "web.shop.serviceaccount.identity.linkerd",
        "web.shop.serviceaccount.identity.Linkerd.cluster.local",
        "",
    ],
)
def test_parse_dns_name_refuses_names_not_in_linkerd_form(name):
    with pytest.raises(IdentityNameError):
        parse_dns_name(name)


@given(sa=labels, ns=labels, cns=labels, td=st.lists(labels, min_size=1, max_size=3))
def test_parse_dns_name_inverts_dns_name(sa, ns, cns, td):
    ident = Identity(sa=sa, ns=ns, control_ns=cns, trust_domain=".".join(td))
    assert parse_dns_name(ident.dns_name) == ident


@given(st.text(max_size=80))
def test_parse_dns_name_raises_only_identity_name_error(text):
    try:
        ident = parse_dns_name(text)
    except IdentityNameError:
        return
    assert ident.dns_name == text
