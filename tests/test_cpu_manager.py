import numpy as np
import pytest

from tests.helpers import RegionStandIn, key, keys
from tiering import (
    CPULoadStoreSpec,
    CPUOffloadingManager,
    CPUPrimaryTierOffloadingManager,
    OffloadingEvent,
    OffloadPolicy,
    ReqContext,
)
from tiering.contract.mediums import LOCAL

POLICIES = ["lru", "arc", "arc-s"]


def store(manager, ctx, *ids):
    out = manager.prepare_store(keys(*ids), ctx)
    assert out is not None
    manager.complete_store(out.keys_to_store, ctx)
    return out


@pytest.fixture(params=POLICIES)
def manager(request):
    return CPUOffloadingManager(num_blocks=4, cache_policy=request.param, enable_events=True)


def test_rejects_bad_construction():
    with pytest.raises(ValueError, match="num_blocks must be at least 1"):
        CPUOffloadingManager(0)
    with pytest.raises(ValueError, match="known policies: arc, arc-s, lru"):
        CPUOffloadingManager(4, cache_policy="mru")


def test_store_lifecycle_and_lookup_states(manager, ctx):
    out = manager.prepare_store(keys(0, 1), ctx)
    assert out.keys_to_store == keys(0, 1)
    assert isinstance(out.store_spec, CPULoadStoreSpec)
    assert out.store_spec.block_ids.dtype == np.int64
    assert sorted(out.store_spec.block_ids.tolist()) == [0, 1]
    assert out.evicted_keys == []
    assert manager.lookup(key(0), ctx) is None  # write in flight
    assert manager.ref_count(key(0)) == -1
    assert manager.complete_store(keys(0, 1), ctx) == keys(0, 1)
    assert manager.lookup(key(0), ctx) is True
    assert manager.lookup(key(9), ctx) is False
    assert manager.ref_count(key(0)) == 0


def test_prepare_store_skips_resident_and_duplicate_keys(manager, ctx):
    store(manager, ctx, 0)
    out = manager.prepare_store([key(0), key(1), key(1)], ctx)
    assert out.keys_to_store == keys(1)
    assert len(out.store_spec.block_ids) == 1


def test_failed_store_frees_rows_and_keeps_stored_blocks(manager, ctx):
    store(manager, ctx, 0)
    manager.prepare_store(keys(1, 2), ctx)
    assert manager.complete_store(keys(0, 1, 2), ctx, success=False) == []
    assert manager.lookup(key(0), ctx) is True  # already stored: untouched by the failure
    assert manager.lookup(key(1), ctx) is False
    assert manager.num_free_blocks == 3


def test_rows_are_reused_after_eviction(manager, ctx):
    store(manager, ctx, 0, 1, 2, 3)
    out = store(manager, ctx, 4, 5)
    assert out.evicted_keys == keys(0, 1)
    assert sorted(out.store_spec.block_ids.tolist()) == [0, 1]
    assert manager.num_free_blocks == 0


def test_store_never_evicts_keys_of_the_same_call(manager, ctx):
    store(manager, ctx, 0, 1, 2, 3)
    out = manager.prepare_store(keys(0, 4), ctx)  # 0 is the oldest, but it is part of the call
    assert out.keys_to_store == keys(4)
    assert out.evicted_keys == keys(1)


def test_prepare_store_returns_none_when_nothing_is_evictable(manager, ctx):
    store(manager, ctx, 0, 1)
    manager.prepare_load(keys(0), ctx)
    manager.prepare_store(keys(2, 3), ctx)  # in flight
    assert manager.prepare_store(keys(4, 5), ctx) is None
    assert manager.lookup(key(1), ctx) is True  # nothing was evicted by the failed call
    assert manager.prepare_store(keys(4), ctx).evicted_keys == keys(1)


