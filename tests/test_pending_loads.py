"""Hits answered while their promotion runs: the worker's load waits for the rows
(`tiering.cpu.row_states`), and a promotion that fails leaves its GPU blocks unwritten and named,
never loaded. Real engine, real block-store tiers, real handlers on the CPU device."""

import threading
import time

import numpy as np
import pytest
import torch

from tests.helpers import ManualTier, key, keys, region_name
from tiering import (
    CpuGpuOffloadingHandlers,
    CPULoadStoreSpec,
    CPUPrimaryTierOffloadingManager,
    GPULoadStoreSpec,
    ReqContext,
    SecondaryTierFactory,
    SharedOffloadRegion,
    TieringOffloadingManager,
    canonicalize_kv_caches,
)
from tiering.cpu import row_states
from tiering.cpu.row_states import FAILED, PENDING, READY, RowStates

NUM_ROWS = 4
NUM_GPU_BLOCKS = 8
PAGE = 4096  # bytes of one GPU block of the one KV tensor: a CPU row is one page


class Engine:
    """A scheduler (manager, one tier from `tier_config`) and a worker (handlers over GPU
    pages in host memory) sharing one region."""

    def __init__(self, tier_config):
        instance = region_name()
        self.region = SharedOffloadRegion(instance, NUM_ROWS, PAGE)
        self.worker_region = SharedOffloadRegion(instance, NUM_ROWS, PAGE, rank=0)
        primary = CPUPrimaryTierOffloadingManager(NUM_ROWS, self.region)
        view = primary.get_kv_memoryview()
        self.tier = SecondaryTierFactory.create_secondary_tier(tier_config, view, None)
        self.manager = TieringOffloadingManager(primary, [self.tier], reset_scope="cpu")  # resets empty the CPU tier
        self.manager.answer_pending_hits = True
        self.gpu = torch.zeros((NUM_GPU_BLOCKS, PAGE), dtype=torch.int8)
        caches = canonicalize_kv_caches([self.gpu], NUM_GPU_BLOCKS)
        self.handlers = CpuGpuOffloadingHandlers(caches, 1, NUM_ROWS, mmap_region=self.worker_region)

    def fill(self, gpu_block: int, value: int) -> None:
        self.gpu[gpu_block] = value

    def store(self, ctx, ids, gpu_blocks):
        """GPU blocks -> CPU rows -> the tier (cascaded and drained)."""
        out = self.manager.prepare_store(keys(*ids), ctx)
        spec = (GPULoadStoreSpec(gpu_blocks, [len(gpu_blocks)], [0]), out.store_spec)
        assert self.handlers.gpu_to_cpu_handler.transfer_async(1000 + ids[0], spec)
        self.handlers.gpu_to_cpu_handler.wait([1000 + ids[0]])
        assert all(result.success for result in self.handlers.gpu_to_cpu_handler.get_finished())
        self.manager.complete_store(out.keys_to_store, ctx)
        assert self.tier.drain(30)
        self.manager.on_schedule_end()

    def load(self, job_id, cpu_spec, gpu_blocks):
        spec = (cpu_spec, GPULoadStoreSpec(gpu_blocks, [len(gpu_blocks)], [0]))
        handler = self.handlers.cpu_to_gpu_handler
        assert handler.transfer_async(job_id, spec)
        handler.wait([job_id])
        (result,) = handler.get_finished()
        return result

    def close(self):
        self.handlers.shutdown()
        self.manager.shutdown()
        self.worker_region.cleanup()


@pytest.fixture
def engine_of():
    made = []

    def make(tier_config):
        made.append(Engine(tier_config))
        return made[-1]

    yield make
    for engine in made:
        engine.close()


def only_in_the_tier(engine, ctx, ids):
    """Store blocks `ids` (GPU blocks 0.., each filled with its id + 1), then empty the CPU
    tier: the blocks are in the secondary tier only."""
    for i, block_id in enumerate(ids):
        engine.fill(i, block_id + 1)
    engine.store(ctx, list(ids), list(range(len(ids))))
    engine.manager.reset_cache()
    engine.gpu.zero_()


