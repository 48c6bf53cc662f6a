"""Statistics of the engine: every `get_stats()` returns a `TierStats`-shaped dict.

``{"counters": {...}, "gauges": {...}, "histograms": {...}}``: counters only grow, gauges
are current values, and each histogram (seconds) is a `Histogram.snapshot()`: cumulative
counts per upper bound, Prometheus style. Everything is plain ints, floats, bools and
strings, so a snapshot can be handed to another thread or dumped as JSON. The shape of each
part is documented in docs/observability.md.

Thread: the scheduler thread only (the classes here are not locked).
"""

from __future__ import annotations

import logging
import time
from bisect import bisect_left
from collections.abc import Callable
from typing import Any

_RATE_HALF_LIFE_S = 1.0  # busy seconds over which a measured service rate halves its memory
SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

TierStats = dict[str, Any]


LookupCounts = dict[bool | None, int]
"""A tier's lookups by answer (True, False, None: ask again), counted on the hot path as
``counts[answer] += 1``."""


def new_lookup_counts() -> LookupCounts:
    """Lookup counts at zero."""
    return {True: 0, False: 0, None: 0}


def lookup_counters(counts: LookupCounts) -> dict[str, int]:
    """A tier's lookup counters: ``lookups`` (calls), ``hits``, ``misses`` and
    ``lookups_deferred`` (answered None)."""
    return {
        "lookups": sum(counts.values()),
        "hits": counts[True],
        "misses": counts[False],
        "lookups_deferred": counts[None],
    }


def worth_logging(count: int) -> bool:
    """Whether the `count`-th occurrence of something (from 1) deserves a log line: the 1st,
    2nd, 4th, 8th, ...: a trace of every kind of event, never a flood."""
    return count & (count - 1) == 0


class RareLog:
    """Warnings of one kind that a client can provoke (a malformed hint, a bad
    ``kv_load_tiers``), logged at their 1st, 2nd, 4th, 8th ... occurrence (`worth_logging`)
    with the count so far: whatever one client sends, the log grows with its logarithm, and
    the scheduler thread formats a line for a few requests only. One per kind and owner (a
    manager); one thread at a time.

    Attributes:
        count: occurrences so far.
    """

    def __init__(self) -> None:
        self.count = 0

    def warning(self, logger: logging.Logger, message: str, *args: object) -> None:
        """Count one occurrence; log `message` % `args` with the count where it is worth a line."""
        self.count += 1
        if worth_logging(self.count):
            logger.warning(f"{message} ({self.count:,} so far; logged at the 1st, 2nd, 4th, 8th ...)", *args)


class Every:
    """Says when `seconds` have passed since it last said so (or since it was made; with
    `at_once`, also the first time it is asked): for log lines at most once an interval.
    One thread at a time.

    Attributes:
        start: when it was made, in `clock` seconds.
    """

    def __init__(self, seconds: float, clock: Callable[[], float] = time.monotonic, at_once: bool = False):
        self.seconds, self._clock = seconds, clock
        self.start = clock()
        self._next = self.start if at_once else self.start + seconds

    def due(self) -> bool:
        """True if the interval has passed (and the next one starts now)."""
        now = self._clock()
        if now < self._next:
            return False
        self._next = now + self.seconds
        return True

    def elapsed(self) -> float:
        """Seconds since `start`."""
        return self._clock() - self.start


class Histogram:
    """Counts of observed durations (seconds) per bucket of `SECONDS_BUCKETS`."""

    __slots__ = ("_counts", "count", "sum")

    def __init__(self) -> None:
        self._counts = [0] * (len(SECONDS_BUCKETS) + 1)
        self.count = 0
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        """Count one duration, in seconds (>= 0)."""
        self._counts[bisect_left(SECONDS_BUCKETS, seconds)] += 1
        self.count += 1
        self.sum += seconds

    def snapshot(self) -> dict[str, Any]:
        """``{"buckets": [[upper bound, cumulative count], ...], "count": n, "sum": s}``
        (the last bound is ``"+Inf"``)."""
        cumulative, buckets = 0, []
        for bound, count in zip([*SECONDS_BUCKETS, "+Inf"], self._counts, strict=True):
            cumulative += count
            buckets.append([bound, cumulative])
        return {"buckets": buckets, "count": self.count, "sum": self.sum}


class JobTimer:
    """Durations and busy time of one kind of job (a tier's stores, say), from submission to
    the end of its I/O.

    `busy_s` is the time, in seconds, during which at least one such job was in flight: the
    tier's bytes over it are its throughput while it worked, not over a mostly idle run.
    """

    __slots__ = ("_busy_since", "_last_end", "_started", "busy_s", "seconds")

    def __init__(self) -> None:
        self.seconds = Histogram()
        self.busy_s = 0.0
        self._started: dict[int, float] = {}
        self._busy_since = 0.0
        self._last_end = 0.0

    def __len__(self) -> int:
        """Jobs started and not finished."""
        return len(self._started)

    def start(self, job_id: int) -> None:
        """Note that job `job_id` was submitted now (a busy stretch begins if none was)."""
        now = time.perf_counter()
        if not self._started:
            self._busy_since = now
        self._started[job_id] = now

    def finish(self, job_id: int, ended: float) -> None:
        """Observe the job's duration, up to `ended` (perf_counter seconds: when its I/O
        ended, which may be before the scheduler hears of it). A job not started here is
        ignored."""
        started = self._started.pop(job_id, None)
        if started is None:
            return
        ended = max(ended, started)
        self.seconds.observe(ended - started)
        self._last_end = max(self._last_end, ended)
        if not self._started:
            self.busy_s += self._last_end - self._busy_since

    def busy_seconds(self) -> float:
        """`busy_s`, the current busy stretch included."""
        return self.busy_s + (time.perf_counter() - self._busy_since if self._started else 0.0)


class ServiceRate:
    """How fast a tier finishes work: units (blocks, rows) per second of busy time,
    smoothed over about a second of busy time, and the units in flight now.

    Busy time is time with something in flight; idle time is never counted, so a tier that
    is rarely used keeps its last rate.
    """

    __slots__ = ("_clock", "_last", "in_flight", "rate")

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        """`clock`: seconds, monotonic (tests pass their own)."""
        self._clock = clock
        self._last = clock()
        self.in_flight = 0
        self.rate = 0.0  # units per busy second; 0: not measured yet

    def started(self, units: int) -> None:
        """`units` more are in flight."""
        self._account()
        self.in_flight += units

    def finished(self, units: int, done: bool = True) -> None:
        """`units` in flight ended; they count towards the rate if `done` (a failure did no
        work worth measuring)."""
        self._account(units if done else 0)
        self.in_flight -= units

    def seconds_for(self, units: float) -> float | None:
        """Seconds `units` would take at the measured rate (None: no rate yet)."""
        return units / self.rate if self.rate else None

    def _account(self, finished: int = 0) -> None:
        """Fold the time since the last event into the rate: busy time if units were in
        flight, and the units that finished in it."""
        now = self._clock()
        elapsed, self._last = now - self._last, now
        if self.in_flight <= 0 or elapsed <= 0:
            return
        sample = finished / elapsed
        weight = 1.0 - 0.5 ** (elapsed / _RATE_HALF_LIFE_S)
        self.rate = sample if not self.rate else self.rate + weight * (sample - self.rate)
