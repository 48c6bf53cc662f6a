"""Where vLLM's scheduler can tell this engine from vLLM's own offloading, it must not:
resets with transfers in flight, eviction order (whatever Python's hash seed), the worker
under torch.inference_mode. Through the real vLLM 0.32 scheduler, connector and worker."""

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch
from vllm.v1.kv_offload.base import CanonicalKVCacheRef, CanonicalKVCaches, CanonicalKVCacheTensor, GPULoadStoreSpec
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

from tests_vllm import tiny
from tests_vllm.conftest import PROMPT, offloading_config, prompt
from tests_vllm.test_vllm import BLOCK_BYTES, CPU_BYTES, FULL_BLOCKS, close, manager_stats
from tiering.integrations import vllm as adapter

pytestmark = pytest.mark.timeout(600)


def rows() -> dict[str, int]:
    """The CPU tier's rows: blocks held, pinned by writes and by reads, quarantined, free."""
    (spec,) = [spec for spec in adapter.live_specs() if spec.engine.manager is not None]
    primary = spec.engine.manager.primary_tier
    gauges = manager_stats()["primary"]["gauges"]
    names = ("blocks", "rows_writing", "rows_reading", "rows_quarantined")
    return {**{name: gauges[name] for name in names}, "free": primary.num_free_blocks}


EMPTY = {"blocks": 0, "rows_writing": 0, "rows_reading": 0, "rows_quarantined": 0, "free": CPU_BYTES // BLOCK_BYTES}


def run_to_first_token(engine, request_id: str, limit: int = 10_000) -> None:
    """Step the engine until `request_id` has a token. Idle steps take microseconds while a
    load runs on the worker's copy thread, so the limit is generous; a request whose
    lookups answer RETRY for good (a block stuck in flight) never gets there."""
    for _ in range(limit):
        if any(out.request_id == request_id and out.outputs[0].token_ids for out in engine.step()):
            return
    raise AssertionError(f"{request_id} got no token in {limit} steps")


def test_a_reset_with_stores_or_loads_in_flight_frees_every_row_and_strands_no_request(model, baseline):
    from vllm import SamplingParams, TokensPrompt

    llm = tiny.make_llm(model, {"cpu_bytes_to_use": CPU_BYTES})
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=2, logprobs=0, ignore_eos=True, detokenize=False)
    request = TokensPrompt(prompt_token_ids=PROMPT)
    try:
        # 1. stores in flight: the prefill's blocks are being written to the CPU tier
        engine.add_request("storing", request, params)
        engine.step()
        assert rows()["rows_writing"] == FULL_BLOCKS // tiny.BLOCK
        llm.reset_prefix_cache(reset_connector=True)  # vLLM drops the stores' completions
        assert rows() == EMPTY
        while engine.has_unfinished_requests():  # the connector stores the running request again
            engine.step()
        tiny.settle(llm, lambda: rows()["rows_writing"] == 0)
        assert llm.reset_prefix_cache()  # vLLM's own cache forgets: the next run asks the CPU tier
        loaded = manager_stats()["primary"]["counters"]["blocks_loaded"]
        engine.add_request("after-stores", request, params)
        engine.step()  # its load starts at once: no block is stuck in flight
        assert manager_stats()["primary"]["counters"]["blocks_loaded"] - loaded == FULL_BLOCKS // tiny.BLOCK
        run_to_first_token(engine, "after-stores")
        while engine.has_unfinished_requests():
            engine.step()

        # 2. a load in flight: the prefix is being copied back to the GPU. Whether the copy's
        # report is still to come after the step that started it depends on the threads'
        # timing (on a loaded machine it can land in that step's output): a request whose load
        # already ended is run out and the next one tried.
        for attempt in range(10):
            tiny.settle(llm, lambda: rows()["rows_writing"] == rows()["rows_reading"] == 0)
            assert llm.reset_prefix_cache()
            engine.add_request(f"loading-{attempt}", request, params)
            engine.step()
            if rows()["rows_reading"] == FULL_BLOCKS // tiny.BLOCK:
                break
            while engine.has_unfinished_requests():
                engine.step()
        else:
            pytest.fail("in 10 tries, no load was still in flight after the step that started it")
        llm.reset_prefix_cache(reset_connector=True)
        assert rows() == EMPTY
        run_to_first_token(engine, f"loading-{attempt}")
        while engine.has_unfinished_requests():
            engine.step()
        tiny.settle(llm, lambda: rows()["rows_writing"] == 0)
        assert llm.reset_prefix_cache()
        tokens, logprobs, cached = tiny.generate(llm, [PROMPT])[0]  # the tier still serves exact bytes
        assert (tokens, logprobs) == baseline[tuple(PROMPT)][:2] and cached == FULL_BLOCKS
    finally:
        close(llm)


