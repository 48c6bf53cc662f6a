import pytest

from tiering.health import HealthState, TierHealth


class Clock:
    now = 100.0

    def __call__(self):
        return self.now


def breaker(**options):
    clock = Clock()
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
    assert not health.probe_due()
    clock.now += 1.0
    assert health.probe_due() and health.state is HealthState.PROBING
    assert not health.probe_due()  # one probe at a time
    health.probe_result(False)
    assert health.backoff_s == 2.0
    clock.now += 2.0
    assert health.probe_due()
    health.probe_result(False)
    assert health.backoff_s == 3.0  # capped
    clock.now += 3.0
    assert health.probe_due()
    health.probe_result(True)
    assert health.healthy and health.backoff_s == 1.0 and health.consecutive_failures == 0
    assert caplog.text.count("unhealthy") == 3 and caplog.text.count("recovered") == 1


def test_rejects_impossible_settings():
    with pytest.raises(ValueError, match="failure_threshold >= 1"):
        TierHealth("t", failure_threshold=0)
