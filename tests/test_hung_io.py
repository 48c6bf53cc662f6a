"""A storage call that never returns: the job fails within op_timeout_s, and no byte the late
thread writes ever reaches a row that is loadable or reused."""

import subprocess
import sys
import threading

import anyio
import anyio.to_thread
import numpy as np
import pytest

from tests.helpers import CTX, ROW, RegionStandIn, block_bytes, key, keys, one_drain, region_name
from tiering import (
    BlockStoreSettings,
    BlockStoreTier,
    CPUPrimaryTierOffloadingManager,
    JobMetadata,
    SharedOffloadRegion,
    TieringOffloadingManager,
)
from tiering.backends import MemoryBlockStore

LATE_BYTE = 0xEE


class StuckThreadStore(MemoryBlockStore):
    """A memory store whose reads or writes block a real thread (a dead NFS mount, a FIFO)
    until `unstick` is set; a stuck read then scribbles over the rows it was given, as a
    late DMA would. Like the file store, it never returns while its thread runs."""

    def __init__(self, fingerprint, stuck: str):
        super().__init__(fingerprint)
        self.stuck = stuck
        self.unstick = threading.Event()
        self.entered = threading.Event()
        self.calls = 0  # calls that got stuck

    def _block(self, buffers):
        self.calls += 1
        self.entered.set()
        self.unstick.wait()
        if self.stuck == "get":
            for buffer in buffers:
                buffer.cast("B")[:] = bytes([LATE_BYTE]) * buffer.nbytes
        raise OSError("the device answered, too late")

    async def _stuck_call(self, items):
        with anyio.CancelScope(shield=True):
            return await anyio.to_thread.run_sync(self._block, [buffer for _, buffer in items])

    async def get_many(self, items):
        if self.stuck == "get":
            return await self._stuck_call(items)
        return await super().get_many(items)

    async def put_many(self, items):
        if self.stuck == "put" and self.objects:  # the first job's puts go through
            return await self._stuck_call(items)
        return await super().put_many(items)

    async def delete_many(self, keys):
        if self.stuck == "delete":
            return await self._stuck_call([])
        return await super().delete_many(keys)


@pytest.fixture
def stuck_engine():
    made = []

    def make(stuck: str, **settings):
        region = SharedOffloadRegion(region_name(), 4, ROW)
        primary = CPUPrimaryTierOffloadingManager(4, region)
        stores = []

        def store_factory(fingerprint):
            stores.append(StuckThreadStore(fingerprint, stuck))
            return stores[0]

        tier = BlockStoreTier(
            None,
            primary.get_kv_memoryview(),
            "stuck",
            store_factory=store_factory,
            settings=BlockStoreSettings(op_timeout_s=0.2, shutdown_timeout_s=0.5, failure_threshold=100, **settings),
        )
        manager = TieringOffloadingManager(primary, [tier])
        made.append((manager, stores[0]))
        return manager, primary, tier, stores[0], np.asarray(primary.get_kv_memoryview())

    yield make
    for manager, store in made:
        store.unstick.set()
        manager.shutdown()


def store(manager, rows, *ids):
    out = manager.prepare_store(keys(*ids), CTX)
    for k, row in zip(out.keys_to_store, out.store_spec.block_ids, strict=True):
        rows[row] = np.frombuffer(block_bytes(k, ROW), dtype=rows.dtype)
    manager.complete_store(out.keys_to_store, CTX)
    return out


def step_until(manager, condition):
    while not condition():
        manager.on_schedule_end()
        threading.Event().wait(0.01)


