"""End to end with a real vLLM: every output is compared with a fresh engine's without
offloading, and vLLM's own counters and the engine's stats prove blocks really moved."""

import gc
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.helpers import engine_regions, region_name, regions_left_behind
from tests_vllm import tiny
from tests_vllm.conftest import LONGER, OTHERS, PROMPT
from tiering.integrations.vllm import live_specs

pytestmark = pytest.mark.timeout(600)
FULL_BLOCKS = len(PROMPT) // tiny.BLOCK * tiny.BLOCK  # 192 of 200 tokens are in full blocks
ROWS = 8  # the CPU tier holds 8 blocks: the other prompts evict the first one's


def counters(llm) -> dict[str, float]:
    return {m.name: getattr(m, "value", 0) for m in llm.get_metrics() if hasattr(m, "value")}


def tier_counts(llm, metric: str) -> dict[str, float]:
    """vLLM's counter `metric` (one of the engine's ``vllm:kv_tiering_*``) by tier label."""
    return {m.labels["tier"]: m.value for m in llm.get_metrics() if m.name == metric}


def manager_stats() -> dict:
    (spec,) = [spec for spec in live_specs() if spec.engine.manager is not None]
    return spec.engine.manager.get_stats()


def close(llm) -> None:
    llm.llm_engine.engine_core.shutdown()  # its workers shut down: vLLM drops their KV connector
    for spec in live_specs():
        spec.shutdown()
    del llm
    gc.collect()


BLOCK_BYTES = 32 << 10  # 2 layers x K,V x 2 heads x 32 dims x 4 bytes x 32 tokens
CPU_BYTES = ROWS * BLOCK_BYTES


def evict_and_reload(llm, baseline, prompt=PROMPT, others=OTHERS):
    """Fill the CPU tier with `others`, forget vLLM's prefix cache, run `prompt` again."""
    for other in others:
        assert tiny.generate(llm, [other])[0][:2] == baseline[tuple(other)][:2]
    # Their cascades finish after generate returns and pin CPU rows until then; a promotion
    # needs a free row, so wait for them (the race CI caught once).
    tiny.settle(llm, lambda: manager_stats()["manager"]["gauges"]["jobs_in_flight"] == 0)
    assert llm.reset_prefix_cache()
    return tiny.generate(llm, [prompt])[0]


def test_stored_then_loaded_from_the_cpu_tier_then_promoted_from_the_file_tier(model, baseline, tmp_path):
    config = {"cpu_bytes_to_use": CPU_BYTES, "secondary_tiers": [{"type": "fs", "root_dir": str(tmp_path / "kv")}]}
    llm = tiny.make_llm(model, config, disable_log_stats=False)
    try:
        # 1. computed, stored in the CPU tier and cascaded to the file tier
        assert tiny.generate(llm, [PROMPT])[0] == (*baseline[tuple(PROMPT)][:2], 0)
        tiny.settle(llm, lambda: manager_stats()["tiers"]["file"]["counters"]["blocks_stored"] == 6)
        stats = manager_stats()
        assert stats["primary"]["counters"]["blocks_stored"] == FULL_BLOCKS // tiny.BLOCK
        assert stats["tiers"]["file"]["counters"]["blocks_stored"] == FULL_BLOCKS // tiny.BLOCK
        assert counters(llm)["vllm:kv_offload_store_bytes"] == FULL_BLOCKS // tiny.BLOCK * BLOCK_BYTES

        # 2. vLLM's prefix cache forgets; the prefix comes back from the CPU tier
        assert llm.reset_prefix_cache()
        tokens, logprobs, cached = tiny.generate(llm, [PROMPT])[0]
        assert (tokens, logprobs) == baseline[tuple(PROMPT)][:2] and cached == FULL_BLOCKS
        assert counters(llm)["vllm:kv_offload_load_bytes"] == FULL_BLOCKS // tiny.BLOCK * BLOCK_BYTES
        stats = manager_stats()  # the engine's per-request counts agree with vLLM's cached tokens
        assert stats["primary"]["counters"]["hit_tokens"] == FULL_BLOCKS
        assert stats["manager"]["counters"]["requested_tokens"] >= 2 * FULL_BLOCKS

        # 3. other prompts evict it from the CPU tier; it is promoted back from the file tier
        before = manager_stats()["primary"]["counters"]["lookups_deferred"]
        tokens, logprobs, cached = evict_and_reload(llm, baseline)
        assert (tokens, logprobs) == baseline[tuple(PROMPT)][:2] and cached == FULL_BLOCKS
        stats = manager_stats()
        assert stats["tiers"]["file"]["counters"]["blocks_loaded"] >= 1
        assert stats["manager"]["counters"]["promotions_submitted"] >= 1
        assert stats["primary"]["counters"]["lookups_deferred"] > before  # answered RETRY, then HIT
        assert stats["tiers"]["file"]["counters"]["hit_tokens"] >= tiny.BLOCK  # charged to the file tier
        assert stats["manager"]["histograms"]["promotion_seconds"]["count"] >= 1

        # 4. vLLM's own stats carry the engine's per-tier counts (read at most once a second)
        tiny.settle(llm, lambda: tier_counts(llm, "vllm:kv_tiering_hit_blocks").get("file", 0) >= 1)
        stats = manager_stats()
        assert tier_counts(llm, "vllm:kv_tiering_hit_blocks")["cpu"] == stats["primary"]["counters"]["hit_blocks"]
        stored = tier_counts(llm, "vllm:kv_tiering_blocks_stored")
        assert stored["cpu"] == stats["primary"]["counters"]["blocks_stored"] and stored["file"] >= 6
        assert tier_counts(llm, "vllm:kv_tiering_blocks_loaded")["file"] >= 1
    finally:
        close(llm)


