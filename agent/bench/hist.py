"""A latency histogram with logarithmic buckets (HdrHistogram-like), pure.

Rules:
1. Values are microseconds (non-negative integers). Bucket `i` holds values
   whose bucket index is `i`: exact below `LINEAR_US`, then `SUB_BUCKETS`
   buckets per power of two, so the relative error of any percentile is at
   most 1/SUB_BUCKETS (about 1.6%).
2. A percentile reports the upper edge of the bucket holding the rank
   `ceil(p/100 * count)` (the conservative choice), clamped to the largest
   value recorded.
3. Histograms merge by adding counts; `to_dict`/`from_dict` carry them
   between processes as JSON (sparse: only non-empty buckets).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

SUB_BUCKETS = 64  # per power of two above LINEAR_US
LINEAR_US = SUB_BUCKETS  # values below this get a bucket each


def bucket_of(value_us: int) -> int:
    """The bucket index of `value_us` (negative values count as 0)."""
    v = max(0, int(value_us))
    if v < LINEAR_US:
        return v
    exp = v.bit_length() - 1  # 2**exp <= v < 2**(exp+1), exp >= log2(LINEAR_US)
    base_exp = LINEAR_US.bit_length() - 1
    sub = (v - (1 << exp)) * SUB_BUCKETS >> exp
    return LINEAR_US + (exp - base_exp) * SUB_BUCKETS + sub


def bucket_upper(index: int) -> int:
    """The largest value (us) that falls in bucket `index`."""
    if index < LINEAR_US:
        return index
    base_exp = LINEAR_US.bit_length() - 1
    k = index - LINEAR_US
    exp = base_exp + k // SUB_BUCKETS
    sub = k % SUB_BUCKETS
    low = (1 << exp) + (sub << exp) // SUB_BUCKETS
    high = (1 << exp) + ((sub + 1) << exp) // SUB_BUCKETS
    return max(low, high - 1)


@dataclass(slots=True)
class Histogram:
    """Counts of latencies (us) by bucket; see the module rules."""

    counts: dict[int, int] = field(default_factory=dict)
    count: int = 0
    max_us: int = 0
    sum_us: int = 0

    def record(self, value_us: int, n: int = 1) -> None:
        v = max(0, int(value_us))
        b = bucket_of(v)
        self.counts[b] = self.counts.get(b, 0) + n
        self.count += n
        self.sum_us += v * n
        self.max_us = max(self.max_us, v)

    def merge(self, other: Histogram) -> None:
        for b, n in other.counts.items():
            self.counts[b] = self.counts.get(b, 0) + n
        self.count += other.count
        self.sum_us += other.sum_us
        self.max_us = max(self.max_us, other.max_us)

    def percentile(self, p: float) -> int:
        """The `p`-th percentile in us (0 when empty).

        Raises:
            ValueError: `p` outside [0, 100].
        """
        if not 0 <= p <= 100:
            raise ValueError(f"percentile {p} is outside [0, 100]")
        if self.count == 0:
            return 0
        rank = max(1, math.ceil(p / 100 * self.count))
        seen = 0
        for b in sorted(self.counts):
            seen += self.counts[b]
            if seen >= rank:
                return min(bucket_upper(b), self.max_us)
        return self.max_us

    @property
    def mean_us(self) -> float:
        return self.sum_us / self.count if self.count else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "counts": {str(b): n for b, n in sorted(self.counts.items())},
            "count": self.count,
            "max_us": self.max_us,
            "sum_us": self.sum_us,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Histogram:
        """Raises: KeyError, ValueError: not a `to_dict` shape."""
        return cls(
            counts={int(b): int(n) for b, n in data["counts"].items()},
            count=int(data["count"]),
            max_us=int(data["max_us"]),
            sum_us=int(data["sum_us"]),
        )
