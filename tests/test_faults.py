"""Faults never crash the scheduler, never load wrong bytes, never leak."""

import errno
import multiprocessing
import os
import signal
import subprocess
import time
from functools import partial

import numpy as np
import pytest

from tests import region_worker
from tests.helpers import CTX, ROW, ManualClock, RegionStandIn, block_bytes, key, keys
from tiering import BlockStoreSettings, BlockStoreTier, JobMetadata, SecondaryTierFactory
from tiering.backends import FileBlockStore
from tiering.backends.file import objects as file_io
from tiering.testing.block_store import FINGERPRINT, read_verified
from tiering.testing.s3_server import MotoServer


def make_tier(config, num_blocks=8):
    view = RegionStandIn(num_blocks, ROW).create_kv_memoryview()
    return SecondaryTierFactory.create_secondary_tier(config, view, None), np.asarray(view)


def disk_tier(root, clock, num_blocks=8, layout="files", **settings):
    """A file tier on `root` (buffered I/O, one file per block unless `layout` says else)
    whose full-device retries follow `clock`."""
    view = RegionStandIn(num_blocks, ROW).create_kv_memoryview()
    store = partial(FileBlockStore, root, direct_io=False, layout=layout)
    return BlockStoreTier(None, view, "file", store, BlockStoreSettings(**settings), clock=clock), np.asarray(view)


def job(job_id, ids, rows, promotion):
    return JobMetadata(job_id, keys(*ids), np.array(rows, dtype=np.int64), promotion, CTX)


def finish(tier):
    tier.on_schedule_end()
    assert tier.drain(30)
    return {result.job_id: result.success for result in tier.get_finished()}


def test_every_corrupted_read_is_rejected_and_the_key_dropped(engine_factory):
    engine = engine_factory({"type": "faulty", "inner": {"type": "memory"}, "corruption_rate": 1.0})
    engine.store(0, 1, 2, 3)
    engine.store(4, 5, 6, 7)  # 0..3 now only in the faulty tier
    assert engine.lookup_until_done(0, 1) == [False, False]  # every read was corrupted: never loaded
    assert engine.tier.failures["load_corrupt"] == 2
    assert engine.tier.lookup(key(0), CTX) is False
    assert engine.primary.lookup(key(0), CTX) is False  # the row reserved for it was freed


def test_a_hung_backend_times_out_into_failed_jobs():
    tier, _ = make_tier({"type": "faulty", "inner": {"type": "memory"}, "hang_rate": 1.0, "op_timeout_s": 0.2})
    try:
        tier.submit_store(job(1, [0, 1], [0, 1], False))
        assert finish(tier) == {1: False}
        assert tier.failures["store"] == 2
    finally:
        tier.shutdown()


def test_shutdown_returns_while_the_backend_hangs_and_reports_the_jobs_failed():
    tier, _ = make_tier({"type": "faulty", "inner": {"type": "memory"}, "hang_rate": 1.0, "op_timeout_s": 300})
    tier.submit_store(job(1, [0], [0], False))
    tier.submit_store(job(2, [1], [1], False))
    tier.on_schedule_end()
    tier.shutdown()  # bounded by cancelling the hung operations, not by their 300 s timeout
    assert {r.job_id: r.success for r in tier.get_finished()} == {1: False, 2: False}


def test_a_full_disk_fails_stores_cleanly_holds_what_fits_and_keeps_serving_loads(tmp_path, monkeypatch, caplog):
    tier, rows = make_tier({"type": "file", "root_dir": str(tmp_path), "direct_io": False, "layout": "files"})
    try:
        rows[:4] = np.frombuffer(b"".join(block_bytes(k, ROW) for k in keys(0, 1, 2, 3)), np.uint8).reshape(4, ROW)
        tier.submit_store(job(1, [0, 1, 2, 3], [0, 1, 2, 3], False))
        assert finish(tier) == {1: True}

        def disk_full(fd, buffers):
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(os, "writev", disk_full)
        tier.submit_store(job(2, [4, 5], [4, 5], False))
        assert finish(tier) == {2: False}
        assert tier.failures["store_no_space"] == 2 and tier.health.healthy
        assert tier.index.room_bytes == tier.index.used_bytes == 4 * tier.object_bytes(key(0))
        assert tier.index.capacity_bytes is None  # the configured capacity is kept, to come back to
        rows[6:8] = 0
        tier.submit_load(job(3, [0, 1], [6, 7], True))  # loads are still served
        assert finish(tier) == {3: True}
        assert rows[6].tobytes() == block_bytes(key(0), ROW)
        monkeypatch.undo()
        tier.submit_store(job(4, [4], [4], False))  # space again: the least recent block makes room
        assert finish(tier) == {4: True}
        assert tier.lookup(key(4), CTX) is True and len(tier.index) == 4
        assert "device full" in caplog.text
    finally:
        tier.shutdown()


