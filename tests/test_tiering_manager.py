"""Every rule of the manager's semantics (tiering.engine.manager), for both policies."""

import logging
import threading

import pytest

from tests.helpers import ManualClock, ManualTier, RegionStandIn, key, keys
from tiering import (
    CPUPrimaryTierOffloadingManager,
    OffloadingEvent,
    ReqContext,
    SecondaryTierManager,
    TieringOffloadingManager,
)
from tiering.backends import ExampleSecondaryTierManager
from tiering.contract.mediums import LOCAL


@pytest.fixture(params=["lru", "arc", "arc-s"])
def policy(request):
    return request.param


def build(policy, tiers, num_blocks=4, log=None, enable_events=True):
    region = RegionStandIn(num_blocks, log=log)
    primary = CPUPrimaryTierOffloadingManager(num_blocks, region, cache_policy=policy, enable_events=True)
    return TieringOffloadingManager(primary, tiers, enable_events=enable_events), region


def store(manager, ctx, *ids, success=True):
    out = manager.prepare_store(keys(*ids), ctx)
    manager.complete_store(out.keys_to_store, ctx, success=success)
    return out


def promote(manager, ctx, *ids):
    """Look keys up (queuing promotions) and end the step; returns the lookup answers."""
    answers = [manager.lookup(k, ctx) for k in keys(*ids)]
    manager.on_schedule_end()
    return answers


# -- lookup ---------------------------------------------------------------------------------


def test_primary_answers_first(policy, ctx):
    tier = ManualTier()
    manager, _ = build(policy, [tier])
    manager.prepare_store(keys(0), ctx)
    assert manager.lookup(key(0), ctx) is None  # store in flight
    manager.complete_store(keys(0), ctx)
    tier.present[key(0)] = True
    assert manager.lookup(key(0), ctx) is True
    manager.on_schedule_end()
    assert [job for job in tier.submitted if job.is_promotion] == []


def test_miss_everywhere_is_false(policy, ctx):
    manager, _ = build(policy, [ManualTier("a"), ManualTier("b")])
    assert manager.lookup(key(0), ctx) is False


def test_first_tier_holding_the_block_gets_the_promotion(policy, ctx):
    first, second = ManualTier("first"), ManualTier("second")
    first.present[key(1)] = True
    second.present.update({key(0): True, key(1): True})
    manager, _ = build(policy, [first, second])
    assert promote(manager, ctx, 0, 1) == [None, None]
    assert [list(job.keys) for job in first.submitted] == [keys(1)]
    assert [list(job.keys) for job in second.submitted] == [keys(0)]


def test_promotion_reserves_a_row_at_once_and_is_never_duplicated(policy, ctx):
    tier = ManualTier()
    tier.present[key(0)] = True
    manager, _ = build(policy, [tier])
    assert manager.lookup(key(0), ctx) is None
    assert manager.primary_tier.ref_count(key(0)) == -1
    other = ReqContext("req-1")
    assert manager.lookup(key(0), other) is None  # in flight now, from the primary
    assert manager.lookup(key(0), ctx) is None
    manager.on_schedule_end()
    assert manager.lookup(key(0), ctx) is None  # still in flight after submission
    manager.on_schedule_end()
    assert len(tier.submitted) == 1 and list(tier.submitted[0].keys) == keys(0)


def test_promotion_needs_room_in_the_primary(policy, ctx):
    tier = ManualTier()
    tier.present[key(9)] = True
    manager, _ = build(policy, [tier], num_blocks=2)
    store(manager, ctx, 0, 1)
    tier.finish_all()  # the cascade's references are released at step end
    manager.on_schedule_end()
    manager.prepare_load(keys(0, 1), ctx)  # both rows pinned by GPU loads
    assert manager.lookup(key(9), ctx) is False
    manager.complete_load(keys(1), ctx)
    assert manager.lookup(key(9), ctx) is None  # evicts 1 to make room
    assert manager.primary_tier.lookup(key(1), ctx) is False