ORDER_SCRIPT = """
import json, sys
from pathlib import Path
from tests_vllm import tiny
from tiering.integrations.vllm import live_specs


def stored():
    (spec,) = [spec for spec in live_specs() if spec.engine.manager is not None]
    return spec.engine.manager.get_stats()["primary"]["counters"]["blocks_stored"]


if __name__ == "__main__":
    model, policy, a, b = Path(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3]), json.loads(sys.argv[4])
    llm = tiny.make_llm(model, {"cpu_bytes_to_use": 4 * (32 << 10), "eviction_policy": policy})
    tiny.generate(llm, [a])
    tiny.generate(llm, [[7] * 8], max_tokens=1)  # one more step: the connector reports A finished
    tiny.settle(llm, lambda: stored() == 3)
    tiny.generate(llm, [b])  # 2 blocks into a tier of 4 rows holding A's 3: one of A's goes
    tiny.settle(llm, lambda: stored() == 5)
    assert llm.reset_prefix_cache()
    print("RESULT", json.dumps(tiny.generate(llm, [a])[0][2]))
"""


def cached_tokens_under_hash_seed(model, policy: str, seed: int) -> int:
    env = {**os.environ, "PYTHONHASHSEED": str(seed), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[1]), env.get("PYTHONPATH", "")])
    a, b = prompt(100, 3 * tiny.BLOCK + 4), prompt(101, 2 * tiny.BLOCK + 4)
    done = subprocess.run(
        [sys.executable, "-c", ORDER_SCRIPT, str(model), policy, json.dumps(a), json.dumps(b)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(next(line for line in done.stdout.splitlines() if line.startswith("RESULT ")).split()[1])


@pytest.mark.parametrize("policy", ["lru", "arc", "arc-s"])
def test_a_prefix_is_evicted_tail_first_whatever_the_hash_seed(model, policy):
    """A 4-row CPU tier holds A (3 blocks), then B (2 blocks) evicts one of A's: its tail, so
    A comes back with its first two blocks, as vLLM's own manager does for every seed (vLLM
    completes stores with a set, whose order moves with PYTHONHASHSEED)."""
    cached = {seed: cached_tokens_under_hash_seed(model, policy, seed) for seed in (0, 1, 2)}
    assert cached == dict.fromkeys((0, 1, 2), 2 * tiny.BLOCK)


def test_the_worker_round_trips_inference_tensors_built_under_inference_mode():
    """As vLLM's model runner builds it: KV caches and the worker made under
    torch.inference_mode; transfers submitted and run outside it."""
    page = 32 << 10
    spec = adapter.KVTieringOffloadingSpec(
        offloading_config({"cpu_bytes_to_use": 4 * 2 * page}, engine_id=f"inference-{uuid.uuid4().hex[:8]}")
    )
    try:
        spec.get_manager()  # the scheduler side makes the shared region the worker maps
        with torch.inference_mode():
            kv = torch.randint(-128, 128, (8, page), dtype=torch.int8, generator=torch.Generator().manual_seed(0))
            caches = CanonicalKVCaches([CanonicalKVCacheTensor(kv, page)], [[CanonicalKVCacheRef(0, page)]])
            worker = spec.get_worker(caches)
        original = kv.clone()
        gpu = GPULoadStoreSpec([5, 2, 7, 1], group_sizes=[4], block_indices=[0])
        assert worker.submit_store(1, gpu, CPULoadStoreSpec([3, 0]))
        worker.wait({1})
        with torch.inference_mode():
            kv.zero_()
        assert worker.submit_load(2, CPULoadStoreSpec([3, 0]), gpu)
        worker.wait({2})
        results = {result.job_id: result for result in worker.get_finished()}
        assert [results[job].success for job in (1, 2)] == [True, True]
        assert results[2].transfer_size == 4 * page
        assert torch.equal(kv[[5, 2, 7, 1]], original[[5, 2, 7, 1]])
        assert not kv[[0, 3, 4, 6]].any()
    finally:
        spec.shutdown()