@pytest.mark.parametrize("connector", ["OffloadingConnector", "KVTieringConnector"])
def test_a_request_whose_kv_load_tiers_exclude_the_file_tier_recomputes_its_blocks(
    model, baseline, tmp_path, connector
):
    config = {"cpu_bytes_to_use": CPU_BYTES, "secondary_tiers": [{"type": "file", "root_dir": str(tmp_path / "kv")}]}
    llm = tiny.make_llm(model, config, connector=connector)
    try:
        tiny.generate(llm, [PROMPT])
        tiny.settle(llm, lambda: manager_stats()["tiers"]["file"]["counters"]["blocks_stored"] == 6)
        for other in OTHERS:  # out of the CPU tier: only the file tier holds the prefix
            tiny.generate(llm, [other])
        tiny.settle(llm, lambda: manager_stats()["manager"]["gauges"]["jobs_in_flight"] == 0)
        assert llm.reset_prefix_cache()
        excluded = {"kv_load_tiers": [{"medium": "cpu"}]}
        tokens, logprobs, cached = tiny.generate(llm, [PROMPT], kv_transfer_params=excluded)[0]
        assert (tokens, logprobs) == baseline[tuple(PROMPT)][:2] and cached == 0  # recomputed
        assert manager_stats()["tiers"]["file"]["counters"]["blocks_loaded"] == 0
        assert llm.reset_prefix_cache()
        allowed = {"kv_load_tiers": [{"owner": "file"}]}
        tokens, logprobs, cached = tiny.generate(llm, [PROMPT], kv_transfer_params=allowed)[0]
        assert (tokens, logprobs) == baseline[tuple(PROMPT)][:2] and cached == FULL_BLOCKS
    finally:
        close(llm)


def generate_counting_steps(llm, prompt):
    """`tiny.generate` of `prompt`, and the number of steps vLLM's engine took (calls of its
    scheduler's ``schedule``: one per step, each running a forward)."""
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    schedule, calls = scheduler.schedule, []

    def counted(*args, **kwargs):
        calls.append(1)
        return schedule(*args, **kwargs)

    scheduler.schedule = counted
    try:
        return tiny.generate(llm, [prompt])[0], len(calls)
    finally:
        del scheduler.schedule


def test_behind_the_engines_connector_a_hit_computes_in_the_step_that_loads_it_and_right(model, baseline, tmp_path):
    log = tmp_path / "requests.jsonl"
    config = {"cpu_bytes_to_use": CPU_BYTES, "request_log": str(log)}
    llm = tiny.make_llm(model, config, connector="KVTieringConnector", disable_log_stats=False)
    try:
        assert tiny.generate(llm, [PROMPT])[0] == (*baseline[tuple(PROMPT)][:2], 0)
        tiny.settle(llm, lambda: manager_stats()["manager"]["gauges"]["jobs_in_flight"] == 0)
        # a hit in vLLM's own cache: the steps a request takes when nothing is loaded
        (*_, cached), steps_cached = generate_counting_steps(llm, PROMPT)
        assert cached == FULL_BLOCKS
        assert llm.reset_prefix_cache()
        (tokens, logprobs, cached), steps_loaded = generate_counting_steps(llm, PROMPT)
        assert (tokens, logprobs) == baseline[tuple(PROMPT)][:2] and cached == FULL_BLOCKS
        assert steps_loaded == steps_cached  # no step spent on the load (vLLM's connector spends one or more)
        assert counters(llm)["vllm:kv_offload_load_bytes"] == FULL_BLOCKS // tiny.BLOCK * BLOCK_BYTES
        tiny.settle(llm, lambda: '"blocks_loaded": 6' in log.read_text())  # reported a step after it finished
    finally:
        close(llm)
    (loaded,) = [entry for entry in map(json.loads, log.read_text().splitlines()) if entry["blocks_loaded"]]
    # planned at the first lookup; the worker reported it with the step's output
    assert loaded["blocks_loaded"] == FULL_BLOCKS // tiny.BLOCK and loaded["steps_to_load"] == 0
    assert loaded["steps_loading"] == 1


