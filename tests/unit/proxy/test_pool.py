"""agent.proxy.pool (its pure parts): how workers are started, h2 lanes per node."""

from __future__ import annotations

from agent.proxy.pool import H2_LANES, WorkerOptions, h2_lanes_for


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
