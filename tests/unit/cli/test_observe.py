"""agent.cli.observe: `meshagent tap --max` takes a count of events."""

from __future__ import annotations

import pytest

from agent import cli


@pytest.mark.parametrize(
    ("value", "why"), [("-3", "must be 0 (never stop) or more"), ("x", "not a count")]
)
def test_tap_refuses_a_bad_max(capsys, value, why):
    with pytest.raises(SystemExit) as exited:
        cli.main(["tap", "--max", value, "default/web"])
    assert exited.value.code == 2
    assert f"argument --max: {why}" in capsys.readouterr().err


def test_tap_takes_zero_for_never_stopping():
    args = cli.build_parser().parse_args(["tap", "--max", "0", "default/web"])
    assert args.max == 0