def test_behind_the_engines_connector_a_request_stores_what_it_computes_in_the_step_it_loads(model, baseline):
    """The loaded prefix and the blocks computed after it in the same step: vLLM's scheduler
    plans a store of a request with a load pending, which it refuses of asynchronous loads."""
    llm = tiny.make_llm(model, {"cpu_bytes_to_use": 2 * CPU_BYTES}, connector="KVTieringConnector")
    try:
        tiny.generate(llm, [PROMPT])
        tiny.settle(llm, lambda: manager_stats()["manager"]["gauges"]["jobs_in_flight"] == 0)
        assert llm.reset_prefix_cache()
        tokens, logprobs, cached = tiny.generate(llm, [LONGER])[0]
        assert (tokens, logprobs) == baseline[tuple(LONGER)][:2] and cached == FULL_BLOCKS
        tiny.settle(llm, lambda: manager_stats()["primary"]["counters"]["blocks_stored"] == 9)  # 6, then 3 more
        assert llm.reset_prefix_cache()
        tokens, logprobs, cached = tiny.generate(llm, [LONGER])[0]
        assert (tokens, logprobs) == baseline[tuple(LONGER)][:2] and cached == 9 * tiny.BLOCK
    finally:
        close(llm)


def test_behind_vllms_connector_a_hit_costs_steps(model, baseline):
    """The control for the test above: the same count tells the two connectors apart."""
    llm = tiny.make_llm(model, {"cpu_bytes_to_use": CPU_BYTES})
    try:
        tiny.generate(llm, [PROMPT])
        tiny.settle(llm, lambda: manager_stats()["manager"]["gauges"]["jobs_in_flight"] == 0)
        _, steps_cached = generate_counting_steps(llm, PROMPT)
        assert llm.reset_prefix_cache()
        (tokens, logprobs, cached), steps_loaded = generate_counting_steps(llm, PROMPT)
        assert (tokens, logprobs, cached) == (*baseline[tuple(PROMPT)][:2], FULL_BLOCKS)
        assert steps_loaded > steps_cached
    finally:
        close(llm)


def test_behind_the_engines_connector_a_file_tier_hit_is_loaded_in_the_step_it_is_found(model, baseline, tmp_path):
    log = tmp_path / "requests.jsonl"
    tier = {"type": "file", "root_dir": str(tmp_path / "kv")}
    # 2 of the 8 rows kept for stores (not the default 4, half the tier): the prefix's 6 blocks promote in one step
    config = {
        "cpu_bytes_to_use": CPU_BYTES,
        "secondary_tiers": [tier],
        "request_log": str(log),
        "store_reserve_rows": 2,
    }
    llm = tiny.make_llm(model, config, connector="KVTieringConnector")
    try:
        tiny.generate(llm, [PROMPT])
        tiny.settle(llm, lambda: manager_stats()["tiers"]["file"]["counters"]["blocks_stored"] == 6)
        tokens, logprobs, cached = evict_and_reload(llm, baseline)
        assert (tokens, logprobs) == baseline[tuple(PROMPT)][:2] and cached == FULL_BLOCKS
        stats = manager_stats()
        assert stats["tiers"]["file"]["counters"]["hit_tokens"] == FULL_BLOCKS  # hits, charged to the file tier
        assert stats["tiers"]["file"]["counters"]["blocks_loaded"] == FULL_BLOCKS // tiny.BLOCK
        tiny.settle(llm, lambda: log.read_text().count("\n") >= 5)  # every request finished
    finally:
        close(llm)
    (entry,) = [entry for entry in map(json.loads, log.read_text().splitlines()) if entry["blocks_loaded"]]
    # loaded in the step of its first lookup (no step waited on the promotion), reported at its end
    assert (entry["steps_to_load"], entry["steps_loading"]) == (0, 1)
    assert entry["blocks_pending"] == FULL_BLOCKS // tiny.BLOCK  # loaded while their promotions ran


def test_behind_the_engines_connector_a_failed_promotion_is_recomputed_with_the_right_output(model, baseline, tmp_path):
    root = tmp_path / "kv"
    tiers = [{"type": "file", "root_dir": str(root)}]
    config = {"cpu_bytes_to_use": CPU_BYTES, "secondary_tiers": tiers, "store_reserve_rows": 2}
    llm = tiny.make_llm(model, config, connector="KVTieringConnector")
    try:
        tiny.generate(llm, [PROMPT])
        tiny.settle(llm, lambda: manager_stats()["tiers"]["file"]["counters"]["blocks_stored"] == 6)
        tiny.corrupt_payloads(root)  # every payload
        tokens, logprobs, _ = evict_and_reload(llm, baseline)  # answered "hit", then failed in the worker
        assert (tokens, logprobs) == baseline[tuple(PROMPT)][:2]
        stats = manager_stats()
        assert stats["tiers"]["file"]["counters"]["failures"]["load_corrupt"] == FULL_BLOCKS // tiny.BLOCK
        assert stats["tiers"]["file"]["counters"]["hit_tokens"] == FULL_BLOCKS
        # the failed rows went back once vLLM finished the load: nothing is held or pinned
        tiny.settle(llm, lambda: manager_stats()["primary"]["gauges"]["rows_quarantined"] == 0)
        assert tiny.generate(llm, [PROMPT])[0][:2] == baseline[tuple(PROMPT)][:2]
    finally:
        close(llm)


