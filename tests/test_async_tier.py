"""The async-tier adapter, through a real TieringOffloadingManager with real bytes."""

import os
import threading
import time

import anyio
import numpy as np
import pytest

from tests.helpers import CTX, ROW, ManualClock, RegionStandIn, block_bytes, key, keys, one_drain
from tiering import (
    AsyncRuntime,
    BlockStoreSettings,
    BlockStoreTier,
    JobMetadata,
    SecondaryTierFactory,
    TierContext,
)
from tiering.backends import MemoryBlockStore
from tiering.tiers.blockstore import batches
from tiering.tiers.object_format import object_size

S = BlockStoreSettings
OBJECT = object_size(len(key(0)), ROW)  # a memory-tier object (64-byte header)
FILE_OBJECT = object_size(len(key(0)), ROW, align=4096)  # the file tier pads headers to a page


@pytest.fixture(params=["memory", "file"])
def config(request, tmp_path):
    return {"type": "memory"} if request.param == "memory" else {"type": "file", "root_dir": str(tmp_path)}


def job(job_id, ids, block_ids, promotion):
    return JobMetadata(job_id, keys(*ids), np.array(block_ids, dtype=np.int64), promotion, CTX)


def test_store_evict_promote_is_byte_exact(config, engine_factory):
    engine = engine_factory(config)
    engine.store(0, 1, 2, 3)
    assert engine.store(4, 5, 6, 7).evicted_keys == keys(0, 1, 2, 3)
    engine.rows[:] = 0  # nothing of the old bytes is left in the primary tier
    assert engine.lookup_until_done(0, 1, 2, 3) == [True] * 4
    assert engine.loaded_bytes(0, 1, 2, 3) == [block_bytes(k, ROW) for k in keys(0, 1, 2, 3)]


class BatchRecordingStore(MemoryBlockStore):
    """A memory store that records the blocks of each `get_many` and `put_many` call."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.gets: list[int] = []
        self.puts: list[int] = []

    async def get_many(self, items):
        self.gets.append(len(items))
        return await super().get_many(items)

    async def put_many(self, items):
        self.puts.append(len(items))
        return await super().put_many(items)


def test_a_promotion_reaches_the_store_in_up_to_four_concurrent_calls_and_a_store_in_one(engine_factory, monkeypatch):
    tier = {"type": "counting", "module_path": __name__, "class_name": "BatchRecordingStore", "batch_bytes": "1GiB"}
    engine = engine_factory(tier, num_blocks=8)
    engine.store(*range(8))  # one cascade job of 8 blocks: one call, batch_bytes allows it
    engine.store(*range(8, 16))
    assert engine.tier.store.puts == [8, 8]
    engine.rows[:] = 0
    assert engine.lookup_until_done(0, 1, 2, 3) == [True] * 4
    assert engine.tier.store.gets == [4]  # 16 KiB: smaller than LOAD_SPREAD_MIN_BYTES, one call
    monkeypatch.setattr(batches, "LOAD_SPREAD_MIN_BYTES", 2 * ROW)
    assert engine.store(*range(16, 24)).evicted_keys  # 0..3 are in the tier only again
    assert engine.lookup_until_done(*range(8)) == [True] * 8
    assert engine.tier.store.gets[1:] == [2, 2, 2, 2]  # a request waits on these: read at a queue depth of 4
    assert engine.loaded_bytes(*range(8)) == [block_bytes(k, ROW) for k in keys(*range(8))]


class CPUBoundStore(BatchRecordingStore):
    """A memory store that says its calls keep a CPU busy each: two at once at most."""

    calls_at_once = 2


def test_a_store_of_cpu_bound_calls_gets_a_steps_blocks_in_no_more_calls_than_it_runs_at_once(engine_factory):
    tier = {"type": "cpu_bound", "module_path": __name__, "class_name": "CPUBoundStore", "batch_bytes": ROW}
    engine = engine_factory(tier, num_blocks=16, reset_scope="cpu")  # the reset empties the CPU tier only
    engine.store(*range(8))  # a block a call would be eight calls: two, larger than batch_bytes
    engine.store(8, 9)  # two calls of batch_bytes each fit
    assert engine.tier.store.puts == [4, 4, 1, 1]
    engine.rows[:] = 0
    engine.manager.reset_cache()
    assert engine.lookup_until_done(*range(10)) == [True] * 10
    assert sum(engine.tier.store.gets) == 10
    assert engine.loaded_bytes(*range(10)) == [block_bytes(k, ROW) for k in keys(*range(10))]


class InOrderStore(BatchRecordingStore):
    """A memory store that says it reads a call's items one after another, and records the
    first key of each call and the most calls it ran at once."""

    reads_in_order = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.firsts = []
        self.running = self.most_running = 0

    async def get_many(self, items):
        self.firsts.append(items[0][0])
        self.running += 1
        self.most_running = max(self.most_running, self.running)
        for _ in range(len(items)):  # one read after another: the other calls run meanwhile
            await anyio.sleep(0)
        self.running -= 1
        return await super().get_many(items)


def in_order_engine(engine_factory, monkeypatch):
    """An engine over an `InOrderStore` holding blocks 0..15 in its tier only, rows zeroed."""
    tier = {"type": "in_order", "module_path": __name__, "class_name": "InOrderStore", "batch_bytes": "1GiB"}
    engine = engine_factory(tier, num_blocks=16, reset_scope="cpu")  # the reset empties the CPU tier only
    monkeypatch.setattr(batches, "LOAD_SPREAD_MIN_BYTES", 2 * ROW)
    engine.store(*range(16))
    engine.rows[:] = 0
    engine.manager.reset_cache()
    return engine


def test_a_store_that_reads_in_order_gets_a_promotion_in_small_calls_a_few_at_a_time(engine_factory, monkeypatch):
    engine = in_order_engine(engine_factory, monkeypatch)
    assert engine.lookup_until_done(*range(16)) == [True] * 16
    assert engine.tier.store.gets == [2] * 8  # calls of LOAD_SPREAD_MIN_BYTES, not four of 4 blocks
    assert engine.tier.store.firsts == keys(*range(0, 16, 2))  # in the promotion's order
    assert engine.tier.store.most_running == batches.LOAD_SPREAD
    assert engine.loaded_bytes(*range(16)) == [block_bytes(k, ROW) for k in keys(*range(16))]


class BlockableGets(BatchRecordingStore):
    """Gets are recorded, then wait, once `blocked`, until `release` is set."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.blocked = False
        self.release = anyio.Event()

    async def get_many(self, items):
        self.gets.append(len(items))
        if self.blocked:
            await self.release.wait()
        return await MemoryBlockStore.get_many(self, items)