def test_a_stuck_read_fails_its_promotion_and_its_row_stays_quarantined_until_the_thread_returns(stuck_engine):
    manager, primary, tier, stuck, rows = stuck_engine("get")
    store(manager, rows, 0, 1, 2, 3)
    assert tier.drain(10)
    manager.on_schedule_end()
    store(manager, rows, 4, 5, 6, 7)  # evicts 0..3 from the primary; they stay in the tier
    assert tier.drain(10)
    manager.on_schedule_end()

    assert manager.lookup(key(0), CTX) is None  # a promotion, whose read gets stuck
    manager.on_schedule_end()
    assert stuck.entered.wait(10)
    step_until(manager, lambda: tier.get_stats()["counters"]["jobs_failed"] == 1)  # reported while stuck
    assert not stuck.unstick.is_set()
    assert primary.lookup(key(0), CTX) is False
    assert tier.failures["load"] == 1
    assert primary.get_stats()["gauges"]["rows_quarantined"] == 1
    assert manager.get_stats()["manager"]["gauges"]["jobs_holding_rows"] == 1

    # Every other row is reused by new GPU stores; the quarantined one is not.
    assert manager.prepare_store(keys(10, 11, 12, 13), CTX) is None  # 3 rows only
    new = store(manager, rows, 10, 11, 12)
    (quarantined,) = set(range(4)) - {int(row) for row in new.store_spec.block_ids}

    stuck.unstick.set()  # the late read lands, in the quarantined row only
    step_until(manager, lambda: primary.get_stats()["gauges"]["rows_quarantined"] == 0)
    assert rows[quarantined].tobytes() == bytes([LATE_BYTE]) * ROW
    for k, row in zip(new.keys_to_store, new.store_spec.block_ids, strict=True):
        assert rows[row].tobytes() == block_bytes(k, ROW)
    assert manager.get_stats()["manager"]["gauges"]["jobs_holding_rows"] == 0
    assert primary.num_free_blocks == 1  # back in use


def test_a_stuck_write_fails_its_cascade_and_keeps_the_source_rows_pinned_until_it_returns(stuck_engine):
    manager, primary, tier, stuck, rows = stuck_engine("put")
    store(manager, rows, 0)
    assert tier.drain(10)
    manager.on_schedule_end()
    store(manager, rows, 1)  # its cascade's write gets stuck
    manager.on_schedule_end()
    assert stuck.entered.wait(10)
    step_until(manager, lambda: tier.get_stats()["counters"]["jobs_failed"] == 1)
    assert primary.ref_count(key(1)) == 1  # still pinned: the thread reads the row
    assert manager.get_stats()["manager"]["gauges"]["jobs_holding_rows"] == 1

    stuck.unstick.set()
    step_until(manager, lambda: primary.ref_count(key(1)) == 0)
    assert manager.get_stats()["manager"]["gauges"]["jobs_holding_rows"] == 0


def test_a_stuck_call_that_two_jobs_share_holds_the_rows_of_both_until_it_returns():
    stores = []

    def store_factory(fingerprint):
        stores.append(StuckThreadStore(fingerprint, "put"))
        return stores[0]

    view = RegionStandIn(4, ROW).create_kv_memoryview()
    settings = BlockStoreSettings(op_timeout_s=0.2, shutdown_timeout_s=0.5, failure_threshold=100)
    tier = BlockStoreTier(None, view, "stuck", store_factory=store_factory, settings=settings)
    stuck = stores[0]

    def submit(job_id, ids):
        tier.submit_store(JobMetadata(job_id, keys(*ids), np.array(ids, dtype=np.int64), False, CTX))

    try:
        submit(0, [0])  # the first job's puts go through
        assert tier.drain(10) and [r.success for r in tier.get_finished()] == [True]
        with one_drain(tier._runtime):
            submit(1, [1, 2])
            submit(2, [3])  # started with job 1: one call for both, which gets stuck
        tier.on_schedule_end()
        assert stuck.entered.wait(10)
        results = []
        while len(results) < 2:  # reported at the timeout while stuck (the test's timeout bounds it)
            results += tier.get_finished()
            threading.Event().wait(0.01)
        assert [(r.job_id, r.success, r.rows_in_use) for r in results] == [(1, False, True), (2, False, True)]
        assert stuck.calls == 1
        stuck.unstick.set()
        released = []
        while len(released) < 2:
            tier.get_finished()
            released += tier.take_released_jobs()
            threading.Event().wait(0.01)
        assert sorted(released) == [1, 2]
    finally:
        stuck.unstick.set()
        tier.shutdown()


def test_shutdown_gives_up_on_a_stuck_thread_and_returns(stuck_engine, caplog):
    # A shutdown that waited for the thread would deadlock here and fail on the test timeout.
    manager, _, tier, stuck, rows = stuck_engine("put")
    store(manager, rows, 0)
    assert tier.drain(10)
    store(manager, rows, 1)
    manager.on_schedule_end()
    assert stuck.entered.wait(10)
    tier.shutdown()
    assert "I/O still running 0.5 s into shutdown" in caplog.text
    assert any(thread.name == "tiering-stuck" and thread.is_alive() for thread in threading.enumerate())


