"""A Prometheus exporter of the engine's stats (needs the ``metrics`` extra: prometheus_client).

The exporter never reads the engine from its HTTP thread: the manager hands it a snapshot
from `on_schedule_end`, on the scheduler thread, at most once per interval
(`TieringOffloadingManager.add_stats_listener`), and a scrape serves the latest one.

Metrics, labelled by ``tier`` (``cpu`` for the primary tier, else the tier's name):
``tiering_tier_<counter>_total`` for each counter (``tiering_tier_hits_total``,
``..._bytes_stored_total``, ...), ``tiering_tier_failures_total{reason=...}``, gauges
``tiering_tier_blocks``, ``tiering_tier_bytes``, ``tiering_tier_capacity_bytes``,
``tiering_tier_jobs_in_flight``, ``tiering_tier_healthy`` (1 or 0), the histogram
``tiering_tier_job_duration_seconds``, and the manager's ``tiering_manager_*``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric


class PrometheusExporter:
    """Serves ``/metrics`` on `address`:`port` (loopback by default) in a daemon thread."""

    def __init__(self, port: int, address: str = "127.0.0.1"):
        """
        Args:
            port: TCP port; 0 picks a free one (see `port`).
            address: the interface to listen on.

        Raises:
            OSError: the address or port cannot be bound.
        """
        self._snapshot: dict[str, Any] | None = None
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
        yield from _tier_metrics(tiers)
        for name, value in snapshot["manager"].items():
            kind = CounterMetricFamily if name.endswith("_submitted") else GaugeMetricFamily
            yield kind(f"tiering_manager_{name}", f"manager {name.replace('_', ' ')}", value=value)


def _tier_metrics(tiers: dict[str, dict[str, Any]]) -> Iterator[Metric]:
    counters: dict[str, CounterMetricFamily] = {}
    gauges: dict[str, GaugeMetricFamily] = {}
    failures = CounterMetricFamily("tiering_tier_failures", "failed operations by reason", labels=["tier", "reason"])
    durations = HistogramMetricFamily("tiering_tier_job_duration_seconds", "job duration", labels=["tier"])
    for tier, stats in tiers.items():
        for name, value in stats.get("counters", {}).items():
            if name == "failures":
                for reason, count in value.items():
                    failures.add_metric([tier, reason], count)
                continue
            family = counters.setdefault(name, CounterMetricFamily(f"tiering_tier_{name}", name, labels=["tier"]))
            family.add_metric([tier], value)
        for name, value in stats.get("gauges", {}).items():
            if isinstance(value, bool):
                value = int(value)
            if not isinstance(value, int | float):
                continue  # a state name; `healthy` carries it as a number
            gauge = gauges.setdefault(name, GaugeMetricFamily(f"tiering_tier_{name}", name, labels=["tier"]))
            gauge.add_metric([tier], value)
        histogram = stats.get("job_seconds")
        if histogram:
            buckets = [(str(bound), count) for bound, count in histogram["buckets"]]
            durations.add_metric([tier], buckets=buckets, sum_value=histogram["sum"])
    yield from counters.values()
    yield from gauges.values()
    yield failures
    yield durations