def test_promotions_started_together_share_calls_and_a_lone_one_is_spread(monkeypatch):
    """A step's promotions go to the store together; a promotion is spread over a few calls
    only when no other load keeps the device busy (else each call would only cost the loop a
    hop, and a group spread like one would read a few blocks at a time)."""
    monkeypatch.setattr(batches, "LOAD_SPREAD_MIN_BYTES", 2 * ROW)
    view = RegionStandIn(32, ROW).create_kv_memoryview()
    tier = BlockStoreTier(None, view, "blockable", BlockableGets, BlockStoreSettings(batch_bytes=1 << 30))
    try:
        with one_drain(tier._runtime):
            tier.submit_store(job(0, range(16), range(16), False))
            tier.submit_store(job(1, range(16, 24), range(8), False))
        tier.on_schedule_end()
        assert tier.drain(10) and tier.store.puts == [24]  # two jobs, one call
        tier.get_finished()
        with one_drain(tier._runtime):
            tier.submit_load(job(2, range(4), range(16, 20), True))
            tier.submit_load(job(3, range(4, 8), range(20, 24), True))
        tier.on_schedule_end()
        assert tier.drain(10) and [r.success for r in tier.get_finished()] == [True, True]
        assert tier.store.gets == [8]  # the two jobs' blocks in one call
        tier.store.blocked = True
        tier.submit_load(job(4, range(8, 12), range(24, 28), True))  # alone: spread
        tier.on_schedule_end()
        while len(tier.store.gets) < 3:  # the test's timeout bounds it
            time.sleep(0.001)
        tier.submit_load(job(5, range(12, 16), range(28, 32), True))  # job 4 is still reading
        tier.on_schedule_end()
        while len(tier.store.gets) < 4:
            time.sleep(0.001)
        assert tier.store.gets[1:] == [2, 2, 4]
        tier._runtime.submit(tier.store.release.set)
        tier.on_schedule_end()
        assert tier.drain(10) and [r.success for r in tier.get_finished()] == [True, True]
    finally:
        tier._runtime.submit(tier.store.release.set)
        tier.on_schedule_end()
        tier.shutdown()
    assert np.array_equal(np.asarray(view)[16:32], np.asarray(view)[:16])