def test_behind_the_engines_connector_loads_on_a_frozen_tier_share_one_wait_then_stop_waiting(
    model, baseline, tmp_path, monkeypatch
):
    """Two requests whose prefixes only a frozen tier holds are answered "hit" and load in
    one step: their loads wait for the promotions until one shared deadline (each load took
    its own, one after the other), then vLLM recomputes the blocks, with the right output.
    A later request is not made to wait for the same stuck promotions: a miss."""
    import anyio

    from tiering.backends.faulty import FaultyBlockStore
    from tiering.cpu.row_states import PROMOTION_WAIT_S, RowStates

    tier = {"type": "faulty", "inner": {"type": "file", "root_dir": str(tmp_path / "kv")}, "op_timeout_s": 60}
    config = {"cpu_bytes_to_use": 2 * CPU_BYTES, "secondary_tiers": [tier], "store_reserve_rows": 2}
    llm = tiny.make_llm(model, {**config, "reset_scope": "cpu"}, connector="KVTieringConnector")
    first, second = PROMPT, OTHERS[0]
    try:
        tiny.generate(llm, [first, second])
        tiny.settle(llm, lambda: manager_stats()["tiers"]["faulty"]["counters"]["blocks_stored"] == 12)
        assert llm.reset_prefix_cache(reset_connector=True)  # the CPU tier too: only the frozen tier holds them

        async def frozen(self, key, into):
            await anyio.sleep_forever()

        deadlines, wait_any = [], RowStates.wait_any

        def recorded(self, rows, deadline):
            deadlines.append(deadline)
            return wait_any(self, rows, deadline)

        monkeypatch.setattr(FaultyBlockStore, "get", frozen)
        monkeypatch.setattr(RowStates, "wait_any", recorded)
        outputs = tiny.generate(llm, [first, second])
        for (tokens, logprobs, _), prompt in zip(outputs, (first, second), strict=True):
            # batched together: the logprobs of the baseline (run alone) to float32's rounding
            assert tokens == baseline[tuple(prompt)][0]
            assert logprobs == pytest.approx(baseline[tuple(prompt)][1], abs=1e-5)
        assert manager_stats()["tiers"]["faulty"]["counters"]["hit_tokens"] == 2 * FULL_BLOCKS  # answered "hit"
        # one wait for the step's two loads: deadlines from their submissions, a moment apart (each
        # load's own used to start as the one before it gave up, a whole wait later)
        assert deadlines and max(deadlines) - min(deadlines) < PROMOTION_WAIT_S / 2, deadlines
        waits = len(deadlines)
        assert llm.reset_prefix_cache()  # vLLM's cache only: the promotions are still pending
        assert tiny.generate(llm, [first])[0][:2] == baseline[tuple(first)][:2]
        assert manager_stats()["manager"]["counters"]["promotions_overdue"] >= 1
        assert len(deadlines) == waits  # nothing waited for them again
    finally:
        close(llm)


def test_behind_the_engines_connector_a_copy_that_fails_is_recomputed_and_never_kept(model, baseline, monkeypatch):
    from tiering.worker.direction import DirectionHandler

    llm = tiny.make_llm(model, {"cpu_bytes_to_use": 2 * CPU_BYTES}, connector="KVTieringConnector")
    try:
        tiny.generate(llm, [PROMPT])
        tiny.settle(llm, lambda: manager_stats()["manager"]["gauges"]["jobs_in_flight"] == 0)
        assert llm.reset_prefix_cache()

        def raising(self, copies):
            raise RuntimeError("a bug in the copy")

        monkeypatch.setattr(DirectionHandler, "_copy_now", raising)  # every copy fails from here on
        # PROMPT's 6 blocks load and fail (recomputed); the 3 blocks LONGER computes after them store and fail
        tokens, logprobs, _ = tiny.generate(llm, [LONGER])[0]
        assert (tokens, logprobs) == baseline[tuple(LONGER)][:2]  # and vLLM's worker did not fail
        tiny.settle(llm, lambda: manager_stats()["primary"]["counters"]["blocks_store_failed"] == 3)
        monkeypatch.undo()
        assert llm.reset_prefix_cache()
        tokens, logprobs, cached = tiny.generate(llm, [LONGER])[0]
        assert (tokens, logprobs) == baseline[tuple(LONGER)][:2]
        assert cached == FULL_BLOCKS  # PROMPT's blocks, still whole; the 3 failed ones were not kept
    finally:
        close(llm)