@pytest.mark.parametrize(
    ("answers", "expected", "promoted_by"),
    [
        ([None, False], None, None),
        ([False, None], None, None),
        ([None, True], None, 1),
        ([True, None], None, 0),
        ([False, False], False, None),
    ],
)
def test_an_unsure_tier_makes_the_answer_none_unless_a_later_tier_hits(policy, ctx, answers, expected, promoted_by):
    tiers = [ManualTier("a"), ManualTier("b")]
    for tier, answer in zip(tiers, answers, strict=True):
        tier.present[key(0)] = answer
    manager, _ = build(policy, tiers)
    assert manager.lookup(key(0), ctx) is expected
    manager.on_schedule_end()
    loads = [i for i, tier in enumerate(tiers) if tier.submitted]
    assert loads == ([] if promoted_by is None else [promoted_by])


# -- promotions -----------------------------------------------------------------------------


def test_promotions_are_batched_per_tier_and_request_at_step_end(policy, ctx):
    tier_a, tier_b = ManualTier("a"), ManualTier("b")
    tier_a.present.update(dict.fromkeys(keys(0, 1, 2), True))
    tier_b.present.update(dict.fromkeys(keys(3), True))
    manager, _ = build(policy, [tier_a, tier_b], num_blocks=8)
    other = ReqContext("req-1")
    manager.lookup(key(0), ctx)
    manager.lookup(key(1), ctx)
    manager.lookup(key(2), other)
    manager.lookup(key(3), ctx)
    assert tier_a.submitted == [] and tier_b.submitted == []  # nothing before the step ends
    manager.on_schedule_end()
    jobs_a = {job.req_context.req_id: list(job.keys) for job in tier_a.submitted}
    assert jobs_a == {"req-0": keys(0, 1), "req-1": keys(2)}
    assert [list(job.keys) for job in tier_b.submitted] == [keys(3)]
    job = tier_a.submitted[0]
    assert job.is_promotion
    assert job.block_ids.tolist() == [manager.primary_tier._order.policy("").get(k).block_id for k in keys(0, 1)]
    assert len({j.job_id for j in tier_a.submitted + tier_b.submitted}) == 3


def test_finished_promotion_makes_blocks_loadable(policy, ctx):
    tier = ManualTier()
    tier.present.update(dict.fromkeys(keys(0, 1), True))
    manager, _ = build(policy, [tier])
    promote(manager, ctx, 0, 1)
    tier.finish()
    assert manager.lookup(key(0), ctx) is True
    assert manager.prepare_load(keys(0, 1), ctx).block_ids.size == 2
    assert OffloadingEvent(keys(0, 1), "CPU", removed=False, locality=LOCAL) in manager.take_events()


def test_failed_promotion_frees_the_rows(policy, ctx):
    tier = ManualTier()
    tier.present[key(0)] = True
    manager, _ = build(policy, [tier])
    promote(manager, ctx, 0)
    tier.finish(success=False)
    del tier.present[key(0)]
    assert manager.lookup(key(0), ctx) is False
    assert manager.primary_tier.num_free_blocks == 4


def test_the_primary_counts_gpu_loads_apart_from_cascade_reads(policy, ctx):
    manager, _ = build(policy, [ManualTier("a"), ManualTier("b")])
    store(manager, ctx, 0, 1, 2)  # cascaded to both tiers: 6 reads, no GPU load
    counters = manager.get_stats()["primary"]["counters"]
    assert (counters["blocks_stored"], counters["blocks_loaded"], counters["blocks_read_by_tiers"]) == (3, 0, 6)