@pytest.mark.asyncio
async def test_a_process_killed_while_writing_leaves_only_intact_blocks(tmp_path, monkeypatch):
    monkeypatch.setattr(file_io, "TEMPORARY_GRACE_S", 0.0)  # restarted once its writes can no longer be in flight
    store = FileBlockStore(tmp_path, FINGERPRINT, direct_io=False)
    await store.open()  # creates the namespace and shard directories
    await store.close()

    def files():
        return [name for _, _, names in os.walk(store.directory) for name in names]

    spawn = multiprocessing.get_context("spawn")
    writer = spawn.Process(
        target=region_worker.write_blocks_forever, args=(tmp_path, FINGERPRINT, 256 << 10), daemon=True
    )
    writer.start()
    deadline = time.monotonic() + 30
    while len(files()) < 40 and time.monotonic() < deadline:
        time.sleep(0.01)
    os.kill(writer.pid, signal.SIGKILL)  # in the middle of some write
    writer.join(30)
    await store.open()
    try:
        recovered = await store.recover()
        assert len(recovered) >= 20
        for k, _ in recovered:
            into = memoryview(bytearray(256 << 10))
            await read_verified(store, k, into)  # every block a restart loads is whole and exact
            assert bytes(into) == block_bytes(k, 256 << 10)
        assert [name for name in files() if name.endswith(".tmp")] == []
    finally:
        await store.close()


@pytest.mark.asyncio
async def test_wrong_credentials_are_a_clear_error(s3_environment):
    from tiering.backends.s3 import S3BlockStore

    server = MotoServer(environment={"INITIAL_NO_AUTH_ACTION_COUNT": "0"})  # this server checks credentials
    server.start()
    try:
        store = S3BlockStore(FINGERPRINT, "some-bucket", endpoint_url=server.endpoint_url, max_attempts=1)
        with pytest.raises(PermissionError, match=r"access denied \(403\); check the credentials"):
            await store.open()
    finally:
        server.stop()


def fill(path) -> None:
    with open(path, "wb", buffering=0) as filler:
        try:
            while True:
                filler.write(b"\0" * 4096)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC


def store_blocks(tier, rows, job_id, ids):
    for i in ids:
        rows[i % len(rows)] = np.frombuffer(block_bytes(key(i), ROW), np.uint8)
    tier.submit_store(job(job_id, ids, [i % len(rows) for i in ids], False))
    return finish(tier)[job_id]


def test_a_disk_filled_by_another_process_is_used_again_once_space_comes_back(small_disk, monkeypatch):
    monkeypatch.setattr("tiering.tiers.blockstore.index.ROOM_BACKOFF_S", (0.2, 0.4))
    clock = ManualClock()
    tier, rows = disk_tier(small_disk / "tier", clock)
    try:
        fill(small_disk / "someone-elses-file")
        assert store_blocks(tier, rows, 1, [0, 1]) is False
        assert tier.index.room_bytes == 0 and tier.health.healthy
        assert store_blocks(tier, rows, 2, [2]) is False  # refused without I/O while full
        assert tier.failures["store_no_space"] == 2
        os.unlink(small_disk / "someone-elses-file")
        clock.now += 0.25  # the first retry is due
        assert store_blocks(tier, rows, 3, [3, 4]) is True  # the room, raised, fits them
        assert len(tier.index) == 2 and tier.index.room_bytes >= tier.index.used_bytes
        clock.now += 0.25  # the next retry: the tier does not use all its room, which is forgotten
        assert store_blocks(tier, rows, 4, [5]) is True
        assert tier.index.room_bytes is None and len(tier.index) == 3
    finally:
        tier.shutdown()


