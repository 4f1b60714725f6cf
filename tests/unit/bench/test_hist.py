"""The bench's latency histogram: buckets, percentiles, merging, JSON round trip."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent.bench.hist import SUB_BUCKETS, Histogram, bucket_of, bucket_upper


def test_small_values_get_exact_buckets():
    for v in range(SUB_BUCKETS):
        assert bucket_upper(bucket_of(v)) == v


@given(st.integers(min_value=0, max_value=10**9))
def test_a_value_lies_in_its_bucket_within_the_relative_error(v):
    upper = bucket_upper(bucket_of(v))
    assert upper >= v
    assert upper - v <= max(1, v / SUB_BUCKETS)


@given(st.integers(min_value=0, max_value=10**8))
def test_bucket_index_grows_with_the_value(v):
    assert bucket_of(v + 1) >= bucket_of(v)


def test_percentiles_of_one_to_a_thousand():
    h = Histogram()
    for v in range(1, 1001):
        h.record(v)
    assert h.count == 1000
    assert abs(h.percentile(50) - 500) <= 500 / SUB_BUCKETS + 1
    assert abs(h.percentile(99) - 990) <= 990 / SUB_BUCKETS + 1
    assert h.percentile(100) == 1000
    assert h.mean_us == pytest.approx(500.5)


def test_percentile_never_exceeds_the_largest_value_recorded():
    h = Histogram()
    h.record(1000)
    assert h.percentile(99.9) == 1000


def test_empty_histogram_reports_zero_and_bad_percentile_raises():
    h = Histogram()
    assert h.percentile(99) == 0
    with pytest.raises(ValueError, match="outside"):
        h.percentile(101)


def test_merge_adds_counts_and_keeps_the_max():
    a, b = Histogram(), Histogram()
    a.record(10, n=3)
    b.record(5000)
    a.merge(b)
    assert a.count == 4
    assert a.max_us == 5000
    assert a.percentile(100) == 5000
    assert a.percentile(50) == 10


def test_json_round_trip_keeps_every_percentile():
    h = Histogram()
    for v in (1, 70, 300, 300, 9000, 123456):
        h.record(v)
    back = Histogram.from_dict(h.to_dict())
    assert back == h
    assert [back.percentile(p) for p in (50, 99, 99.9)] == [h.percentile(p) for p in (50, 99, 99.9)]