def test_the_source_of_a_promoted_block_is_remembered_until_the_gpu_stores_it_again(policy, ctx):
    disk, other = ManualTier("file"), ManualTier("s3")
    other.present[key(1)] = True
    disk.present[key(0)] = True
    manager, _ = build(policy, [disk, other])
    store(manager, ctx, 2)
    promote(manager, ctx, 0, 1)
    disk.finish_all()
    other.finish_all()
    manager.lookup(key(0), ctx)  # results are applied before the step's first lookup
    assert [manager.promotion_source(k) for k in keys(0, 1, 2)] == ["file", "s3", None]
    manager.reset_cache()
    store(manager, ctx, 0)  # back from the GPU: no longer a promotion
    assert manager.promotion_source(key(0)) is None


# -- cascade --------------------------------------------------------------------------------


def test_a_request_that_looked_up_or_stored_is_open_until_it_finishes(policy):
    manager, _ = build(policy, [ManualTier()])
    looked_up, stored, silent = ReqContext("looked-up"), ReqContext("stored"), ReqContext("silent")
    manager.lookup(key(9), looked_up)
    store(manager, stored, 0)
    manager.on_new_request(silent)
    assert manager.get_stats()["manager"]["gauges"]["requests_open"] == 2
    for request in (silent, looked_up, stored):
        manager.on_request_finished(request)
    assert manager.get_stats()["manager"]["gauges"]["requests_open"] == 0


def test_complete_store_cascades_at_once_to_every_tier(policy, ctx):
    tiers = [ManualTier("a"), ManualTier("b")]
    manager, _ = build(policy, tiers)
    out = store(manager, ctx, 0, 1)
    for tier in tiers:
        assert len(tier.submitted) == 1
        job = tier.submitted[0]
        assert not job.is_promotion and list(job.keys) == keys(0, 1)
        assert job.block_ids.tolist() == out.store_spec.block_ids.tolist()
    assert tiers[0].submitted[0].job_id != tiers[1].submitted[0].job_id
    assert manager.primary_tier.ref_count(key(0)) == 1  # one read reference for the cascade


def test_failed_store_cascades_nothing(policy, ctx):
    tier = ManualTier()
    manager, _ = build(policy, [tier])
    store(manager, ctx, 0, success=False)
    assert tier.submitted == []
    assert manager.lookup(key(0), ctx) is False


def test_cascade_releases_its_reference_whether_or_not_it_succeeded(policy, ctx):
    tiers = [ManualTier("a"), ManualTier("b")]
    manager, _ = build(policy, tiers)
    store(manager, ctx, 0)
    tiers[0].finish(success=True)
    manager.on_schedule_end()
    assert manager.primary_tier.ref_count(key(0)) == 1  # until every tier reports
    tiers[1].finish(success=False)
    manager.on_schedule_end()
    assert manager.primary_tier.ref_count(key(0)) == 0


def test_a_slow_tier_protects_cascading_blocks_from_eviction(policy, ctx):
    slow = ManualTier("slow")
    manager, _ = build(policy, [slow], num_blocks=2)
    store(manager, ctx, 0, 1)  # both cascading, held by the slow tier
    manager.on_schedule_end()
    assert manager.prepare_store(keys(2), ctx) is None
    slow.finish()
    manager.on_schedule_end()
    out = manager.prepare_store(keys(2), ctx)
    assert out is not None and out.evicted_keys == keys(0)


# -- steps ----------------------------------------------------------------------------------


def test_finished_jobs_are_processed_once_per_step(policy, ctx):
    tier = ManualTier()
    manager, _ = build(policy, [tier])
    manager.lookup(key(0), ctx)
    manager.lookup(key(1), ctx)
    manager.prepare_store(keys(2), ctx)
    assert tier.polls == 1  # before the step's first lookup only
    manager.on_schedule_end()
    assert tier.polls == 2
    manager.prepare_store(keys(3), ctx)
    manager.lookup(key(0), ctx)
    assert tier.polls == 3