@pytest.mark.parametrize("layout", ["files", "segments"])
def test_a_tier_started_on_a_full_disk_starts_fails_its_stores_and_stores_once_there_is_room(
    small_disk, monkeypatch, layout
):
    """The segment layout's start-up check of hole punching met ENOSPC and called it "cannot
    punch holes": the engine refused to start (under vllm serve, the server never came up)."""
    monkeypatch.setattr("tiering.tiers.blockstore.index.ROOM_BACKOFF_S", (0.2, 0.4))
    clock = ManualClock()
    fill(small_disk / "someone-elses-file")
    tier, rows = disk_tier(small_disk / "tier", clock, layout=layout)
    try:
        assert tier.lookup(key(0), CTX) is False
        assert store_blocks(tier, rows, 1, [0, 1]) is False
        assert tier.failures["store_no_space"] == 2 and tier.health.healthy
        os.unlink(small_disk / "someone-elses-file")
        clock.now += 0.25  # the first retry is due
        assert store_blocks(tier, rows, 2, [2, 3]) is True
        assert tier.lookup(key(2), CTX) is True
    finally:
        tier.shutdown()


def test_a_tier_that_filled_the_disk_regains_its_capacity_when_the_disk_grows(small_disk, monkeypatch):
    monkeypatch.setattr("tiering.tiers.blockstore.index.ROOM_BACKOFF_S", (0.2, 0.4))
    clock = ManualClock()
    tier, rows = disk_tier(small_disk / "tier", clock, capacity_bytes=4 << 20)
    try:
        ids = iter(range(10**6))
        while store_blocks(tier, rows, next(ids), [next(ids)]):
            pass
        held = tier.index.room_bytes
        assert held == tier.index.used_bytes and 0 < held <= 1 << 20
        subprocess.run(["mount", "-o", "remount,size=4m", str(small_disk)], check=True)
        while tier.index.room_bytes is not None:  # raised an eighth per retry (the test's timeout bounds it)
            clock.now += 0.5  # the next retry is due
            assert store_blocks(tier, rows, next(ids), [next(ids)])  # every raise fits: nothing fails
        assert tier.index.used_bytes > held
    finally:
        tier.shutdown()


@pytest.mark.parametrize("layout", ["files", "segments"])
def test_a_full_disk_under_steady_stores_keeps_its_room_and_evicts_only_the_shortfall(small_disk, monkeypatch, layout):
    """Stores keep coming while evicted objects are still being deleted: the room must stay
    at what the disk holds, not ratchet down by what was in flight at each refusal. Each
    step waits for the jobs of the step before it (a scheduler's pace: its steps take time),
    so the jobs of two steps and the deletes they evicted for overlap."""
    monkeypatch.setattr("tiering.tiers.blockstore.index.ROOM_BACKOFF_S", (0.05, 0.2))  # retries within the test
    clock = ManualClock()
    tier, _ = disk_tier(small_disk / "tier", clock, layout=layout)
    try:
        held, offered, next_key, running = [], 0, 0, set()
        for step in range(300):
            for _ in range(4):  # jobs in flight at once, as a busy scheduler sends them
                running.add(step * 4 + _)
                tier.submit_store(job(step * 4 + _, range(next_key, next_key + 8), range(8), False))
                next_key += 8
                offered += 8
            tier.on_schedule_end()
            while running and min(running) < step * 4:  # the test's timeout bounds it
                running.difference_update(result.job_id for result in tier.get_finished())
                time.sleep(0.001)
            clock.now += 0.002
            held.append(tier.index.used_bytes)
        disk = 1 << 20
        stored = tier.get_stats()["counters"]["blocks_stored"]
        evicted = tier.get_stats()["counters"]["evictions"]
        assert sorted(held[100:])[len(held[100:]) // 2] >= 0.8 * disk  # the median, once full
        assert tier.failures["store_no_space"] < 0.1 * offered
        assert evicted <= stored  # never more than what stores displaced
    finally:
        tier.shutdown()
