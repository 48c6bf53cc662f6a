"""Hybrid models under a real vLLM, tiny and random, of the shapes vLLM serves: Command-R7B's
(sliding layers of window + 1 tokens), Gemma 3's (5 sliding layers to 1 full), gpt-oss's
(alternating, a 128-token window), Mistral's (every layer sliding) and Llama 4's (attention
local to chunks), which vLLM's hybrid KV cache serves in groups by kind. A prefix loaded
from the CPU tier, and one promoted from the file tier, must give the output of an engine
without offloading, and count as hits in every group."""

from typing import NamedTuple

import pytest

from tests_vllm import tiny
from tests_vllm.conftest import prompt
from tests_vllm.test_vllm import close, evict_and_reload, manager_stats

pytestmark = pytest.mark.timeout(600)
SLIDING, FULL, CHUNKED = "sliding_attention", "full_attention", "chunked_attention"
PROMPT = prompt(10, 8 * tiny.BLOCK + 14)  # 8 full blocks and a part of one
OTHERS = [prompt(seed, len(PROMPT)) for seed in (11, 12, 13)]  # each pushes PROMPT's rows to the file tier
PREFIX = 8 * tiny.BLOCK


class Shape(NamedTuple):
    architecture: str
    layers: list[str]  # each layer's attention
    window: int  # tokens a sliding window (or an attention chunk) spans
    groups: int  # KV-cache groups vLLM makes of the layers
    row_bytes: int  # bytes of a group's block: a CPU row
    stored: int  # rows PROMPT stores: every block of a full group, a window's tail of the others (CPU rows too)
    vllm_cached: int  # prompt tokens vLLM's own OffloadingConnector serves (measured by the test below)
    unattended: int = 0  # prompt tokens before the last attention chunk: vLLM counts them cached, no KV needed


MODELS = {
    # Command-R7B: vLLM gives its sliding layers the window + 1 tokens, one past a block boundary
    "cohere2": Shape("cohere2", [SLIDING, SLIDING, SLIDING, FULL], 64, 4, 16 << 10, 8 + 3 * 2, 0),
    "gemma3": Shape("gemma3", [SLIDING] * 5 + [FULL], 64, 6, 16 << 10, 8 + 5 * 2, PREFIX),
    "gpt-oss-like": Shape("llama", [SLIDING, FULL], 128, 2, 16 << 10, 8 + 4, PREFIX),
    "mistral": Shape("mistral", [SLIDING, SLIDING], 64, 1, 32 << 10, 2, PREFIX),
    # Llama 4's local attention: within chunks of 96 tokens, the prompt's last chunk holds 2 full blocks
    "llama4-chunked": Shape("llama4", [CHUNKED, CHUNKED], 96, 1, 32 << 10, 2, PREFIX, 192),
}


@pytest.fixture(scope="module", params=list(MODELS))
def hybrid(request, tmp_path_factory):
    """(name, model path, outputs without offloading by prompt)."""
    shape = MODELS[request.param]
    path = tiny.make_model(
        tmp_path_factory.mktemp("model") / request.param, shape.layers, shape.window, shape.architecture
    )
    llm = tiny.make_llm(path)
    try:
        return request.param, path, {tuple(p): tiny.generate(llm, [p])[0] for p in [PROMPT, *OTHERS]}
    finally:
        del llm


@pytest.mark.parametrize("connector", ["KVTieringConnector", "OffloadingConnector"])
def test_a_prefix_from_the_cpu_tier_and_one_from_the_file_tier_give_the_same_output(hybrid, tmp_path, connector):
    """Under the engine's connector every shape gets its whole prefix (8 full blocks; the
    prompt ends in a part of one); under vLLM's own, what it measured (Command-R's window of
    65 tokens asks for a block more than is stored: no hit), which the per-group counter
    of hits ended shows."""
    name, path, baseline = hybrid
    shape = MODELS[name]
    expected = PREFIX if connector == "KVTieringConnector" else max(shape.vllm_cached, shape.unattended)
    tiers = [{"type": "file", "root_dir": str(tmp_path / "kv")}]
    config = {"cpu_bytes_to_use": shape.stored * shape.row_bytes, "secondary_tiers": tiers}
    llm = tiny.make_llm(path, config, connector=connector)
    try:
        assert tiny.generate(llm, [PROMPT])[0] == (*baseline[tuple(PROMPT)][:2], shape.unattended)
        tiny.settle(llm, lambda: manager_stats()["manager"]["gauges"]["jobs_in_flight"] == 0)
        assert manager_stats()["primary"]["counters"]["blocks_stored"] == shape.stored
        assert llm.reset_prefix_cache()
        tokens, logprobs, cached = tiny.generate(llm, [PROMPT])[0]  # loaded from the CPU tier
        assert (tokens, logprobs) == baseline[tuple(PROMPT)][:2] and cached == expected
        stats = manager_stats()
        by_group = stats["manager"]["counters"]["hit_blocks_by_group"]
        assert stats["primary"]["counters"]["hit_blocks"] == sum(by_group.values())
        if expected:
            assert sorted(by_group) == [str(group) for group in range(shape.groups)] and all(by_group.values())
        else:  # a sliding-window group ended the hit every time: the counter names it
            ended = stats["manager"]["counters"]["hits_ended_by_group"]
            assert ended.get("0", 0) >= 1 and sum(by_group.values()) < shape.stored
        tokens, logprobs, cached = evict_and_reload(llm, baseline, PROMPT, OTHERS)  # promoted from the file tier
        assert (tokens, logprobs) == baseline[tuple(PROMPT)][:2] and cached == expected
        stats = manager_stats()
        assert stats["primary"]["counters"]["blocks_store_failed"] == 0
        if expected:
            assert stats["tiers"]["file"]["counters"]["hit_blocks"] > 0
            assert sum(stats["manager"]["counters"]["hit_blocks_by_group"].values()) > sum(by_group.values())
    finally:
        close(llm)