def test_a_tier_whose_loop_thread_died_misses_and_fails_its_jobs_at_once(engine_factory, caplog):
    engine = engine_factory({"type": "memory"}, num_blocks=4)
    engine.store(0, 1)
    runtime = engine.tier._runtime

    def escape():
        raise SystemExit("a bug")

    runtime.submit(escape)
    runtime.flush()
    while runtime.alive:  # the thread ends once the error has unwound its loop
        threading.Event().wait(0.01)
    assert "the event loop thread died" in caplog.text
    assert engine.manager.get_stats()["tiers"]["memory"]["gauges"]["loop_alive"] is False
    engine.manager.reset_cache()  # blocks 0 and 1 are in the tier only
    assert [engine.manager.lookup(k, CTX) for k in keys(0, 1)] == [False, False]  # misses: the requests recompute
    engine.store(2)  # its cascade fails at once: the drain in `store` returns, nothing is left in flight
    stats = engine.manager.get_stats()
    assert stats["tiers"]["memory"]["counters"]["jobs_failed"] == 1
    assert stats["manager"]["gauges"]["jobs_in_flight"] == 0
    assert engine.primary.ref_count(key(2)) == 0  # its row is not pinned by a cascade that will never run


def test_slow_tier_answers_none_until_the_store_lands(engine_factory):
    engine = engine_factory({"type": "memory", "latency_s": 0.2})
    out = engine.manager.prepare_store(keys(0), CTX)
    engine.manager.complete_store(out.keys_to_store, CTX)
    assert engine.tier.lookup(key(0), CTX) is None
    assert engine.tier.has_pending_work()
    assert not engine.tier.drain(0.01)
    engine.settle()
    assert engine.tier.lookup(key(0), CTX) is True
    assert not engine.tier.has_pending_work()


def test_a_job_in_flight_keeps_the_loop_polling_so_the_step_makes_no_system_call(monkeypatch):
    monkeypatch.setattr("tiering.tiers.runtime.POLL_IDLE_S", 0.02)
    tier = make_tier(BlockablePuts, capacity_objects=2)
    try:
        tier.store.blocked = True
        tier.submit_store(job(0, [0], [0], False))
        tier.on_schedule_end()
        assert tier.store.writing.wait(10)  # the job is in flight, and stays so until released
        tier._runtime.run_sync(anyio.sleep, 0.1)  # five idle times on the loop's clock, the loop running
        assert tier._runtime._polling  # the next flush will not ring
    finally:
        tier._runtime.submit(tier.store.release.set)
        tier.on_schedule_end()
        assert tier.drain(10) and [r.success for r in tier.get_finished()] == [True]
        tier.shutdown()


def test_a_failing_backend_fails_the_job_and_forgets_its_blocks(engine_factory, caplog):
    engine = engine_factory({"type": "memory", "failure_rate": 1.0})
    results = []
    out = engine.manager.prepare_store(keys(0, 1), CTX)
    engine.manager.complete_store(out.keys_to_store, CTX)
    assert engine.tier.drain(10)
    results = engine.tier.get_finished()
    assert [r.success for r in results] == [False]
    assert engine.tier.lookup(key(0), CTX) is False
    assert engine.tier.index.used_bytes == 0
    assert engine.tier.failures["store"] == 2
    assert "store failed (1 so far)" in caplog.text and "(2 so far)" in caplog.text


def test_capacity_evicts_least_recent_and_deletes_the_objects(engine_factory):
    engine = engine_factory({"type": "memory", "capacity_bytes": 3 * OBJECT}, num_blocks=8)
    engine.store(0, 1, 2)
    engine.manager.touch(keys(0), CTX)
    engine.store(3, 4)
    assert [engine.tier.lookup(k, CTX) for k in keys(0, 1, 2, 3, 4)] == [True, False, False, True, True]
    assert engine.tier.index.used_bytes == 3 * OBJECT
    assert sorted(engine.tier.store.objects) == keys(0, 3, 4)


