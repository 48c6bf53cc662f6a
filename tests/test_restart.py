"""Restarts that keep the cache warm: a graceful stop drains what only the CPU tier holds to
the lasting tiers, and a tier serves while it recovers what its store held."""

import logging

import anyio
import numpy as np

from tests.helpers import CTX, ROW, RegionStandIn, block_bytes, key, keys
from tiering import BlockStoreSettings, BlockStoreTier, Doorbell, JobMetadata
from tiering.backends import MemoryBlockStore
from tiering.engine.admission import AdmissionConfig
from tiering.tiers.blockstore import recovery
from tiering.tiers.object_format import object_size

WRITE_BACK = AdmissionConfig(write="back")


def file_tier(root, **options):
    return {"type": "file", "root_dir": str(root), "layout": "files", **options}


def offered(engine, count):
    """Which of blocks 0..count-1 a lookup finds (each promoted, then loadable)."""
    answers = engine.lookup_until_done(*range(count), steps=20)
    return {i for i, found in enumerate(answers) if found}


def test_a_graceful_stop_writes_every_block_only_the_cpu_tier_held(engine_factory, tmp_path):
    """The issue's case: 256 blocks in a 1,024-row CPU tier, a write-back file tier, one step, a
    graceful stop. The write-back wrote the 128 coldest; the drain writes the other 128."""
    first = engine_factory(file_tier(tmp_path), num_blocks=1024, admission=[WRITE_BACK])
    first.store(*range(256))  # one step: its write-back takes the window's 128 coldest blocks
    first.close()
    second = engine_factory(file_tier(tmp_path), num_blocks=1024)
    assert offered(second, 256) == set(range(256))
    assert second.loaded_bytes(0, 255) == [block_bytes(key(0), ROW), block_bytes(key(255), ROW)]


def test_without_the_drain_a_stop_loses_what_only_the_cpu_tier_held(engine_factory, tmp_path):
    first = engine_factory(file_tier(tmp_path), num_blocks=1024, admission=[WRITE_BACK])
    first.store(*range(256))
    first.settle()  # the write-back's copies land
    first.manager.shutdown_drain_s = 0
    first.close()
    second = engine_factory(file_tier(tmp_path), num_blocks=1024)
    assert offered(second, 256) == set(range(128))  # the write-back's window only


def test_the_drain_writes_the_hottest_blocks_and_never_past_the_tier_capacity(engine_factory, tmp_path, caplog):
    capacity = 100 * object_size(len(key(0)), ROW, align=4096)
    config = file_tier(tmp_path, capacity_bytes=capacity)
    first = engine_factory(config, num_blocks=1024, admission=[AdmissionConfig(write="back", writeback_window=64)])
    first.store(*range(256))  # stored in order: 255 is the hottest
    first.settle()  # the write-back's copies land: the tier holds 0..63
    with caplog.at_level(logging.INFO, logger="tiering.engine.drain"):
        first.close()
    assert "wrote 100 to file of the 192 blocks only the CPU tier held" in caplog.text
    assert "92 stay only there and end with it (92 beyond the lasting tiers' room, 0 not written" in caplog.text
    assert "lost" not in caplog.text  # a cache's blocks that end with it are no data lost
    second = engine_factory(config, num_blocks=1024)
    assert offered(second, 256) == set(range(156, 256))


def test_blocks_a_lasting_tier_holds_are_not_written_again(engine_factory, tmp_path, caplog):
    first = engine_factory(file_tier(tmp_path), num_blocks=64)  # write-through: the tier has every block
    first.store(*range(32))
    with caplog.at_level(logging.INFO, logger="tiering.engine.drain"):
        first.close()
    assert "wrote none of the 0 blocks only the CPU tier held" in caplog.text


class SlowListing(MemoryBlockStore):
    """A store whose listing at start waits until `listed` is set and then names `LISTED`,
    oldest first: a large tier still being scanned."""

    LISTED = tuple((key(i), object_size(len(key(i)), ROW)) for i in range(10))

    def __init__(self, fingerprint):
        super().__init__(fingerprint)
        self.listed = anyio.Event()

    async def recover(self):
        await self.listed.wait()
        return list(self.LISTED)


