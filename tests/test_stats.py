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
    assert primary["counters"]["bytes_stored"] == 8 * engine.rows.shape[1] and primary["counters"]["bytes_loaded"] == 0
    assert primary["counters"]["blocks_read_by_tiers"] == 8
    assert primary["counters"]["evictions"] == 5
    assert primary["gauges"] == {
        "blocks": 4,
        "capacity_blocks": 4,
        "rows_reading": 0,
        "rows_writing": 0,
        "rows_quarantined": 0,
        "retained_blocks": 0,
        "healthy": True,
    }

    memory = stats["tiers"]["memory"]
    object_bytes = tier.object_bytes(keys(0)[0])
    assert memory["counters"]["blocks_stored"] == 8
    assert memory["counters"]["bytes_stored"] == 8 * object_bytes
    assert memory["counters"]["blocks_loaded"] == 1
    assert memory["counters"]["jobs_succeeded"] == 3 and memory["counters"]["jobs_failed"] == 0
    assert memory["counters"]["misses"] >= 1 and memory["counters"]["hits"] >= 1
    assert memory["counters"]["store_busy_seconds"] > 0 and memory["counters"]["load_busy_seconds"] > 0
    assert memory["gauges"]["blocks"] == 8 and memory["gauges"]["bytes"] == 8 * object_bytes
    assert memory["gauges"]["jobs_in_flight"] == 0 and memory["gauges"]["healthy"] is True
    assert memory["histograms"]["store_seconds"]["count"] == 2
    assert memory["histograms"]["load_seconds"]["buckets"][-1] == ["+Inf", 1]

    gauges = {"jobs_in_flight": 0, "jobs_holding_rows": 0, "promotions_queued": 0, "promotion_rows": 0}
    assert stats["manager"]["gauges"] == {**gauges, "requests_open": 1}  # the run's one request never finished
    counters = stats["manager"]["counters"]
    assert counters["cascades_submitted"] == 2 and counters["promotions_submitted"] == 1
    assert "requested_tokens" not in counters  # the manager was not told the tokens per block
    assert stats["manager"]["histograms"]["promotion_seconds"]["count"] == 1


def test_each_block_counts_once_per_request_for_the_tier_that_supplied_it(engine_factory):
    from tiering import ReqContext

    engine = engine_factory({"type": "memory"}, num_blocks=8)
    manager = engine.manager
    manager.block_tokens = 16
    engine.store(*range(8))
    engine.store(8, 9, 10, 11)  # evicts 0..3 from the CPU tier; the memory tier has them
    a, b, c = ReqContext("a"), ReqContext("b"), ReqContext("c")
    k = {i: key for i, key in zip([0, 8, 20, 30, 31], keys(0, 8, 20, 30, 31), strict=True)}

    assert manager.lookup(k[8], a) is True  # in the CPU tier
    assert manager.lookup(k[0], a) is None  # promotion queued; the scheduler asks again later
    engine.settle()  # submitted
    engine.settle()  # landed
    assert [manager.lookup(k[i], a) for i in (8, 0, 20)] == [True, True, False]  # two repeats
    manager.on_request_finished(a)
    assert [manager.lookup(k[i], b) for i in (0, 8)] == [True, True]  # both in the CPU tier now
    assert manager.lookup(k[30], c) is False
    manager.prepare_store([k[30], k[31]], c)  # computed after the miss: 31 was never looked up

    stats = manager.get_stats()
    hits = {name: part["counters"]["hit_blocks"] for name, part in (("cpu", stats["primary"]), *stats["tiers"].items())}
    assert hits == {"cpu": 3, "memory": 1}
    assert stats["tiers"]["memory"]["counters"]["hit_tokens"] == 16
    assert stats["primary"]["counters"]["hit_tokens"] == 48
    counters = stats["manager"]["counters"]
    assert counters["requested_blocks"] == 12 + 3 + 2 + 2  # the stores of req-0, then a, b, c
    assert counters["requested_tokens"] == 16 * counters["requested_blocks"]
    assert counters["lookups_repeated"] == 2
    assert stats["primary"]["gauges"]["rows_writing"] == 2  # c's store is in flight


def test_a_forgotten_request_counts_again_and_the_oldest_goes_first():
    from tiering.engine.lookups import RequestLookups

    counts = RequestLookups(lambda key: None, max_requests=2)
    for req_id in ("a", "b", "c"):  # "a" is forgotten when "c" arrives
        counts.answered(req_id, b"k", True)
    counts.answered("a", b"k", True)  # "a" again: new, and "b" is forgotten
    counts.answered("c", b"k", True)  # a repeat
    assert (counts.requested_blocks, counts.lookups_repeated, counts.hit_blocks["cpu"]) == (4, 1, 4)
    counts.finished("c")
    counts.answered("c", b"k", False)
    assert counts.requested_blocks == 5


def test_pinned_rows_are_counted_while_readers_and_writes_are_in_flight(engine_factory):
    engine = engine_factory({"type": "memory"}, num_blocks=4)
    primary = engine.primary
    out = engine.manager.prepare_store(keys(0, 1), CTX)
    assert primary.get_stats()["gauges"]["rows_writing"] == 2
    engine.manager.complete_store(out.keys_to_store, CTX)  # the cascade reads both rows
    gauges = primary.get_stats()["gauges"]
    assert (gauges["rows_writing"], gauges["rows_reading"]) == (0, 2)
    engine.settle()
    engine.manager.prepare_load(keys(0, 0), CTX)  # two readers of one row: one row
    assert primary.get_stats()["gauges"]["rows_reading"] == 1
    engine.manager.complete_load(keys(0, 0), CTX)
    assert primary.get_stats()["gauges"]["rows_reading"] == 0


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
            if module.name == "tiering.engine.metrics":
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


def test_hits_and_the_misses_that_end_them_are_counted_once_per_request_by_kv_cache_group():
    from tiering.contract.keys import make_offload_key
    from tiering.engine.lookups import RequestLookups

    counts = RequestLookups(lambda key: None)
    full, window, other = (make_offload_key(bytes(16), group) for group in (0, 1, 2))
    counts.answered("a", full, True)
    counts.answered("a", window, False)  # the sliding-window group ends the hit
    counts.answered("a", window, False)  # asked again: counted once
    counts.answered("b", full, True)
    counts.answered("b", window, False)
    counts.answered("b", other, True)
    assert counts.hit_blocks_by_group == {0: 2, 2: 1}
    assert counts.hits_ended_by_group == {1: 2}
