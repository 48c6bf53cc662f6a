"""Soft retention from clients' hints (tiering.eviction.retention), in the CPU tier's eviction and in
the block-store tiers' (their index, and the writes a long retention asks for)."""

import logging

import pytest

from tests.helpers import ROW, ManualClock, RegionStandIn, key, keys
from tiering import CPUPrimaryTierOffloadingManager, ReqContext
from tiering.cpu.tenants import TenantsConfig
from tiering.engine.admission import AdmissionConfig
from tiering.eviction.policies import make_cache_policy
from tiering.eviction.retention import MAX_RETAIN_S, Retention, hint_of, retention_s
from tiering.stats import RareLog
from tiering.tiers.blockstore.index import BlockIndex
from tiering.tiers.object_format import object_size


@pytest.fixture(params=["lru", "arc", "arc-s"])
def policy(request):
    return request.param


def tier(policy, rows=8, fraction=0.5):
    """A CPU tier of `rows` rows whose retention runs on a manual clock."""
    primary = CPUPrimaryTierOffloadingManager(
        rows, RegionStandIn(rows), cache_policy=policy, retention_max_fraction=fraction
    )
    clock = ManualClock()
    primary.retention.clock = clock
    return primary, clock


def serve(primary, req_id, ids, hint=None):
    """A request that stores `ids` (loading those already there) and finishes."""
    ctx = ReqContext(req_id, kv_transfer_params=None if hint is None else {"kv_tiering": hint})
    resident = [k for k in keys(*ids) if primary.lookup(k, ctx)]
    if resident:
        primary.prepare_load(resident, ctx)
        primary.complete_load(resident, ctx)
    out = primary.prepare_store(keys(*ids), ctx)
    assert out is not None, f"{req_id}: store refused"
    primary.complete_store(out.keys_to_store, ctx)
    primary.on_request_finished(ctx)
    return out.evicted_keys


def resident(primary, *ids):
    return [primary.lookup(k, ReqContext("probe")) is True for k in keys(*ids)]


def test_durations_and_hints_parse_and_a_bad_hint_is_ignored_not_fatal(caplog):
    assert [retention_s(v) for v in ("5m", "1h", "24h", "90s", "2d", 300, "1.5h")] == [
        300.0,
        3600.0,
        86400.0,
        90.0,
        172800.0,
        300.0,
        5400.0,
    ]
    assert retention_s("30d") == MAX_RETAIN_S
    for bad in ("soon", -5, 0, True, "5 minutes ago"):
        with pytest.raises(ValueError):
            retention_s(bad)
    assert hint_of(ReqContext("r", kv_transfer_params={"kv_tiering": {"retain": "5m"}})).retain_s == 300.0
    assert hint_of(ReqContext("r", kv_transfer_params={"kv_tiering": {"release": True}})).release
    assert hint_of(ReqContext("r", kv_transfer_params={"other": 1})) is None
    assert hint_of(ReqContext("r")) is None
    assert hint_of(ReqContext("r", kv_transfer_params={"kv_tiering": {"retain": "forever"}}), RareLog()) is None
    assert "request r: hint kv_tiering ignored" in caplog.text


def test_a_clients_long_hint_is_refused_unparsed_and_logged_in_one_short_line(caplog):
    """A run of blanks made the old pattern backtrack quadratically on the scheduler thread
    (16 KB: seconds; 1 MB: hours): a duration is at most 32 characters, refused unparsed."""
    assert retention_s(" 5 m ") == 300.0 and retention_s("2.5h") == 9000.0
    for long in ("1" + " " * 1_000_000 + "x", "1" * 33, ["5m"] * 100_000):
        with pytest.raises(ValueError, match=r"at most 32 characters|expected a duration") as refused:
            retention_s(long)
        assert len(str(refused.value)) < 120
        hint = {"kv_tiering": {"retain": long}}
        assert hint_of(ReqContext("r", kv_transfer_params=hint), RareLog()) is None
    hint = {"kv_tiering": {"retain": "5m", "x" * 1_000_000: 1}}  # a key of its own
    assert hint_of(ReqContext("r", kv_transfer_params=hint), RareLog()) is None
    hint = {"kv_tiering": {"retain": "5m", **{str(i): 1 for i in range(100_000)}}}  # keys by the many
    assert hint_of(ReqContext("r", kv_transfer_params=hint), RareLog()) is None
    assert max(len(line) for line in caplog.text.splitlines()) < 300


