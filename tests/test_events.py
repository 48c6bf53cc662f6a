"""KV events from every tier (`tiering.tiers.events`): what a router following the engine
sees of the CPU tier and of each secondary tier, with medium, locality and owner."""

from tests.helpers import ROW, keys
from tiering.contract.mediums import LOCAL, REMOTE, STORAGE, OffloadingEvent
from tiering.tiers.events import MERGE_BLOCKS, TierEvents
from tiering.tiers.object_format import object_size


def announced(events, medium=STORAGE):
    """(removed, keys) of each event of `medium`, in order, with runs of a kind joined."""
    out: list[tuple[bool, list]] = []
    for event in events:
        if event.medium != medium:
            continue
        if out and out[-1][0] == event.removed:
            out[-1][1].extend(event.keys)
        else:
            out.append((event.removed, list(event.keys)))
    return out


def test_a_block_store_tier_announces_what_it_stores_and_every_way_a_block_leaves(engine_factory):
    capacity = 4 * object_size(len(keys(0)[0]), ROW)
    engine = engine_factory({"type": "memory", "capacity_bytes": capacity}, num_blocks=8, events=True)
    engine.store(0, 1, 2, 3)
    events = engine.manager.take_events()
    cpu = [event for event in events if event.medium == "CPU"]
    assert cpu and all(event.locality == LOCAL and event.ownership is None for event in cpu)
    stored = [event for event in events if event.medium == STORAGE]
    assert announced(stored) == [(False, keys(0, 1, 2, 3))]
    assert all(e.locality == LOCAL and e.ownership == "memory" and e.removal_expected for e in stored)
    engine.store(4, 5)  # the tier's capacity evicts its two oldest
    assert announced(engine.manager.take_events()) == [(True, keys(0, 1)), (False, keys(4, 5))]
    engine.manager.reset_cache()  # a new generation: every block it held leaves
    assert announced(engine.manager.take_events()) == [(True, keys(2, 3, 4, 5))]


def test_a_dropped_object_is_announced_removed(engine_factory):
    engine = engine_factory(
        {"type": "faulty", "inner": {"type": "memory"}, "corruption_rate": 1.0}, num_blocks=4, events=True
    )
    engine.store(0, 1, 2, 3)
    engine.store(4, 5, 6, 7)  # 0..3 now only in the faulty tier
    engine.manager.take_events()
    assert engine.lookup_until_done(0) == [False]  # its read is corrupted: dropped
    assert (True, keys(0)) in announced(engine.manager.take_events())


def test_recovered_blocks_are_announced_once_events_start_and_a_shared_directory_is_remote(tmp_path, engine_factory):
    root = str(tmp_path / "kv")
    first = engine_factory({"type": "file", "root_dir": root, "layout": "files"}, num_blocks=4)  # as shared ones
    first.store(0, 1)
    first.manager.shutdown()
    again = engine_factory({"type": "file", "root_dir": root, "layout": "files"}, num_blocks=4, events=True)
    recovered = [event for event in again.manager.take_events() if event.medium == STORAGE]
    assert announced(recovered) == [(False, keys(0, 1))] and recovered[0].locality == LOCAL
    again.manager.shutdown()
    shared = engine_factory({"type": "file", "root_dir": root, "shared": True}, num_blocks=4, events=True)
    assert {event.locality for event in shared.manager.take_events() if event.medium == STORAGE} == {REMOTE}


def test_no_events_are_kept_by_a_manager_without_them(engine_factory):
    engine = engine_factory({"type": "memory"}, num_blocks=4)
    engine.store(0, 1)
    assert engine.manager.take_events() == [] and engine.tier.take_events() == []


def test_events_nobody_takes_stay_bounded_and_what_is_dropped_is_counted():
    events = TierEvents(STORAGE, LOCAL, "file", max_blocks=10)
    for i in range(0, 30, 3):
        events.add(keys(i, i + 1, i + 2), removed=bool(i % 2))
    taken = events.take()
    assert sum(len(event.keys) for event in taken) <= 10 and events.dropped == 30 - sum(len(e.keys) for e in taken)
    assert taken[-1] == OffloadingEvent(keys(27, 28, 29), STORAGE, True, LOCAL, "file", True)
    assert events.take() == []