@pytest.mark.parametrize("hint", [None, {"retain": "1h"}], ids=["no-hint", "retain"])
def test_a_prefix_whose_request_asked_for_retention_survives_a_flood_that_evicts_it_otherwise(model, baseline, hint):
    config = {"cpu_bytes_to_use": 16 * BLOCK_BYTES, "retention_max_fraction": 0.5}  # 8 rows may be retained
    llm = tiny.make_llm(model, config, connector="KVTieringConnector")
    try:
        params = None if hint is None else {"kv_tiering": hint}  # as in an OpenAI request body
        tiny.generate(llm, [PROMPT], kv_transfer_params=params)
        tiny.settle(llm, lambda: manager_stats()["manager"]["gauges"]["requests_open"] == 0)  # the hint applied
        for other in OTHERS:  # 18 new blocks into 16 rows
            tiny.generate(llm, [other])
        tiny.settle(llm, lambda: manager_stats()["manager"]["gauges"]["jobs_in_flight"] == 0)
        assert llm.reset_prefix_cache()
        tokens, logprobs, cached = tiny.generate(llm, [PROMPT])[0]
        assert (tokens, logprobs) == baseline[tuple(PROMPT)][:2]
        retained = manager_stats()["primary"]["gauges"]["retained_blocks"]
        if hint is None:
            assert cached < FULL_BLOCKS and retained == 0  # the flood evicted some of it
        else:
            assert cached == FULL_BLOCKS and retained == FULL_BLOCKS // tiny.BLOCK
    finally:
        close(llm)


@pytest.mark.parametrize("hint", [None, {"release": True}], ids=["no-hint", "release"])
def test_a_released_prefix_is_evicted_before_an_older_one(model, baseline, hint):
    llm = tiny.make_llm(model, {"cpu_bytes_to_use": 16 * BLOCK_BYTES}, connector="KVTieringConnector")
    try:
        older, released = OTHERS[0], PROMPT
        params = [None, None if hint is None else {"kv_tiering": hint}, None]
        for prompt, kv_transfer_params in zip([older, released, OTHERS[1]], params, strict=True):
            tiny.generate(llm, [prompt], kv_transfer_params=kv_transfer_params)
            # vLLM reports a request finished to the engine a step later: its order (and hint) apply then
            tiny.settle(llm, lambda: manager_stats()["manager"]["gauges"]["requests_open"] == 0)
        # 18 blocks into 16 rows: 2 were evicted
        assert llm.reset_prefix_cache()
        whole, evicted = (released, older) if hint is None else (older, released)  # least recent, or released
        tokens, logprobs, cached = tiny.generate(llm, [whole])[0]  # loads it all: stores, and so evicts, nothing
        assert (tokens, logprobs) == baseline[tuple(whole)][:2] and cached == FULL_BLOCKS
        tokens, logprobs, cached = tiny.generate(llm, [evicted])[0]
        assert (tokens, logprobs) == baseline[tuple(evicted)][:2] and cached < FULL_BLOCKS
        assert manager_stats()["primary"]["counters"]["retentions_released"] == (0 if hint is None else 6)
    finally:
        close(llm)


def test_an_s3_tier_serves_promotions_the_same_way(model, baseline, monkeypatch):
    from tiering.testing.s3_server import MotoServer

    credentials = {
        "AWS_ACCESS_KEY_ID": "test",
        "AWS_SECRET_ACCESS_KEY": "test-secret",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",
    }
    for name, value in credentials.items():
        monkeypatch.setenv(name, value)
    server = MotoServer()
    server.start()
    try:
        server.create_bucket("kv-vllm")
        tier = {"type": "obj", "bucket": "kv-vllm", "endpoint_url": server.endpoint_url}
        llm = tiny.make_llm(model, {"cpu_bytes_to_use": CPU_BYTES, "secondary_tiers": [tier]})
        try:
            assert tiny.generate(llm, [PROMPT])[0][:2] == baseline[tuple(PROMPT)][:2]
            tokens, logprobs, cached = evict_and_reload(llm, baseline)
            assert (tokens, logprobs) == baseline[tuple(PROMPT)][:2] and cached == FULL_BLOCKS
            tiny.settle(llm, lambda: manager_stats()["tiers"]["s3"]["gauges"]["jobs_in_flight"] == 0)
            s3 = manager_stats()["tiers"]["s3"]["counters"]
            assert s3["blocks_stored"] >= FULL_BLOCKS // tiny.BLOCK and s3["blocks_loaded"] >= 1
        finally:
            close(llm)
    finally:
        server.stop()