def make_tier(store_factory, capacity_objects, runtime_spec=None):
    view = RegionStandIn(8, ROW).create_kv_memoryview()
    return BlockStoreTier(runtime_spec, view, "memory", store_factory, S(capacity_bytes=capacity_objects * OBJECT))


def test_a_block_being_read_is_never_evicted():
    tier = make_tier(lambda fp: MemoryBlockStore(fp, latency_s=0.3), capacity_objects=2)
    try:
        tier.submit_store(job(0, [0, 1], [0, 1], False))
        assert tier.drain(10)
        tier.get_finished()
        tier.submit_load(job(1, [0], [5], True))  # slow read of 0 in flight
        tier.touch(keys(0), CTX)
        tier.touch(keys(1), CTX)  # 0 is now the least recent, but it is being read
        tier.submit_store(job(2, [2], [2], False))  # evicts 1, not 0
        tier.submit_store(job(3, [3], [3], False))  # 0 is read, 2 in flight: no room
        assert tier.drain(10)
        assert {r.job_id: r.success for r in tier.get_finished()} == {1: True, 2: True, 3: False}
        assert sorted(tier.store.objects) == keys(0, 2)
    finally:
        tier.shutdown()


class SlowDeletes(MemoryBlockStore):
    def __init__(self, fingerprint):
        super().__init__(fingerprint)
        self.delete_calls = []

    async def delete_many(self, keys):
        self.delete_calls.append(sorted(keys))
        await anyio.sleep(0.3)
        await super().delete_many(keys)


def test_a_key_evicted_and_stored_again_is_deleted_before_the_new_put():
    tier = make_tier(SlowDeletes, capacity_objects=2)
    try:
        tier.submit_store(job(0, [0, 1], [0, 1], False))
        assert tier.drain(10)
        tier.get_finished()
        tier.submit_store(job(1, [2], [2], False))  # evicts 0
        tier.on_schedule_end()  # the step ends: 0's (slow) delete starts
        tier.submit_store(job(2, [0], [0], False))  # evicts 1; this put must wait for 0's delete
        assert tier.drain(10)
        assert [r.success for r in tier.get_finished()] == [True, True]
        assert tier.lookup(key(0), CTX) is True
        assert sorted(tier.store.objects) == keys(0, 2)
    finally:
        tier.shutdown()


def test_a_steps_evictions_are_one_delete_and_a_key_stored_again_in_the_step_is_not_deleted():
    tier = make_tier(SlowDeletes, capacity_objects=3)
    try:
        tier.submit_store(job(0, [0, 1, 2], [0, 1, 2], False))
        assert tier.drain(10)
        tier.get_finished()
        tier.submit_store(job(1, [3], [3], False))  # evicts 0
        tier.submit_store(job(2, [4], [4], False))  # evicts 1
        tier.submit_store(job(3, [0], [0], False))  # evicts 2, and stores 0 again: its delete is moot
        assert tier.store.delete_calls == []  # deletes wait for the end of the step
        assert tier.drain(10)  # (a drain ends the step too)
        assert sorted(r.success for r in tier.get_finished()) == [True, True, True]
        assert tier.store.delete_calls == [sorted(keys(1, 2))]
        assert sorted(tier.store.objects) == sorted(keys(0, 3, 4))
    finally:
        tier.shutdown()


class BlockablePuts(MemoryBlockStore):
    """Puts wait, once `blocked`, until `release` is set (a disk stuck behind a write burst)."""

    def __init__(self, fingerprint):
        super().__init__(fingerprint)
        self.blocked = False
        self.release = anyio.Event()
        self.writing = threading.Event()

    async def put_many(self, items):
        if self.blocked:
            self.writing.set()
            await self.release.wait()
        return await super().put_many(items)


def test_a_load_never_waits_behind_stores():
    view = RegionStandIn(8, ROW).create_kv_memoryview()
    settings = BlockStoreSettings(max_concurrency=1, batch_bytes=ROW)  # one store call at a time
    tier = BlockStoreTier(None, view, "blocked", BlockablePuts, settings)
    try:
        tier.submit_store(job(0, [5], [5], False))
        assert tier.drain(10) and [r.success for r in tier.get_finished()] == [True]
        tier.store.blocked = True
        tier.submit_store(job(1, [0, 1, 2], [0, 1, 2], False))  # takes the only store slot, and hangs
        tier.on_schedule_end()
        assert tier.store.writing.wait(10)
        tier.submit_load(job(2, [5], [6], True))
        tier.on_schedule_end()
        results = []
        for _ in range(500):  # up to ~5 s; the load must not wait for the stores
            if results := tier.get_finished():
                break
            tier.drain(0.01)
        assert [(r.job_id, r.success) for r in results] == [(2, True)]
    finally:
        tier._runtime.submit(tier.store.release.set)
        tier.on_schedule_end()
        tier.shutdown()


