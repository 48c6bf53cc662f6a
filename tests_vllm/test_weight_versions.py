"""vLLM's own weight version (``LLMEngine.set_weight_version``, what ``finish_weight_update(weight_version=...)``
and ``POST /update_weight_version`` call) moves the engine's lasting tiers to the namespace of those
weights (`tiering.integrations.vllm_plugin`): the next request recomputes, with the output of a run
without offloading; an engine started later on that version loads what was stored under it, one on
the checkpoint what was stored before the update, one on another version nothing."""

import pytest

from tests_vllm import tiny
from tests_vllm.conftest import PROMPT
from tests_vllm.test_vllm import CPU_BYTES, FULL_BLOCKS, close, manager_stats
from tiering.contract.identity import namespace
from tiering.integrations.vllm import live_specs

pytestmark = pytest.mark.timeout(600)
STORED = FULL_BLOCKS // tiny.BLOCK  # the prompt's full blocks


def file_tier_counts() -> dict:
    return manager_stats()["tiers"]["file"]


def started(model, config: dict):
    llm = tiny.make_llm(model, config, connector="KVTieringConnector")
    tiny.settle(llm, lambda: not file_tier_counts()["gauges"]["recovering"])
    return llm


def test_vllms_weight_version_moves_the_lasting_tiers_to_the_namespace_of_those_weights(model, baseline, tmp_path):
    config = {"cpu_bytes_to_use": CPU_BYTES, "secondary_tiers": [{"type": "file", "root_dir": str(tmp_path / "kv")}]}
    expected_tokens, expected_logprobs, _ = baseline[tuple(PROMPT)]
    llm = started(model, config)
    try:
        assert tiny.generate(llm, [PROMPT])[0][0] == expected_tokens  # stored under the checkpoint's weights
        tiny.settle(llm, lambda: file_tier_counts()["counters"]["blocks_stored"] == STORED)
        llm.llm_engine.set_weight_version("step-1")  # the weights changed (vLLM's own API)
        assert llm.reset_prefix_cache()  # vLLM's own cache, as after a weight update
        tokens, logprobs, cached = tiny.generate(llm, [PROMPT])[0]
        assert (tokens, cached) == (expected_tokens, 0)  # recomputed: nothing of the old weights is offered
        assert logprobs == pytest.approx(expected_logprobs, abs=1e-4)
        (spec,) = [spec for spec in live_specs() if spec.engine.manager is not None]
        (tier,) = spec.engine.manager.secondary_tiers
        step_1 = namespace(spec.engine.layout_fingerprint, "step-1").hex()
        tiny.settle(llm, lambda: tier.store.directory.name == step_1)  # the loop thread moves it (`start_switch`)
        tiny.settle(llm, lambda: file_tier_counts()["counters"]["blocks_stored"] == 2 * STORED)  # into step-1's
        assert llm.reset_prefix_cache(reset_connector=True)  # a reset keeps the declared version
        assert tier.store.directory.name == step_1
    finally:
        close(llm)
    for weights, loaded in (("step-1", FULL_BLOCKS), (None, FULL_BLOCKS), ("step-2", 0)):
        llm = started(model, {**config, **({"weight_version": weights} if weights else {})})
        try:
            tokens, _, cached = tiny.generate(llm, [PROMPT])[0]
            assert (tokens, cached) == (expected_tokens, loaded), weights
        finally:
            close(llm)
