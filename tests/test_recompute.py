"""Load or recompute: the gate's decision from a tier's measured rate, its backlog and the
prefill rate, and what the scheduler sees through the manager."""

from tests.helpers import ManualTier, RegionStandIn, key, keys
from tiering import CPUPrimaryTierOffloadingManager, ReqContext, TieringOffloadingManager
from tiering.recompute import RecomputeGate


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def measure(gate: RecomputeGate, clock: Clock, blocks: int, seconds: float) -> None:
    """One promotion of `blocks` taking `seconds`."""
    gate.queued(blocks)
    gate.submitted(blocks)
    clock.now += seconds
    gate.finished(blocks, True, seconds)


def test_without_a_prefill_rate_or_a_measurement_every_block_is_loaded():
    clock = Clock()
    assert RecomputeGate(None, 32, clock=clock).worth_loading("r", 1)
    gate = RecomputeGate(1000.0, 32, clock=clock)  # a block recomputes in 32 ms
    assert gate.worth_loading("r", 1)  # no rate yet
    measure(gate, clock, 1, 10.0)  # then a very slow load
    assert gate.worth_loading("s", 1)  # the probe of this interval
    assert not gate.worth_loading("t", 1)


def test_a_fast_tier_loads_a_slow_one_is_declined_and_counted():
    clock = Clock()
    fast, slow = RecomputeGate(1000.0, 32, clock=clock), RecomputeGate(1000.0, 32, clock=clock)
    measure(fast, clock, 1, 0.01)  # a promotion in 10 ms
    measure(slow, clock, 1, 0.1)  # in 100 ms, slower than 32 ms of prefill
    assert fast.worth_loading("a", 1) and fast.declined == 0
    assert slow.worth_loading("a", 1)  # the first decline would be the probe of the interval
    assert [slow.worth_loading(r, 1) for r in "bcd"] == [False] * 3
    assert slow.declined == 3
    assert slow.worth_loading("a", 2)  # the probing request keeps its run


def test_a_fast_tier_with_a_deep_backlog_is_declined():
    clock = Clock()
    gate = RecomputeGate(1000.0, 32, clock=clock)
    for _ in range(10):  # promotions of a block in 10 ms, one after the other: 100 blocks/s
        measure(gate, clock, 1, 0.01)
    gate.queued(1)
    gate.submitted(1)  # 1 block ahead: ready in about 10 + 10 ms, before 32 ms
    assert gate.worth_loading("a", 1)
    gate.queued(2)  # 3 ahead of a new request: about 40 ms
    assert gate.worth_loading("probe", 1)  # (the probe of this interval)
    assert not gate.worth_loading("b", 1)
    assert gate.worth_loading("a", 3)  # a's third block: 1 block ahead of its run, against 96 ms of prefill


def test_a_tier_that_recovers_is_measured_again_by_a_probe_every_interval():
    clock = Clock()
    gate = RecomputeGate(1000.0, 32, probe_interval_s=10.0, clock=clock)
    measure(gate, clock, 1, 1.0)
    assert gate.worth_loading("probe-1", 1) and not gate.worth_loading("b", 1)
    clock.now += 10.0
    assert gate.worth_loading("probe-2", 1)  # the tier is fast again:
    measure(gate, clock, 1, 0.001)
    assert not gate.worth_loading("c", 1)  # half-way there: 0.5 s
    clock.now += 10.0
    assert gate.worth_loading("probe-3", 1)
    for _ in range(6):
        measure(gate, clock, 1, 0.001)
    assert gate.worth_loading("d", 1) and gate.worth_loading("e", 1)


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
    assert manager.lookup(key(2), ReqContext("probe")) is None  # the probe of the interval
    assert manager.lookup(key(3), ReqContext("x")) is False  # nobody has it
    slow.present[key(4)] = True
    assert manager.lookup(key(4), ReqContext("second")) is False  # declined, and no other tier has it
    stats = manager.get_stats()["tiers"]
    assert stats["slow"]["counters"]["promotions_declined"] == 1
    assert stats["fast"]["counters"]["promotions_declined"] == 0
    manager.shutdown()