def test_a_second_engine_gets_its_prefix_from_the_valkey_cluster_the_first_one_filled(model, baseline):
    from tiering.testing.valkey_server import ValkeyCluster

    cluster = ValkeyCluster(primaries=3)
    cluster.start()
    try:
        tier = {"type": "valkey", "addresses": cluster.addresses[:1], "cluster_mode": True}
        config = {"cpu_bytes_to_use": CPU_BYTES, "secondary_tiers": [tier]}
        first = tiny.make_llm(model, config)
        try:
            assert tiny.generate(first, [PROMPT])[0] == (*baseline[tuple(PROMPT)][:2], 0)
            tiny.settle(first, lambda: manager_stats()["tiers"]["valkey"]["counters"]["blocks_stored"] == 6)
        finally:
            close(first)
        second = tiny.make_llm(model, config)  # another engine: an empty CPU tier, the same cluster
        try:
            tokens, logprobs, cached = tiny.generate(second, [PROMPT])[0]
            assert (tokens, logprobs) == baseline[tuple(PROMPT)][:2] and cached == FULL_BLOCKS
            valkey = manager_stats()["tiers"]["valkey"]["counters"]
            assert valkey["blocks_loaded"] == FULL_BLOCKS // tiny.BLOCK and valkey["lookups_deferred"] >= 1  # probed
            assert valkey["hit_tokens"] == FULL_BLOCKS
        finally:
            close(second)
    finally:
        cluster.stop()


def test_a_second_engine_while_the_first_one_runs_is_refused_not_fed_its_connector(model, baseline, tmp_path):
    """vLLM reuses the first engine's worker connector for a second engine of the process;
    its transfers would bypass the second engine's CPU tier (empty rows cascaded to shared
    tiers, stale KV loaded: wrong output, seen before this check)."""
    config = {"cpu_bytes_to_use": CPU_BYTES, "secondary_tiers": [{"type": "file", "root_dir": str(tmp_path / "kv")}]}
    first = tiny.make_llm(model, config)
    try:
        with pytest.raises(RuntimeError, match=r"vLLM gave engine .* the KV connector of engine .*shut the earlier"):
            tiny.make_llm(model, config)
        assert tiny.generate(first, [PROMPT])[0] == (*baseline[tuple(PROMPT)][:2], 0)  # the first one is unharmed
    finally:
        close(first)


def test_a_corrupted_object_is_never_loaded_and_the_block_is_recomputed(model, baseline, tmp_path):
    root = tmp_path / "kv"
    llm = tiny.make_llm(
        model, {"cpu_bytes_to_use": CPU_BYTES, "secondary_tiers": [{"type": "file", "root_dir": str(root)}]}
    )
    try:
        tiny.generate(llm, [PROMPT])
        tiny.settle(llm, lambda: manager_stats()["tiers"]["file"]["counters"]["blocks_stored"] == 6)
        assert len(tiny.object_pages(root)) == FULL_BLOCKS // tiny.BLOCK
        tiny.corrupt_payloads(root)  # every payload changed, every header valid
        tokens, logprobs, cached = evict_and_reload(llm, baseline)
        assert (tokens, logprobs) == baseline[tuple(PROMPT)][:2]
        assert cached < FULL_BLOCKS  # recomputed, not loaded
        assert manager_stats()["tiers"]["file"]["counters"]["failures"]["load_corrupt"] >= 1
    finally:
        close(llm)


def test_negative_control_wrong_bytes_loaded_above_the_checks_change_the_output(model, baseline):
    """Proves the comparisons above can fail: a test-only tier scribbles on every row it
    promotes, after the CRC check."""
    tier = {"type": "scribbler", "module_path": "tests_vllm.scribbler", "class_name": "ScribblingTier"}
    llm = tiny.make_llm(model, {"cpu_bytes_to_use": CPU_BYTES, "secondary_tiers": [tier]})
    try:
        tiny.generate(llm, [PROMPT])
        tokens, logprobs, cached = evict_and_reload(llm, baseline)
        assert cached == FULL_BLOCKS
        assert (tokens, logprobs) != baseline[tuple(PROMPT)][:2]
    finally:
        close(llm)


SCRIPT = """
import json, sys
from pathlib import Path
from tests_vllm import tiny
from tests_vllm.conftest import PROMPT

if __name__ == "__main__":
    model, root, engine_id = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    config = {"cpu_bytes_to_use": 256 << 10, "secondary_tiers": [{"type": "file", "root_dir": str(root)}]}
    llm = tiny.make_llm(model, config, engine_id=engine_id)
    first = tiny.generate(llm, [PROMPT])[0]
    assert llm.reset_prefix_cache()
    second = tiny.generate(llm, [PROMPT])[0]
    tiny.settle(llm, lambda: len(tiny.object_pages(root)) == 6)  # the cascade landed
    print("RESULT", json.dumps([first, second]))
    del llm  # no shutdown: what is left must go at exit
"""