def test_a_job_finished_mid_step_is_seen_at_step_end(policy, ctx):
    tier = ManualTier()
    manager, _ = build(policy, [tier])
    store(manager, ctx, 0)
    tier.finish()
    assert manager.primary_tier.ref_count(key(0)) == 1  # not polled again mid-step
    manager.on_schedule_end()
    assert manager.primary_tier.ref_count(key(0)) == 0


class RingingTier(ManualTier):
    """A `ManualTier` that rings the manager's doorbell when a job finishes."""

    def attach_doorbell(self, doorbell):
        self.doorbell = doorbell

    def finish(self, job_id=None, success=True):
        job = super().finish(job_id, success)
        self.doorbell.ring()
        return job


def test_a_tier_that_rings_is_polled_only_after_a_ring(policy, ctx):
    ringing, plain = RingingTier("ringing"), ManualTier("plain")
    manager, _ = build(policy, [ringing, plain])
    manager.on_schedule_end()  # the doorbell starts rung: the first step polls every tier
    assert (ringing.polls, plain.polls) == (1, 1)
    for _ in range(3):
        manager.on_schedule_end()
        manager.lookup(key(0), ctx)
    assert (ringing.polls, plain.polls) == (1, 7)  # the plain tier: every step and every first lookup
    store(manager, ctx, 0)
    ringing.finish()
    manager.on_schedule_end()
    assert ringing.polls == 2 and manager.primary_tier.ref_count(key(0)) == 1  # the plain tier's store pins it
    manager.on_schedule_end()
    assert ringing.polls == 2


def test_a_tier_whose_doorbell_hook_raises_is_polled_every_step(policy, ctx, caplog):
    class BrokenBell(ManualTier):
        def attach_doorbell(self, doorbell):
            raise RuntimeError("no bell")

    tier = BrokenBell()
    with caplog.at_level(logging.ERROR):
        manager, _ = build(policy, [tier])
    manager.on_schedule_end()
    manager.on_schedule_end()
    assert tier.polls == 2 and "no bell" in caplog.text


def test_touch_reaches_every_tier(policy, ctx):
    tiers = [ManualTier("a"), ManualTier("b")]
    manager, _ = build(policy, tiers)
    store(manager, ctx, 0, 1, 2, 3)
    tiers[0].finish_all()
    tiers[1].finish_all()
    manager.on_schedule_end()
    manager.touch(keys(1, 0), ctx)
    assert tiers[0].touched == [keys(1, 0)] and tiers[1].touched == [keys(1, 0)]
    assert store(manager, ctx, 4, 5).evicted_keys == keys(2, 3)


def test_has_pending_work_tracks_queued_and_unreported_jobs(policy, ctx):
    tier = ManualTier()
    tier.present[key(5)] = True
    manager, _ = build(policy, [tier])
    assert not manager.has_pending_work()
    manager.lookup(key(5), ctx)
    assert manager.has_pending_work()
    manager.on_schedule_end()
    tier.finish()
    manager.on_schedule_end()
    assert not manager.has_pending_work()


# -- events ---------------------------------------------------------------------------------


class EventfulTier(ExampleSecondaryTierManager):
    def submit_store(self, job_metadata):
        super().submit_store(job_metadata)
        self.events = [OffloadingEvent(list(job_metadata.keys), "EXAMPLE", removed=False)]

    def take_events(self):
        events, self.events = getattr(self, "events", []), []
        return events


def test_events_come_from_the_primary_and_the_tiers(policy, ctx):
    manager, _ = build(policy, [EventfulTier(None, memoryview(b""))])
    store(manager, ctx, 0)
    assert manager.take_events() == [
        OffloadingEvent(keys(0), "CPU", removed=False, locality=LOCAL),
        OffloadingEvent(keys(0), "EXAMPLE", removed=False),
    ]
    assert manager.take_events() == []


def test_events_disabled(policy, ctx):
    manager, _ = build(policy, [EventfulTier(None, memoryview(b""))], enable_events=False)
    store(manager, ctx, 0)
    assert manager.take_events() == []


