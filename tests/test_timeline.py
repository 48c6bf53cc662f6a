"""The request log: when each request's prefix was looked up, promoted and loaded, in
seconds and scheduler steps, one JSON line per finished request."""

import json

import numpy as np
import pytest

from tests.helpers import ManualClock, ManualTier, RegionStandIn, key, keys, region_name
from tiering import CPUPrimaryTierOffloadingManager, KVLayout, ReqContext, TieringOffloadingManager
from tiering.config import parse_config
from tiering.cpu.row_states import RowStates
from tiering.cpu.shared_region import region_path
from tiering.engine.timeline import RequestTimeline
from tiering.errors import ConfigError
from tiering.spec import TieringOffloadingSpec


def lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_promoted_prefix_shows_its_deferred_steps_promotion_and_load(tmp_path):
    log = tmp_path / "requests.jsonl"
    tier = ManualTier("file")
    manager = TieringOffloadingManager(CPUPrimaryTierOffloadingManager(8, RegionStandIn(8)), [tier], request_log=log)
    clock = ManualClock(10.0)
    manager._timeline._clock = clock  # the manager's own clock, moved by the test
    tier.present.update(dict.fromkeys(keys(1, 2), True))
    request = ReqContext("req-1")
    assert [manager.lookup(k, request) for k in keys(1, 2)] == [None, None]  # promotions queued
    manager.on_schedule_end()  # step 1: submitted
    clock.now += 0.25
    tier.finish()
    manager.on_schedule_end()  # step 2: promoted
    clock.now += 0.05
    assert [manager.lookup(k, request) for k in keys(1, 2)] == [True, True]
    manager.prepare_load(keys(1, 2), request)
    manager.on_schedule_end()  # step 3: the worker copies
    clock.now += 0.01
    manager.complete_load(keys(1, 2), request)
    manager.on_request_finished(request)
    other = ReqContext("req-2")
    assert manager.lookup(key(9), other) is False  # nothing anywhere: no load
    manager.on_request_finished(other)
    manager.lookup(key(1), ReqContext("never-finished"))
    manager.on_request_finished(ReqContext("cached-whole"))  # vLLM's GPU cache held it all: no lookup
    manager.shutdown()
    promoted, missed, cached = lines(log)  # the unfinished request wrote nothing
    assert promoted == {
        "req_id": "req-1",
        "first_lookup": 10.0,
        "load_prepared": pytest.approx(10.3),
        "steps_to_load": 2,
        "load_completed": pytest.approx(10.31),
        "steps_loading": 1,
        "blocks_loaded": 2,
        "blocks_pending": 0,
        "rows_wait_s": None,
        "promotions": {"file": pytest.approx(0.25)},
        "promoted_blocks": {"file": 2},
        "finished": pytest.approx(10.31),
    }
    assert missed["req_id"] == "req-2" and missed["load_prepared"] is None and missed["blocks_loaded"] == 0
    assert cached["req_id"] == "cached-whole" and cached["first_lookup"] is None and cached["finished"] == 10.31


class SettlingTier(ManualTier):
    """A tier that settles its promoted rows (here: the test does, through `states`)."""

    def attach_row_states(self, row_states):
        self.states = row_states


class RegionWithStates(RegionStandIn):
    def create_row_states(self):
        return RowStates(np.zeros(self.shape[0], dtype=np.uint8))


def test_a_prefix_loaded_while_its_promotion_ran_shows_no_deferred_step_and_the_workers_wait(tmp_path):
    log = tmp_path / "requests.jsonl"
    tier = SettlingTier("file")
    primary = CPUPrimaryTierOffloadingManager(8, RegionWithStates(8))
    manager = TieringOffloadingManager(primary, [tier], request_log=log)
    manager.answer_pending_hits = True
    tier.present.update(dict.fromkeys(keys(1, 2), True))
    request = ReqContext("req-1")
    assert [manager.lookup(k, request) for k in keys(1, 2)] == [True, True]  # hits while promoted
    manager.prepare_load(keys(1, 2), request)
    manager.on_schedule_end()
    manager.load_waited("req-1", 0.02)  # what the worker measured, through the connector
    manager.complete_load(keys(1, 2), request)
    manager.on_request_finished(request)
    manager.shutdown()
    (entry,) = lines(log)
    assert (entry["steps_to_load"], entry["blocks_pending"], entry["rows_wait_s"]) == (0, 2, 0.02)


def test_a_log_that_cannot_be_written_switches_itself_off(caplog):
    timeline = RequestTimeline("/dev/full")  # every write fails with ENOSPC
    timeline.looked_up("a")
    timeline.finished("a")
    timeline.looked_up("b")
    timeline.finished("b")
    assert "request_log: cannot write" in caplog.text and caplog.text.count("request_log") == 1


def test_a_request_log_that_cannot_be_opened_is_a_config_error_and_leaks_nothing(tmp_path):
    config = parse_config(f"cpu_bytes_to_use: 64KiB\nrequest_log: {tmp_path / 'missing' / 'x.jsonl'}")
    spec = TieringOffloadingSpec(config, KVLayout("t", 1, 64), region_name())
    with spec, pytest.raises(ConfigError) as raised:
        spec.get_manager()
    assert "request_log: cannot be opened for appending: No such file or directory" in str(raised.value)
    assert not region_path(spec.instance_id).exists()  # (another engine's start may sweep others' meanwhile)