def test_a_corrupted_file_is_never_promoted(engine_factory, tmp_path):
    engine = engine_factory({"type": "file", "root_dir": str(tmp_path), "layout": "files"})
    engine.store(0, 1, 2, 3)
    engine.store(4, 5, 6, 7)  # 0..3 only in the file tier now
    path = engine.tier.store.path(key(1))
    raw = bytearray(path.read_bytes())
    raw[-100] ^= 0x01  # one flipped bit in the payload
    path.write_bytes(raw)
    assert engine.lookup_until_done(0, 1) == [True, False]
    assert not path.exists()
    assert engine.tier.lookup(key(1), CTX) is False
    assert engine.tier.failures["load_corrupt"] == 1
    assert engine.primary.lookup(key(1), CTX) is False  # its reserved row was freed
    assert engine.loaded_bytes(0) == [block_bytes(key(0), ROW)]


def test_file_tier_restart_finds_every_block(engine_factory, tmp_path):
    config = {"type": "file", "root_dir": str(tmp_path)}
    first = engine_factory(config, num_blocks=8)
    first.store(*range(8))
    first.close()
    second = engine_factory(config, num_blocks=8)
    assert len(second.tier.index) == 8
    assert second.tier.index.used_bytes == 8 * second.tier.object_bytes(key(0)) == 8 * FILE_OBJECT
    assert second.lookup_until_done(*range(8)) == [True] * 8
    assert second.loaded_bytes(*range(8)) == [block_bytes(k, ROW) for k in keys(*range(8))]


def test_restart_with_a_smaller_capacity_evicts_the_oldest(engine_factory, tmp_path):
    first = engine_factory({"type": "file", "root_dir": str(tmp_path), "layout": "files"}, num_blocks=8)
    first.store(0, 1, 2, 3)
    for i in range(4):  # blocks written over time (file timestamps are too coarse to tell a burst apart)
        os.utime(first.tier.store.path(key(i)), (1_000_000 + i, 1_000_000 + i))
    first.close()
    config = {"type": "file", "root_dir": str(tmp_path), "layout": "files", "capacity_bytes": 2 * FILE_OBJECT}
    second = engine_factory(config)
    assert second.tier.drain(10)
    assert [second.tier.lookup(k, CTX) for k in keys(0, 1, 2, 3)] == [False, False, True, True]
    assert not second.tier.store.path(key(0)).exists()


def test_shutdown_reports_jobs_in_flight_as_failed_once(engine_factory):
    tier = make_tier(lambda fp: MemoryBlockStore(fp, latency_s=0.2), capacity_objects=4)
    tier.submit_store(job(0, [0], [0], False))
    assert tier.drain(10)
    tier.get_finished()
    tier.store.latency_s = 30
    tier.submit_store(job(1, [1], [1], False))
    tier.submit_load(job(2, [0], [2], True))
    tier.shutdown()
    tier.shutdown()
    assert sorted((r.job_id, r.success) for r in tier.get_finished()) == [(1, False), (2, False)]
    assert tier.get_finished() == []
    tier.submit_store(job(3, [5], [5], False))  # after shutdown: failed at once
    assert [(r.job_id, r.success) for r in tier.get_finished()] == [(3, False)]


def test_tiers_of_one_engine_share_one_runtime():
    class Spec:
        runtime = AsyncRuntime("tiering-shared")

        def tier_context(self, view, name):
            return TierContext(name, view, b"L" * 16, self.runtime, self)

    tiers = [make_tier(MemoryBlockStore, 2, runtime_spec=Spec()) for _ in range(2)]
    assert [t.name for t in threading.enumerate()].count("tiering-shared") == 1
    assert tiers[0].context.layout_fingerprint == b"L" * 16
    tiers[0].shutdown()
    assert any(t.name == "tiering-shared" for t in threading.enumerate())
    tiers[1].shutdown()
    assert not any(t.name == "tiering-shared" for t in threading.enumerate())