# -- reset and shutdown ---------------------------------------------------------------------


def test_reset_cache_processes_what_finished_and_empties_the_primary(policy, ctx):
    tier = ManualTier()
    tier.present[key(7)] = True
    manager, _ = build(policy, [tier])
    store(manager, ctx, 0, 1)  # cascades in flight
    tier.finish_all()  # ...reported, not processed yet
    manager.lookup(key(7), ctx)  # a promotion queued, not submitted
    manager.reset_cache()
    assert tier.drains == 0  # a reset waits for no tier
    assert [job.is_promotion for job in tier.submitted] == [False]  # the queued one was dropped
    assert manager.primary_tier.num_free_blocks == 4
    assert not manager.has_pending_work()
    assert tier.present[key(0)] is True  # the tier keeps its blocks
    manager.on_schedule_end()
    assert promote(manager, ctx, 0) == [None]  # ...and serves them again


def test_a_reset_hands_the_declared_weight_version_to_each_tier_that_takes_it(policy, ctx):
    class Versioned(ManualTier):
        def new_generation(self, weight_version=None):
            self.log.append(f"{self.tier_type}: {weight_version}")

    class Unversioned(ManualTier):  # a third party's hook from before versions: called without one
        def new_generation(self):
            self.log.append(f"{self.tier_type}: called")

    log: list[str] = []
    manager, _ = build(policy, [Versioned("a", log), Unversioned("b", log)])
    manager.reset_cache("step-7")
    manager.reset_cache()
    assert log == ["a: step-7", "b: called", "a: None", "b: called"]
    with pytest.raises(ValueError, match="printable ASCII characters without blanks"):
        manager.reset_cache("step 8")
    assert len(log) == 4  # refused before anything was reset


class StuckTier(ManualTier):
    """Its jobs outlive any drain, and a drain never returns (a frozen endpoint)."""

    def drain(self, timeout_s=None):
        self.drains += 1
        threading.Event().wait()  # the per-test timeout ends a reset that waits here
        return False


def test_reset_cache_voids_jobs_in_flight_and_every_row_comes_back(policy, ctx):
    tier = StuckTier()
    tier.present[key(7)] = True
    manager, _ = build(policy, [tier])
    primary = manager.primary_tier
    store(manager, ctx, 0, 1)  # two cascades in flight, reading rows of 0 and 1
    assert promote(manager, ctx, 7) == [None]  # a promotion in flight, writing a row
    manager.prepare_load(keys(0), ctx)  # a GPU load in flight (void after the reset)
    manager.prepare_store(keys(2), ctx)  # a GPU store in flight (void after the reset)
    manager.reset_cache()
    assert [primary.lookup(k, ctx) for k in keys(0, 1, 2, 7)] == [False] * 4  # no key stuck in flight
    assert primary.num_free_blocks == 1  # the tier's I/O may still use 3 rows
    assert manager.has_pending_work()
    tier.finish_all()
    manager.on_schedule_end()
    assert primary.num_free_blocks == 4
    assert not manager.has_pending_work()
    gauges = primary.get_stats()["gauges"]
    assert (gauges["rows_reading"], gauges["rows_writing"], gauges["rows_quarantined"]) == (0, 0, 0)
    assert manager.get_stats()["tiers"]["manual"]["gauges"]["rows_in_flight"] == 0
    assert primary.lookup(key(7), ctx) is False  # the voided promotion loaded nothing


def test_a_cascade_half_reported_at_a_reset_gives_its_rows_back_when_its_last_tier_reports(policy, ctx):
    tiers = [ManualTier("a"), ManualTier("b")]
    manager, _ = build(policy, tiers)
    primary = manager.primary_tier
    store(manager, ctx, 0, 1)  # one cascade, its rows pinned once for both tiers
    tiers[0].finish()
    manager.on_schedule_end()
    manager.reset_cache()
    assert primary.num_free_blocks == primary.num_blocks - 2  # tier b may still read them
    tiers[1].finish()
    manager.on_schedule_end()
    assert primary.num_free_blocks == primary.num_blocks and not manager.has_pending_work()
    gauges = primary.get_stats()["gauges"]
    assert (gauges["rows_reading"], gauges["rows_quarantined"]) == (0, 0)


