"""Admission in front of a secondary tier: the bound, shedding on the measured rate, the
reuse filter, and what the scheduler sees when a tier falls behind."""

import pytest

from tests.helpers import CTX, ROW, ManualClock, ManualTier, RegionStandIn, keys
from tiering import ConfigError, CPUPrimaryTierOffloadingManager, TieringOffloadingManager, parse_config
from tiering.engine.admission import AdmissionConfig, TierAdmission
from tiering.eviction.sketch import CountMinSketch

UNBOUNDED = AdmissionConfig(max_rows_in_flight=1 << 30, max_backlog_s=None)


def test_the_bound_admits_a_whole_job_when_nothing_is_in_flight_and_what_exceeds_it_waits():
    admission = TierAdmission(AdmissionConfig(max_rows_in_flight=4, max_backlog_s=None), 99)
    assert admission.admit(keys(*range(6))) == keys(*range(6))  # nothing in flight: never starved
    assert admission.admit(keys(6)) == []
    assert list(admission.waiting) == keys(6)
    assert admission.admit_waiting(lambda key: True) == []  # no room yet
    admission.finished(keys(*range(6)), success=True)
    assert admission.admit(keys(7, 8)) == keys(7, 8)
    assert admission.admit(keys(9, 10, 11)) == keys(9, 10)  # 2 of the 4 rows were free
    assert list(admission.waiting) == keys(6, 11)
    admission.finished(keys(7, 8, 9, 10), success=True)
    assert admission.admit_waiting(lambda key: key != keys(6)[0]) == keys(11)  # 6 was evicted meanwhile
    assert admission.counters == {
        "cascades_admitted": 11,
        "cascades_deferred": 2,
        "cascades_dropped": 1,
        "cascades_filtered": 0,
        "cascades_retained": 0,
    }
    assert admission.rows_in_flight == 1


def test_at_most_the_bounds_worth_of_blocks_wait():
    admission = TierAdmission(AdmissionConfig(max_rows_in_flight=2, max_backlog_s=None), 99)
    admission.admit(keys(0, 1))
    assert admission.admit(keys(2, 3, 4)) == []
    assert list(admission.waiting) == keys(3, 4)  # the oldest was dropped
    assert admission.counters["cascades_dropped"] == 1


def test_a_tier_that_keeps_up_sheds_nothing_and_one_that_falls_behind_sheds_until_it_catches_up():
    clock = ManualClock(0.0)
    config = AdmissionConfig(max_rows_in_flight=1000, max_backlog_s=1.0)
    admission = TierAdmission(config, 99, clock=clock)
    for _ in range(50):  # 10 blocks every 0.1 s, done 0.05 s later: 200 blocks/s while busy
        assert len(admission.admit(keys(*range(10)))) == 10
        clock.now += 0.05
        admission.finished(keys(*range(10)), success=True)
        clock.now += 0.05
    assert admission.counters["cascades_dropped"] == 0
    assert admission.backlog_s == 0
    for _ in range(30):  # now 100 blocks a step and nothing finishes: 3,000 blocks queued at ~200 a second
        admission.admit(keys(*range(100)))
        clock.now += 0.1
    assert admission.counters["cascades_dropped"] > 0
    assert admission.backlog_s is not None and admission.backlog_s > 1.0
    admission.finished(keys(*range(admission.rows_in_flight)), success=True)  # the tier catches up
    assert admission.admit(keys(1, 2)) == keys(1, 2)


def test_the_reuse_filter_cascades_blocks_stored_at_least_n_times_and_forgets_slowly():
    admission = TierAdmission(AdmissionConfig(min_reuse=2, max_backlog_s=None), 99)
    admission.stored(keys(1, 2))
    assert admission.admit(keys(1, 2)) == []
    admission.stored(keys(1, 3))
    assert admission.admit(keys(1, 3)) == keys(1)
    assert admission.counters["cascades_filtered"] == 3
    sketch = CountMinSketch(1 << 16, window=4)
    assert [sketch.add(k) for k in keys(1, 1, 1)] == [1, 2, 3]
    sketch.add(keys(2)[0])  # the 4th sighting halves every count
    assert sketch.add(keys(1)[0]) == 2


def manager_over(tier, rows=8, admission=None):
    primary = CPUPrimaryTierOffloadingManager(rows, RegionStandIn(rows, ROW))
    return TieringOffloadingManager(primary, [tier], admission=[admission] if admission else None)


def store(manager, *ids):
    out = manager.prepare_store(keys(*ids), CTX)
    if out is not None:
        manager.complete_store(out.keys_to_store, CTX)
    return out


