"""A `vllm serve` restarted over its file tier comes back warm. Stopped with SIGTERM (and
``--shutdown-timeout`` long enough), the engine drains what only its CPU tier held (write-back
kept it from the file tier) to the file tier, and the restarted server loads every block of the
earlier prompts from the file tier, with the same output. Killed with SIGKILL mid-load, it
loses what was not written, and everything written loads intact.
"""

from __future__ import annotations

import json
import re
import signal
import threading
import urllib.request
from pathlib import Path

import pytest

from tests_vllm import tiny
from tests_vllm.conftest import prompt
from tiering.benchmarks.serve.server import ServerOptions, VllmServer, free_port

pytestmark = pytest.mark.timeout(900)
PROMPTS = [prompt(900 + i, 300) for i in range(4)]  # 9 full blocks each: 36 in a CPU tier of 128
BLOCKS = 9 * len(PROMPTS)
FILLER = prompt(990, 16)  # under a block: keeps the engine stepping (its stats are published from a step)
WINDOW = 16  # the write-back's window: an eighth of the CPU tier's 128 rows


class CountingServer(VllmServer):
    """`vllm serve` of the engine config `engine` with a 128-row CPU tier, its exporter on a
    port of its own, given 60 s to stop, its engine id `engine_id` (None: vLLM draws one)."""

    def __init__(self, model: Path, engine: dict, log: Path, engine_id: str | None = None):
        self.engine_port = free_port()
        engine = {"cpu_bytes_to_use": 4 << 20, **engine, "metrics": {"port": self.engine_port}}
        options = ServerOptions(
            engine,
            tiny.BLOCK,
            max_model_len=1024,
            gpu_blocks=64,
            extra_args=["--shutdown-timeout", "60", "--enable-prompt-tokens-details"],
            engine_id=engine_id,
        )
        super().__init__(model, options, log)

    def text(self, tokens: list[int]) -> str:
        return self.complete(tokens)[0]

    def complete(self, tokens: list[int]) -> tuple[str, int]:
        """The completion's text and the prompt tokens vLLM found cached (its own cache's and the
        engine's: on a fresh server, the engine's)."""
        body = {"model": self.model_name, "prompt": tokens, "max_tokens": 4, "temperature": 0}
        request = urllib.request.Request(
            f"{self.url}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=120) as response:
            answer = json.loads(response.read())
        return answer["choices"][0]["text"], answer["usage"]["prompt_tokens_details"]["cached_tokens"]

    def counter(self, name: str) -> dict[str, float]:
        """The engine's counter ``tiering_tier_<name>_total`` by tier, from its exporter."""
        samples = self.metrics(self.engine_port).get(f"tiering_tier_{name}_total", {})
        return {dict(labels)["tier"]: value for labels, value in samples.items()}

    def file_failures(self) -> float:
        """Failed store calls of the file tier, every reason."""
        failures = self.metrics(self.engine_port).get("tiering_tier_failures_total", {})
        return sum(value for labels, value in failures.items() if dict(labels).get("tier") == "file")

    def wait_for(self, name: str, tier: str, at_least: float) -> dict[str, float]:
        """The counters `name` once `tier`'s reaches `at_least` (the test's timeout bounds it); the
        engine publishes its stats from a scheduler step, so short requests keep it stepping."""
        while (counts := self.counter(name)).get(tier, 0) < at_least:
            self.text(FILLER)
        return counts

    def kill_under_load(self, prompts: list[list[int]], stored: float) -> None:
        """Send `prompts` from a thread and, once the CPU tier has stored `stored` blocks, kill
        every process of the server (SIGKILL) while it serves them."""

        def load() -> None:
            try:
                for tokens in prompts:
                    self.text(tokens)
            except OSError:
                pass  # killed under it

        threading.Thread(target=load, daemon=True).start()
        try:
            self.wait_for("blocks_stored", "cpu", stored)
        finally:
            self.stop(signal.SIGKILL, group=True)


class Server(CountingServer):
    """A `CountingServer` with a write-back file tier under `root`."""

    def __init__(self, model: Path, root: Path, log: Path):
        tier = {"type": "file", "root_dir": str(root), "admission": {"write": "back"}}
        super().__init__(model, {"secondary_tiers": [tier]}, log)


def test_a_sigterm_drains_the_cpu_tier_and_the_restarted_server_loads_it_from_the_file_tier(model, tmp_path):
    root = tmp_path / "kv"
    first = Server(model, root, tmp_path / "first.log")
    try:
        expected = [first.text(tokens) for tokens in PROMPTS]
        stored = first.wait_for("blocks_stored", "file", WINDOW)
        assert stored["cpu"] == BLOCKS and stored["file"] < BLOCKS  # the CPU tier holds blocks the file tier does not
    finally:
        first.stop(signal.SIGTERM)  # as a service manager stops it
    drained = re.search(r"shutdown: wrote (\d+) to file of the (\d+) blocks only the CPU tier held", first.output())
    assert drained, first.output()[-3000:]
    assert int(drained[1]) == int(drained[2]) > 0  # every one of them

    second = Server(model, root, tmp_path / "second.log")
    try:
        texts, cached = zip(*(second.complete(tokens) for tokens in PROMPTS), strict=True)
        assert list(texts) == expected
        assert list(cached) == [9 * tiny.BLOCK] * len(PROMPTS)  # every full block, from the restarted engine
        second.wait_for("blocks_loaded", "file", BLOCKS)  # all of them from the file tier
        assert second.file_failures() == 0
    finally:
        second.stop(signal.SIGTERM)


def test_a_sigkill_loses_what_was_not_written_and_corrupts_nothing(model, tmp_path):
    root = tmp_path / "kv"
    first = Server(model, root, tmp_path / "first.log")
    try:
        expected = [first.text(tokens) for tokens in PROMPTS]
        first.wait_for("blocks_stored", "file", WINDOW)
        first.kill_under_load([prompt(950 + i, 300) for i in range(8)], BLOCKS + 9)  # new blocks, being written back
    finally:
        first.stop(signal.SIGKILL, group=True)
    assert "shutdown: wrote" not in first.output()

    second = Server(model, root, tmp_path / "second.log")
    try:
        texts, cached = zip(*(second.complete(tokens) for tokens in PROMPTS), strict=True)
        assert list(texts) == expected
        hits = sum(cached) // tiny.BLOCK
        assert WINDOW <= hits < BLOCKS  # what the write-back wrote; the rest was lost
        second.wait_for("blocks_loaded", "file", hits)
        assert second.file_failures() == 0  # nothing written was torn
    finally:
        second.stop(signal.SIGTERM)