def test_a_job_its_tier_never_reports_fails_at_its_deadline_and_the_request_recomputes(policy, ctx, caplog):
    tier = ManualTier()  # a tier with a bug: it reports nothing until the test says so
    tier.present[key(0)] = True
    clock = ManualClock(0.0)
    primary = CPUPrimaryTierOffloadingManager(4, RegionStandIn(4), cache_policy=policy)
    manager = TieringOffloadingManager(primary, [tier], job_deadline_s=60, clock=clock)
    assert promote(manager, ctx, 0) == [None]
    store(manager, ctx, 1)  # and a cascade, reading the row of 1
    clock.now = 59.9
    manager.on_schedule_end()
    assert manager.lookup(key(0), ctx) is None  # both still in flight
    clock.now = 60.0
    manager.on_schedule_end()
    counters, gauges = manager.get_stats()["manager"]["counters"], manager.get_stats()["manager"]["gauges"]
    assert (counters["jobs_expired"], gauges["jobs_in_flight"], gauges["jobs_holding_rows"]) == (2, 0, 2)
    assert "job 0 not reported 60 s after its submission" in caplog.text
    assert not manager.has_pending_work()
    assert manager.lookup(key(0), ctx) is False  # a miss: the request recomputes, the stuck tier is not asked
    manager.on_schedule_end()
    assert sum(job.is_promotion for job in tier.submitted) == 1
    assert primary.get_stats()["gauges"]["rows_quarantined"] == 1  # the tier may still write the row
    assert primary.ref_count(key(1)) == 1  # and still read this one
    tier.finish_all()  # it reports after all
    manager.on_schedule_end()
    assert primary.get_stats()["gauges"]["rows_quarantined"] == 0 and primary.ref_count(key(1)) == 0
    assert primary.num_free_blocks == 3  # every row back but the one of block 1, stored
    assert manager.get_stats()["manager"]["gauges"]["jobs_holding_rows"] == 0
    assert manager.get_stats()["tiers"]["manual"]["gauges"]["rows_in_flight"] == 0
    assert manager.lookup(key(0), ctx) is None  # the tier answers again: promoted from it once more


def test_no_deadline_without_one(policy, ctx):
    tier = ManualTier()
    tier.present[key(0)] = True
    clock = ManualClock(0.0)
    primary = CPUPrimaryTierOffloadingManager(4, RegionStandIn(4), cache_policy=policy)
    manager = TieringOffloadingManager(primary, [tier], job_deadline_s=None, clock=clock)
    promote(manager, ctx, 0)
    clock.now = 1e9
    manager.on_schedule_end()
    assert manager.get_stats()["manager"]["gauges"]["jobs_in_flight"] == 1


def test_shutdown_order_and_every_job_reported_once(policy, ctx, caplog):
    log: list[str] = []
    tiers = [ManualTier("a", log), ManualTier("b", log)]
    tiers[1].present[key(9)] = True
    manager, _ = build(policy, tiers, log=log)
    store(manager, ctx, 0)  # two cascades in flight
    promote(manager, ctx, 9)  # one promotion in flight
    manager.lookup(key(0), ctx)
    manager.shutdown_drain_s = 0  # no drain, which would let the jobs finish (tests/test_restart.py)
    with caplog.at_level(logging.WARNING):
        manager.shutdown()
        manager.shutdown()
    assert log == ["a.shutdown", "b.shutdown", "region.cleanup"]
    assert not manager.has_pending_work()
    assert "never reported" not in caplog.text
    assert manager.primary_tier.ref_count(key(0)) == 0
    assert manager.primary_tier.lookup(key(9), ctx) is False


