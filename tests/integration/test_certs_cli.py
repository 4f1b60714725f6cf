"""`meshagent certs ...` through agent.cli.main into temporary directories."""

from __future__ import annotations

import json
import stat
from datetime import UTC, datetime, timedelta
from pathlib import Path

import yaml
from cryptography import x509

from agent.cli import main
from agent.identity import ca, files
from agent.identity.csr import check_csr, make_csr, new_key
from agent.identity.names import Identity


def _mode(path) -> int:
    return stat.S_IMODE(Path(path).stat().st_mode)


def _cn(path) -> str:
    cert = files.read_certs(path)[0]
    return str(cert.subject.get_attributes_for_oid(x509.NameOID.COMMON_NAME)[0].value)


def test_create_root_then_issuer_gives_a_chain_that_signs_leaves(tmp_path, capsys):
    root, issuer = tmp_path / "root", tmp_path / "issuer"
    assert main(["certs", "create-root", str(root)]) == 0
    assert "ca.key" in capsys.readouterr().out
    assert main(["certs", "create-issuer", str(issuer), "--ca", str(root)]) == 0
    assert _mode(root / "ca.key") == 0o600
    assert _mode(issuer / "issuer.key") == 0o600
    assert sorted(p.name for p in issuer.iterdir()) == ["ca.crt", "issuer.crt", "issuer.key"]
    assert _cn(root / "ca.crt") == "root.linkerd.cluster.local"
    assert _cn(issuer / "issuer.crt") == "identity.linkerd.cluster.local"
    loaded = ca.load_issuer(issuer)
    web = Identity(sa="web", ns="shop")
    now = datetime.now(UTC)
    leaf, chain, _ = loaded.sign_leaf(
        check_csr(make_csr(new_key(), web), web.dns_name), web, now=now
    )
    ca.verify_chain(leaf, chain, ca.load_trust_bundle(root / "ca.crt"), now=now)


def test_create_output_lists_files_and_modes_as_json(tmp_path, capsys):
    assert main(["certs", "create-root", str(tmp_path), "-o", "json"]) == 0
    out = json.loads(capsys.readouterr().out)
    modes = {Path(row["file"]).name: row["mode"] for row in out["files"]}
    assert modes == {"ca.crt": "0644", "ca.key": "0600"}
    assert out["subject"] == "CN=root.linkerd.cluster.local"


def test_existing_keys_are_not_overwritten_without_force(tmp_path, capsys):
    assert main(["certs", "create-root", str(tmp_path)]) == 0
    key_before = (tmp_path / "ca.key").read_bytes()
    capsys.readouterr()
    assert main(["certs", "create-root", str(tmp_path)]) == 2
    assert "--force" in capsys.readouterr().err
    assert (tmp_path / "ca.key").read_bytes() == key_before
    assert main(["certs", "create-root", str(tmp_path), "--force"]) == 0
    assert (tmp_path / "ca.key").read_bytes() != key_before
    assert _mode(tmp_path / "ca.key") == 0o600


def test_issuer_keys_are_not_overwritten_without_force(tmp_path, capsys):
    main(["certs", "create-root", str(tmp_path / "r")])
    main(["certs", "create-issuer", str(tmp_path / "i"), "--ca", str(tmp_path / "r")])
    before = (tmp_path / "i" / "issuer.key").read_bytes()
    assert main(["certs", "create-issuer", str(tmp_path / "i"), "--ca", str(tmp_path / "r")]) == 2
    assert (tmp_path / "i" / "issuer.key").read_bytes() == before


def test_lifetime_and_trust_domain_flags(tmp_path):
    root, issuer = tmp_path / "r", tmp_path / "i"
    start = datetime.now(UTC)
    assert (
        main(
            [
                "certs",
                "create-root",
                str(root),
                "--trust-domain",
                "example.org",
                "--lifetime",
                "48h",
            ]
        )
        == 0
    )
    assert main(["certs", "create-issuer", str(issuer), "--ca", str(root), "--lifetime", "2h"]) == 0
    assert _cn(root / "ca.crt") == "root.linkerd.example.org"
    assert _cn(issuer / "issuer.crt") == "identity.linkerd.example.org"
    root_end = files.read_certs(root / "ca.crt")[0].not_valid_after_utc
    issuer_end = files.read_certs(issuer / "issuer.crt")[0].not_valid_after_utc
    assert abs(root_end - (start + timedelta(hours=48))) < timedelta(minutes=1)
    assert abs(issuer_end - (start + timedelta(hours=2))) < timedelta(minutes=1)


def test_trust_domain_comes_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("MESHAGENT_TRUST_DOMAIN", "env.example")
    assert main(["certs", "create-root", str(tmp_path)]) == 0
    assert _cn(tmp_path / "ca.crt") == "root.linkerd.env.example"


def test_bad_flag_values_are_refused_naming_the_flag(tmp_path, capsys):
    assert main(["certs", "create-root", str(tmp_path), "--lifetime", "soon"]) == 2
    assert "--lifetime" in capsys.readouterr().err
    assert main(["certs", "create-root", str(tmp_path), "--trust-domain", "Bad_Domain"]) == 2
    assert "--trust-domain" in capsys.readouterr().err
    assert not (tmp_path / "ca.key").exists()


def test_inspect_reports_chaining_with_sibling_or_given_ca(tmp_path, capsys):
    main(["certs", "create-root", str(tmp_path / "r")])
    main(["certs", "create-issuer", str(tmp_path / "i"), "--ca", str(tmp_path / "r")])
    main(["certs", "create-root", str(tmp_path / "other")])
    capsys.readouterr()
    assert main(["certs", "inspect", str(tmp_path / "i" / "issuer.crt"), "-o", "json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["chains"] is True
    assert info["is_ca"] is True
    assert info["key_type"] == "ECDSA P-256"
    foreign = str(tmp_path / "other" / "ca.crt")
    assert (
        main(
            ["certs", "inspect", str(tmp_path / "i" / "issuer.crt"), "--ca", foreign, "-o", "yaml"]
        )
        == 1
    )
    info = yaml.safe_load(capsys.readouterr().out)
    assert info["chains"] is False
    assert "does not chain" in info["chain_error"]


def test_inspect_table_shows_fields(tmp_path, capsys):
    main(["certs", "create-root", str(tmp_path)])
    capsys.readouterr()
    assert main(["certs", "inspect", str(tmp_path / "ca.crt")]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split() == ["FIELD", "VALUE"]
    assert "CN=root.linkerd.cluster.local" in out


def test_inspect_of_a_missing_file_is_an_error(tmp_path, capsys):
    assert main(["certs", "inspect", str(tmp_path / "nope.crt")]) == 2
    assert "missing" in capsys.readouterr().err