def test_refusals_are_counted_by_reason_and_traced_in_the_log(manager, ctx, caplog):
    store(manager, ctx, 0, 1)
    manager.prepare_load(keys(0, 1), ctx)  # read
    manager.prepare_store(keys(2, 3), ctx)  # being written
    for _ in range(3):
        assert manager.prepare_store(keys(4), ctx) is None
    assert manager.prepare_store(keys(*range(10, 15)), ctx) is None  # 5 blocks, 4 rows
    refused = manager.get_stats()["counters"]["stores_refused"]
    assert refused == {"rows_in_flight": 3, "larger_than_tier": 1, "tenant_share": 0}
    lines = [record.getMessage() for record in caplog.records if "CPU tier" in record.getMessage()]
    assert len(lines) == 3  # the 1st and 2nd of a reason, not the 3rd
    assert "stores refused (rows_in_flight, 1 so far): 1 blocks asked, 4 rows of 4 held" in lines[0]
    assert "(2 being written, 2 being read); a larger cpu_bytes_to_use avoids it" in lines[0]
    assert "stores refused (larger_than_tier, 1 so far): 5 blocks asked" in lines[2]


def test_prepare_load_pins_until_complete_load(manager, ctx):
    store(manager, ctx, 0, 1, 2, 3)
    spec = manager.prepare_load(keys(1, 0), ctx)
    assert spec.block_ids.tolist() == [
        manager._order.policy("").get(key(1)).block_id,
        manager._order.policy("").get(key(0)).block_id,
    ]
    manager.prepare_load(keys(0), ctx)
    assert manager.ref_count(key(0)) == 2
    assert manager.prepare_store(keys(4, 5, 6), ctx) is None  # only 2 and 3 are evictable
    manager.complete_load(keys(0, 1), ctx)
    manager.complete_load(keys(0), ctx)
    assert manager.ref_count(key(0)) == 0
    assert manager.prepare_store(keys(4, 5, 6), ctx).evicted_keys == keys(0, 1, 2)


def test_prepare_load_errors_change_nothing(manager, ctx):
    store(manager, ctx, 0)
    manager.prepare_store(keys(1), ctx)
    with pytest.raises(KeyError, match=r"prepare_load: key .* is ref count -1"):
        manager.prepare_load(keys(0, 1), ctx)
    with pytest.raises(KeyError, match=r"prepare_load: key .* is not resident"):
        manager.prepare_load(keys(0, 7), ctx)
    assert manager.ref_count(key(0)) == 0
    with pytest.raises(KeyError, match=r"complete_load: key .* is ref count 0"):
        manager.complete_load(keys(0), ctx)
    store(manager, ctx, 2)
    manager.prepare_load(keys(0), ctx)
    with pytest.raises(KeyError, match=r"complete_load: key .* is ref count 0"):
        manager.complete_load(keys(0, 2), ctx)  # 2 has no reader: 0 keeps its own
    with pytest.raises(KeyError, match=r"complete_load: key .* is ref count 0"):
        manager.complete_load(keys(0, 0), ctx)  # one reader, released once only
    assert manager.ref_count(key(0)) == 1 and manager.get_stats()["gauges"]["rows_reading"] == 1


@pytest.mark.parametrize("container", [list, set, reversed], ids=["list", "set", "reversed"])
def test_recency_comes_from_prepare_store_not_from_how_completions_arrive(container, ctx):
    manager = CPUOffloadingManager(4, "lru")
    first = manager.prepare_store(keys(0, 1), ctx)
    store(manager, ctx, 2, 3)
    manager.complete_store(container(first.keys_to_store), ctx)  # completes last, in any order
    assert store(manager, ctx, 4, 5, 6).evicted_keys == keys(0, 1, 2)


@pytest.mark.parametrize("container", [list, set], ids=["list", "set"])
def test_a_finished_request_is_evicted_tail_first_whatever_the_completion_order(manager, container, ctx):
    out = manager.prepare_store(keys(0, 1, 2), ctx)  # a prefix, head first
    manager.complete_store(container(out.keys_to_store), ctx)
    manager.on_request_finished(ctx)
    other = ReqContext("other")
    assert manager.prepare_store(keys(7, 8, 9), other).evicted_keys == keys(2, 1)  # one free row, then the tail


def test_a_request_reusing_blocks_ranks_them_at_its_end(ctx):
    manager = CPUOffloadingManager(4, "lru")
    store(manager, ctx, 0, 1, 2, 3)  # ranked at prepare_store: 0 least recent
    reader = ReqContext("reader")
    manager.prepare_load(keys(0), reader)
    manager.complete_load(keys(0), reader)
    assert manager.prepare_store(keys(0, 1), reader).keys_to_store == []  # offered again: a reuse
    manager.on_request_finished(reader)
    assert store(manager, ReqContext("next"), 4, 5).evicted_keys == keys(2, 3)


