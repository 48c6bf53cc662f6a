"""A Prometheus exporter of the engine's stats (needs the ``metrics`` extra: prometheus_client).

The exporter never reads the engine from its HTTP thread: the manager hands it a snapshot
from `on_schedule_end`, on the scheduler thread, at most once per interval
(`TieringOffloadingManager.add_stats_listener`), and a scrape serves the latest one.

Each tier's stats become ``tiering_tier_<name>`` labelled ``tier`` (``cpu`` for the primary
tier, else the tier's name), the manager's become ``tiering_manager_<name>``: counters as
``..._total`` (a counter of counts by reason, ``failures``, gets a ``reason`` label), gauges
as they are, histograms (seconds) as Prometheus histograms. Every metric also carries the
exporter's constant labels (the engine's ``instance`` and ``model`` when the spec starts it),
and every HELP text says what is counted (`HELP`; docs/observability.md lists them all).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from tiering.cpu.refusals import REFUSAL_REASONS
from tiering.tiers.context import PRIMARY_NAME


class PrometheusExporter:
    """Serves ``/metrics`` on `address`:`port` (loopback by default) in a daemon thread."""

    def __init__(self, port: int, address: str = "127.0.0.1", labels: dict[str, str] | None = None):
        """
        Args:
            port: TCP port; 0 picks a free one (see `port`).
            address: the interface to listen on.
            labels: constant labels of every metric, for example ``{"instance": ...,
                "model": ...}``.

        Raises:
            OSError: the address or port cannot be bound.
        """
        self._snapshot: dict[str, Any] | None = None
        self.labels = dict(labels or {})
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_SnapshotCollector(self))
        self._server, self._thread = start_http_server(port, addr=address, registry=self.registry)

    @property
    def port(self) -> int:
        """The port it listens on."""
        return self._server.server_port

    def publish(self, stats: dict[str, Any]) -> None:
        """Serve `stats` (a `TieringOffloadingManager.get_stats()` snapshot) from now on; any
        thread (a reference swap)."""
        self._snapshot = stats

    def attach(self, manager: Any, interval_s: float = 1.0) -> None:
        """Publish `manager`'s stats now and then every `interval_s` seconds (scheduler thread)."""
        self.publish(manager.get_stats())
        manager.add_stats_listener(self.publish, interval_s)

    def close(self) -> None:
        """Stop serving and join the server thread. Safe to call more than once."""
        if self._thread.is_alive():
            self._server.shutdown()
            self._server.server_close()
            self._thread.join(5)


class _SnapshotCollector:
    def __init__(self, exporter: PrometheusExporter):
        self._exporter = exporter

    def collect(self) -> Iterator[Metric]:
        snapshot = self._exporter._snapshot
        if snapshot is None:
            return
        constant = self._exporter.labels
        tiers = {PRIMARY_NAME: snapshot["primary"], **snapshot["tiers"]}
        yield from _families("tiering_tier_", tiers, constant, "tier")
        yield from _families("tiering_manager_", {"": snapshot["manager"]}, constant, None)
        yield from _families("tiering_tenant_", snapshot.get("tenants", {}), constant, "tenant")