@pytest.mark.parametrize(
    ("config", "error", "message"),
    [
        ({"type": "memory", "capacity_bytes": 0}, ValueError, "capacity_bytes: expected a size from 1 byte to 1 EiB"),
        ({"type": "memory", "capacity_bytes": 4096}, ValueError, r"capacity_bytes \(4096\) cannot hold one block"),
        ({"type": "memory", "capacity_bytes": "lots"}, ValueError, "capacity_bytes: expected a size such as"),
        ({"type": "memory", "latency_s": "slow"}, ValueError, "latency_s: expected a duration such as"),
        ({"type": "memory", "max_concurrency": 0}, ValueError, "max_concurrency: Input should be greater than or"),
        ({"type": "memory", "failure_rate": 1.5}, ValueError, "failure_rate: Input should be less than or equal to 1"),
        ({"type": "file"}, ValueError, "root_dir: required key is missing"),
        ({"type": "file", "root_dir": "/etc/hostname/x"}, ValueError, "root_dir: /etc/hostname/x cannot be used"),
        ({"type": "file", "root_dir": "/tmp/unused", "bucket": "x"}, ValueError, "bucket: unknown key; expected one"),
    ],
)
def test_bad_options_fail_at_construction(config, error, message):
    view = RegionStandIn(2, ROW).create_kv_memoryview()
    with pytest.raises(error, match=message):
        SecondaryTierFactory.create_secondary_tier(config, view, None)


class CountingStore(MemoryBlockStore):
    """A memory store that counts existence checks; `backing` may be shared by two stores."""

    def __init__(self, fingerprint, backing, **kwargs):
        super().__init__(fingerprint, **kwargs)
        self.objects = backing
        self.exists_calls = 0
        self.exists_many_calls = 0

    async def exists(self, key):
        self.exists_calls += 1
        return await super().exists(key)

    async def exists_many(self, keys):
        self.exists_many_calls += 1
        return await super().exists_many(keys)


def shared_tiers(count=2, clock=time.monotonic, **options):
    backing: dict = {}
    view = RegionStandIn(8, ROW).create_kv_memoryview()
    settings = S(probe_misses=True, **options)
    return [
        BlockStoreTier(None, view, "shared", lambda fp: CountingStore(fp, backing), settings, clock=clock)
        for _ in range(count)
    ]


def finish(tier, timeout_s=10):
    tier.on_schedule_end()
    assert tier.drain(timeout_s)
    return tier.get_finished()


def test_a_miss_is_probed_once_and_a_block_another_engine_wrote_is_found():
    writer, reader = shared_tiers()
    try:
        writer.submit_store(job(0, [0], [0], False))
        finish(writer)
        assert reader.lookup(key(0), CTX) is None  # unknown here: one existence probe starts
        assert reader.lookup(key(0), CTX) is None  # still in flight: no second probe
        finish(reader)
        assert reader.store.exists_calls == 1
        assert reader.lookup(key(0), CTX) is True
        reader.submit_load(job(1, [0], [3], True))
        assert [r.success for r in finish(reader)] == [True]
    finally:
        writer.shutdown()
        reader.shutdown()


def test_a_steps_probes_go_out_together_in_calls_of_batch_bytes():
    writer, reader = shared_tiers(batch_bytes=2 * ROW)  # 2 keys per call
    try:
        writer.submit_store(job(0, [0, 2], [0, 2], False))
        finish(writer)
        assert [reader.lookup(key(i), CTX) for i in range(5)] == [None] * 5
        finish(reader)
        assert (reader.store.exists_many_calls, reader.store.exists_calls) == (3, 5)
        assert [reader.lookup(key(i), CTX) for i in range(5)] == [True, False, True, False, False]
    finally:
        writer.shutdown()
        reader.shutdown()


def test_an_absent_key_is_remembered_for_the_negative_ttl():
    clock = ManualClock()
    (tier,) = shared_tiers(count=1, clock=clock, negative_ttl_s=0.2)
    try:
        assert tier.lookup(key(9), CTX) is None
        finish(tier)
        clock.now += 0.19
        assert tier.lookup(key(9), CTX) is False  # cached absence: no new probe
        assert tier.store.exists_calls == 1
        clock.now += 0.02
        assert tier.lookup(key(9), CTX) is None  # expired: probed again
        finish(tier)
        assert tier.store.exists_calls == 2
    finally:
        tier.shutdown()