def test_a_hit_is_answered_in_the_step_its_promotion_starts_and_the_load_waits_for_it(engine_of):
    engine = engine_of({"type": "memory", "latency_s": 0.05})  # the load is submitted before the rows land
    ctx = ReqContext("req-0")
    only_in_the_tier(engine, ctx, [0, 1])
    assert [engine.manager.lookup(k, ctx) for k in keys(0, 1)] == [True, True]
    cpu_spec = engine.manager.prepare_load(keys(0, 1), ctx)
    states = engine.region.create_row_states().states
    assert [states[row] for row in cpu_spec.block_ids] == [PENDING, PENDING]
    engine.manager.on_schedule_end()  # submits the promotion
    result = engine.load(1, cpu_spec, [5, 6])
    assert result.success and result.failed_block_ids == ()
    assert [int(engine.gpu[block][0]) for block in (5, 6)] == [1, 2]
    assert all((engine.gpu[block] == block - 4).all() for block in (5, 6))
    engine.manager.complete_load(keys(0, 1), ctx)  # may come before the manager hears of the promotion
    assert engine.manager.get_stats()["tiers"]["memory"]["counters"]["hit_blocks"] == 2
    engine.manager.lookup(key(9), ctx)  # next step: the promotion is processed
    assert [engine.manager.primary_tier.ref_count(k) for k in keys(0, 1)] == [0, 0]
    assert [engine.manager.lookup(k, ctx) for k in keys(0, 1)] == [True, True]


def test_a_promotion_pending_past_a_loads_wait_is_a_miss_so_the_request_recomputes(engine_of, monkeypatch):
    """A frozen tier's promotion: lookups answered "hit" until its job timed out (30 s and
    more), and every step's loads waited in vain for it. Past `PROMOTION_WAIT_S` a lookup
    answers "miss"."""
    monkeypatch.setattr(row_states, "PROMOTION_WAIT_S", 600.0)
    engine = engine_of({"type": "memory"})
    ctx, later = ReqContext("req-0"), ReqContext("req-1")
    only_in_the_tier(engine, ctx, [0])
    assert engine.manager.lookup(key(0), ctx) is True  # its promotion queued: a load may wait for it
    monkeypatch.setattr(row_states, "PROMOTION_WAIT_S", 0.0)  # as if a load's wait had passed since
    assert engine.manager.lookup(key(0), later) is False
    assert engine.manager.get_stats()["manager"]["counters"]["promotions_overdue"] == 1
    engine.manager.on_schedule_end()  # the promotion is submitted and lands
    assert engine.tier.drain(30)
    engine.manager.on_schedule_end()
    assert engine.manager.lookup(key(0), later) is True  # in the CPU tier now


def test_a_load_copies_each_row_as_its_promotion_lands_not_after_the_last(engine_of, monkeypatch):
    monkeypatch.setattr(row_states, "PROMOTION_WAIT_S", 600.0)  # the test settles the rows by hand
    engine = engine_of({"type": "memory"})
    ctx = ReqContext("req-0")
    engine.fill(0, 1)
    engine.fill(1, 2)
    engine.store(ctx, [0, 1], [0, 1])
    cpu_spec = engine.manager.prepare_load(keys(0, 1), ctx)
    first, second = cpu_spec.block_ids
    states = engine.manager.primary_tier.row_states
    states.mark([first, second], PENDING)  # both rows' bytes still landing, as under a promotion
    handler = engine.handlers.cpu_to_gpu_handler
    turns, copied = [], threading.Event()
    copy_now = handler._copy_now

    def recording(copies):
        copy_now(copies)
        turns.append(sorted({row for copy in copies for row in copy.cpu_rows.tolist()}))
        copied.set()

    monkeypatch.setattr(handler, "_copy_now", recording)
    assert handler.transfer_async(1, (cpu_spec, GPULoadStoreSpec([5, 6], [2], [0])))
    states.settle(first, ok=True)
    assert copied.wait(60)
    assert turns == [[first]] and (engine.gpu[5] == 1).all() and not engine.gpu[6].any()
    assert handler.get_finished() == []  # the job is not over: its second row is still landing
    states.settle(second, ok=True)
    handler.wait([1])
    (result,) = handler.get_finished()
    assert result.success and result.failed_block_ids == ()
    assert turns == [[first], [second]] and (engine.gpu[6] == 2).all()
    engine.manager.complete_load(keys(0, 1), ctx)


def raising(*_):
    raise RuntimeError("a bug in the copy")


