"""agent.bench.sidenoise in the bench's real lab: four paths in turns, numbers for each."""

from __future__ import annotations

import json
import subprocess

import pytest

from agent.bench import sidenoise

pytestmark = pytest.mark.privileged


def _netns() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    return {line.split()[0] for line in out.stdout.splitlines() if line.strip()}


@pytest.mark.timeout(120)
def test_four_paths_are_measured_in_turns_and_the_lab_is_gone_after(capsys):
    before = _netns()
    argv = ["--runs", "1", "--duration", "0.4", "--warmup", "0.2", "-o", "json"]
    assert sidenoise.main(argv) == 0
    assert _netns() - before == set()
    (run,) = json.loads(capsys.readouterr().out)
    assert run["errors"] == 0
    for name in sidenoise.PATHS:
        assert 0 < run["p50_ms"][name] <= run["p99_ms"][name]
    assert all(a is not None for a in run["added_p99_ms"])


def test_a_run_needs_positive_runs_and_time(capsys):
    with pytest.raises(SystemExit):
        sidenoise.main(["--runs", "0"])
    assert "--runs and --duration must be positive, got 0 and 10.0" in capsys.readouterr().err