def test_a_tier_that_falls_behind_sheds_cascades_and_the_gpu_keeps_storing():
    tier = ManualTier()  # never finishes a job: the slowest tier there is
    manager = manager_over(tier)
    try:
        refused = sum(store(manager, 2 * i, 2 * i + 1) is None for i in range(20))
        stats = manager.get_stats()["tiers"]["manual"]
        assert refused == 0
        assert stats["gauges"]["rows_in_flight"] == 4  # the default bound: half of 8 rows, one tier
        assert stats["gauges"]["cascades_waiting"] == 4  # the bound's worth waits, unpinned
        assert stats["counters"]["cascades_dropped"] == 32
    finally:
        manager.shutdown()


def test_blocks_over_the_bound_are_cascaded_once_the_tier_has_room():
    tier = ManualTier()
    manager = manager_over(tier, admission=AdmissionConfig(max_rows_in_flight=2, max_backlog_s=None))
    try:
        store(manager, 0, 1)
        store(manager, 2, 3)  # over the bound: waits, unpinned
        assert manager.primary_tier.ref_count(keys(2)[0]) == 0
        manager.on_schedule_end()
        assert [list(job.keys) for job in tier.submitted] == [keys(0, 1)]
        tier.finish()
        manager.on_schedule_end()
        assert [list(job.keys) for job in tier.submitted] == [keys(0, 1), keys(2, 3)]
        counters = manager.get_stats()["tiers"]["manual"]["counters"]
        assert (counters["cascades_deferred"], counters["cascades_dropped"]) == (2, 0)
    finally:
        manager.shutdown()


def test_without_a_bound_a_slow_tier_pins_every_row_and_gpu_stores_are_refused():
    tier = ManualTier()
    manager = manager_over(tier, admission=UNBOUNDED)
    try:
        refused = sum(store(manager, 2 * i, 2 * i + 1) is None for i in range(20))
        assert refused == 16  # 4 stores of 2 fill the 8 rows, all pinned by the cascade
    finally:
        manager.shutdown()


def test_admission_is_configured_per_tier_and_checked_at_load():
    config = parse_config(
        "cpu_bytes_to_use: 1MiB\nsecondary_tiers:\n"
        "  - {type: memory, admission: {min_reuse: 2, max_rows_in_flight: 64}}\n  - {type: memory}\n"
    )
    assert config.secondary_tiers[0]["admission"] == {"min_reuse": 2, "max_rows_in_flight": 64}
    assert "admission" not in config.secondary_tiers[1]
    with pytest.raises(ConfigError, match=r"secondary_tiers\[0\].admission.min_reuse: Input should be greater"):
        parse_config("cpu_bytes_to_use: 1MiB\nsecondary_tiers: [{type: memory, admission: {min_reuse: 0}}]")
    with pytest.raises(ConfigError, match=r"secondary_tiers\[0\].admission.shed: unknown key"):
        parse_config("cpu_bytes_to_use: 1MiB\nsecondary_tiers: [{type: memory, admission: {shed: yes}}]")


def test_write_back_scans_only_after_something_changed():
    tier = ManualTier()
    manager = manager_over(tier, rows=8, admission=AdmissionConfig(write="back", writeback_window=3))
    scans = []
    coldest = manager.primary_tier.coldest
    manager.primary_tier.coldest = lambda n: scans.append(n) or coldest(n)
    try:
        store(manager, 0, 1, 2, 3)
        manager.on_schedule_end()
        assert len(scans) == 1 and len(tier.pending) == 1
        for _ in range(100):  # idle steps: nothing to scan for (each used to scan the window)
            manager.on_schedule_end()
        assert len(scans) == 1
        tier.finish(next(iter(tier.pending)), success=True)
        manager.touch(keys(2), CTX)
        manager.on_schedule_end()  # a job ended and an order changed: scanned again
        assert len(scans) == 2 and [list(j.keys) for j in tier.pending.values()] == [keys(3)]
    finally:
        manager.shutdown()


def test_write_back_copies_the_coldest_blocks_not_the_ones_just_stored():
    tier = ManualTier()
    manager = manager_over(tier, rows=8, admission=AdmissionConfig(write="back", writeback_window=3))
    try:
        store(manager, 0, 1, 2, 3)
        assert tier.pending == {}  # nothing is cascaded when stored
        manager.on_schedule_end()
        (job,) = tier.pending.values()
        assert list(job.keys) == keys(0, 1, 2)  # the three least recent: the next to be evicted
        manager.on_schedule_end()
        assert len(tier.pending) == 1  # the coldest three are written or being written
        tier.finish(job.job_id, success=True)
        manager.touch(keys(2), CTX)  # 2 is hot again: 3 is now among the coldest
        manager.on_schedule_end()
        assert [list(j.keys) for j in tier.pending.values()] == [keys(3)]
        assert manager.get_stats()["tiers"]["manual"]["counters"]["cascades_admitted"] == 4
    finally:
        manager.shutdown()
