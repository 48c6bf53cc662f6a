"""The Prometheus exporter serves the expected metrics on 127.0.0.1."""

import urllib.request

import pytest

from tests.helpers import CTX, keys, region_name
from tiering import KVLayout, TieringOffloadingSpec, parse_config
from tiering.engine.metrics import PrometheusExporter


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        return response.read().decode()


def test_the_exporter_serves_tier_and_manager_metrics(engine_factory):
    engine = engine_factory({"type": "memory"})
    exporter = PrometheusExporter(0)
    try:
        assert scrape(exporter.port).strip() == ""  # nothing published yet
        engine.store(0, 1)
        engine.manager.lookup(keys(9)[0], CTX)
        exporter.attach(engine.manager)
        text = scrape(exporter.port)
    finally:
        exporter.close()
        exporter.close()
    for line in (
        'tiering_tier_blocks_stored_total{tier="memory"} 2.0',
        'tiering_tier_blocks_stored_total{tier="cpu"} 2.0',
        'tiering_tier_misses_total{tier="memory"} 1.0',
        'tiering_tier_healthy{tier="memory"} 1.0',
        'tiering_tier_blocks{tier="cpu"} 2.0',
        'tiering_tier_store_seconds_count{tier="memory"} 1.0',
        'tiering_tier_load_seconds_count{tier="memory"} 0.0',
        'tiering_tier_hit_blocks_total{tier="cpu"} 0.0',
        "tiering_manager_cascades_submitted_total 1.0",
        "tiering_manager_requested_blocks_total 3.0",
        "tiering_manager_jobs_in_flight 0.0",
        "tiering_manager_promotion_seconds_count 0.0",
    ):
        assert line in text, line
    assert 'tiering_tier_store_seconds_bucket{le="+Inf",tier="memory"} 1.0' in text


def test_a_config_with_metrics_starts_and_stops_the_exporter():
    config = parse_config(
        "cpu_bytes_to_use: 64KiB\nmetrics: {port: 0, interval_s: 0.01}\nsecondary_tiers: [{type: memory}]"
    )
    spec = TieringOffloadingSpec(config, KVLayout("tiny", 2, 64, 4), region_name())
    manager = spec.get_manager()
    try:
        port = spec.exporter.port
        manager.on_schedule_end()
        text = scrape(port)
        assert f'tiering_tier_capacity_blocks{{instance="{spec.instance_id}",model="tiny",tier="cpu"}} 128.0' in text
        assert "# HELP tiering_tier_misses_total Lookup calls this tier answered 'not here'." in text
        assert "# TYPE tiering_tier_misses_total counter" in text
    finally:
        spec.shutdown()
    with pytest.raises(OSError):
        scrape(port)


def test_metrics_config_is_validated():
    from tiering import ConfigError

    with pytest.raises(ConfigError, match=r"metrics\.port: Input should be less than or equal to 65535"):
        parse_config("cpu_bytes_to_use: 1MiB\nmetrics: {port: 70000}")


def test_the_docs_list_exactly_the_metrics_served_with_their_help_texts():
    import re
    from pathlib import Path

    from tiering.engine.metrics import HELP

    config = parse_config(
        "cpu_bytes_to_use: 64KiB\nmetrics: {port: 0}\nsecondary_tiers: [{type: memory, failure_threshold: 1}]"
    )
    spec = TieringOffloadingSpec(config, KVLayout("tiny", 2, 64, 4), region_name())
    try:
        manager = spec.get_manager()
        manager.prepare_store(keys(0), CTX)  # a failure counter needs a failure: none here
        text = scrape(spec.exporter.port)
        stats = manager.get_stats()
    finally:
        spec.shutdown()
    parts = [stats["primary"], *stats["tiers"].values(), stats["manager"]]
    reported = {name for part in parts for kind in ("counters", "gauges", "histograms") for name in part[kind]}
    assert reported - set(HELP) == {"state"}  # the breaker's state as a string; `healthy` serves it
    served = {name: help.replace("\\'", "'") for name, help in re.findall(r"^# HELP (\S+) (.*)$", text, re.MULTILINE)}
    readme = (Path(__file__).resolve().parents[1] / "docs" / "observability.md").read_text()
    rows = re.findall(r"^  \| `(tiering_[a-z_]+)(?:\{(?:reason|group)\})?` \| (.*) \|$", readme, re.MULTILINE)
    documented = dict(rows)
    assert len(rows) == len(documented)  # no metric listed twice
    assert {name: documented.get(name) for name in served} == served  # all served, with their HELP
    for name, help in documented.items():  # and nothing that is not a metric
        stat = re.sub(r"^tiering_(tier|manager)_|_total$", "", name)
        assert HELP[stat] == help, name