def test_a_retained_prefix_outlives_a_flood_that_evicts_an_unretained_one(policy):
    primary, _ = tier(policy)
    serve(primary, "kept", [0, 1], {"retain": "5m"})
    serve(primary, "plain", [2, 3])
    for i in range(10):  # a flood of new prompts, two blocks each
        serve(primary, f"flood-{i}", [100 + 2 * i, 101 + 2 * i])
    assert resident(primary, 0, 1, 2, 3) == [True, True, False, False]
    assert primary.get_stats()["gauges"]["retained_blocks"] == 2


class CountingLive:
    """Wraps `Retention.live` so that every question an eviction walk asks of the live
    deadlines is counted: the walk's steps over retained keys."""

    def __init__(self, monkeypatch):
        self.asked = 0
        live = Retention.live

        def counted(retention):
            deadlines = live(retention)
            return None if deadlines is None else self.Counted(self, deadlines)

        monkeypatch.setattr(Retention, "live", counted)

    class Counted:
        def __init__(self, owner, deadlines):
            self.owner, self.deadlines = owner, deadlines

        def __contains__(self, key):
            self.owner.asked += 1
            return key in self.deadlines

        def __bool__(self):
            return bool(self.deadlines)


@pytest.mark.parametrize("tenants", [None, TenantsConfig()], ids=["one-order", "tenants"])
def test_no_single_store_walks_the_blocks_a_client_retained(policy, tenants, monkeypatch):
    """A client's retained share sinks to the cold end: each eviction used to step over all
    of it (20k rows, 4k retained: 1.3 ms per store instead of 25 us); stepping over each
    once per pass of the tier still let one call pay for all of them (the first evicting
    store after a client retained a fifth of a 200,000-row tier walked its 40,000 blocks:
    106 ms, against 0.2 ms without hints). Retained blocks now wait outside the eviction
    order: every call's walk is its own evictions'."""
    primary = CPUPrimaryTierOffloadingManager(
        200, RegionStandIn(200), cache_policy=policy, tenants=tenants, retention_max_fraction=0.2
    )
    serve(primary, "greedy", list(range(40)), {"retain": "7d"})  # the tier's cold end
    for i in range(80):
        serve(primary, f"fill-{i}", [1000 + 2 * i, 1001 + 2 * i])
    walk, worst = CountingLive(monkeypatch), 0
    for i in range(100):  # one eviction each
        before = walk.asked
        serve(primary, f"evicting-{i}", [5000 + i])
        worst = max(worst, walk.asked - before)
    assert resident(primary, *range(40)) == [True] * 40
    assert worst <= 2, worst  # was 40 + 2 in the first evicting call


def test_a_passed_over_block_goes_back_to_the_cold_end_when_its_deadline_lapses(policy):
    primary, clock = tier(policy, rows=8, fraction=0.5)
    serve(primary, "kept", [0, 1], {"retain": 60})
    serve(primary, "plain", [2, 3, 4, 5, 6, 7])
    assert not set(serve(primary, "evicting", [8, 9])) & set(keys(0, 1))  # passed over
    serve(primary, "back", [1])  # used again: its place is its use's
    clock.now += 61
    assert serve(primary, "after", [10]) == keys(0)  # the oldest again, not the most recent
    assert resident(primary, 1) == [True]


def test_a_tier_index_never_walks_its_retained_keys(monkeypatch):
    """The same for a secondary tier's index: each evicted block stepped over every
    retained one (1M blocks, 200k retained: 88 ms per evicted block), then the first one
    stepped over all of them; retained keys now wait outside the eviction order."""
    clock = ManualClock()
    index = BlockIndex("t", 200, clock=clock, max_retained=40)
    evicted = []
    for i in range(200):
        index.reserve_all([(key(i), i)], lambda _key: 1, evicted)
        index.mark_stored(key(i))
    index.touch(keys(*range(40)))  # a request loaded them, and retains them as it finishes
    index.retain(keys(*range(40)), 60)
    walk, worst = CountingLive(monkeypatch), 0
    for i in range(160):
        before = walk.asked
        index.reserve_all([(key(1000 + i), 0)], lambda _key: 1, evicted)
        worst = max(worst, walk.asked - before)
        index.mark_stored(key(1000 + i))
    assert evicted == keys(*range(40, 200))  # every key that was ahead of them when retained
    assert worst <= 1, worst  # was 40 per evicted block (6,600 in all), then 40 in the first one
    clock.now += 61
    index.reserve_all([(key(2000), 0)], lambda _key: 1, evicted)
    assert evicted[-1] == key(0)  # its deadline lapsed after eviction would have taken it: the cold end


