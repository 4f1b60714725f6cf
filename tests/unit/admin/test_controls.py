"""Readiness, log-level specs and config_dump scrubbing."""

from __future__ import annotations

import enum
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from agent.admin.controls import (
    REQUIRED,
    LogLevelControl,
    ReadinessGate,
    is_secret_name,
    parse_log_level,
    scrub,
)

PEM = (
    ec.generate_private_key(ec.SECP256R1())
    .private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    .decode()
)


def test_gate_is_ready_only_when_every_condition_holds():
    gate = ReadinessGate()
    state = gate.check()
    assert not state.ready
    assert len(state.reasons) == len(REQUIRED)
    for name in REQUIRED[:-1]:
        gate.set(name, True)
    state = gate.check()
    assert not state.ready
    assert state.reasons == ("control_plane: control plane has not answered yet",)
    gate.set("control_plane", True)
    assert gate.check().ready
    gate.set("certificates", False, "web.shop expired")
    assert gate.check().reasons == ("certificates: web.shop expired",)


def test_gate_refuses_unknown_conditions():
    with pytest.raises(KeyError, match="unknown readiness condition"):
        ReadinessGate().set("nope", True)


@pytest.mark.parametrize(
    ("spec", "default", "targets"),
    [
        ("info", "info", ()),
        ("agent.proxy=debug,info", "info", (("agent.proxy", "debug"),)),
        ("warn,linkerd::app=trace", "warn", (("linkerd.app", "trace"),)),
        (" agent=ERROR , agent.admin=off ", "info", (("agent", "error"), ("agent.admin", "off"))),
    ],
)
def test_log_specs_parse(spec, default, targets):
    parsed = parse_log_level(spec)
    assert (parsed.default, parsed.targets) == (default, targets)


@pytest.mark.parametrize("spec", ["", "loud", "info,debug", "a b=info", "=info", "x=verbose"])
def test_bad_log_specs_are_refused(spec):
    with pytest.raises(ValueError):
        parse_log_level(spec)


def test_log_level_control_applies_and_resets_logger_levels():
    root = logging.getLogger()
    before = root.level
    seen: list[str] = []
    try:
        ctl = LogLevelControl("info", on_change=seen.append)
        assert ctl.set("agent.admin.testing=debug,warn") == "agent.admin.testing=debug,warn"
        assert logging.getLogger("agent.admin.testing").level == logging.DEBUG
        assert root.level == logging.WARNING
        ctl.set("error")
        assert logging.getLogger("agent.admin.testing").level == logging.NOTSET
        assert root.level == logging.ERROR
        assert ctl.current == "error"
        assert seen == ["agent.admin.testing=debug,warn", "error"]
    finally:
        root.setLevel(before)


@pytest.mark.parametrize(
    "name",
    [
        "key",
        "private_key",
        "privateKey",
        "token",
        "sa_token",
        "clientSecret",
        "tls.key",
        "password",
        "PRIVATE-KEY",
    ],
)
def test_secret_looking_names(name):
    assert is_secret_name(name)


@pytest.mark.parametrize("name", ["identity", "not_after", "monkey", "endpoints", "tls_identity"])
def test_ordinary_names(name):
    assert not is_secret_name(name)


class Mode(enum.Enum):
    IPTABLES = "iptables"


@dataclass(frozen=True)
class Cert:
    identity: str
    not_after: str
    key_pem: str
    chain: tuple[str, ...]


def test_scrub_removes_leaked_keys_anywhere():
    leaky = {
        "pods": [{"name": "web", "mode": Mode.IPTABLES, "path": Path("/run/netns/x")}],
        "certificates": [
            Cert(identity="web.shop", not_after="2030-01-01", key_pem=PEM, chain=("CERT", PEM)),
        ],
        "private_key": PEM,
        "token": "eyJhbGci",
        "notes": ["ok", PEM, b"\x30\x82raw-der"],
        "nested": {"deep": {"secret": "s", "value": 3, "blob": PEM}},
    }
    out = scrub(leaky)
    text = json.dumps(out)
    assert "PRIVATE KEY" not in text
    assert "eyJhbGci" not in text
    assert out["pods"] == [{"name": "web", "mode": "iptables", "path": "/run/netns/x"}]
    assert out["certificates"] == [
        {"identity": "web.shop", "not_after": "2030-01-01", "chain": ["CERT"]}
    ]
    assert out["notes"] == ["ok"]
    assert out["nested"] == {"deep": {"value": 3}}


def test_scrub_drops_private_key_objects():
    key = ec.generate_private_key(ec.SECP256R1())
    assert scrub({"holder": key, "ok": 1}) == {"ok": 1}
