"""agent.redirect.ebpf_node's settings from the environment."""

from __future__ import annotations

import pytest

from agent.errors import SettingError
from agent.redirect.ebpf_node import (
    DEFAULT_ACCEL_MAX_MSG,
    ENV_ACCEL,
    ENV_ACCEL_MAX_MSG,
    ENV_PAIR,
    accel_from_env,
    pair_from_env,
)


def test_acceleration_is_off_unless_asked_for_and_its_message_bound_is_a_byte_count() -> None:
    assert accel_from_env({}) == (False, DEFAULT_ACCEL_MAX_MSG)
    assert accel_from_env({ENV_ACCEL: " On ", ENV_ACCEL_MAX_MSG: "4096"}) == (True, 4096)
    assert accel_from_env({ENV_ACCEL: "no"}) == (False, DEFAULT_ACCEL_MAX_MSG)
    with pytest.raises(SettingError, match=ENV_ACCEL_MAX_MSG):
        accel_from_env({ENV_ACCEL_MAX_MSG: "16k"})


@pytest.mark.parametrize(("raw", "want"), [("", True), ("1", True), ("off", False), ("0", False)])
def test_the_paired_relay_is_on_unless_turned_off(raw: str, want: bool) -> None:
    assert pair_from_env({ENV_PAIR: raw}) is want


@pytest.mark.parametrize("name", [ENV_ACCEL, ENV_PAIR])
def test_a_setting_that_is_not_a_boolean_is_named_with_its_value(name: str) -> None:
    with pytest.raises(SettingError) as exc:
        (accel_from_env if name == ENV_ACCEL else pair_from_env)({name: "maybe"})
    assert name in str(exc.value)
    assert "maybe" in str(exc.value)
