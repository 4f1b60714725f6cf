"""agent.proxy.placement: slots on CPUs, and the steering program's instructions."""

from __future__ import annotations

import pytest

from agent.proxy import placement
from agent.proxy.placement import MAX_STEERED_CPUS, NO_SLOT


def test_slots_take_the_allowed_cpus_in_order_round_robin() -> None:
    assert placement.slot_cpus({3, 1}, 2) == (1, 3)
    assert placement.slot_cpus({5, 2, 9}, 5) == (2, 5, 9, 2, 5)
    assert placement.slot_cpus({4}, 1) == (4,)


@pytest.mark.parametrize(("allowed", "workers"), [(set(), 2), ({0, 1}, 0)])
def test_no_cpus_or_no_workers_is_an_error(allowed: set[int], workers: int) -> None:
    with pytest.raises(ValueError, match="cannot place"):
        placement.slot_cpus(allowed, workers)


def test_the_table_maps_each_cpu_to_its_one_slot() -> None:
    assert placement.steering_table((2, 7, 3)) == {2: 0, 7: 1, 3: 2}


def test_no_table_when_a_cpu_has_two_slots_or_there_are_none() -> None:
    assert placement.steering_table(placement.slot_cpus({0, 1}, 3)) is None
    assert placement.steering_table(()) is None
    assert placement.steering_table(tuple(range(MAX_STEERED_CPUS + 1))) is None


def test_the_program_returns_the_cpus_slot_and_past_the_group_elsewhere() -> None:
    program = placement.steering_program({0: 1, 1: 0, 6: 2})
    assert placement.run(program, 0) == 1
    assert placement.run(program, 1) == 0
    assert placement.run(program, 6) == 2
    assert placement.run(program, 3) == NO_SLOT  # no slot there: the kernel's hash
    assert NO_SLOT >= 2**32 - 1  # past any group the kernel can hold


def test_the_program_is_a_load_two_instructions_per_cpu_and_a_default_return() -> None:
    insns = placement.decode(placement.steering_program({4: 0, 2: 1}))
    assert insns == [
        (0x20, 0, 0, 0xFFFFF000 + 36),  # ld [SKF_AD_CPU]
        (0x15, 0, 1, 2),  # jeq #2: next, else skip one
        (0x06, 0, 0, 1),  # ret #1
        (0x15, 0, 1, 4),
        (0x06, 0, 0, 0),
        (0x06, 0, 0, NO_SLOT),
    ]


def test_the_largest_table_fits_the_kernels_instruction_limit() -> None:
    program = placement.steering_program({c: c for c in range(MAX_STEERED_CPUS)})
    assert len(placement.decode(program)) <= 4096
    assert placement.run(program, MAX_STEERED_CPUS - 1) == MAX_STEERED_CPUS - 1


@pytest.mark.parametrize("table", [{}, {c: c for c in range(MAX_STEERED_CPUS + 1)}])
def test_an_empty_or_oversized_table_has_no_program(table: dict[int, int]) -> None:
    with pytest.raises(ValueError, match="covers 1 to"):
        placement.steering_program(table)


def test_an_unknown_instruction_is_named() -> None:
    program = placement.steering_program({0: 0})
    bad = placement.INSN.pack(0x07, 0, 0, 0) + program  # tax: not one the program uses
    with pytest.raises(ValueError, match="instruction 0: code 0x7"):
        placement.run(bad, 0)
