"""Load or recompute: the gate's decision from a tier's measured rate, its backlog and the
prefill rate, and what the scheduler sees through the manager."""

from tests.helpers import ManualClock, ManualTier, RegionStandIn, key, keys
from tiering import CPUPrimaryTierOffloadingManager, ReqContext, TieringOffloadingManager
from tiering.engine.recompute import RecomputeGate


def measure(gate: RecomputeGate, clock: ManualClock, blocks: int, seconds: float) -> None:
    """One promotion of `blocks` taking `seconds`."""
    gate.queued(blocks)
    gate.submitted(blocks)
    clock.now += seconds
    gate.finished(blocks, True, seconds)


def test_without_a_prefill_rate_or_a_measurement_every_block_is_loaded():
    clock = ManualClock(100.0)
    assert RecomputeGate(None, 32, clock=clock).decide(1) == "load"
    gate = RecomputeGate(1000.0, 32, clock=clock)  # a block recomputes in 32 ms
    assert gate.decide(1) == "load"  # no rate yet
    measure(gate, clock, 1, 10.0)  # then a very slow load
    assert [gate.decide(1) for _ in range(3)] == ["trial", "decline", "decline"]
    assert gate.declined == 3  # a trial's request recomputes too


def test_a_fast_tier_loads_a_slow_one_is_declined_and_counted():
    clock = ManualClock(100.0)
    fast, slow = RecomputeGate(1000.0, 32, clock=clock), RecomputeGate(1000.0, 32, clock=clock)
    measure(fast, clock, 1, 0.01)  # a promotion in 10 ms
    measure(slow, clock, 1, 0.1)  # in 100 ms, slower than 32 ms of prefill
    assert fast.decide(1) == "load" and fast.declined == 0
    assert [slow.decide(1) for _ in range(4)] == ["trial"] + ["decline"] * 3
    assert slow.declined == 4
    assert slow.decide(4) == "load"  # a run of 4 blocks recomputes in 128 ms: loading is faster


def test_a_fast_tier_with_a_deep_backlog_is_declined():
    clock = ManualClock(100.0)
    gate = RecomputeGate(1000.0, 32, clock=clock)
    for _ in range(10):  # promotions of a block in 10 ms, one after the other: 100 blocks/s
        measure(gate, clock, 1, 0.01)
    gate.queued(1)
    gate.submitted(1)  # 1 block ahead: ready in about 10 + 10 ms, before 32 ms
    assert gate.decide(1) == "load"
    gate.queued(2)  # 3 ahead of a new request: about 40 ms
    assert [gate.decide(1) for _ in range(2)] == ["trial", "decline"]
    assert gate.decide(3) == "load"  # the third block of a run: 1 block ahead of it, against 96 ms of prefill


def test_a_tier_that_recovers_is_measured_again_by_a_probe_every_interval():
    clock = ManualClock(100.0)
    gate = RecomputeGate(1000.0, 32, trial_interval_s=10.0, clock=clock)
    measure(gate, clock, 1, 1.0)
    assert [gate.decide(1) for _ in range(2)] == ["trial", "decline"]
    clock.now += 10.0
    assert gate.decide(1) == "trial"  # the tier is fast again:
    measure(gate, clock, 1, 0.001)
    assert gate.decide(1) == "decline"  # half-way there: 0.5 s
    clock.now += 10.0
    assert gate.decide(1) == "trial"
    for _ in range(6):
        measure(gate, clock, 1, 0.001)
    assert gate.decide(1) == "load" and gate.decide(1) == "load"


def test_the_manager_answers_a_miss_for_a_declined_block_and_counts_it_per_tier():
    slow, fast = ManualTier("slow"), ManualTier("fast")
    primary = CPUPrimaryTierOffloadingManager(8, RegionStandIn(8))
    manager = TieringOffloadingManager(primary, [slow, fast], block_tokens=32, recompute_tokens_per_s=1e9)
    slow.present.update(dict.fromkeys(keys(1, 2), True))
    fast.present[key(2)] = True
    first = ReqContext("first")
    assert manager.lookup(key(1), first) is None  # no rate yet: promoted
    manager.on_schedule_end()
    slow.finish()  # any measurable time is slower than a prefill of a billion tokens a second
    manager.on_schedule_end()
    assert manager.lookup(key(1), first) is True
    # the interval's probe: a miss for the request (fast has key 2 too, but is not asked), promoted meanwhile
    assert manager.lookup(key(2), ReqContext("trial")) is False
    manager.on_schedule_end()
    assert [job.keys for job in slow.pending.values()] == [[key(2)]] and not fast.pending
    assert manager.lookup(key(3), ReqContext("x")) is False  # nobody has it
    slow.present[key(4)] = True
    assert manager.lookup(key(4), ReqContext("second")) is False  # declined, and no other tier has it
    stats = manager.get_stats()["tiers"]
    assert stats["slow"]["counters"]["promotions_declined"] == 2
    assert stats["fast"]["counters"]["promotions_declined"] == 0
    slow.finish()
    manager.on_schedule_end()
    assert manager.lookup(key(2), ReqContext("later")) is True  # the probe's block serves later requests
    manager.shutdown()


def test_a_probe_never_evicts_the_hits_its_request_is_about_to_load():
    """vLLM looks a prefix up block by block and loads the hits before the first miss in the
    same step: a probe's row, reserved at once, could evict one of them (vLLM's scheduler then
    died on prepare_load's KeyError). It is reserved at the step's end, after the loads."""
    slow = ManualTier("slow")
    primary = CPUPrimaryTierOffloadingManager(2, RegionStandIn(2))
    manager = TieringOffloadingManager(primary, [slow], block_tokens=32, recompute_tokens_per_s=1e9)
    slow.present.update(dict.fromkeys(keys(1, 2), True))
    first = ReqContext("first")
    assert manager.lookup(key(1), first) is None  # no rate yet: promoted, and measured as slow
    manager.on_schedule_end()
    slow.finish()
    manager.on_schedule_end()
    stored = ReqContext("stored")
    manager.complete_store(manager.prepare_store(keys(9), stored).keys_to_store, stored)  # rows full: 1, 9
    manager.on_schedule_end()
    slow.finish()  # key 9's cascade: its row is free to evict again
    manager.on_schedule_end()
    request = ReqContext("request")
    assert manager.lookup(key(1), request) is True  # the least recent row
    assert manager.lookup(key(2), request) is False  # the interval's probe
    spec = manager.prepare_load(keys(1), request)  # key 1 is still there
    manager.on_schedule_end()
    assert [job.keys for job in slow.pending.values()] == [keys(2)]  # the probe took key 9's row
    assert primary.ref_count(key(9)) is None and list(spec.block_ids) != []
    manager.complete_load(keys(1), request)
    manager.shutdown()
