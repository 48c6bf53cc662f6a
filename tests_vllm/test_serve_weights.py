"""Two `vllm serve` replicas share a file tier while their weights change at different times, as in
an RL loop: one is told a new weight version through vLLM's own API (``POST /update_weight_version``,
dev mode); its next request recomputes, with the output it had before any offloading, while the
other replica still loads the checkpoint's blocks; once the second declares the same version, a
prompt the first stored under it is loaded by the second."""

import json
import time
import urllib.request

import pytest

from tests_vllm import tiny
from tests_vllm.conftest import prompt
from tiering.benchmarks.serve.server import ServerOptions, VllmServer

pytestmark = pytest.mark.timeout(900)
BLOCKS = 9  # full blocks of each 300-token prompt
P1, P2, P3 = (prompt(900 + i, 300) for i in range(3))
FILLER = prompt(990, 16)  # under a block: keeps a server stepping, stores nothing


class Replica(VllmServer):
    def __init__(self, model, root, log):
        tier = {"type": "file", "root_dir": str(root), "shared": True, "probe_misses": True}
        engine = {"cpu_bytes_to_use": 4 << 20, "secondary_tiers": [tier]}
        options = ServerOptions(
            engine,
            tiny.BLOCK,
            max_model_len=1024,
            gpu_blocks=64,
            log_stats_s=1,
            extra_args=["--enable-prompt-tokens-details"],
            env={"VLLM_SERVER_DEV_MODE": "1"},  # vLLM's weight and cache endpoints
        )
        super().__init__(model, options, log)

    def post(self, path: str, body: dict | None = None) -> dict:
        data = json.dumps(body or {}).encode()
        request = urllib.request.Request(f"{self.url}{path}", data, {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            return json.loads(response.read())

    def complete(self, tokens: list[int]) -> tuple[str, int]:
        """(the completion's text, prompt tokens served from a cache) of `tokens`, greedy."""
        body = {"model": self.model_name, "prompt": tokens, "max_tokens": 4, "temperature": 0}
        answer = self.post("/v1/completions", body)
        details = answer["usage"].get("prompt_tokens_details") or {}
        return answer["choices"][0]["text"], details.get("cached_tokens") or 0

    def declare(self, version: str) -> None:
        """A weight update's end, as an RL trainer drives it: the version, then vLLM's own cache."""
        assert self.post("/update_weight_version", {"new_version": version})["success"]
        assert self.post("/reset_prefix_cache")["success"]

    def file_blocks_stored(self) -> float:
        samples = self.metrics().get("vllm:kv_tiering_blocks_stored_total", {})
        return sum(value for labels, value in samples.items() if dict(labels).get("tier") == "file")

    def wait_stored(self, blocks: int) -> None:
        """Until this replica's file tier stored `blocks` in all (the counts move as it steps)."""
        deadline = time.monotonic() + 120
        while self.file_blocks_stored() < blocks:
            assert time.monotonic() < deadline, f"{self.file_blocks_stored()} of {blocks} blocks stored"
            self.complete(FILLER)


def test_replicas_share_a_file_tier_on_one_weight_version_and_never_across_versions(model, tmp_path):
    a = Replica(model, tmp_path / "kv", tmp_path / "a.log")
    try:
        b = Replica(model, tmp_path / "kv", tmp_path / "b.log")
        try:
            first = {}
            for tokens in (P1, P2):  # on the checkpoint's weights: computed, stored in its namespace
                first[tuple(tokens)], cached = a.complete(tokens)
                assert cached == 0
            a.wait_stored(2 * BLOCKS)
            assert b.complete(P1) == (first[tuple(P1)], BLOCKS * tiny.BLOCK)  # the other replica's blocks

            a.declare("step-1")
            assert a.complete(P1) == (first[tuple(P1)], 0)  # recomputed: nothing of the old weights offered
            assert b.complete(P2) == (first[tuple(P2)], BLOCKS * tiny.BLOCK)  # still on the checkpoint: hits

            a.complete(P3)  # stored under step-1's weights
            a.wait_stored(4 * BLOCKS)  # P1 again and P3, into step-1's namespace
            assert b.complete(P3)[1] == 0  # b is behind: never offered step-1's blocks
            b.declare("step-1")
            assert b.complete(P1)[1] == BLOCKS * tiny.BLOCK  # the same weights: a stored, b loads
        finally:
            b.stop()
    finally:
        a.stop()