def test_lookups_answer_while_the_tier_recovers_and_recovered_blocks_are_the_oldest():
    view = RegionStandIn(8, ROW).create_kv_memoryview()
    settings = BlockStoreSettings(capacity_bytes=8 * SlowListing.LISTED[0][1])
    tier = BlockStoreTier(None, view, "slow", SlowListing, settings)
    try:
        # the listing has not ended: every lookup answers at once, a miss
        assert [tier.lookup(k, CTX) for k in keys(*range(10))] == [False] * 10
        assert tier.get_stats()["gauges"]["recovering"] is True
        stored = JobMetadata(1, keys(9, 20), np.array([0, 1], dtype=np.int64), False, CTX)
        tier.submit_store(stored)  # stores go on: block 9 (listed too) and 20
        tier.on_schedule_end()
        while not (results := tier.get_finished()):  # `drain` would wait for the listing too
            tier.drain(0.01)
        assert [r.success for r in results] == [True]
        tier._runtime.submit(tier.store.listed.set)
        tier.on_schedule_end()
        assert tier.wait_recovered(10)
        assert tier.get_stats()["gauges"]["recovering"] is False
        # 8 fit: the two stored here and the 6 newest listed (3..8); 0, 1 and 2 are deleted
        assert [tier.lookup(k, CTX) for k in keys(*range(10), 20)] == [False] * 3 + [True] * 8
        assert tier.index.used_bytes == 8 * SlowListing.LISTED[0][1]
        assert tier.index.stored_keys()[:2] == keys(3, 4)  # the oldest listed go first
    finally:
        tier._runtime.submit(tier.store.listed.set)
        tier.shutdown()


def test_a_tier_that_lists_within_its_start_wait_is_warm_at_the_first_lookup(engine_factory, tmp_path):
    """A restarted engine that served at once (an offline LLM, a replica joining under load)
    missed every block its file tier held: what the listing found was indexed only as the
    tier was polled, steps later."""
    first = engine_factory(file_tier(tmp_path))
    first.store(0, 1, 2)
    first.close()
    engine = engine_factory(file_tier(tmp_path), recovered=False)  # no step, no wait of its own
    assert [engine.tier.lookup(k, CTX) for k in keys(0, 1, 2, 3)] == [True, True, True, False]
    assert engine.tier.get_stats()["gauges"]["recovering"] is False


def test_what_was_found_is_indexed_a_slice_per_poll_the_newest_first(monkeypatch):
    monkeypatch.setattr(recovery, "SLICE_BLOCKS", 3)
    tier = BlockStoreTier(None, RegionStandIn(8, ROW).create_kv_memoryview(), "slow", SlowListing)
    doorbell = Doorbell()
    tier.attach_doorbell(doorbell)
    try:
        tier._runtime.submit(tier.store.listed.set)
        tier.on_schedule_end()
        assert tier.drain(10)  # the listing is over; nothing is indexed until the tier is polled
        polls = []
        while doorbell.rung:  # as the manager polls a tier: only after a ring
            doorbell.rung = False
            tier.get_finished()
            polls.append([i for i in range(10) if tier.lookup(key(i), CTX)])
        assert polls == [[7, 8, 9], [4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 5, 6, 7, 8, 9], list(range(10))]
        assert tier.get_stats()["gauges"]["recovering"] is False
    finally:
        tier.shutdown()


def test_a_tier_without_keys_knows_its_files_by_name_and_size_and_checks_each_when_loaded(engine_factory, tmp_path):
    first = engine_factory(file_tier(tmp_path), num_blocks=8)
    first.store(0, 1, 2)
    torn, garbage = first.tier.store.path(key(1)), first.tier.store.path(key(2))
    first.close()
    torn.write_bytes(torn.read_bytes()[:-5])  # not an object's size: removed at start
    garbage.write_bytes(bytes(garbage.stat().st_size))  # an object's name and size: indexed, never loaded
    second = engine_factory(file_tier(tmp_path), num_blocks=8)
    assert not torn.exists() and len(second.tier.index) == 2
    assert second.lookup_until_done(0, 1, 2) == [True, False, False]
    assert second.tier.failures["load_corrupt"] == 1 and not garbage.exists()
    assert second.loaded_bytes(0) == [block_bytes(key(0), ROW)]
