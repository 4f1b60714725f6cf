"""agent.proxy.pool (its pure parts): how workers are started, h2 lanes per node."""

from __future__ import annotations

from agent.proxy.pool import H2_LANES, WRAP_ENV, WorkerOptions, h2_lanes_for


def test_a_node_of_one_worker_keeps_one_lane_and_of_several_h2_lanes():
    assert h2_lanes_for(1) == 1
    assert h2_lanes_for(2) == H2_LANES
    assert h2_lanes_for(64) == H2_LANES


def test_worker_argv_carries_the_lanes_and_the_upgrade_mode():
    argv = WorkerOptions(h2_lanes=1, h2_upgrade="off").argv(channel_fd=7, worker_id=2)
    assert argv[1:3] == ["-m", "agent.proxy.worker"]
    assert "--h2-lanes=1" in argv
    assert argv[argv.index("--h2-upgrade") + 1] == "off"
    assert f"--h2-lanes={H2_LANES}" in WorkerOptions().argv(channel_fd=7, worker_id=0)


def test_a_wrap_command_from_the_environment_goes_before_the_worker_argv(monkeypatch):
    monkeypatch.setenv(WRAP_ENV, "valgrind --tool=callgrind '--callgrind-out-file=/tmp/a b/cg.%p'")
    argv = WorkerOptions(python="/py").argv(channel_fd=7, worker_id=0)
    wrap = ["valgrind", "--tool=callgrind", "--callgrind-out-file=/tmp/a b/cg.%p"]
    assert argv[:5] == [*wrap, "/py", "-m"]
    monkeypatch.delenv(WRAP_ENV)
    assert WorkerOptions(python="/py").argv(channel_fd=7, worker_id=0)[:2] == ["/py", "-m"]