def run_script(model, root, multiprocessing: str) -> tuple[list, str]:
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": multiprocessing}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[1]), env.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(model), str(root), region_name()],
        env=env,
        capture_output=True,
        text=True,
        timeout=500,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT ")), done.stdout + done.stderr


@pytest.mark.parametrize("multiprocessing", ["1", "0"], ids=["engine-core-in-its-own-process", "in-process"])
def test_a_process_leaves_no_shared_memory_temp_files_or_stuck_exit(model, baseline, tmp_path, multiprocessing):
    regions_before = engine_regions()
    (first, second), output = run_script(model, tmp_path / "kv", multiprocessing)
    # the engine's own lines show as vLLM's do, with nothing configured
    assert re.search(r"INFO .*\[spec\.py:\d+\] engine ready: 8 CPU blocks", output), output[-3000:]
    # 8 rows of 32 tokens cannot carry two steps of vLLM's token budget: said once, at start
    warnings = re.findall(r"WARNING .* the CPU tier \(cpu_bytes_to_use=262144: 8 rows of 32 tokens\)", output)
    assert len(warnings) == 1, output[-3000:]
    expected = list(baseline[tuple(PROMPT)][:2])
    assert first[:2] == expected and second[:2] == expected
    assert first[2] == 0 and second[2] == FULL_BLOCKS
    assert regions_left_behind(regions_before) == []  # the script named its engine with this run's mark
    files = [path for path in (tmp_path / "kv").rglob("*") if path.is_file()]
    assert len(tiny.object_pages(tmp_path / "kv")) == FULL_BLOCKS // tiny.BLOCK
    assert not any(path.name.endswith(".tmp") for path in files)


KILLED_SCRIPT = """
import sys, time
from pathlib import Path
from tests_vllm import tiny
from tests_vllm.conftest import PROMPT

if __name__ == "__main__":
    model, root, engine_id = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    config = {"cpu_bytes_to_use": 256 << 10, "secondary_tiers": [{"type": "file", "root_dir": str(root)}]}
    llm = tiny.make_llm(model, config, engine_id=engine_id)
    tiny.generate(llm, [PROMPT])
    print("SERVING", flush=True)
    time.sleep(600)
"""


def test_every_process_killed_with_sigkill_leaves_no_shared_memory(model, tmp_path):
    """vLLM force-kills its engine process on a stop (and SIGKILL runs no cleanup): once every
    process of the engine has mapped the region, its name is gone, so nothing can leak."""
    regions_before = engine_regions()
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[1]), env.get("PYTHONPATH", "")])
    command = [sys.executable, "-c", KILLED_SCRIPT, str(model), str(tmp_path / "kv"), region_name()]
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert any(line.startswith("SERVING") for line in process.stdout), "the engine never served"
    finally:
        os.killpg(process.pid, signal.SIGKILL)  # the script and vLLM's engine-core process
        process.wait(60)
        process.stdout.close()
    assert regions_left_behind(regions_before) == []  # the script named its engine with this run's mark


TRACE = Path(__file__).resolve().parents[1] / "traces" / "conversation_trace.jsonl.gz"  # shipped with the repository


def test_a_trace_replayed_through_vllm_hits_in_the_engine(model, tmp_path):
    from vllm import SamplingParams, TokensPrompt

    from tiering.benchmarks.loadgen.workload import read_trace
    from tiering.benchmarks.serve.workload import prompts

    requests = read_trace(TRACE, 40)
    config = {"cpu_bytes_to_use": CPU_BYTES, "secondary_tiers": [{"type": "file", "root_dir": str(tmp_path / "kv")}]}
    llm = tiny.make_llm(model, config, disable_log_stats=False)
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, detokenize=False)
    prompt_tokens = cached_tokens = 0
    try:
        for tokens in prompts(requests, tiny.BLOCK, 1000, 1024):  # one request after the other
            (output,) = llm.generate([TokensPrompt(prompt_token_ids=tokens)], params, use_tqdm=False)
            prompt_tokens += len(tokens)
            cached_tokens += output.num_cached_tokens or 0
        stored_bytes = counters(llm)["vllm:kv_offload_store_bytes"]
        engine = manager_stats()
    finally:
        close(llm)
    assert 0 < cached_tokens < prompt_tokens and stored_bytes > 0
    assert (
        engine["primary"]["counters"]["blocks_stored"] > 0 and engine["tiers"]["file"]["counters"]["blocks_stored"] > 0
    )