def test_a_tier_whose_reads_stop_returning_turns_unhealthy_and_never_retries_the_block(stuck_engine):
    manager, primary, tier, stuck, rows = stuck_engine("get")  # its breaker would need 100 failures
    store(manager, rows, 0, 1, 2, 3)
    assert tier.drain(10)
    manager.on_schedule_end()
    store(manager, rows, 4, 5, 6, 7)
    assert tier.drain(10)
    manager.on_schedule_end()
    assert manager.lookup(key(0), CTX) is None
    manager.on_schedule_end()
    step_until(manager, lambda: tier.get_stats()["counters"]["jobs_failed"] == 1)
    assert not tier.health.healthy  # at once: its calls stop returning
    for _ in range(20):  # the scheduler asks again and again: no new read, no new stranded thread
        assert manager.lookup(key(0), CTX) is False
        assert manager.lookup(key(1), CTX) is False  # no work for an unhealthy tier
        manager.on_schedule_end()
    assert stuck.calls == 1 and len(tier.index) == 7  # key 0 was dropped
    assert primary.get_stats()["gauges"]["rows_quarantined"] == 1  # the one row the thread may write

    stuck.unstick.set()  # the mount answers again: the row comes back, a probe finds the tier well
    step_until(manager, lambda: primary.get_stats()["gauges"]["rows_quarantined"] == 0 and tier.health.healthy)
    assert tier.lookup(key(0), CTX) is False and tier.lookup(key(1), CTX) is True


@pytest.mark.parametrize("stuck_call", ["put", "delete"])
def test_a_tier_whose_writes_or_deletes_stop_returning_turns_unhealthy_and_gets_no_more_work(stuck_engine, stuck_call):
    capacity = {"capacity_bytes": 2 * ROW + 1000} if stuck_call == "delete" else {}  # room for 2: deletes
    manager, _, tier, stuck, rows = stuck_engine(stuck_call, **capacity)
    store(manager, rows, 0)
    assert tier.drain(10)
    manager.on_schedule_end()
    store(manager, rows, 1, 2)  # a stuck write, or (three blocks in a tier of two) a stuck delete
    manager.on_schedule_end()
    assert stuck.entered.wait(10)
    step_until(manager, lambda: not tier.health.healthy)  # at the op timeout, not after 100 failures
    for i in range(20, 40):  # stores keep coming: none reaches the stuck backend
        out = manager.prepare_store(keys(i), CTX)
        if out is not None:
            manager.complete_store(out.keys_to_store, CTX)
        manager.on_schedule_end()
    assert stuck.calls == 1
    assert tier.get_stats()["gauges"]["healthy"] == 0


