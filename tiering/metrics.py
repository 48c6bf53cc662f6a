"""A Prometheus exporter of the engine's stats (needs the ``metrics`` extra: prometheus_client).

The exporter never reads the engine from its HTTP thread: the manager hands it a snapshot
from `on_schedule_end`, on the scheduler thread, at most once per interval
(`TieringOffloadingManager.add_stats_listener`), and a scrape serves the latest one.

Metrics, labelled by ``tier`` (``cpu`` for the primary tier, else the tier's name):
``tiering_tier_<counter>_total`` for each counter (``tiering_tier_hits_total``,
``..._bytes_stored_total``, ...), ``tiering_tier_failures_total{reason=...}``, gauges
``tiering_tier_blocks``, ``tiering_tier_bytes``, ``tiering_tier_capacity_bytes``,
``tiering_tier_jobs_in_flight``, ``tiering_tier_healthy`` (1 or 0), the histogram
``tiering_tier_job_duration_seconds``, and the manager's ``tiering_manager_*``. Every
metric also carries the exporter's constant labels (the engine's ``instance`` and ``model``
when the spec starts it). Counters end in ``_total``; every HELP text says what is counted.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric


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
        tiers = {"cpu": snapshot["primary"], **snapshot["tiers"]}
        constant = self._exporter.labels
        yield from _tier_metrics(tiers, constant)
        for name, value in snapshot["manager"].items():
            kind = CounterMetricFamily if name.endswith("_submitted") else GaugeMetricFamily
            family = kind(f"tiering_manager_{name}", _help(name), labels=list(constant))
            family.add_metric(list(constant.values()), value)
            yield family


HELP = {
    "lookups": "Lookups answered by this tier, every retry of a request included.",
    "hits": "Lookups this tier answered 'loadable now'.",
    "misses": "Lookups this tier answered 'not here'.",
    "lookups_deferred": "Lookups answered 'in flight, ask again next step' (a store or probe pending).",
    "blocks_stored": "Blocks this tier finished storing (the CPU tier: GPU stores into it).",
    "bytes_stored": "Bytes of the blocks this tier finished storing, headers included.",
    "blocks_loaded": "Blocks loaded from this tier (the CPU tier: loads into the GPU).",
    "bytes_loaded": "Bytes of the blocks loaded from this tier, headers included.",
    "blocks_read_by_tiers": "CPU-tier blocks read by secondary tiers (cascades).",
    "blocks_promoted": "Blocks promoted into the CPU tier from a secondary tier.",
    "promotions_refused": "Promotions the CPU tier refused for lack of an evictable row.",
    "stores_refused": "GPU stores the CPU tier refused for lack of an evictable row.",
    "blocks_store_failed": "GPU stores into the CPU tier reported as failed.",
    "evictions": "Blocks evicted to make room.",
    "jobs_succeeded": "Store and load jobs that moved every block.",
    "jobs_failed": "Store and load jobs that failed (some block was not moved).",
    "cascades_admitted": "Blocks admitted for copying to this tier.",
    "cascades_dropped": "Blocks not copied to this tier: over its pinned-row bound, or while it was behind.",
    "cascades_filtered": "Blocks not copied to this tier: stored fewer than min_reuse times.",
    "blocks": "Blocks held (or being stored) now.",
    "bytes": "Bytes held (or being stored) now, headers included.",
    "capacity_bytes": "The configured capacity in bytes.",
    "room_bytes": "While the device is full: the bytes it was found to hold.",
    "jobs_in_flight": "Jobs submitted and not reported yet.",
    "healthy": "1 while I/O flows, 0 while the tier's circuit breaker is open.",
    "rows_in_flight": "CPU-tier rows pinned by this tier's unreported cascades.",
    "rows_quarantined": "CPU-tier rows kept out of use behind an I/O that has not returned.",
    "promotions_submitted": "Load jobs submitted to secondary tiers (one per tier and request and step).",
    "cascades_submitted": "Store jobs submitted to secondary tiers.",
    "jobs_holding_rows": "Failed jobs whose timed-out I/O may still use their rows.",
    "promotions_queued": "Blocks queued for promotion at the end of this step.",
}


def _help(name: str) -> str:
    return HELP.get(name, f"{name.replace('_', ' ')} (see get_stats())")


def _tier_metrics(tiers: dict[str, dict[str, Any]], constant: dict[str, str]) -> Iterator[Metric]:
    names, values = [*constant, "tier"], list(constant.values())
    counters: dict[str, CounterMetricFamily] = {}
    gauges: dict[str, GaugeMetricFamily] = {}
    failures = CounterMetricFamily(
        "tiering_tier_failures", "Failed store calls by reason (store, load_corrupt, ...).", labels=[*names, "reason"]
    )
    durations = HistogramMetricFamily(
        "tiering_tier_job_duration_seconds", "Seconds from a job's submission to its report.", labels=names
    )
    for tier, stats in tiers.items():
        labels = [*values, tier]
        for name, value in stats.get("counters", {}).items():
            if name == "failures":
                for reason, count in value.items():
                    failures.add_metric([*labels, reason], count)
                continue
            family = counters.setdefault(name, CounterMetricFamily(f"tiering_tier_{name}", _help(name), labels=names))
            family.add_metric(labels, value)
        for name, value in stats.get("gauges", {}).items():
            if isinstance(value, bool):
                value = int(value)
            if not isinstance(value, int | float):
                continue  # a state name; `healthy` carries it as a number
            gauge = gauges.setdefault(name, GaugeMetricFamily(f"tiering_tier_{name}", _help(name), labels=names))
            gauge.add_metric(labels, value)
        histogram = stats.get("job_seconds")
        if histogram:
            buckets = [(str(bound), count) for bound, count in histogram["buckets"]]
            durations.add_metric(labels, buckets=buckets, sum_value=histogram["sum"])
    yield from counters.values()
    yield from gauges.values()
    yield failures
    yield durations