def test_positions_recorded_by_the_request_give_the_prefix_order(ctx):
    class PositionedContext(ReqContext):
        def get_offload_key_position(self, key):  # vLLM's ReqContext records token positions
            return {key_: 32 * (i + 1) for i, key_ in enumerate(keys(0, 1, 2))}.get(key)

    manager = CPUOffloadingManager(4, "lru")
    positioned = PositionedContext("positioned")
    store(manager, positioned, 2)  # stored tail first (a sliding-window backfill, say)
    store(manager, positioned, 1)
    store(manager, positioned, 0)
    manager.on_request_finished(positioned)
    assert store(manager, ctx, 5, 6, 7).evicted_keys == keys(2, 1)


def test_touch_orders_eviction(manager, ctx):
    store(manager, ctx, 0, 1, 2, 3)
    manager.touch(keys(1, 0), ctx)
    assert store(manager, ctx, 4, 5).evicted_keys == keys(2, 3)


def test_events_record_stores_and_evictions(manager, ctx):
    store(manager, ctx, 0, 1, 2, 3)
    store(manager, ctx, 4)
    manager.prepare_store(keys(5), ctx)  # evicts 1 for a write that then fails
    manager.complete_store(keys(5), ctx, success=False)
    assert manager.take_events() == [
        OffloadingEvent(keys(0, 1, 2, 3), "CPU", removed=False, locality=LOCAL),
        OffloadingEvent(keys(0), "CPU", removed=True, locality=LOCAL),
        OffloadingEvent(keys(4), "CPU", removed=False, locality=LOCAL),
        OffloadingEvent(keys(1), "CPU", removed=True, locality=LOCAL),
        # never stored, yet announced removed: vLLM's event tracker recorded its tokens when the store began
        OffloadingEvent(keys(5), "CPU", removed=True, locality=LOCAL),
    ]
    assert manager.take_events() == []


def test_events_disabled_by_default(ctx):
    manager = CPUOffloadingManager(2)
    store(manager, ctx, 0)
    assert list(manager.take_events()) == []


def test_reset_cache_forgets_every_block_and_frees_every_row_as_vllm_does(manager, ctx):
    store(manager, ctx, 0, 1, 2)
    manager.prepare_load(keys(2), ctx)  # a load in flight
    manager.prepare_store(keys(3), ctx)  # a store in flight
    manager.take_events()
    manager.reset_cache()
    assert [manager.lookup(k, ctx) for k in keys(0, 1, 2, 3)] == [False] * 4
    assert manager.take_events() == []  # vLLM's manager emits nothing at a reset either
    assert manager.num_free_blocks == 4
    assert manager.get_stats()["gauges"] | {"rows_reading": 0, "rows_writing": 0} == manager.get_stats()["gauges"]
    assert sorted(store(manager, ctx, 5, 6, 7, 8).store_spec.block_ids.tolist()) == [0, 1, 2, 3]


def test_reset_cache_keeps_rows_held_by_other_io_until_each_hold_is_released(ctx):
    manager = CPUOffloadingManager(4, "arc")
    rows = store(manager, ctx, 0, 1).store_spec.block_ids.tolist()
    manager.reset_cache(keep_rows=[rows[0], rows[0], rows[1]])  # row 0 held twice (two tiers)
    assert manager.num_free_blocks == 2
    manager.release_rows([rows[0], rows[1]])
    assert manager.num_free_blocks == 3
    manager.release_rows([rows[0]])
    assert manager.num_free_blocks == 4
    with pytest.raises(KeyError, match="is not quarantined"):
        manager.release_rows([rows[0]])


def test_new_request_is_block_level(manager, ctx):
    assert manager.on_new_request(ctx).policy is OffloadPolicy.BLOCK_LEVEL


def test_primary_tier_uses_its_region_exactly_twice(ctx):
    region = RegionStandIn(num_blocks=4, row_bytes=8)
    primary = CPUPrimaryTierOffloadingManager(4, region, cache_policy="arc")
    assert region.views_created == 1
    view = primary.get_kv_memoryview()
    assert view.shape == (4, 8)
    primary.shutdown()
    primary.shutdown()
    assert (region.views_created, region.cleanups) == (1, 1)


