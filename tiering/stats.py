"""Statistics of the engine: every `get_stats()` returns a `TierStats`-shaped dict.

``{"counters": {...}, "gauges": {...}, "job_seconds": {...}}``: counters only grow, gauges
are current values, and ``job_seconds`` is a histogram of job durations (seconds) with
cumulative counts per upper bound, Prometheus style. Everything is plain ints, floats,
bools and strings, so a snapshot can be handed to another thread or dumped as JSON.
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Any

JOB_SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

TierStats = dict[str, Any]


class Histogram:
    """Counts of observed durations per bucket (scheduler thread only)."""

    __slots__ = ("_counts", "count", "sum")

    def __init__(self) -> None:
        self._counts = [0] * (len(JOB_SECONDS_BUCKETS) + 1)
        self.count = 0
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        self._counts[bisect_left(JOB_SECONDS_BUCKETS, seconds)] += 1
        self.count += 1
        self.sum += seconds

    def snapshot(self) -> dict[str, Any]:
        """``{"buckets": [[upper bound, cumulative count], ...], "count": n, "sum": s}``
        (the last bound is ``"+Inf"``)."""
        cumulative, buckets = 0, []
        for bound, count in zip([*JOB_SECONDS_BUCKETS, "+Inf"], self._counts, strict=True):
            cumulative += count
            buckets.append([bound, cumulative])
        return {"buckets": buckets, "count": self.count, "sum": self.sum}
