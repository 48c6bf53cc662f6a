import pytest

from tests.helpers import ManualClock
from tiering.tiers.blockstore.health import HealthState, TierHealth


def breaker(**options):
    clock = ManualClock(100.0)
    return TierHealth("tier", clock=clock, **options), clock


def test_trips_after_consecutive_failures_only():
    health, _ = breaker(failure_threshold=3)
    for _ in range(100):  # a 10% failure rate: every batch has successes
        health.record(successes=9, failures=1)
    assert health.healthy and health.consecutive_failures == 0
    health.record(0, 2)
    health.record(0, 1)
    assert not health.healthy and health.state is HealthState.UNHEALTHY


def test_probes_after_the_backoff_and_doubles_it_while_probes_fail(caplog):
    health, clock = breaker(failure_threshold=1, backoff_s=1.0, max_backoff_s=3.0)
    health.record(0, 1)
    assert not health.ping_due()
    clock.now += 1.0
    assert health.ping_due() and health.state is HealthState.PROBING
    assert not health.ping_due()  # one probe at a time
    health.ping_result(False)
    assert health.backoff_s == 2.0
    clock.now += 2.0
    assert health.ping_due()
    health.ping_result(False)
    assert health.backoff_s == 3.0  # capped
    clock.now += 3.0
    assert health.ping_due()
    health.ping_result(True)
    assert health.healthy and health.backoff_s == 1.0 and health.consecutive_failures == 0
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warnings == [
        "tier tier unhealthy (1 consecutive failures); no I/O for 1.0 s",
        "tier tier recovered after 6.0 s; resuming I/O",
    ]


def test_a_backend_back_after_a_long_outage_is_used_again_within_the_ceiling_and_logged_once_a_minute(caplog):
    health, clock = breaker(failure_threshold=1)  # defaults: probes 1, 2, 4, 5, 5 ... s apart
    health.record(0, 1)
    probes = 0
    for _ in range(int(300 / 0.5)):  # five minutes down
        clock.now += 0.5
        if health.ping_due():
            probes += 1
            health.ping_result(False)
    clock.now += 0.5
    waited = 0.5
    while not health.ping_due():  # the backend is back
        clock.now += 0.5
        waited += 0.5
    health.ping_result(True)
    assert health.healthy and waited <= 5.0 and probes >= 55
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 2 + 4 and all("still unhealthy after" in line for line in warnings[1:-1])


def test_rejects_impossible_settings():
    with pytest.raises(ValueError, match="failure_threshold >= 1"):
        TierHealth("t", failure_threshold=0)
