"""Counters and gauges match what a scripted run did."""

from tests.helpers import CTX, keys


def test_counters_match_a_scripted_run(engine_factory):
    engine = engine_factory({"type": "memory"}, num_blocks=4)
    manager, tier = engine.manager, engine.tier
    engine.store(0, 1, 2, 3)  # 4 blocks stored, cascaded in one job
    assert manager.lookup(keys(9)[0], CTX) is False  # a miss everywhere
    engine.store(4, 5, 6, 7)  # 4 more: evicts 0..3 from the primary tier, one more cascade
    assert engine.lookup_until_done(0) == [True]  # promoted back: evicts one more block
    stats = manager.get_stats()

    primary = stats["primary"]
    assert primary["counters"]["blocks_stored"] == 8 and primary["counters"]["blocks_promoted"] == 1
    assert primary["counters"]["blocks_loaded"] == 0  # by the GPU; the cascades read 8
    assert primary["counters"]["blocks_read_by_tiers"] == 8
    assert primary["counters"]["evictions"] == 5
    assert primary["gauges"] == {"blocks": 4, "capacity_blocks": 4, "rows_quarantined": 0, "healthy": True}

    memory = stats["tiers"]["memory"]
    object_bytes = tier.object_bytes(keys(0)[0])
    assert memory["counters"]["blocks_stored"] == 8
    assert memory["counters"]["bytes_stored"] == 8 * object_bytes
    assert memory["counters"]["blocks_loaded"] == 1
    assert memory["counters"]["jobs_succeeded"] == 3 and memory["counters"]["jobs_failed"] == 0
    assert memory["counters"]["misses"] >= 1 and memory["counters"]["hits"] >= 1
    assert memory["gauges"]["blocks"] == 8 and memory["gauges"]["bytes"] == 8 * object_bytes
    assert memory["gauges"]["jobs_in_flight"] == 0 and memory["gauges"]["healthy"] is True
    assert memory["job_seconds"]["count"] == 3
    assert memory["job_seconds"]["buckets"][-1] == ["+Inf", 3]

    assert stats["manager"] == {
        "cascades_submitted": 2,
        "promotions_submitted": 1,
        "jobs_in_flight": 0,
        "jobs_holding_rows": 0,
        "promotions_queued": 0,
    }


def test_listeners_get_snapshots_at_most_every_interval(engine_factory):
    engine = engine_factory({"type": "memory"})
    seen = []
    engine.manager.add_stats_listener(seen.append, interval_s=3600)
    engine.manager.add_stats_listener(lambda stats: 1 / 0, interval_s=3600)  # logged, not raised
    for _ in range(5):
        engine.manager.on_schedule_end()
    assert len(seen) == 1 and set(seen[0]) == {"primary", "tiers", "manager"}


def test_every_logger_is_under_one_tree():
    import importlib
    import logging
    import pkgutil

    import tiering
    import tiering.backends as backends

    for package in (tiering, backends):
        for module in pkgutil.iter_modules(package.__path__, f"{package.__name__}."):
            if module.name == "tiering.metrics":
                continue  # imports prometheus_client only; no logger
            loaded = importlib.import_module(module.name)
            log = getattr(loaded, "logger", None)
            if log is not None:
                assert isinstance(log, logging.Logger) and log.name.startswith("tiering."), module.name


def test_a_tier_state_change_is_one_log_line_not_one_per_block(caplog):
    import numpy as np

    from tests.helpers import ROW, RegionStandIn
    from tiering import BlockStoreSettings, BlockStoreTier, JobMetadata
    from tiering.backends import MemoryBlockStore

    view = RegionStandIn(64, ROW).create_kv_memoryview()
    settings = BlockStoreSettings(failure_threshold=2)
    tier = BlockStoreTier(None, view, "flaky", lambda fp: MemoryBlockStore(fp, failure_rate=1.0), settings)
    try:
        for job_id in range(8):  # 8 jobs of 8 blocks, every block failing
            ids = list(range(job_id * 8, job_id * 8 + 8))
            tier.submit_store(JobMetadata(job_id, keys(*ids), np.array(ids), False, CTX))
            tier.on_schedule_end()
            assert tier.drain(10)
            tier.get_finished()
    finally:
        tier.shutdown()
    assert caplog.text.count("unhealthy") == 1
    assert caplog.text.count("store failed") <= 5  # the 1st, 2nd, 4th, 8th, 16th... failure, not 64 lines
