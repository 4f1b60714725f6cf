"""`meshagent run` settings: flags and their MESHAGENT_* mirrors into RunSettings."""

from __future__ import annotations

import argparse
import os

import pytest

from agent import config
from agent.errors import SettingError
from agent.proxy import worker
from agent.proxy.pool import WorkerOptions
from agent.supervisor import cpulimit
from agent.supervisor.settings import RUN_OPTIONS, RunSettings


def _settings(tmp_path, argv: list[str], env: dict[str, str] | None = None) -> RunSettings:
    (tmp_path / "ca.crt").write_text("trust")
    (tmp_path / "pods").mkdir(exist_ok=True)
    parser = argparse.ArgumentParser()
    config.add_options(parser, RUN_OPTIONS)
    base = ["--control-plane", "embedded", "--pods-from", f"manifests:{tmp_path / 'pods'}"]
    args = parser.parse_args([*base, "--identity-dir", str(tmp_path), *argv])
    return RunSettings.from_values(config.resolve(args, env or {}, RUN_OPTIONS))


def test_h2_upgrade_is_auto_unless_asked_and_reaches_the_worker_command(tmp_path):
    assert _settings(tmp_path, []).h2_upgrade == "auto"
    assert _settings(tmp_path, ["--h2-upgrade", "on"]).h2_upgrade == "on"
    assert _settings(tmp_path, [], {"MESHAGENT_H2_UPGRADE": "off"}).h2_upgrade == "off"
    flag_wins = _settings(tmp_path, ["--h2-upgrade", "off"], {"MESHAGENT_H2_UPGRADE": "on"})
    assert flag_wins.h2_upgrade == "off"
    argv = WorkerOptions(h2_upgrade="on").argv(3, 0)
    assert argv[argv.index("--h2-upgrade") + 1] == "on"
    argv = WorkerOptions().argv(3, 0)
    assert argv[argv.index("--h2-upgrade") + 1] == "auto"
    for mode in ("auto", "on", "off"):  # what the worker's own parser takes
        argv = WorkerOptions(h2_upgrade=mode).argv(3, 0)
        assert worker.parse_args(argv[3:]).h2_upgrade == mode


def test_io_uring_is_on_unless_switched_off_and_reaches_the_worker_command(tmp_path):
    assert _settings(tmp_path, []).io_uring is True
    assert _settings(tmp_path, ["--io-uring", "off"]).io_uring is False
    assert _settings(tmp_path, [], {"MESHAGENT_IO_URING": "off"}).io_uring is False
    for on in (True, False):
        argv = WorkerOptions(io_uring=on).argv(3, 0)
        assert worker.parse_args(argv[3:]).io_uring == ("on" if on else "off")
    with pytest.raises(SettingError, match="MESHAGENT_IO_URING") as err:
        _settings(tmp_path, [], {"MESHAGENT_IO_URING": "1"})
    assert "on, off" in str(err.value)


def test_a_bad_h2_upgrade_value_names_the_variable(tmp_path):
    with pytest.raises(SettingError, match="MESHAGENT_H2_UPGRADE") as err:
        _settings(tmp_path, [], {"MESHAGENT_H2_UPGRADE": "yes"})
    assert "auto, on, off" in str(err.value)


def test_cpu_placement_is_off_unless_asked_and_pins_only_when_pin(tmp_path):
    assert _settings(tmp_path, []).cpu_placement == "off"
    assert _settings(tmp_path, ["--cpu-placement", "pin"]).cpu_placement == "pin"
    assert _settings(tmp_path, [], {"MESHAGENT_CPU_PLACEMENT": "steer"}).cpu_placement == "steer"
    with pytest.raises(SettingError, match="MESHAGENT_CPU_PLACEMENT") as err:
        _settings(tmp_path, [], {"MESHAGENT_CPU_PLACEMENT": "on"})
    assert "steer, pin, bind, off" in str(err.value)
    assert _settings(tmp_path, ["--cpu-placement", "bind"]).cpu_placement == "bind"
    steered = WorkerOptions(cpus=(4, 6)).argv(3, 1)
    assert worker.parse_args(steered[3:]).cpu is None  # steered, runs anywhere
    pinned = WorkerOptions(cpus=(4, 6), pin=True)
    assert [worker.parse_args(pinned.argv(3, i)[3:]).cpu for i in range(3)] == [4, 6, 4]


def test_workers_default_to_the_cpus_this_process_may_use(tmp_path):
    assert _settings(tmp_path, []).workers == cpulimit.usable_cpus()
    assert cpulimit.usable_cpus() <= len(os.sched_getaffinity(0))
    assert _settings(tmp_path, ["--workers", "3"]).workers == 3


def test_worker_plugins_are_found_before_any_worker_starts(tmp_path):
    plugin = tmp_path / "plug.py"
    plugin.write_text("")
    got = _settings(tmp_path, ["--worker-plugins", f"agent.proxy.dataplane, {plugin}"])
    assert got.worker_plugins == ("agent.proxy.dataplane", str(plugin))
    bad = {
        "nope.mod": "no module named 'nope.mod'",
        "agent.nope": "no module named 'agent.nope'",
        str(tmp_path / "gone.py"): "does not exist",
    }
    for value, why in bad.items():
        with pytest.raises(SettingError, match="--worker-plugins") as err:
            _settings(tmp_path, ["--worker-plugins", value])
        assert why in str(err.value)


def test_the_workers_keep_the_kernels_slice_unless_asked_and_a_slice_reaches_them(tmp_path):
    assert _settings(tmp_path, []).worker_slice is None
    assert _settings(tmp_path, ["--worker-slice", "1ms"]).worker_slice == pytest.approx(0.001)
    from_env = _settings(tmp_path, [], {"MESHAGENT_WORKER_SLICE": "400us"})
    assert from_env.worker_slice == pytest.approx(0.0004)
    flag_wins = _settings(tmp_path, ["--worker-slice", "off"], {"MESHAGENT_WORKER_SLICE": "1ms"})
    assert flag_wins.worker_slice is None
    argv = WorkerOptions(slice_s=0.0001).argv(3, 0)
    assert worker.parse_args(argv[3:]).slice == pytest.approx(0.0001)
    assert worker.parse_args(WorkerOptions().argv(3, 0)[3:]).slice is None
    assert not any(a.startswith("--slice") for a in WorkerOptions().argv(3, 0))
    with pytest.raises(SettingError, match="MESHAGENT_WORKER_SLICE") as err:
        _settings(tmp_path, [], {"MESHAGENT_WORKER_SLICE": "10us"})
    assert "100us to 100ms" in str(err.value)