def test_a_deadline_that_ends_before_eviction_would_have_reached_the_block_leaves_it_recent(policy):
    """A retained block waits outside the eviction order; when its deadline ends (here the
    cap drops it for a later request's) before the blocks ahead of it have all gone, it
    comes back as recent, not as the next victim: dropped at the cold end, the blocks of a
    continuing conversation went first and the continuation hint's hit rate fell from 31.3%
    to 19.6% (LRU, 5% of the conversation trace)."""
    primary, _ = tier(policy, rows=8, fraction=0.25)  # two blocks may be retained
    serve(primary, "plain", [0, 1, 2, 3])
    serve(primary, "first", [4, 5], {"retain": 60})
    serve(primary, "second", [6, 7], {"retain": 60})  # over the cap: 4 and 5 lose their deadlines
    assert serve(primary, "evicting", [8, 9]) == keys(3, 2)  # the least recent (a prefix tail first), not 4 and 5


def test_an_expired_deadline_is_ordinary_recency(policy):
    primary, clock = tier(policy)
    serve(primary, "kept", [0, 1], {"retain": 60})
    clock.now += 61
    for i in range(10):
        serve(primary, f"flood-{i}", [100 + 2 * i, 101 + 2 * i])
    assert resident(primary, 0, 1) == [False, False]
    assert primary.get_stats()["counters"]["retentions_expired"] == 2
    assert primary.get_stats()["gauges"]["retained_blocks"] == 0


def test_a_release_makes_the_blocks_its_request_stored_go_first_until_used_again(policy):
    primary, _ = tier(policy)
    serve(primary, "old", [1, 2])  # the oldest blocks
    serve(primary, "doc", [5])
    serve(primary, "session", [3, 4, 5, 6], {"release": True})  # stored 3, 4 and 6; found 5 (another's)
    serve(primary, "filler", [7, 8])  # the tier's 8 rows are full
    serve(primary, "back", [6])  # the session's 6 is used again: ordinary from now on
    assert set(serve(primary, "next", [9, 10])) == set(keys(3, 4))  # not 1 and 2, older
    assert resident(primary, 1, 2, 5, 6) == [True] * 4
    assert primary.get_stats()["counters"]["retentions_released"] == 3


def test_retention_never_holds_more_than_its_share_and_never_refuses_a_store(policy):
    primary, clock = tier(policy, rows=8, fraction=0.5)  # at most 4 rows retained
    for i in range(4):  # every request asks for a day; later ones for longer
        clock.now += 1
        serve(primary, f"greedy-{i}", [2 * i, 2 * i + 1], {"retain": "24h"})
    stats = primary.get_stats()
    assert stats["gauges"]["retained_blocks"] == 4 and stats["counters"]["retentions_dropped"] == 4
    assert resident(primary, 0, 1, 2, 3, 4, 5, 6, 7) == [True] * 8
    serve(primary, "new", [50, 51, 52, 53, 54, 55])  # 6 rows: more than the unretained ones
    assert resident(primary, 50, 51, 52, 53, 54, 55) == [True] * 6
    assert sum(resident(primary, 4, 5, 6, 7)) == 2  # the latest deadlines kept the longest
    assert primary.get_stats()["gauges"]["retained_blocks"] <= 2


def test_without_hints_nothing_changes(policy):
    with_retention, _ = tier(policy)
    without = CPUPrimaryTierOffloadingManager(8, RegionStandIn(8), cache_policy=policy, retention_max_fraction=0)
    assert without.retention is None
    for primary in (with_retention, without):
        evicted = [serve(primary, f"r-{i}", [i % 11, (3 * i) % 13 + 20]) for i in range(40)]
        primary.evictions = evicted
    assert with_retention.evictions == without.evictions


