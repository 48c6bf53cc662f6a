"""vLLM's event tracker over a soak of stores, evictions and promotions behind the engine's
connector with ``self_describing_kv_events``: every block announced carries its tokens,
promotions' too, and the tracker keeps a block's tokens until every tier that
announced the block has announced its removal, so it must end up holding blocks some tier
still holds, and no others."""

import pytest

from tests_vllm import tiny
from tests_vllm.conftest import prompt
from tests_vllm.test_vllm import close, manager_stats
from tiering.integrations.vllm import live_specs
from tiering.tiers.object_format import object_size

pytestmark = pytest.mark.timeout(600)
PROMPTS = [prompt(900 + i, 200) for i in range(16)]  # 6 full blocks each


def test_after_a_soak_vllms_event_tracker_holds_only_blocks_some_tier_holds(model, tmp_path):
    capacity = 24 * object_size(36, 32 << 10)  # 4 prompts' blocks
    tier = {"type": "file", "root_dir": str(tmp_path / "kv"), "capacity_bytes": capacity}
    config = {"cpu_bytes_to_use": 8 * (32 << 10), "secondary_tiers": [tier], "self_describing_kv_events": True}
    events = {"enable_kv_cache_events": True, "publisher": "null"}
    llm = tiny.make_llm(model, config, connector="KVTieringConnector", kv_events_config=events)
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    published: list = []
    scheduler.kv_event_publisher.publish = lambda batch: published.extend(batch.events)
    try:
        for group in range(0, len(PROMPTS), 4):  # 4 prompts, then again: out of the CPU tier, in the file tier
            for tokens in PROMPTS[group : group + 4] * 2:
                tiny.generate(llm, [tokens], max_tokens=2)
                assert llm.reset_prefix_cache()  # vLLM's own cache forgets: the next one looks in the tiers
        tiny.settle(llm, lambda: manager_stats()["manager"]["gauges"]["jobs_in_flight"] == 0)
        tiny.generate(llm, [[7] * 8], max_tokens=1)  # a step that takes the last jobs' events
        stats = manager_stats()
        assert stats["primary"]["counters"]["evictions"] > 0
        assert stats["tiers"]["file"]["counters"]["evictions"] > 0
        assert stats["tiers"]["file"]["counters"]["blocks_loaded"] > 0  # promotions

        (spec,) = [spec for spec in live_specs() if spec.engine.manager is not None]
        manager = spec.engine.manager
        (file_tier,) = manager.secondary_tiers
        tracked = set(scheduler.connector.connector_scheduler._events_tracker._pending_event_metadata)
        held = {key for key in tracked if manager.primary_tier.ref_count(key) is not None or key in file_tier._index}
        assert tracked and tracked == held, f"{len(tracked - held)} of {len(tracked)} blocks left in no tier"
        # every announcement carried its tokens: promotions' too (the lookup that answered their hit recorded them)
        stored = [e for e in published if type(e).__name__ == "BlockStored" and e.medium in ("CPU", "STORAGE")]
        assert len([e for e in stored if e.medium == "CPU"]) > len(PROMPTS) * 6  # promotions stored again
        assert all(len(e.token_ids) == tiny.BLOCK for e in stored)
    finally:
        close(llm)