HELP = {
    "lookups": "Lookup calls answered by this tier, every repeat of a request's lookup included.",
    "hits": "Lookup calls this tier answered 'loadable now' (for hit rates use hit_tokens).",
    "misses": "Lookup calls this tier answered 'not here'.",
    "lookups_deferred": "Lookup calls answered 'in flight, ask again next step' (a store or probe pending).",
    "hit_blocks": "Blocks requests found, once per block per request, by the tier that supplied them.",
    "hit_tokens": "Tokens of the blocks requests found (hit_blocks times the tokens per block).",
    "blocks_stored": "Blocks this tier finished storing (the CPU tier: GPU stores into it).",
    "bytes_stored": "Bytes of the blocks this tier finished storing (secondary tiers: headers included).",
    "blocks_loaded": "Blocks loaded from this tier (the CPU tier: loads into the GPU).",
    "bytes_loaded": "Bytes of the blocks loaded from this tier (secondary tiers: headers included).",
    "found_blocks_loaded": "Blocks loaded that this tier found in its store (recovered at start, or by a probe: "
    "stored by another engine, or before a restart) instead of storing them itself.",
    "store_busy_seconds": "Seconds during which at least one store job of this tier was in flight.",
    "load_busy_seconds": "Seconds during which at least one load job of this tier was in flight.",
    "blocks_read_by_tiers": "CPU-tier blocks read by secondary tiers (cascades).",
    "blocks_promoted": "Blocks promoted into the CPU tier from a secondary tier.",
    "blocks_adopted": "Blocks a crash-surviving CPU tier adopted at start from its dead engine's region (cpu_tier).",
    "blocks_sealed": "Blocks a crash-surviving CPU tier stored and hashed since start: adoptable after a crash.",
    "promotions_refused": f"Promotions the CPU tier refused, by reason ({', '.join(REFUSAL_REASONS)}).",
    "stores_refused": f"GPU stores the CPU tier refused, by reason ({', '.join(REFUSAL_REASONS)}).",
    "blocks_store_failed": "Writes into CPU-tier rows (GPU stores, promotions) that failed.",
    "evictions": "Blocks evicted to make room.",
    "index_forgotten": "Keys a tier whose store evicts by itself forgot beyond index_max_blocks (objects kept).",
    "jobs_succeeded": "Store and load jobs that moved every block.",
    "jobs_failed": "Store and load jobs that failed (some block was not moved).",
    "failures": "Failed store calls by reason (store, load_corrupt, ...).",
    "cascades_admitted": "Blocks admitted for copying to this tier.",
    "cascades_deferred": "Blocks over this tier's pinned-row bound, made to wait for room.",
    "cascades_dropped": "Blocks not copied to this tier: it was behind, or they waited in vain (evicted first).",
    "cascades_filtered": "Blocks not copied to this tier: stored fewer than min_reuse times.",
    "cascades_retained": "Blocks copied to this tier past its admission: retained for retained_write_s or more.",
    "promotions_declined": "Promotions from this tier declined: recomputing was faster (recompute_tokens_per_s).",
    "blocks": "Blocks held (or being stored) now.",
    "share_blocks": "CPU-tier rows this tenant may hold while others need them (tenants config).",
    "bytes": "Bytes held (or being stored) now, headers included.",
    "capacity_blocks": "The CPU tier's rows.",
    "capacity_bytes": "The configured capacity in bytes.",
    "room_bytes": "While the device is full: the bytes it was found to hold.",
    "jobs_in_flight": "Jobs submitted and not reported yet.",
    "probe_answers": "Existence probes in flight and absences remembered (at most 65,536; the oldest go first).",
    "healthy": "1 while I/O flows, 0 while the tier's circuit breaker is open.",
    "recovering": "1 while a tier lists or indexes the blocks its store held at start (lookups miss them until then).",
    "loop_alive": "1 while the tier's event loop thread runs; 0 once it died (the log says why): the tier misses.",
    "rows_reading": "CPU-tier rows pinned by readers now (GPU loads and cascades in flight).",
    "rows_writing": "CPU-tier rows reserved for writes in flight now (GPU stores and promotions).",
    "rows_in_flight": "CPU-tier rows pinned by this tier's unreported cascades.",
    "cascades_waiting": "Blocks waiting for room under this tier's pinned-row bound (cascades_deferred).",
    "rows_quarantined": "CPU-tier rows kept out of use behind an I/O that has not returned.",
    "retained_blocks": "Blocks under a deadline from a request's hint (at most retention_max_fraction of the tier).",
    "events_dropped": "Blocks of KV events a tier dropped because nobody took them (past MAX_EVENT_BLOCKS).",
    "records_rewritten": "Records (manifest, versions) unreadable, foreign or under an older key, written again.",
    "retentions": "Blocks given a retention deadline by a request's hint.",
    "retentions_expired": "Retention deadlines that passed: the block is ordinary again.",
    "retentions_released": "Blocks a request's release hint made go first at the next evictions.",
    "retentions_dropped": "Retention deadlines dropped early: past retention_max_fraction, or no other block to evict.",
    "store_seconds": "Seconds from a store job's submission to the end of its I/O.",
    "load_seconds": "Seconds from a load job's submission to the end of its I/O.",
    "requested_blocks": "Blocks of requests the engine saw (looked up, or stored after a miss), once per request.",
    "requested_tokens": "Tokens of the requested blocks (requested_blocks times the tokens per block).",
    "lookups_repeated": "Further lookups of a block a request had already asked about (retries after 'in flight').",
    "requests_open": "Requests that looked up or stored blocks and are not reported finished yet (at most 4,096).",
    "hit_blocks_by_group": "Blocks of requests found by the engine, once per request, by KV-cache group index.",
    "hits_ended_by_group": (
        "Blocks of requests whose first lookup missed, once per request, by KV-cache group index: "
        "each ends the request's hit in that group."
    ),
    "promotions_submitted": "Load jobs submitted to secondary tiers (one per tier and request and step).",
    "promotions_deferred": (
        "Lookups answered 'ask again next step': a promotion would have left fewer than store_reserve_rows "
        "rows for stores, or promotions held max_promotion_rows."
    ),
    "promotions_overdue": (
        "Lookups answered 'miss' for a block whose promotion was pending longer than a load waits "
        "(PROMOTION_WAIT_S, a frozen or slow tier): the request recomputes it."
    ),
    "cascades_submitted": "Store jobs submitted to secondary tiers.",
    "jobs_expired": "Jobs a secondary tier did not report within job_deadline_s, failed by the manager.",
    "jobs_holding_rows": "Failed jobs whose timed-out I/O may still use their rows.",
    "promotions_queued": "Blocks queued for promotion at the end of this step.",
    "promotion_rows": "CPU-tier rows reserved by promotions queued or in flight.",
    "promotion_seconds": "Seconds from the lookup that queued a promotion to its blocks being loadable.",
}


