"""`TierCounters`: what a block-store tier counts, and its `get_stats` snapshot.

Thread: the scheduler thread only (owned by `BlockStoreTier`).
"""

from __future__ import annotations

import logging
from collections import Counter

from tiering.stats import Every, JobTimer, TierStats, lookup_counters, new_lookup_counts, worth_logging
from tiering.tiers.blockstore import outbox
from tiering.tiers.blockstore.health import TierHealth
from tiering.tiers.blockstore.index import BlockIndex

logger = logging.getLogger(__name__)

COUNTERS = (
    "blocks_stored",
    "bytes_stored",
    "blocks_loaded",
    "bytes_loaded",
    "found_blocks_loaded",
    "jobs_succeeded",
    "jobs_failed",
)
FORGED_LOG_INTERVAL_S = 60.0  # a block whose seal does not open is logged at most this often per tier


class TierCounters:
    """The counts of tier `name`: `lookups` by answer, `counts` (`COUNTERS`), `failures` of
    store calls by reason, and the durations of its store and load jobs (`stores`, `loads`)."""

    def __init__(self, name: str):
        self.name = name
        self.lookups = new_lookup_counts()
        self.counts: Counter[str] = Counter()
        self.failures: Counter[str] = Counter(dict.fromkeys(outbox.FAILURE_REASONS, 0))  # served at zero
        self.stores, self.loads = JobTimer(), JobTimer()
        self._forged_log = Every(FORGED_LOG_INTERVAL_S, at_once=True)

    def failed(self, outcome: outbox.Outcome) -> None:
        """Count the outcome's failed calls by reason; log a trace of them (a forged block
        once a minute: each names its block)."""
        for reason, error in outcome.failures:
            count = self.failures[reason] = self.failures[reason] + 1
            if reason == "load_forged":
                if self._forged_log.due():
                    logger.warning("tier %s: not loaded, seal does not open (%d so far): %s", self.name, count, error)
            elif worth_logging(count):
                logger.warning("tier %s: %s failed (%d so far): %r", self.name, reason, count, error)

    def snapshot(
        self,
        index: BlockIndex,
        probe_answers: int,
        health: TierHealth,
        loop_alive: bool,
        recovering: bool,
        records_rewritten: int = 0,
    ) -> TierStats:
        """See `BlockStoreTier.get_stats`; `records_rewritten`: `Records.rewritten`."""
        retention = index.retention
        counters = {
            **lookup_counters(self.lookups),
            **{name: self.counts[name] for name in COUNTERS},
            "store_busy_seconds": self.stores.busy_seconds(),
            "load_busy_seconds": self.loads.busy_seconds(),
            "evictions": index.evictions,
            "index_forgotten": index.forgotten,
            "events_dropped": index.events.dropped if index.events is not None else 0,
            "records_rewritten": records_rewritten,
            "failures": dict(self.failures),
            **(retention.counters if retention is not None else {}),
        }
        gauges = {
            "blocks": len(index),
            "retained_blocks": len(retention) if retention is not None else 0,
            "bytes": index.used_bytes,
            "capacity_bytes": index.capacity_bytes,
            "room_bytes": index.room_bytes,
            "jobs_in_flight": len(self.stores) + len(self.loads),
            "probe_answers": probe_answers,
            "healthy": health.healthy,
            "loop_alive": loop_alive,
            "recovering": recovering,
            "state": health.state.value,
        }
        histograms = {"store_seconds": self.stores.seconds.snapshot(), "load_seconds": self.loads.seconds.snapshot()}
        return {"counters": counters, "gauges": gauges, "histograms": histograms}