def test_a_hint_too_large_for_a_float_is_ignored_and_the_deadline_heap_stays_small(caplog):
    assert hint_of(ReqContext("r", kv_transfer_params={"kv_tiering": {"retain": 10**400}}), RareLog()) is None
    assert "hint kv_tiering ignored" in caplog.text
    clock = ManualClock()
    retention = Retention(4, make_cache_policy("lru", 8), clock)
    for _ in range(1000):  # the same blocks retained by request after request, each deadline later
        clock.now += 1
        retention.retain(keys(0, 1, 2), 60)
    assert len(retention) == 3 and len(retention._heap) <= 2 * 3 + 64
    clock.now += 61
    assert retention.live() is None and retention.counters["retentions_expired"] == 3


def test_a_release_leaves_alone_the_blocks_other_requests_used_since_it_stored_them(policy):
    """A stores a system prompt (3, 4) and its own turn (5); B reuses the prompt and ends
    first; A's release then takes 5 only: the prompt is not A's alone any more."""
    primary, _ = tier(policy)
    serve(primary, "old", [1, 2])
    a = ReqContext("a", kv_transfer_params={"kv_tiering": {"release": True}})
    out = primary.prepare_store(keys(3, 4, 5), a)
    primary.complete_store(out.keys_to_store, a)
    serve(primary, "b", [3, 4, 6])  # found 3 and 4
    primary.on_request_finished(a)
    assert primary.get_stats()["counters"]["retentions_released"] == 1
    serve(primary, "filler", [7, 8])  # the tier's 8 rows are full
    evicted = set(serve(primary, "next", [9, 10]))
    assert keys(5)[0] in evicted and not evicted & set(keys(3, 4))
    assert resident(primary, 3, 4) == [True, True]


def test_released_blocks_evicted_meanwhile_leave_nothing_behind(policy):
    primary, _ = tier(policy)
    serve(primary, "session", [1, 2], {"release": True})
    for i in range(10):  # the released go first, then the flood evicts the rest of what it needs
        serve(primary, f"flood-{i}", [100 + 2 * i, 101 + 2 * i])
    assert not primary.retention.active


OBJECT = object_size(len(key(0)), ROW)  # a memory-tier object


def tier_engine(engine_factory, admission=None):
    """A manager over 8 CPU rows and a memory tier of 4 blocks, 2 of which may be retained."""
    config = {"type": "memory", "capacity_bytes": 4 * OBJECT, "retention_max_fraction": 0.5}
    engine = engine_factory(config, num_blocks=8, admission=None if admission is None else [admission])
    clock = ManualClock()
    engine.tier._index.retention.clock = clock
    return engine, clock


def finished(engine, req_id, ids, hint=None):
    """Request `req_id` stores `ids` and finishes with `hint`."""
    ctx = ReqContext(req_id, kv_transfer_params=None if hint is None else {"kv_tiering": hint})
    engine.store(*ids, ctx=ctx)
    engine.manager.on_request_finished(ctx)
    engine.settle()


def in_tier(engine, *ids):
    return [engine.tier.lookup(k, ReqContext("probe")) is True for k in keys(*ids)]


@pytest.mark.parametrize("hint", [None, {"retain": "1h"}], ids=["no-hint", "retain"])
def test_a_block_store_tier_passes_over_retained_blocks_until_their_deadline(engine_factory, hint):
    engine, clock = tier_engine(engine_factory)
    finished(engine, "chat", [0, 1], hint)
    finished(engine, "other", [2, 3])
    finished(engine, "flood", [4, 5])  # evicts 2 of the 4
    if hint is None:
        assert in_tier(engine, 0, 1, 2, 3) == [False, False, True, True]
    else:
        assert in_tier(engine, 0, 1, 2, 3) == [True, True, False, False]
        stats = engine.manager.get_stats()["tiers"]["memory"]
        assert stats["gauges"]["retained_blocks"] == 2 and stats["counters"]["retentions"] == 2
        clock.now += 3601  # the deadline passed: 0 and 1 are the least recent again
        finished(engine, "flood-2", [6, 7])
        assert in_tier(engine, 0, 1, 4, 5) == [False, False, True, True]
        assert engine.manager.get_stats()["tiers"]["memory"]["counters"]["retentions_expired"] == 2


