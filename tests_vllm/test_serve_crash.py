"""A `vllm serve` whose CPU tier outlives a crash (``cpu_tier: {survive_crash: true}``), killed
with SIGKILL under load and started again with the same command, answers its earlier prompts
from the CPU tier the killed engine left: every full block cached, from the adopted region
(there is no other tier), with the same output. Started with another ``model_version``, it
adopts nothing."""

from __future__ import annotations

import signal
import uuid
from pathlib import Path

import pytest

from tests_vllm import tiny
from tests_vllm.conftest import prompt
from tests_vllm.test_serve_restart import CountingServer
from tiering.cpu.kept_regions import KEPT_SUFFIX

pytestmark = pytest.mark.timeout(900)
PROMPTS = [prompt(700 + i, 300) for i in range(4)]  # 9 full blocks each: 36 in a CPU tier of 128
BLOCKS = 9 * len(PROMPTS)


class Server(CountingServer):
    """A `CountingServer` whose CPU tier survives crashes, and no other tier."""

    def __init__(self, model: Path, log: Path, engine_id: str, model_version: str | None = None):
        engine: dict = {"cpu_tier": {"survive_crash": True}}
        if model_version is not None:
            engine["model_version"] = model_version
        super().__init__(model, engine, log, engine_id)


@pytest.fixture
def engine_ids():
    """Engine ids of this test alone; the regions they leave kept are removed at the end."""
    tag = f"crash-{uuid.uuid4().hex[:8]}"
    yield (f"{tag}-{i}" for i in range(10))
    for path in Path("/dev/shm").glob(f"tiering-{tag}-*{KEPT_SUFFIX}"):
        path.unlink(missing_ok=True)


def test_a_server_killed_under_load_restarts_warm_from_its_cpu_tier(model, tmp_path, engine_ids):
    first = Server(model, tmp_path / "first.log", next(engine_ids))
    try:
        expected = [first.complete(tokens)[0] for tokens in PROMPTS]
        first.wait_for("blocks_stored", "cpu", BLOCKS)
        first.wait_for("blocks_sealed", "cpu", BLOCKS)  # hashed by the sealer: adoptable after a crash
        more = [prompt(750 + i, 300) for i in range(8)]
        first.kill_under_load(more, BLOCKS + 9)  # killed while it stores them
    finally:
        first.stop(signal.SIGKILL, group=True)

    second = Server(model, tmp_path / "second.log", next(engine_ids))
    try:
        texts, cached = zip(*(second.complete(tokens) for tokens in PROMPTS), strict=True)
        assert list(texts) == expected
        assert list(cached) == [9 * tiny.BLOCK] * len(PROMPTS), second.output()[-3000:]  # from the adopted CPU tier
        adopted = second.wait_for("blocks_adopted", "cpu", BLOCKS)["cpu"]
        assert adopted <= BLOCKS + 9 * len(more)
        assert second.counter("blocks_stored").get("cpu", 0) == 0  # nothing stored again: every block was there
    finally:
        second.stop(signal.SIGKILL, group=True)

    other = Server(model, tmp_path / "other.log", next(engine_ids), model_version="another")
    try:
        texts, cached = zip(*(other.complete(tokens) for tokens in PROMPTS), strict=True)
        assert list(texts) == expected and list(cached) == [0] * len(PROMPTS)
        assert other.wait_for("blocks_stored", "cpu", BLOCKS)["cpu"] == BLOCKS  # its stats are published
        assert other.counter("blocks_adopted").get("cpu", 0) == 0
    finally:
        other.stop(signal.SIGTERM)