@pytest.mark.timeout(180)  # 100,000 probes: 7 s on an idle 2-core VM, more beside other jobs
def test_a_hundred_thousand_distinct_misses_keep_the_newest_answers_and_no_more_than_the_bound():
    (tier,) = shared_tiers(count=1, negative_ttl_s=3600)
    try:
        misses = [key(i) for i in range(100_000)]
        assert all(tier.lookup(k, CTX) is None for k in misses)
        finish(tier, timeout_s=150)
        assert tier.get_stats()["gauges"]["probe_answers"] == 65_536  # was every key: 100,000
        probed = tier.store.exists_calls  # keys checked
        assert tier.lookup(misses[-1], CTX) is False  # the newest absences are remembered
        assert tier.lookup(misses[0], CTX) is None  # the oldest was forgotten: probed again
        finish(tier)
        assert tier.store.exists_calls == probed + 1
        assert tier.get_stats()["gauges"]["probe_answers"] == 65_536
    finally:
        tier.shutdown()


def test_repeated_failures_pause_the_tier_until_a_probe_succeeds(caplog):
    view = RegionStandIn(8, ROW).create_kv_memoryview()
    clock = ManualClock()
    tier = BlockStoreTier(
        None,
        view,
        "flaky",
        lambda fp: MemoryBlockStore(fp, failure_rate=1.0),
        S(failure_threshold=3, backoff_s=0.1),
        clock=clock,
    )
    try:
        tier.submit_store(job(0, [0, 1, 2], [0, 1, 2], False))
        assert [r.success for r in finish(tier)] == [False]
        assert not tier.health.healthy
        tier.submit_store(job(1, [3], [3], False))  # fails fast, nothing sent
        tier.submit_load(job(2, [0], [0], True))
        assert [r.success for r in finish(tier)] == [False, False]
        assert tier.store.objects == {} and tier.lookup(key(3), CTX) is False
        clock.now += 0.09
        finish(tier)  # no probe before the backoff has passed
        assert tier.health.backoff_s == 0.1
        clock.now += 0.02
        finish(tier)  # the probe fails too: the backoff doubles
        assert not tier.health.healthy and tier.health.backoff_s == 0.2
        tier.store.failure_rate = 0.0  # the backend comes back
        clock.now += 0.21
        finish(tier)
        assert tier.health.healthy
        tier.submit_store(job(3, [4], [4], False))
        assert [r.success for r in finish(tier)] == [True]
        assert tier.lookup(key(4), CTX) is True
    finally:
        tier.shutdown()
    assert caplog.text.count("unhealthy (") == 1  # tripped; the failed probe is summed up a minute later
    assert caplog.text.count("recovered") == 1


def test_sizes_in_tier_options_may_be_strings():
    view = RegionStandIn(2, ROW).create_kv_memoryview()
    tier = SecondaryTierFactory.create_secondary_tier({"type": "memory", "capacity_bytes": "1MiB"}, view, None)
    try:
        assert tier.index.capacity_bytes == 1 << 20
    finally:
        tier.shutdown()


def test_a_shut_down_tier_raises_nothing_on_later_steps():
    tier = make_tier(MemoryBlockStore, capacity_objects=2)
    tier.shutdown()
    tier.on_schedule_end()
    assert tier.drain(1) is True
    tier.submit_store(job(1, [0], [0], False))
    assert [(r.job_id, r.success) for r in tier.get_finished()] == [(1, False)]


def test_an_index_over_its_max_keys_forgets_the_least_recent_without_deleting():
    (tier,) = shared_tiers(count=1, index_max_blocks=3)
    try:
        for i in range(5):
            tier.submit_store(job(i, [i], [i], False))
            finish(tier)
        assert len(tier.index) == 3 and tier.get_stats()["counters"]["index_forgotten"] == 2
        assert len(tier.store.objects) == 5  # forgotten, not deleted
        assert tier.lookup(key(0), CTX) is None  # unknown now: probed, and found again
        finish(tier)
        assert tier.lookup(key(0), CTX) is True
    finally:
        tier.shutdown()