def test_a_failed_gpu_store_is_never_kept_and_a_failed_load_names_every_block(engine_of, monkeypatch, caplog):
    engine = engine_of({"type": "memory"})
    ctx = ReqContext("req-0")
    engine.fill(0, 1)
    engine.fill(2, 3)
    engine.store(ctx, [0, 2], [0, 2])  # blocks 0 and 2 in the CPU tier
    store, load = engine.handlers.gpu_to_cpu_handler, engine.handlers.cpu_to_gpu_handler
    monkeypatch.setattr(store, "_copy_now", raising)
    out = engine.manager.prepare_store(keys(1), ctx)
    assert store.transfer_async(7, (GPULoadStoreSpec([1], [1], [0]), out.store_spec))
    store.wait([7])
    (result,) = store.get_finished()
    assert not result.success and result.failed_block_ids == ()
    states = engine.manager.primary_tier.row_states.states
    assert states[out.store_spec.block_ids[0]] == FAILED  # the worker's mark, read by the scheduler's side
    engine.manager.complete_store(out.keys_to_store, ctx)  # as vLLM completes every store
    assert engine.manager.primary_tier.lookup(key(1), ctx) is False  # not kept
    assert engine.manager.primary_tier.get_stats()["counters"]["blocks_store_failed"] == 1
    assert engine.manager.primary_tier.num_free_blocks == NUM_ROWS - 2  # its row came back
    assert not engine.tier.has_pending_work()  # and nothing was cascaded from it
    monkeypatch.setattr(load, "_copy_now", raising)
    result = engine.load(8, engine.manager.prepare_load(keys(0, 2), ctx), [5, 4])
    assert not result.success and result.failed_block_ids == (4, 5)  # for vLLM to recompute
    assert "a bug in the copy" in caplog.text


def test_a_failed_promotion_is_never_loaded_and_its_gpu_blocks_are_named(engine_of):
    engine = engine_of({"type": "faulty", "inner": {"type": "memory"}, "corruption_rate": 1.0, "seed": 0})
    ctx = ReqContext("req-0")
    only_in_the_tier(engine, ctx, [0, 1])
    assert [engine.manager.lookup(k, ctx) for k in keys(0, 1)] == [True, True]
    cpu_spec = engine.manager.prepare_load(keys(0, 1), ctx)
    engine.manager.on_schedule_end()
    engine.gpu.fill_(7)
    result = engine.load(1, cpu_spec, [5, 6])
    assert result.success and result.failed_block_ids == (5, 6)
    assert (engine.gpu == 7).all()  # nothing copied: the corrupted bytes never reach the GPU
    primary = engine.manager.primary_tier
    engine.manager.lookup(key(9), ctx)  # the failed promotion is processed while the load still pins its rows
    assert primary.get_stats()["gauges"]["rows_quarantined"] == 2
    engine.manager.complete_load(keys(0, 1), ctx)
    assert primary.get_stats()["gauges"]["rows_quarantined"] == 0
    assert primary.num_free_blocks == NUM_ROWS
    assert not primary.row_states.states.any()  # every row READY again
    engine.fill(0, 42)  # the freed rows work as any others
    engine.store(ctx, [20], [0])
    assert engine.load(2, engine.manager.prepare_load(keys(20), ctx), [3]).failed_block_ids == ()
    assert (engine.gpu[3] == 42).all()


def test_only_the_failed_rows_of_a_load_are_left_out(engine_of):
    engine = engine_of({"type": "memory"})
    ctx = ReqContext("req-0")
    engine.fill(0, 1)
    engine.store(ctx, [0], [0])  # block 0 in the CPU tier, ready
    out = engine.manager.prepare_store(keys(1), ctx)  # a row for block 1, whose promotion fails
    states = engine.manager.primary_tier.row_states
    (row,) = out.store_spec.block_ids
    states.settle(row, ok=False)
    rows = np.array([engine.manager.prepare_load(keys(0), ctx).block_ids[0], row])
    result = engine.load(1, CPULoadStoreSpec(rows), [4, 5])
    assert result.failed_block_ids == (5,)
    assert (engine.gpu[4] == 1).all() and not engine.gpu[5].any()


def test_a_late_promotion_stops_the_wait_at_its_bound(engine_of, monkeypatch):
    monkeypatch.setattr(row_states, "PROMOTION_WAIT_S", 0.0)
    engine = engine_of({"type": "memory"})
    ctx = ReqContext("req-0")
    out = engine.manager.prepare_store(keys(0), ctx)
    engine.manager.primary_tier.row_states.mark(out.store_spec.block_ids, PENDING)  # never settled
    assert engine.load(1, out.store_spec, [2]).failed_block_ids == (2,)


def test_row_states_wait_any_returns_once_a_row_is_not_pending_or_at_the_deadline():
    states = RowStates(np.array([READY, FAILED, PENDING, READY], dtype=np.uint8))
    assert states.wait_any(np.array([2, 3]), time.monotonic() + 60).tolist() == [PENDING, READY]
    assert states.wait_any(np.array([1, 2]), time.monotonic() + 60).tolist() == [FAILED, PENDING]
    assert states.wait_any(np.array([2]), time.monotonic()).tolist() == [PENDING]  # the deadline
    states.settle(2, ok=True)
    assert states.wait_any(np.array([2]), time.monotonic() + 60).tolist() == [READY]
    with pytest.raises(ValueError, match="1-D uint8"):
        RowStates(np.zeros((2, 2), dtype=np.uint8))