def test_events_of_one_kind_nobody_takes_stay_bounded_in_blocks():
    """Events of one kind merge into one event, and the bound dropped only while more than one
    was queued: with nobody taking them (an embedder without a router) they grew without limit."""
    events = TierEvents(STORAGE, LOCAL, "file", max_blocks=100)
    for i in range(10_000):
        events.add(keys(i), removed=False)
    taken = events.take()
    assert sum(len(event.keys) for event in taken) == 100 and events.dropped == 9_900
    assert taken[-1].keys[-1] == keys(9_999)[0]  # the newest are kept
    large = TierEvents(STORAGE, LOCAL, "file", max_blocks=100_000)
    for i in range(0, 300_000, 1000):  # a long run of one kind: events of MERGE_BLOCKS, the oldest dropped whole
        large.add(keys(*range(i, i + 1000)), removed=True)
    kept = large.take()
    assert sum(len(event.keys) for event in kept) <= 100_000 and large.dropped == 300_000 - sum(
        len(e.keys) for e in kept
    )
    assert all(len(event.keys) <= MERGE_BLOCKS + 1000 for event in kept)


def test_blocks_of_a_remote_tier_in_the_engines_own_memory_are_local_until_they_leave():
    """A Mooncake tier's objects in the segment this engine lends are LOCAL, stored and
    removed alike, whatever else is announced between; the others are the tier's REMOTE."""
    events = TierEvents(STORAGE, REMOTE, "pool")
    events.add(keys(0, 1, 2, 3), removed=False, local=keys(1, 3))
    events.add(keys(4), removed=False)
    events.add(keys(3, 4, 1), removed=True)
    events.add(keys(1), removed=False)  # stored again, elsewhere this time
    events.add(keys(1), removed=True)
    assert [(e.removed, e.locality, e.keys) for e in events.take()] == [
        (False, LOCAL, keys(1, 3)),
        (False, REMOTE, keys(0, 2, 4)),  # joined: the same kind as the last REMOTE store
        (True, LOCAL, keys(3, 1)),
        (True, REMOTE, keys(4)),
        (False, REMOTE, keys(1)),
        (True, REMOTE, keys(1)),
    ]
    local_tier = TierEvents(STORAGE, LOCAL, "file")  # a local tier's blocks are all LOCAL: nothing to remember
    local_tier.add(keys(0), removed=False, local=keys(0))
    assert local_tier._local == set()


def test_stores_over_the_network_are_remote():
    from tiering.backends.s3 import S3BlockStore
    from tiering.backends.valkey import ValkeyBlockStore

    assert S3BlockStore.locality == ValkeyBlockStore.locality == REMOTE


# What the KV-aware routers accept of an event's medium, read in their sources (2026-11):
DYNAMO_MEDIUMS = {"GPU", "DEVICE", "CPU", "CPU_PINNED", "CPU_TIER1", "CPU_TIER2", "DISK", "NVME", "STORAGE"}
DYNAMO_MEDIUMS |= {"EXTERNAL", "NETWORK", "REMOTE", "SHARED"}
"""ai-dynamo/dynamo, `dynamo_kv_router::protocols::StorageTier::from_kv_medium`: a store of any other
medium is dropped. "CPU" is host memory, "STORAGE" disk. A CPU store without its tokens (vLLM's
placeholder payload) indexes nothing (lib/llm, `cpu_event_with_placeholder_payload_is_dropped_safely`)."""
LLM_D_DEFAULT_WEIGHTS = {"gpu": 1.0, "cpu": 0.8}
"""llm-d/llm-d-kv-cache, pkg/kvcache/backend.go `DefaultKVCacheBackendConfig`; pkg/kvevents/pool.go
`normalizeEventDeviceTier` lower-cases a medium, and pkg/kvcache/kvblock_scorer.go `getMaxWeight`
weighs one its config does not list 1.0, as the GPU."""


def test_every_medium_and_locality_the_engine_can_emit_is_one_the_routers_accept():
    from pathlib import Path

    from tiering.engine.load_tiers import LOCALITIES, MEDIUMS

    emitted = {("CPU", LOCAL)} | {(medium, locality) for medium in MEDIUMS for locality in LOCALITIES}
    assert {medium for medium, _ in emitted} <= DYNAMO_MEDIUMS
    assert {locality for _, locality in emitted} == {"LOCAL", "REMOTE"}  # vLLM's Locality (its stage checks)
    # llm-d weighs a medium its scorer is not told of as the GPU: the routers' page says how to tell it
    page = (Path(__file__).parents[1] / "docs" / "routers.md").read_text()
    for medium in {medium.lower() for medium, _ in emitted} - set(LLM_D_DEFAULT_WEIGHTS):
        assert f'"name": "{medium}"' in page, medium


def test_a_failed_store_is_announced_removed_so_vllms_tracker_forgets_its_tokens(engine_factory):
    from tests.helpers import CTX

    engine = engine_factory({"type": "memory"}, num_blocks=4, events=True)
    out = engine.manager.prepare_store(keys(0, 1), CTX)
    engine.manager.complete_store(out.keys_to_store, CTX, success=False)  # the GPU copy failed
    assert announced(engine.manager.take_events(), medium="CPU") == [(True, keys(0, 1))]