def test_a_block_store_tier_evicts_a_released_session_first(engine_factory):
    engine, _ = tier_engine(engine_factory)
    finished(engine, "older", [0, 1])
    finished(engine, "closed", [2, 3], {"release": True})
    finished(engine, "next", [4, 5])
    assert in_tier(engine, 0, 1, 2, 3) == [True, True, False, False]
    assert engine.manager.get_stats()["tiers"]["memory"]["counters"]["retentions_released"] == 2


def test_a_block_store_tier_gives_up_the_earliest_deadline_when_nothing_else_can_go(engine_factory):
    engine, clock = tier_engine(engine_factory)
    finished(engine, "a", [0, 1], {"retain": "1h"})
    clock.now += 1
    finished(engine, "b", [2, 3], {"retain": "2h"})  # past the 2 that may be retained: 0 and 1 lose theirs
    finished(engine, "c", [4, 5])
    assert in_tier(engine, 0, 1, 2, 3) == [False, False, True, True]
    assert engine.manager.get_stats()["tiers"]["memory"]["counters"]["retentions_dropped"] == 2


@pytest.mark.parametrize(("retain", "written"), [("5m", False), ("1h", True)])
def test_a_long_retention_writes_blocks_admission_would_skip(engine_factory, retain, written):
    engine, _ = tier_engine(engine_factory, AdmissionConfig(min_reuse=2))  # every block is stored once: filtered
    finished(engine, "plain", [0])
    finished(engine, "kept", [1, 2], {"retain": retain})  # retained_write_s defaults to 1h
    assert in_tier(engine, 0, 1, 2) == [False, written, written]
    stats = engine.manager.get_stats()["tiers"]["memory"]
    assert stats["counters"]["cascades_retained"] == (2 if written else 0)
    assert stats["gauges"]["retained_blocks"] == (2 if written else 0)


@pytest.mark.parametrize("tenants", [None, TenantsConfig()], ids=["one-order", "tenants"])
def test_a_released_block_leaves_arc_as_dropped_so_its_return_does_not_adapt_arc(tenants):
    """A release is the client's call, not ARC's: no ghost entry, so no adaptation when it
    comes back (an evicted block's return does adapt ARC)."""
    primary = CPUPrimaryTierOffloadingManager(
        8, RegionStandIn(8), cache_policy="arc", tenants=tenants, retention_max_fraction=0.5
    )
    serve(primary, "session", [1, 2], {"release": True})
    serve(primary, "plain", [3])
    for i in range(8):  # the released blocks go first, then the plain one
        serve(primary, f"fill-{i}", [10 + i])
    assert resident(primary, 1, 2, 3) == [False, False, False]
    policy = primary._order.policy(primary._order.tenant_of(ReqContext("again")))
    target = policy.target_t1_size
    serve(primary, "again", [1, 2])
    assert policy.target_t1_size == target
    serve(primary, "plain-again", [3])  # an ordinary eviction's ghost
    assert policy.target_t1_size > target


def test_a_client_that_sends_bad_hints_and_load_tiers_by_the_thousand_costs_a_few_log_lines(caplog):
    """20,000 requests with a malformed kv_load_tiers logged 20,000 warnings on the scheduler
    thread; every warning a client can provoke is now logged at its 1st, 2nd, 4th ... time."""
    from tests.helpers import ManualTier
    from tiering import CPUPrimaryTierOffloadingManager, ReqContext, TieringOffloadingManager

    primary = CPUPrimaryTierOffloadingManager(8, RegionStandIn(8))
    manager = TieringOffloadingManager(primary, [ManualTier()])
    params = {"kv_load_tiers": "storage", "kv_tiering": {"retain": "forever"}}
    with caplog.at_level(logging.WARNING):
        for i in range(20_000):
            ctx = ReqContext(f"req-{i}", kv_transfer_params=params)
            manager.on_new_request(ctx)
            hint_of(ctx, manager._client_warnings)
    lines = [r.getMessage() for r in caplog.records if "ignored" in r.getMessage()]
    assert 1 <= len(lines) <= 16 and "kv_load_tiers ignored" in lines[0]
    assert lines[-1].endswith("so far; logged at the 1st, 2nd, 4th, 8th ...)") and "32,768 so far" in lines[-1]
    manager.shutdown()