def test_a_reset_frees_the_rows_of_failed_promotions_a_void_load_pinned(engine_of):
    engine = engine_of({"type": "faulty", "inner": {"type": "memory"}, "corruption_rate": 1.0, "seed": 0})
    ctx = ReqContext("req-0")
    only_in_the_tier(engine, ctx, [0, 1])
    assert [engine.manager.lookup(k, ctx) for k in keys(0, 1)] == [True, True]
    engine.manager.prepare_load(keys(0, 1), ctx)  # its transfer will be void: complete_load never comes
    engine.manager.on_schedule_end()
    assert engine.tier.drain(30)
    engine.manager.lookup(key(9), ctx)
    primary = engine.manager.primary_tier
    assert primary.get_stats()["gauges"]["rows_quarantined"] == 2
    engine.manager.reset_cache()
    assert primary.get_stats()["gauges"]["rows_quarantined"] == 0
    assert primary.num_free_blocks == NUM_ROWS and not primary.row_states.states.any()


def test_a_tier_whose_row_states_hook_raises_is_logged_and_its_hits_wait_for_their_promotions(caplog):
    class Broken(ManualTier):
        def attach_row_states(self, row_states):
            raise RuntimeError("no states for me")

    tier = Broken()
    tier.present[key(0)] = True
    region = SharedOffloadRegion(region_name(), NUM_ROWS, PAGE)
    with caplog.at_level("ERROR"):
        manager = TieringOffloadingManager(CPUPrimaryTierOffloadingManager(NUM_ROWS, region), [tier])
    try:
        manager.answer_pending_hits = True
        assert "attach_row_states failed" in caplog.text
        assert manager.lookup(key(0), ReqContext("req-0")) is None  # not a hit before it lands
        assert not manager.pending_loadable(key(0))
    finally:
        manager.shutdown()


def test_a_failed_store_its_caller_fails_itself_leaves_no_scan_behind(engine_of, monkeypatch):
    engine = engine_of({"type": "memory"})
    ctx = ReqContext("req-0")
    store = engine.handlers.gpu_to_cpu_handler
    monkeypatch.setattr(store, "_copy_now", raising)
    out = engine.manager.prepare_store(keys(1), ctx)
    assert store.transfer_async(7, (GPULoadStoreSpec([1], [1], [0]), out.store_spec))
    store.wait([7])
    assert not store.get_finished()[0].success
    states = engine.manager.primary_tier.row_states
    assert states.store_failures_pending()
    engine.manager.complete_store(out.keys_to_store, ctx, success=False)  # a caller that saw the failure
    monkeypatch.undo()
    engine.fill(2, 3)
    engine.store(ctx, [2], [2])  # the next completed store finds no FAILED row left
    assert not states.store_failures_pending()


def test_the_loads_a_step_submits_together_share_one_deadline(engine_of, monkeypatch):
    """One thread copies the loads in turn; each took its own `PROMOTION_WAIT_S` as it
    started, so a step with four loads on a frozen tier's rows waited four times as long."""
    engine = engine_of({"type": "memory"})
    ctx = ReqContext("req-0")
    out = engine.manager.prepare_store(keys(0, 1), ctx)
    states = engine.manager.primary_tier.row_states
    states.mark(out.store_spec.block_ids, PENDING)  # never settled: the promotions of a frozen tier
    deadlines = []
    wait_any = RowStates.wait_any

    def recorded(self, rows, deadline):  # the worker's view of the rows' states
        deadlines.append(deadline)
        return wait_any(self, rows, deadline)

    monkeypatch.setattr(RowStates, "wait_any", recorded)
    monkeypatch.setattr(row_states, "PROMOTION_WAIT_S", 0.5)
    handler = engine.handlers.cpu_to_gpu_handler
    for job, (row, gpu_block) in enumerate(zip(out.store_spec.block_ids, [2, 3], strict=True)):
        assert handler.transfer_async(job, (CPULoadStoreSpec([row]), GPULoadStoreSpec([gpu_block], [1], [0])))
    submitted = time.monotonic()
    handler.wait([0, 1])
    assert [result.failed_block_ids for result in handler.get_finished()] == [(2,), (3,)]
    # each waited no further than PROMOTION_WAIT_S from the submissions (the second once
    # began its own wait at the first's deadline)
    assert len(deadlines) >= 2 and max(deadlines) <= submitted + 0.5
