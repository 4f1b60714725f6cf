"""agent.proxy.worker: its command line."""

from __future__ import annotations

import pytest

from agent.proxy import worker


def test_h2_lanes_flag_defaults_to_several_and_refuses_zero(capsys: pytest.CaptureFixture[str]):
    base = ["--channel-fd=3", "--worker-id=0"]
    assert worker.parse_args(base).h2_lanes == 4
    assert worker.parse_args([*base, "--h2-lanes=1"]).h2_lanes == 1
    with pytest.raises(SystemExit):
        worker.parse_args([*base, "--h2-lanes=0"])
    assert "--h2-lanes" in capsys.readouterr().err