def test_a_call_stuck_in_a_file_tier_never_keeps_the_process_from_exiting(tmp_path):
    code = f"""
import threading
import numpy as np
from tiering import JobMetadata, ReqContext, SecondaryTierFactory, make_offload_key
from tiering.backends.file import objects as file_io

rows = memoryview(bytearray(4 * 4096)).cast("B", (4, 4096))
config = {{"type": "file", "root_dir": {str(tmp_path)!r}, "layout": "files", "op_timeout_s": 0.2,
          "shutdown_timeout_s": 0.2}}
tier = SecondaryTierFactory.create_secondary_tier(config, rows, None)
file_io.read_object = lambda *args: threading.Event().wait()  # a read in a hung mount
key, context = make_offload_key(bytes(8), 0), ReqContext("r")
tier.submit_store(JobMetadata(1, [key], np.array([0]), False, context))
tier.on_schedule_end()
tier.drain(10)
tier.get_finished()
tier.submit_load(JobMetadata(2, [key], np.array([1]), True, context))
tier.on_schedule_end()
while not tier.get_finished():
    threading.Event().wait(0.05)
tier.shutdown()
print("exiting with a thread stuck:", sum(t.name.startswith("tiering-file-read") for t in threading.enumerate()))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "exiting with a thread stuck: 1" in done.stdout


class MiscountingStore(MemoryBlockStore):
    """A buggy third-party store: `put_many` answers for one block too few."""

    async def put_many(self, items):
        return (await super().put_many(items))[:-1]


def test_a_job_that_breaks_while_running_or_starting_fails_once_and_the_tier_goes_on(monkeypatch):
    region = SharedOffloadRegion(region_name(), 8, ROW)
    primary = CPUPrimaryTierOffloadingManager(8, region)
    tier = BlockStoreTier(None, primary.get_kv_memoryview(), "buggy", store_factory=MiscountingStore)
    manager = TieringOffloadingManager(primary, [tier])
    rows = np.asarray(primary.get_kv_memoryview())
    try:
        store(manager, rows, 0, 1)
        assert tier.drain(10)
        manager.on_schedule_end()
        assert tier.get_stats()["counters"]["jobs_failed"] == 1 and tier.failures["internal"] == 1
        assert primary.ref_count(key(0)) == 0  # the cascade's pins were released

        def broken(*args):
            raise RuntimeError("bug while starting a job")

        monkeypatch.setattr(tier._worker, "_store_waits", broken)
        store(manager, rows, 2)
        assert tier.drain(10)
        manager.on_schedule_end()
        assert tier.get_stats()["counters"]["jobs_failed"] == 2 and tier.failures["start"] == 1
        assert primary.ref_count(key(2)) == 0
        assert manager.get_stats()["manager"]["gauges"]["jobs_in_flight"] == 0
        monkeypatch.undo()

        store(manager, rows, 3)  # a single block: the store answers for none of it
        assert tier.drain(10)
        manager.on_schedule_end()
        assert tier.lookup(key(0), CTX) is False and tier.health.healthy
    finally:
        manager.shutdown()


@pytest.mark.asyncio
async def test_a_call_that_returns_in_the_turn_its_timeout_fires_is_not_hung():
    """Its result arrives before the caller resumes: it returned, so no row stays held (the
    caller once counted it hung for ever, and its job's rows stayed quarantined)."""
    import asyncio

    from tiering.tiers.blockstore.calls import StoreCalls
    from tiering.tiers.blockstore.outbox import Outbox, StoreDone

    calls, done = StoreCalls(0.0, Outbox()), StoreDone(job_id=1)  # the timeout fires in the first turn

    async def operation():
        await asyncio.sleep(0)  # the timer, started as the lane is held, fires in the next turn
        await asyncio.sleep(0)  # and this returns in the turn after, before the caller resumes
        return "stored"

    assert await calls.call([done], asyncio.Semaphore(1), operation) == "stored"
    while calls.running:
        await asyncio.wait(calls.running)
    assert done.hung == 0


@pytest.mark.asyncio
async def test_time_queued_for_a_lane_is_not_counted_against_a_calls_timeout():
    """A call queued longer than its timeout behind the lane's holder, then answered at
    once: it is answered, not failed as hung."""
    import asyncio

    from tiering.tiers.blockstore.calls import StoreCalls
    from tiering.tiers.blockstore.outbox import Outbox, StoreDone

    calls, lane, job = StoreCalls(0.2, Outbox()), asyncio.Semaphore(1), StoreDone(job_id=1)

    async def delete():
        return "deleted"  # at once: within any timeout

    await lane.acquire()  # another call holds the lane
    queued = asyncio.ensure_future(calls.call([job], lane, delete))
    await asyncio.sleep(0.5)  # at least this long: past the timeout, still queued
    lane.release()
    assert await queued == "deleted" and job.hung == 0


@pytest.mark.asyncio
async def test_deletes_queued_behind_a_call_share_the_next_call():
    """Every evicting step sends a delete, and each took a call of its own, one at a time: a
    backend slower than the steps fell a call further behind at every step. Those that queue
    behind a call share the next one."""
    import asyncio

    from tiering.tiers.blockstore.calls import StoreCalls
    from tiering.tiers.blockstore.deletes import Deletes
    from tiering.tiers.blockstore.outbox import Outbox

    deletes, gate, calls = Deletes(StoreCalls(30.0, Outbox())), asyncio.Event(), []

    class SlowStore:
        async def ready(self):  # `BlockStore.ready`: nothing to wait for
            return None

        async def delete_many(self, keys):
            calls.append(list(keys))
            await gate.wait()

    store = SlowStore()
    first = asyncio.ensure_future(deletes.delete(store, keys(0)))
    while not calls:  # the first call holds the lane
        await asyncio.sleep(0)
    queued = [asyncio.ensure_future(deletes.delete(store, keys(i))) for i in (1, 2, 3)]
    await asyncio.sleep(0)
    gate.set()
    assert await asyncio.gather(first, *queued) == [None] * 4
    assert calls == [keys(0), keys(1, 2, 3)] and deletes.calls == 2
