"""`TierHealth`: a circuit breaker over a tier's I/O outcomes (scheduler thread only).

Healthy: I/O flows. After `failure_threshold` consecutive failed operations the tier turns
unhealthy for `backoff_s` seconds: no I/O is sent, lookups miss, jobs fail fast. When the
backoff has passed, one ping (one small request, `BlockStore.ping`) is sent; success makes the tier
healthy again, failure doubles the backoff, up to `max_backoff_s`. That ceiling bounds how
long a backend that came back stays unused, so it is seconds (5 by default), not tens: a
ping every few seconds is no load for a backend, even from many engines. Log lines: one per
state change, never one per block; pings that keep failing are summed up once a minute.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable

from tiering.stats import Every

logger = logging.getLogger(__name__)

SUMMARY_INTERVAL_S = 60.0
"""At most one WARNING line per tier and interval while its pings keep failing."""


class HealthState(enum.Enum):
    HEALTHY = "healthy"
    UNHEALTHY = "unhealthy"
    PROBING = "probing"


class TierHealth:
    """Consecutive-failure breaker with exponential backoff.

    Attributes:
        state: the `HealthState`.
    """

    def __init__(
        self,
        name: str,
        failure_threshold: int = 5,
        backoff_s: float = 1.0,
        max_backoff_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        """
        Raises:
            ValueError: `failure_threshold` < 1 or a backoff is not positive.
        """
        if failure_threshold < 1 or backoff_s <= 0 or max_backoff_s < backoff_s:
            raise ValueError(
                f"need failure_threshold >= 1 and 0 < backoff_s <= max_backoff_s, "
                f"got {failure_threshold}, {backoff_s}, {max_backoff_s}"
            )
        self.name = name
        self.failure_threshold = failure_threshold
        self.initial_backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self._clock = clock
        self.state = HealthState.HEALTHY
        self.consecutive_failures = 0
        self.backoff_s = backoff_s
        self._retry_at = 0.0
        self._unhealthy = Every(SUMMARY_INTERVAL_S, clock)  # since the tier turned unhealthy
        self._failed_pings = 0

    @property
    def healthy(self) -> bool:
        """True while I/O may be sent (HEALTHY); False while paused or probing."""
        return self.state is HealthState.HEALTHY

    def record(self, successes: int, failures: int) -> None:
        """Count the outcomes of one finished batch of operations; may trip the breaker.

        A batch with any success shows the backend alive and resets the count, whatever
        else failed in it: only batches that fail entirely add up.
        """
        if successes:
            self.consecutive_failures = 0
        else:
            self.consecutive_failures += failures
        if self.healthy and self.consecutive_failures >= self.failure_threshold:
            self._pause(f"{self.consecutive_failures} consecutive failures")

    def trip(self, reason: str) -> None:
        """Turn unhealthy now, whatever the count (a call that never returned)."""
        if self.healthy:
            self.consecutive_failures = max(self.consecutive_failures, self.failure_threshold)
            self._pause(reason)

    def ping_due(self) -> bool:
        """True once per backoff period when a ping should be sent (the state becomes PROBING)."""
        if self.state is HealthState.UNHEALTHY and self._clock() >= self._retry_at:
            self.state = HealthState.PROBING
            return True
        return False

    def ping_result(self, ok: bool) -> None:
        """Apply the outcome of the ping sent after `ping_due`."""
        if ok:
            logger.warning("tier %s recovered after %.1f s; resuming I/O", self.name, self._unhealthy.elapsed())
            self.state = HealthState.HEALTHY
            self.consecutive_failures = 0
            self.backoff_s = self.initial_backoff_s
            return
        self.backoff_s = min(self.backoff_s * 2, self.max_backoff_s)
        self._failed_pings += 1
        self.state = HealthState.UNHEALTHY
        self._retry_at = self._clock() + self.backoff_s
        logger.log(
            logging.WARNING if self._unhealthy.due() else logging.DEBUG,
            "tier %s still unhealthy after %.0f s (%d pings failed); next ping in %.1f s",
            self.name,
            self._unhealthy.elapsed(),
            self._failed_pings,
            self.backoff_s,
        )

    def _pause(self, reason: str) -> None:
        logger.warning("tier %s unhealthy (%s); no I/O for %.1f s", self.name, reason, self.backoff_s)
        self.state = HealthState.UNHEALTHY
        self._unhealthy = Every(SUMMARY_INTERVAL_S, self._clock)
        self._failed_pings = 0
        self._retry_at = self._unhealthy.start + self.backoff_s
