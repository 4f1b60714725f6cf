"""`meshagent certs` flag values: a lifetime long enough to be used, a valid trust domain."""

from __future__ import annotations

from datetime import timedelta

import pytest

from agent.identity import options


@pytest.mark.parametrize(
    ("raw", "lifetime"),
    [
        ("87600h", timedelta(hours=87600)),
        ("90m", timedelta(minutes=90)),
        ("3600", timedelta(hours=1)),
    ],
)
def test_a_lifetime_reads_as_a_duration(raw, lifetime):
    assert options.parse_lifetime(raw) == lifetime


@pytest.mark.parametrize("raw", ["1ms", "59s", "0"])
def test_a_lifetime_too_short_to_be_used_is_refused(raw):
    with pytest.raises(ValueError, match="at least 1m"):
        options.parse_lifetime(raw)


@pytest.mark.parametrize("raw", ["soon", "nan", "", "-1h"])
def test_a_lifetime_that_is_no_duration_is_refused(raw):
    with pytest.raises(ValueError):
        options.parse_lifetime(raw)


def test_a_trust_domain_must_be_a_dns_subdomain():
    assert options.parse_trust_domain("cluster.local") == "cluster.local"
    with pytest.raises(ValueError, match="trust domain"):
        options.parse_trust_domain("Bad_Domain")
