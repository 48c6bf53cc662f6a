"""A `vllm serve` whose CPU tier outlives a crash (``cpu_tier: {survive_crash: true}``), killed
with SIGKILL under load and started again with the same command, answers its earlier prompts
from the CPU tier the killed engine left: every full block cached, from the adopted region
(there is no other tier), with the same output. Started with another ``model_version``, it
adopts nothing."""

from __future__ import annotations

import json
import signal
import threading
import urllib.request
import uuid
from pathlib import Path

import pytest

from tests_vllm import tiny
from tests_vllm.conftest import prompt
from tiering.benchmarks.serve.server import ServerOptions, VllmServer, free_port
from tiering.cpu.kept_regions import KEPT_SUFFIX

pytestmark = pytest.mark.timeout(900)
PROMPTS = [prompt(700 + i, 300) for i in range(4)]  # 9 full blocks each: 36 in a CPU tier of 128
BLOCKS = 9 * len(PROMPTS)
FILLER = prompt(790, 16)  # under a block: keeps the engine stepping (its stats are published from a step)


class Server(VllmServer):
    """`vllm serve` with a 128-row CPU tier that survives crashes and no other tier (the engine's
    exporter on a port of its own), its engine id `engine_id`."""

    def __init__(self, model: Path, log: Path, engine_id: str, model_version: str | None = None):
        self.engine_port = free_port()
        engine: dict = {
            "cpu_bytes_to_use": 4 << 20,
            "cpu_tier": {"survive_crash": True},
            "metrics": {"port": self.engine_port},
        }
        if model_version is not None:
            engine["model_version"] = model_version
        options = ServerOptions(
            engine,
            tiny.BLOCK,
            max_model_len=1024,
            gpu_blocks=64,
            extra_args=["--enable-prompt-tokens-details"],
            engine_id=engine_id,
        )
        super().__init__(model, options, log)

    def complete(self, tokens: list[int]) -> tuple[str, int]:
        """The completion's text and the prompt tokens found cached (on a fresh server, the
        engine's CPU tier's)."""
        body = {"model": self.model_name, "prompt": tokens, "max_tokens": 4, "temperature": 0}
        request = urllib.request.Request(
            f"{self.url}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=120) as response:
            answer = json.loads(response.read())
        return answer["choices"][0]["text"], answer["usage"]["prompt_tokens_details"]["cached_tokens"]

    def cpu_counter(self, name: str) -> float:
        """The CPU tier's counter ``tiering_tier_<name>_total``, from the engine's exporter."""
        samples = self.metrics(self.engine_port).get(f"tiering_tier_{name}_total", {})
        return sum(value for labels, value in samples.items() if dict(labels).get("tier") == "cpu")

    def wait_for(self, name: str, at_least: float) -> None:
        """Until the CPU tier's counter `name` reaches `at_least` (the test's timeout bounds it);
        the engine publishes its stats from a step, so short requests keep it stepping."""
        while self.cpu_counter(name) < at_least:
            self.complete(FILLER)


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
        first.wait_for("blocks_stored", BLOCKS)
        first.wait_for("blocks_sealed", BLOCKS)  # hashed by the sealer: adoptable after a crash
        more = [prompt(750 + i, 300) for i in range(8)]  # stored while the server dies

        def load() -> None:
            try:
                for tokens in more:
                    first.complete(tokens)
            except OSError:
                pass  # killed under it

        threading.Thread(target=load, daemon=True).start()
        first.wait_for("blocks_stored", BLOCKS + 9)
    finally:
        first.stop(signal.SIGKILL, group=True)

    second = Server(model, tmp_path / "second.log", next(engine_ids))
    try:
        texts, cached = zip(*(second.complete(tokens) for tokens in PROMPTS), strict=True)
        assert list(texts) == expected
        assert list(cached) == [9 * tiny.BLOCK] * len(PROMPTS), second.output()[-3000:]  # from the adopted CPU tier
        second.wait_for("blocks_adopted", BLOCKS)
        assert second.cpu_counter("blocks_adopted") <= BLOCKS + 9 * len(more)
        assert second.cpu_counter("blocks_stored") == 0  # nothing stored again: every block was there
    finally:
        second.stop(signal.SIGKILL, group=True)

    other = Server(model, tmp_path / "other.log", next(engine_ids), model_version="another")
    try:
        texts, cached = zip(*(other.complete(tokens) for tokens in PROMPTS), strict=True)
        assert list(texts) == expected and list(cached) == [0] * len(PROMPTS)
        other.wait_for("blocks_stored", BLOCKS)  # its stats are published
        assert other.cpu_counter("blocks_adopted") == 0
    finally:
        other.stop(signal.SIGTERM)
