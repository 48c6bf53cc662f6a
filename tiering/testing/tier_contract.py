"""`TierContractSuite`: the `SecondaryTierManager` contract, tested on any tier.

A tier's test module subclasses it with a `tier_kit` fixture returning a `TierKit` (how to
build the tier over given primary rows); pytest then runs every test against that tier::

    class TestMyTier(TierContractSuite):
        @pytest.fixture
        def tier_kit(self, tmp_path):
            return TierKit(make=lambda rows, capacity_blocks: ...)

The tests call the tier from one thread, as a scheduler does, and wait for its jobs by
polling `get_finished` after `on_schedule_end` and `drain`; a tier with the
`attach_doorbell` hook is polled only after it rang, as the manager does, so a result it
forgets to ring for is never collected. Needs pytest (the ``testing``
extra).
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest

from tiering import Doorbell, JobMetadata, JobResult, ReqContext, SecondaryTierManager, make_offload_key
from tiering.contract.keys import OffloadKey

ROWS, ROW_BYTES = 16, 4096
CONTEXT = ReqContext("contract")


@dataclass
class TierKit:
    """make(rows, capacity_blocks) builds a tier over `rows` (a 2-D memoryview, one row per
    block) holding at most `capacity_blocks` blocks (None: no limit). `bounded`: the tier
    honours the capacity; `copies_bytes`: loads bring back the stored bytes (False for a
    tier of keys only)."""

    make: Callable[[memoryview, int | None], SecondaryTierManager]
    bounded: bool = True
    copies_bytes: bool = True


def key(i: int) -> OffloadKey:
    """The key of block number `i` in these tests."""
    return make_offload_key(b"contract" + i.to_bytes(8, "big"), 0)


class Driver:
    """A tier over its own random primary rows, driven as a scheduler would."""

    def __init__(self, kit: TierKit, capacity_blocks: int | None = None):
        self.rows = np.frombuffer(bytearray(os.urandom(ROWS * ROW_BYTES)), dtype=np.uint8).reshape(ROWS, ROW_BYTES)
        self.tier = kit.make(self.rows.data, capacity_blocks)
        self.doorbell = Doorbell()
        self.tier.attach_doorbell(self.doorbell)
        self.rings = type(self.tier).attach_doorbell is not SecondaryTierManager.attach_doorbell
        self.reported: Counter[int] = Counter()
        self.results: dict[int, JobResult] = {}
        self._next_job = 0

    def submit(self, keys: list[OffloadKey], rows: list[int], promotion: bool) -> int:
        job_id, self._next_job = self._next_job, self._next_job + 1
        job = JobMetadata(job_id, keys, np.array(rows, dtype=np.int64), promotion, CONTEXT)
        (self.tier.submit_load if promotion else self.tier.submit_store)(job)
        return job_id

    def poll(self) -> None:
        if self.rings and not self.doorbell.rung:
            return
        self.doorbell.rung = False
        for result in self.tier.get_finished():
            self.reported[result.job_id] += 1
            self.results[result.job_id] = result

    def settle(self, timeout_s: float = 30.0) -> None:
        """Run steps until nothing is in flight and every result is collected."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.tier.on_schedule_end()
            self.tier.drain(max(0.0, deadline - time.monotonic()))
            self.poll()
            if not self.tier.has_pending_work():
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"tier still has work in flight after {timeout_s} s")
            time.sleep(0.001)

    def store(self, *blocks: int) -> None:
        """Store blocks 0.. from the rows of the same numbers, and wait."""
        job_id = self.submit([key(b) for b in blocks], list(blocks), promotion=False)
        self.settle()
        assert self.results[job_id].success

    def close(self) -> None:
        self.tier.shutdown()


class TierContractSuite:
    """The tests; subclass it (name the subclass ``Test...``) and give it a ``tier_kit``
    fixture."""

    @pytest.fixture
    def driver(self, tier_kit):
        driver = Driver(tier_kit)
        yield driver
        driver.close()

    def test_every_job_is_reported_exactly_once(self, driver):
        stores = [driver.submit([key(2 * i), key(2 * i + 1)], [2 * i, 2 * i + 1], False) for i in range(4)]
        driver.settle()
        loads = [driver.submit([key(i)], [8 + i], True) for i in range(4)]
        unknown = driver.submit([key(99)], [15], True)
        driver.settle()
        assert driver.reported == Counter(dict.fromkeys([*stores, *loads, unknown], 1))
        assert all(driver.results[job].success for job in [*stores, *loads])
        assert not driver.results[unknown].success

    def test_a_key_being_stored_is_never_a_miss(self, driver):
        driver.submit([key(0), key(1)], [0, 1], False)
        assert {driver.tier.lookup(key(0), CONTEXT), driver.tier.lookup(key(1), CONTEXT)} <= {None, True}
        driver.settle()
        assert driver.tier.lookup(key(0), CONTEXT) is True
        assert driver.tier.lookup(key(5), CONTEXT) in (False, None)  # None: a tier that probes its store
        driver.settle()
        assert driver.tier.lookup(key(5), CONTEXT) is False

    def test_a_load_brings_back_the_stored_bytes(self, driver, tier_kit):
        if not tier_kit.copies_bytes:
            pytest.skip("this tier holds keys only")
        expected = driver.rows[0:4].copy()
        driver.store(0, 1, 2, 3)
        driver.rows[8:12] = 0
        job = driver.submit([key(i) for i in range(4)], [8, 9, 10, 11], True)
        driver.settle()
        assert driver.results[job].success
        assert np.array_equal(driver.rows[8:12], expected)

    def test_a_block_being_read_is_never_evicted(self, tier_kit):
        if not tier_kit.bounded:
            pytest.skip("this tier has no capacity to evict from")
        driver = Driver(tier_kit, capacity_blocks=4)
        try:
            expected = driver.rows[0].copy()
            driver.store(0, 1, 2, 3)
            load = driver.submit([key(0)], [12], True)  # in flight while new blocks need room
            store = driver.submit([key(i) for i in range(4, 8)], list(range(4, 8)), False)
            driver.settle()
            assert driver.results[load].success and driver.reported[store] == 1
            if tier_kit.copies_bytes:
                assert np.array_equal(driver.rows[12], expected)
            driver.store(8, 9, 10, 11)  # room for these comes from evicting older blocks
            assert sum(driver.tier.lookup(key(i), CONTEXT) is True for i in range(12)) <= 4
        finally:
            driver.close()

    def test_shutdown_reports_every_job_in_flight(self, tier_kit):
        driver = Driver(tier_kit)
        jobs = [driver.submit([key(i)], [i], False) for i in range(4)]
        driver.tier.on_schedule_end()
        driver.close()
        driver.close()  # a second shutdown does nothing
        driver.poll()
        assert driver.reported == Counter(dict.fromkeys(jobs, 1))

    def test_stats_are_counters_and_gauges(self, driver):
        driver.store(0)
        stats = driver.tier.get_stats()
        assert isinstance(stats["counters"], dict) and isinstance(stats["gauges"], dict)