_DICT_LABELS = {
    "hit_blocks_by_group": "group",
    "hits_ended_by_group": "group",
}  # the label of a counter kept by key; "reason" otherwise


def _help(name: str) -> str:
    return HELP.get(name, f"{name.replace('_', ' ')} (see get_stats())")


def _families(
    prefix: str, parts: dict[str, dict[str, Any]], constant: dict[str, str], label: str | None
) -> Iterator[Metric]:
    """One family per name across `parts` (a tier's stats by tier name, labelled `label`)."""
    names = [*constant, label] if label else list(constant)
    families: dict[str, Metric] = {}

    def family(kind: type, name: str, extra: tuple[str, ...] = ()) -> Any:
        if name not in families:
            families[name] = kind(f"{prefix}{name}", _help(name), labels=[*names, *extra])
        return families[name]

    for part, stats in parts.items():
        labels = [*constant.values(), part] if label else list(constant.values())
        for name, value in stats.get("counters", {}).items():
            if isinstance(value, dict):
                for reason, count in value.items():
                    label_name = _DICT_LABELS.get(name, "reason")
                    family(CounterMetricFamily, name, (label_name,)).add_metric([*labels, reason], count)
            else:
                family(CounterMetricFamily, name).add_metric(labels, value)
        for name, value in stats.get("gauges", {}).items():
            if isinstance(value, bool | int | float):  # a state name is carried by `healthy`
                family(GaugeMetricFamily, name).add_metric(labels, int(value) if isinstance(value, bool) else value)
        for name, histogram in stats.get("histograms", {}).items():
            buckets = [(str(bound), count) for bound, count in histogram["buckets"]]
            family(HistogramMetricFamily, name).add_metric(labels, buckets=buckets, sum_value=histogram["sum"])
    yield from families.values()
