"""Hybrid models under a real vLLM: tiny Llamas whose layers are sliding-window attention
(some or all of them), which vLLM's hybrid KV cache serves in groups by kind. A prefix loaded
from the CPU tier, and one promoted from the file tier, must give the output of an engine
without offloading, and count as hits in every group."""

import pytest

from tests_vllm import tiny
from tests_vllm.conftest import OTHERS, PROMPT
from tests_vllm.test_vllm import FULL_BLOCKS, close, evict_and_reload, manager_stats

pytestmark = pytest.mark.timeout(600)
WINDOW = 64  # tokens a sliding-window layer attends to: 2 blocks
SLIDING, FULL = "sliding_attention", "full_attention"
MODELS = {  # architecture and layer kinds; KV-cache groups vLLM makes of them; bytes of a group's block (a
    # CPU row); rows a prompt of 6 full blocks stores; CPU rows (one prompt's fit, the other prompts' push
    # them to the file tier)
    "alternating": (("llama", [SLIDING, FULL]), 2, 16 << 10, 6 + 2, 16),
    "all-sliding": (("llama", [SLIDING, SLIDING]), 1, 32 << 10, 2, 4),
    # Command-R7B's shape: vLLM gives its sliding layers WINDOW + 1 tokens, one past a block boundary
    "cohere2": (("cohere2", [SLIDING, SLIDING, SLIDING, FULL]), 4, 16 << 10, 6 + 3 * 2, 24),
}


@pytest.fixture(scope="module", params=list(MODELS))
def hybrid(request, tmp_path_factory):
    """(name, model path, outputs without offloading by prompt)."""
    architecture, layer_types = MODELS[request.param][0]
    path = tiny.make_model(tmp_path_factory.mktemp("model") / request.param, layer_types, WINDOW, architecture)
    llm = tiny.make_llm(path)
    try:
        return request.param, path, {tuple(p): tiny.generate(llm, [p])[0] for p in [PROMPT, *OTHERS]}
    finally:
        del llm


def test_a_prefix_from_the_cpu_tier_and_one_from_the_file_tier_give_the_same_output(hybrid, tmp_path):
    name, path, baseline = hybrid
    _, groups, row_bytes, stored, rows = MODELS[name]
    tiers = [{"type": "file", "root_dir": str(tmp_path / "kv")}]
    config = {"cpu_bytes_to_use": rows * row_bytes, "secondary_tiers": tiers}
    llm = tiny.make_llm(path, config, connector="KVTieringConnector")
    try:
        assert tiny.generate(llm, [PROMPT])[0] == (*baseline[tuple(PROMPT)][:2], 0)
        tiny.settle(llm, lambda: manager_stats()["manager"]["gauges"]["jobs_in_flight"] == 0)
        assert manager_stats()["primary"]["counters"]["blocks_stored"] == stored  # a window's tail per sliding group
        assert llm.reset_prefix_cache()
        tokens, logprobs, cached = tiny.generate(llm, [PROMPT])[0]  # loaded from the CPU tier
        assert (tokens, logprobs) == baseline[tuple(PROMPT)][:2] and cached == FULL_BLOCKS
        stats = manager_stats()
        by_group = stats["manager"]["counters"]["hit_blocks_by_group"]
        assert sorted(by_group) == [str(group) for group in range(groups)] and all(by_group.values())
        assert stats["primary"]["counters"]["hit_blocks"] == sum(by_group.values())
        tokens, logprobs, cached = evict_and_reload(llm, baseline)  # promoted from the file tier
        assert (tokens, logprobs) == baseline[tuple(PROMPT)][:2] and cached == FULL_BLOCKS
        stats = manager_stats()
        assert stats["tiers"]["file"]["counters"]["hit_blocks"] > 0
        assert sum(stats["manager"]["counters"]["hit_blocks_by_group"].values()) > sum(by_group.values())
        assert stats["primary"]["counters"]["blocks_store_failed"] == 0
    finally:
        close(llm)
