"""The engine's per-tier counts as vLLM connector stats, so vLLM's periodic log line and its
``/metrics`` show them next to vLLM's own ``vllm:kv_offload_*`` metrics (the ``vllm`` extra).

Each count is a vLLM counter labelled with the tier (``cpu`` and each secondary tier by
name); the CPU tier's refusals are labelled with their reason too
(`tiering.cpu.refusals.REFUSAL_REASONS`). The engine's own exporter (the ``metrics`` key)
remains the detailed view: every counter, gauge and histogram of docs/observability.md.

Thread: vLLM's scheduler thread.
"""

from __future__ import annotations

import time

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
from vllm.v1.kv_offload.base import OffloadingCounterMetadata

from tiering.engine.manager import TieringOffloadingManager
from tiering.tiers.context import PRIMARY_NAME

COUNTERS = {  # the engine's counter -> (vLLM's metric, what it counts)
    "hit_blocks": (
        "vllm:kv_tiering_hit_blocks",
        "Blocks of requests served by each tier, once per request and block (cpu: held by the CPU tier "
        "at the request's first lookup; a secondary tier: promoted from it).",
    ),
    "blocks_stored": (
        "vllm:kv_tiering_blocks_stored",
        "Blocks stored into each tier (cpu: from the GPU; a secondary tier: cascaded from the CPU tier).",
    ),
    "blocks_loaded": (
        "vllm:kv_tiering_blocks_loaded",
        "Blocks loaded from each tier (cpu: into the GPU; a secondary tier: promoted into the CPU tier).",
    ),
    "found_blocks_loaded": (
        "vllm:kv_tiering_found_blocks_loaded",
        "Blocks a secondary tier loaded that it found in its store (stored by another engine sharing it, or "
        "before a restart) instead of storing them itself.",
    ),
    "cascades_dropped": (
        "vllm:kv_tiering_cascades_dropped",
        "Blocks a secondary tier's admission control did not copy to it (over its pinned-row bound, "
        "or while the tier was behind).",
    ),
    "promotions_declined": (
        "vllm:kv_tiering_promotions_declined",
        "Blocks of a secondary tier recomputed instead: promoting them was slower (recompute_tokens_per_s).",
    ),
    "jobs_failed": ("vllm:kv_tiering_jobs_failed", "Store and load jobs of a secondary tier that failed."),
    "retentions": (
        "vllm:kv_tiering_retentions",
        "Blocks each tier gave a retention deadline for a request's hint (kv_transfer_params kv_tiering retain).",
    ),
    "stores_refused": (
        "vllm:kv_tiering_stores_refused",
        "GPU stores the CPU tier refused, by reason: rows_in_flight (every row it could free was held by a "
        "transfer), larger_than_tier or tenant_share (a tenant beyond its share found no row).",
    ),
    "promotions_refused": (
        "vllm:kv_tiering_promotions_refused",
        "Promotions the CPU tier refused, by reason: rows_in_flight (every row it could free was held by a "
        "transfer), larger_than_tier or tenant_share (a tenant beyond its share found no row).",
    ),
}
BY_REASON = frozenset({"stores_refused", "promotions_refused"})
"""Counters the engine counts by reason (a dict), labelled ``reason`` as well."""


def metric_definitions() -> dict[str, OffloadingCounterMetadata]:
    """vLLM's metric definitions of `COUNTERS` (for ``OffloadingSpec.build_metric_definitions``)."""
    return {
        metric: OffloadingCounterMetadata(documentation, ("tier", "reason") if name in BY_REASON else ("tier",))
        for name, (metric, documentation) in COUNTERS.items()
    }


class VllmStats:
    """What the engine counted since the last `take`, as vLLM's connector stats."""

    def __init__(self, manager: TieringOffloadingManager, interval_s: float = 1.0):
        """
        Args:
            manager: the engine whose `get_stats` is read.
            interval_s: read it at most this often, seconds (vLLM asks every step; the
                counts in between are carried to the next answer, none is lost).
        """
        self._manager = manager
        self._interval_s = interval_s
        self._due = 0.0
        self._reported: dict[tuple[str, ...], float] = {}  # (counter, tier[, reason]) -> value already reported

    def take(self) -> OffloadingConnectorStats | None:
        """The counts' increases since the last answer, or None: nothing new, or asked again
        within `interval_s`. Never raises for a tier's failure (`get_stats` guards them)."""
        now = time.monotonic()
        if now < self._due:
            return None
        self._due = now + self._interval_s
        stats = self._manager.get_stats()
        stats_out = OffloadingConnectorStats()
        for tier, part in {PRIMARY_NAME: stats["primary"], **stats["tiers"]}.items():
            counters = part.get("counters", {})
            for name, (metric, _) in COUNTERS.items():
                value = counters.get(name)
                by_label = {(tier, *labels): count for labels, count in _by_reason(value).items()}
                for labels, count in by_label.items():
                    if count > self._reported.get((name, *labels), 0):
                        stats_out.increase_counter(metric, count - self._reported.get((name, *labels), 0), labels)
                        self._reported[(name, *labels)] = count
        return None if stats_out.is_empty() else stats_out


def _by_reason(value: object) -> dict[tuple[str, ...], float]:
    """A counter's counts by its labels after the tier: ``(reason,)`` for a dict of counts by
    reason, ``()`` for a plain count; nothing for a counter a tier does not have."""
    if isinstance(value, dict):
        return {(reason,): count for reason, count in value.items()}
    return {(): value} if isinstance(value, int | float) else {}