def test_works_without_secondary_tiers(policy, ctx):
    manager, _ = build(policy, None)
    store(manager, ctx, 0)
    assert manager.lookup(key(0), ctx) is True
    assert manager.lookup(key(1), ctx) is False
    manager.on_schedule_end()
    manager.shutdown()


# -- a failing backend never reaches the scheduler ------------------------------------------


class BrokenTier(SecondaryTierManager):
    def lookup(self, key, req_context):
        raise OSError("lookup broke")

    def submit_store(self, job_metadata):
        raise OSError("store broke")

    def submit_load(self, job_metadata):
        raise OSError("load broke")

    def get_finished(self):
        raise OSError("poll broke")

    def touch(self, keys, req_context):
        raise OSError("touch broke")

    def on_schedule_end(self):
        raise OSError("flush broke")

    def drain(self, timeout_s=None):
        raise OSError("drain broke")

    def take_events(self):
        raise OSError("events broke")

    def shutdown(self):
        raise OSError("shutdown broke")


def test_a_raising_tier_fails_its_jobs_and_never_raises(policy, ctx, caplog):
    good = ManualTier("good")
    good.present[key(3)] = True
    manager, region = build(policy, [BrokenTier(None, memoryview(b""), "broken"), good])
    with caplog.at_level(logging.ERROR):
        store(manager, ctx, 0)  # the broken tier's cascade fails at submission
        assert manager.primary_tier.ref_count(key(0)) == 1  # only the good tier's reference
        assert manager.lookup(key(3), ctx) is None  # broken lookup counts as a miss
        manager.touch(keys(0), ctx)
        manager.on_schedule_end()
        manager.take_events()
        manager.reset_cache()
        manager.shutdown()
    assert "store broke" in caplog.text and "lookup broke" in caplog.text
    assert region.cleanups == 1


def test_a_raising_submit_load_frees_the_reserved_rows(policy, ctx):
    class BrokenLoads(ManualTier):
        def submit_load(self, job_metadata):
            raise OSError("load broke")

    tier = BrokenLoads()
    tier.present[key(0)] = True
    manager, _ = build(policy, [tier])
    promote(manager, ctx, 0)
    assert manager.primary_tier.lookup(key(0), ctx) is False
    assert not manager.has_pending_work()


def test_a_result_reported_twice_is_ignored(policy, ctx, caplog):
    tier = ManualTier()
    manager, _ = build(policy, [tier])
    store(manager, ctx, 0)
    job = tier.finish()
    tier.results.append(type(tier.results[0])(job.job_id, True))
    with caplog.at_level(logging.WARNING):
        manager.on_schedule_end()
    assert manager.primary_tier.ref_count(key(0)) == 0
    assert f"job {job.job_id} reported again" in caplog.text


def test_promotions_leave_store_reserve_rows_for_the_gpus_stores_and_the_rest_wait(policy, ctx):
    tier = ManualTier()
    tier.present.update(dict.fromkeys(keys(*range(6)), True))
    region = RegionStandIn(8)
    primary = CPUPrimaryTierOffloadingManager(8, region, cache_policy=policy)
    manager = TieringOffloadingManager(primary, [tier], store_reserve_rows=4)
    assert promote(manager, ctx, *range(6)) == [None] * 6
    assert [list(job.keys) for job in tier.submitted] == [keys(0, 1, 2, 3)]
    assert [manager.primary_tier.ref_count(k) for k in keys(4, 5)] == [None, None]  # nothing reserved
    stats = manager.get_stats()["manager"]
    assert stats["counters"]["promotions_deferred"] == 2
    assert stats["gauges"]["promotion_rows"] == 4
    assert manager.prepare_store(keys(10, 11, 12, 13), ctx) is not None  # the GPU's stores still find rows
    manager.on_schedule_end()
    tier.finish()
    manager.complete_store(keys(10, 11, 12, 13), ctx)
    manager.on_schedule_end()
    while tier.pending:  # the stores' cascades
        tier.finish()
    assert promote(manager, ctx, 4, 5) == [None, None]  # rows came back: every block is idle now
    assert [list(job.keys) for job in tier.submitted][-1] == keys(4, 5)
    tier.finish(success=False)
    manager.lookup(key(99), ctx)  # processes the failure
    assert manager.get_stats()["manager"]["gauges"]["promotion_rows"] == 0