def test_a_requests_cache_salt_is_its_tenant_and_tenants_never_share_blocks(model, baseline):
    config = {"cpu_bytes_to_use": 2 * CPU_BYTES, "tenants": {"default_share": 0.5}}  # 8 rows each
    llm = tiny.make_llm(model, config, connector="KVTieringConnector")
    blocks = FULL_BLOCKS // tiny.BLOCK
    try:
        assert tiny.generate(llm, [PROMPT], cache_salt="acme")[0] == (*baseline[tuple(PROMPT)][:2], 0)
        tiny.settle(llm, lambda: manager_stats()["manager"]["gauges"]["jobs_in_flight"] == 0)
        assert llm.reset_prefix_cache()
        # the same tokens for another tenant: no block of acme's is a hit, the output is right
        assert tiny.generate(llm, [PROMPT], cache_salt="globex")[0] == (*baseline[tuple(PROMPT)][:2], 0)
        tiny.settle(llm, lambda: manager_stats()["manager"]["gauges"]["jobs_in_flight"] == 0)
        assert llm.reset_prefix_cache()
        tokens, logprobs, cached = tiny.generate(llm, [PROMPT], cache_salt="acme")[0]  # acme's own: a hit
        assert (tokens, logprobs) == baseline[tuple(PROMPT)][:2] and cached == FULL_BLOCKS
        tenants = manager_stats()["tenants"]
    finally:
        close(llm)
    for tenant in ("acme", "globex"):
        assert tenants[tenant]["counters"]["blocks_stored"] == tenants[tenant]["gauges"]["blocks"] == blocks
    assert tenants["acme"]["counters"]["hits"] >= blocks


def test_a_vllm_whose_offloading_scheduler_lacks_what_synchronous_loads_read_is_refused_by_name(model, monkeypatch):
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import OffloadingConnectorScheduler
    from vllm.distributed.kv_transfer.kv_transfer_state import ensure_kv_transfer_shutdown

    built = OffloadingConnectorScheduler.__init__

    def without_jobs(self, *args, **kwargs):
        built(self, *args, **kwargs)
        del self._current_batch_load_jobs

    monkeypatch.setattr(OffloadingConnectorScheduler, "__init__", without_jobs)
    with pytest.raises(Exception, match="lacks \\(_current_batch_load_jobs\\); use OffloadingConnector"):
        tiny.make_llm(model, {"cpu_bytes_to_use": CPU_BYTES}, connector="KVTieringConnector")
    ensure_kv_transfer_shutdown()  # the worker's connector, built before the scheduler's refused
    for spec in live_specs():
        spec.shutdown()
    gc.collect()


def test_a_restart_loads_from_the_file_tier_only_under_the_same_kv_settings(model, baseline, tmp_path):
    """A lasting tier offers a block only to an engine whose KV settings are the stored ones,
    in the generation since the last reset: after a reset of the connector, nothing stored
    before is offered; a restart with another `model_version` or another block size
    recomputes (with the output of a fresh run); a restart with the same settings loads the
    prefix from the file tier."""
    config = {"cpu_bytes_to_use": CPU_BYTES, "secondary_tiers": [{"type": "file", "root_dir": str(tmp_path / "kv")}]}
    restarts = [
        ("first run", config, {}),
        ("another model_version", {**config, "model_version": "rl-step-2"}, {}),
        ("another block size", config, {"block_size": 2 * tiny.BLOCK}),
        ("the same settings", config, {}),
    ]
    expected_tokens, expected_logprobs, _ = baseline[tuple(PROMPT)]
    for what, settings, options in restarts:
        llm = tiny.make_llm(model, settings, **options)
        try:
            # the file tier lists what it holds while the engine serves: its first lookups would miss
            tiny.settle(llm, lambda: not manager_stats()["tiers"]["file"]["gauges"]["recovering"])
            tokens, logprobs, cached = tiny.generate(llm, [PROMPT])[0]
            assert tokens == expected_tokens, what
            assert np.allclose(logprobs, expected_logprobs, atol=1e-4), what  # a block size may round otherwise
            assert cached == (FULL_BLOCKS if what == "the same settings" else 0), what
            if what == "the same settings":
                assert manager_stats()["tiers"]["file"]["counters"]["blocks_loaded"] == FULL_BLOCKS // tiny.BLOCK
            else:  # stored under its own settings' namespace (a 64-token block: 3 blocks)
                blocks = FULL_BLOCKS // options.get("block_size", tiny.BLOCK)
                tiny.settle(llm, lambda b=blocks: manager_stats()["tiers"]["file"]["counters"]["blocks_stored"] == b)
                assert manager_stats()["tiers"]["file"]["counters"]["blocks_loaded"] == 0, what
            if what == "first run":  # a weight update's reset: a new generation, the stored blocks are gone
                assert llm.reset_prefix_cache(reset_connector=True)
                tokens, logprobs, cached = tiny.generate(llm, [PROMPT])[0]
                assert (tokens, logprobs, cached) == (expected_tokens, expected_logprobs, 0)
                again = 2 * FULL_BLOCKS // tiny.BLOCK  # stored into the new generation, which the last run loads
                tiny.settle(llm, lambda n=again: manager_stats()["tiers"]["file"]["counters"]["blocks_stored"] == n)
        finally:
            close(llm)
