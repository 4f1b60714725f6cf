"""Pinned map access in agent.redirect.maps that needs no kernel; the re-exports."""

from __future__ import annotations

import pytest

from agent.redirect import bpf_objects, maps, maps_abi


def test_accel_stats_are_zero_before_sk_msg_ever_loaded(tmp_path):
    assert maps.accel_stats(tmp_path) == dict.fromkeys(maps.ACCEL_STAT_NAMES, 0)
    assert len(maps.ACCEL_STAT_NAMES) <= maps.ACCEL_STATS_SLOTS


@pytest.mark.parametrize("name", maps.__all__)
def test_every_name_in_all_is_importable_from_maps_as_the_same_object(name):
    # callers reach the mirrors and the libbpf calls through `maps`; the split keeps that working
    homes = [m for m in (maps, maps_abi, bpf_objects) if name in vars(m)]
    assert len({id(getattr(m, name)) for m in homes}) == 1