def test_max_promotion_rows_caps_the_rows_promotions_hold(policy, ctx):
    tier = ManualTier()
    tier.present.update(dict.fromkeys(keys(*range(6)), True))
    primary = CPUPrimaryTierOffloadingManager(8, RegionStandIn(8), cache_policy=policy)
    manager = TieringOffloadingManager(primary, [tier], max_promotion_rows=3)
    assert promote(manager, ctx, *range(6)) == [None] * 6
    assert [list(job.keys) for job in tier.submitted] == [keys(0, 1, 2)]
    assert manager.get_stats()["manager"]["counters"]["promotions_deferred"] == 3


def test_a_small_tier_promotes_every_block_found_in_the_step_it_was_looked_up(policy):
    """The seeds' contract in a 5-row tier: three blocks of a secondary tier are one job, and
    two requests' promotions of one step are a job each, all submitted at that step's end."""
    tier = ManualTier()
    tier.present.update(dict.fromkeys(keys(*range(5)), True))
    manager, _ = build(policy, [tier], num_blocks=5)
    first, second = ReqContext("req-a"), ReqContext("req-b")
    assert [manager.lookup(k, first) for k in keys(0, 1, 2)] == [None] * 3
    assert [manager.lookup(k, second) for k in keys(3, 4)] == [None] * 2
    manager.on_schedule_end()
    assert [(job.req_context.req_id, list(job.keys)) for job in tier.submitted] == [
        ("req-a", keys(0, 1, 2)),
        ("req-b", keys(3, 4)),
    ]
    assert manager.get_stats()["manager"]["counters"]["promotions_deferred"] == 0


@pytest.mark.parametrize("head_in_secondary", [True, False])
def test_a_requests_promotions_never_evict_the_head_it_found_in_the_step(policy, ctx, head_in_secondary):
    """4 CPU rows: the request's head (blocks 0-1, least recently used) and two other blocks;
    its tail (2-3) only in a secondary tier. The tail's promotions evict the other blocks,
    not the head, and the next pass finds the whole prefix in the CPU tier."""
    tier = ManualTier()
    manager, _ = build(policy, [tier])
    store(manager, ctx, 0, 1)
    store(manager, ctx, 10, 11)
    while manager.has_pending_work() or tier.pending:  # cascades (the second waits for room)
        tier.finish_all()
        manager.on_schedule_end()
    tier.present.update(dict.fromkeys(keys(2, 3), True))
    if not head_in_secondary:
        for k in keys(0, 1):
            tier.present.pop(k)
    assert promote(manager, ctx, 0, 1, 2, 3) == [True, True, None, None]
    tier.finish()
    assert promote(manager, ctx, 0, 1, 2, 3) == [True, True, True, True]
    assert [manager.primary_tier.ref_count(k) for k in keys(10, 11)] == [None, None]


def test_the_managers_keep_few_enough_attributes_for_cpython_to_share_their_keys(policy):
    """Past 30 instance attributes CPython (3.11) stops sharing an instance's dict keys, and
    attribute reads on the scheduler's hot paths slow (about 5% in a micro-benchmark here;
    the manager had reached 33): group new state in objects."""
    manager, _ = build(policy, [ManualTier()])
    assert len(vars(manager)) <= 30
    assert len(vars(manager.primary_tier)) <= 30