def test_primary_tier_rejects_a_region_of_another_size():
    with pytest.raises(ValueError, match=r"expected \(5, row_bytes\)"):
        CPUPrimaryTierOffloadingManager(5, RegionStandIn(num_blocks=4))


def test_primary_tier_aliases_name_the_secondary_direction(ctx):
    primary = CPUPrimaryTierOffloadingManager(4, RegionStandIn(4))
    assert primary.prepare_write(keys(*range(10, 15)), ctx) is None  # a promotion of 5 blocks into 4 rows
    counters = primary.get_stats()["counters"]
    assert counters["promotions_refused"] == {"rows_in_flight": 0, "larger_than_tier": 1, "tenant_share": 0}
    assert counters["stores_refused"] == {"rows_in_flight": 0, "larger_than_tier": 0, "tenant_share": 0}
    out = primary.prepare_write(keys(0), ctx)  # a promotion reserves a row
    assert primary.lookup(key(0), ctx) is None
    primary.complete_write(out.keys_to_store, ctx)
    reading = primary.prepare_read(keys(0), ctx)  # a cascade pins it
    assert reading.rows == reading.block_ids.tolist() == out.store_spec.block_ids.tolist()
    assert primary.ref_count(key(0)) == 1
    primary.complete_read(reading)
    assert primary.ref_count(key(0)) == 0
    with pytest.raises(KeyError, match=r"complete_read: key .* is ref count 0"):
        primary.complete_read(reading)  # released twice


@pytest.mark.parametrize("policy", POLICIES)
def test_the_resident_index_follows_the_policy_through_any_calls(policy, ctx):
    """The manager answers lookups from its own index of resident blocks; after every kind
    of call (stores that evict, failed stores, loads, touches, a reset) it holds exactly
    the blocks the policy ranks, with the same states."""
    rng = np.random.default_rng(7)
    manager = CPUOffloadingManager(num_blocks=6, cache_policy=policy)
    for step in range(600):
        ids = [int(i) for i in rng.choice(12, size=int(rng.integers(1, 4)), replace=False)]
        action = rng.integers(0, 10)
        if action < 6:
            out = manager.prepare_store(keys(*ids), ctx)
            if out is not None:
                manager.complete_store(out.keys_to_store, ctx, success=bool(rng.integers(0, 4)))
        elif action < 8:
            ready = [k for k in keys(*ids) if manager.lookup(k, ctx)]
            if ready:
                manager.prepare_load(ready, ctx)
                manager.complete_load(ready, ctx)
        elif action < 9:
            manager.touch([k for k in keys(*ids) if manager.lookup(k, ctx) is not False], ctx)
        elif step % 7 == 0:
            manager.reset_cache()
        ranked = dict(manager._order.policy("").items())
        assert {k: b.ref_cnt for k, b in manager._resident.items()} == {k: b.ref_cnt for k, b in ranked.items()}
        assert all(manager.lookup(key(i), ctx) == (key(i) in ranked) for i in range(12))


def test_rows_are_reused_most_recently_freed_first_and_start_as_writes_in_flight(manager, ctx):
    assert store(manager, ctx, 0, 1).store_spec.block_ids.tolist() == [0, 1]
    out = manager.prepare_store(keys(2, 3, 4), ctx)  # an eviction frees row 0: it goes first
    assert out.store_spec.block_ids.tolist() == [0, 2, 3] and out.evicted_keys == keys(0)
    assert [manager.lookup(k, ctx) for k in keys(2, 3, 4)] == [None] * 3  # row 0's status was reset
    manager.complete_store(keys(2, 3, 4), ctx, success=False)  # rows 0, 2, 3 freed, in that order
    assert manager.prepare_store(keys(5, 6), ctx).store_spec.block_ids.tolist() == [3, 2]
    assert manager.ref_count(key(5)) == manager.ref_count(key(6)) == -1 and manager.ref_count(key(1)) == 0


def test_a_write_in_flight_is_named_for_the_adapter():
    manager, ctx = CPUOffloadingManager(num_blocks=4), ReqContext("r")
    manager.prepare_store([key(1)], ctx)
    assert manager.write_in_flight(key(1)) and not manager.write_in_flight(key(2))
    manager.complete_store([key(1)], ctx)
    assert not manager.write_in_flight(key(1))
