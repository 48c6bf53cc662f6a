"""Load or recompute: a block only a slow tier holds is better recomputed than promoted.

A promotion is worth it only if the block reaches the primary tier sooner than the model
would recompute it. Per secondary tier, `RecomputeGate` measures how long its promotions
take (from the lookup that queues one to its blocks being loadable, smoothed over the last
few) and how many blocks it loads per second of busy time (`tiering.stats.ServiceRate`).
For the next block of a request's run of ``n`` blocks on that tier it estimates

    load_s = promotion_s + ahead / blocks_per_s

where ``ahead`` counts the other requests' blocks in flight or queued there, and declines
the block when ``load_s`` exceeds ``n * tokens_per_block / recompute_tokens_per_s``, the
time to recompute the run. A declined block is a miss: the scheduler recomputes it (and
the rest of the prefix). Before a tier's first promotion nothing is declined. While a tier
is declining, one block every `trial_interval_s` is a trial: it is promoted in the
background, so that a tier that recovered is measured again, while its request is answered
a miss and recomputes, so that no request waits on a tier found slow.

Thread: the scheduler thread only.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Literal

from tiering.stats import ServiceRate

_WEIGHT = 0.5  # of the latest promotion in the smoothed duration

Decision = Literal["load", "trial", "decline"]
"""``load``: promote the block for the request; ``trial``: promote it in the background and
answer the request a miss; ``decline``: a miss, nothing promoted."""


class RecomputeGate:
    """Whether promotions from one secondary tier are faster than recomputing."""

    def __init__(
        self,
        recompute_tokens_per_s: float | None,
        tokens_per_block: int | None,
        trial_interval_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        """
        Args:
            recompute_tokens_per_s: the model's prefill rate, prompt tokens per second;
                None: never decline.
            tokens_per_block: tokens per block; None: never decline.
            trial_interval_s: while declining, promote one block in the background this
                often, seconds.
            clock: seconds, monotonic (tests pass their own).
        """
        self._seconds_per_block = (
            tokens_per_block / recompute_tokens_per_s if recompute_tokens_per_s and tokens_per_block else None
        )
        self._service = ServiceRate(clock)  # blocks promoted per busy second
        self._promotion_s: float | None = None  # smoothed duration of a promotion
        self._queued = 0  # blocks queued this step, not submitted yet
        self._trial_interval_s = trial_interval_s
        self._last_trial = -float("inf")
        self._clock = clock
        self.declined = 0

    def decide(self, run_blocks: int) -> Decision:
        """What to do with the next block of a request's run on this tier: `run_blocks`
        blocks of that request are queued on it this step, this one included. A trial and
        a decline are counted in `declined` (the request recomputes the block either way)."""
        if self._seconds_per_block is None or self._promotion_s is None:
            return "load"
        ahead = self._service.in_flight + self._queued - (run_blocks - 1)
        load_s = self._promotion_s + (self._service.seconds_for(max(0, ahead)) or 0.0)
        if load_s <= run_blocks * self._seconds_per_block:
            return "load"
        self.declined += 1
        now = self._clock()
        if now - self._last_trial >= self._trial_interval_s:
            self._last_trial = now
            return "trial"
        return "decline"

    def queued(self, blocks: int = 1) -> None:
        """`blocks` were queued for promotion from this tier (negative: dropped)."""
        self._queued += blocks

    def submitted(self, blocks: int) -> None:
        """Queued blocks went out as a load job."""
        self._queued -= blocks
        self._service.started(blocks)

    def finished(self, blocks: int, success: bool, seconds: float) -> None:
        """A load job of `blocks` was reported, `seconds` after its first block was queued."""
        self._service.finished(blocks, done=success)
        if success:
            last = self._promotion_s
            self._promotion_s = seconds if last is None else last + _WEIGHT * (seconds - last)
