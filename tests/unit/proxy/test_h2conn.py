"""agent.proxy.h2conn.write_early: when a lane writes before the end of the iteration."""

from __future__ import annotations

import pytest

from agent.proxy.h2conn import write_early


@pytest.mark.parametrize(
    ("held", "other", "now"),
    [
        (0, 0, False),  # nothing held back: nothing to write
        (1, 0, True),  # the peer has nothing: the first stream goes at once
        (1, 1, True),
        (1, 2, False),  # the peer has more to do than this side holds back
        (2, 2, True),
        (15, 16, False),
        (16, 16, True),
        (17, 3, True),
    ],
)
def test_a_lane_writes_once_it_holds_back_as_much_as_the_other_side_has(held, other, now):
    assert write_early(held, other) is now


def test_a_batch_of_new_streams_goes_in_writes_that_double():
    """The client side's rule over one callback that opens 64 streams (the peer has none)."""
    writes, held = [], 0
    for opened in range(1, 65):
        held += 1
        if write_early(held, opened - held):
            writes.append(opened)
            held = 0
    assert writes == [1, 2, 4, 8, 16, 32, 64]
