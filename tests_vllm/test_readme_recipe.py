"""README.md's ``vllm serve`` recipe as it is printed: its ``--kv-transfer-config`` JSON is read
from the file (as tests/test_readme.py reads the set-up commands) and given to a real server,
which serves request after request and whose /metrics scrape. The one edit is the tier's
``root_dir``, which every operator points at a disk of their own.

Before the fix, vLLM's API server built its offloading metrics for vLLM's default spec (the
recipe names no spec: the connector's default), the first request answered 200, the second
500 (``assert key in self._offloading_metric_defs``), and the server exited.
"""

import json
import re
import signal
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests_vllm import tiny
from tests_vllm.conftest import prompt
from tiering.benchmarks.serve.server import ServerOptions, VllmServer

pytestmark = pytest.mark.timeout(600)
ROOT = Path(__file__).resolve().parent.parent
README_ROOT_DIR = "/mnt/nvme/kv-cache"


def readme_kv_transfer_config() -> str:
    """The text of ``KV='...'`` in README.md's server recipe."""
    (text,) = re.findall(r"^KV='(.*?)'$", (ROOT / "README.md").read_text(), flags=re.S | re.M)
    return text


def complete(server: VllmServer, tokens: list[int]) -> int:
    """The HTTP status of a completion of `tokens` (2 tokens out); 0 where nothing answered."""
    body = json.dumps({"model": server.model_name, "prompt": tokens, "max_tokens": 2, "temperature": 0}).encode()
    request = urllib.request.Request(f"{server.url}/v1/completions", body, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return 0  # the server is gone


def tier_counts(server: VllmServer, name: str) -> dict[str, float]:
    """The engine's counter ``vllm:kv_tiering_<name>_total`` on the server's /metrics, by tier."""
    samples = server.metrics().get(f"vllm:kv_tiering_{name}_total", {})
    return {dict(labels)["tier"]: value for labels, value in samples.items()}


def test_the_readmes_server_recipe_serves_request_after_request_and_its_metrics_scrape(model, tmp_path):
    text = readme_kv_transfer_config()
    transfer = json.loads(text)
    assert "spec_name" not in transfer["kv_connector_extra_config"]  # the recipe as users copy it
    assert [tier["root_dir"] for tier in transfer["kv_connector_extra_config"]["secondary_tiers"]] == [README_ROOT_DIR]
    options = ServerOptions(
        block_size=tiny.BLOCK,
        max_model_len=1024,
        gpu_blocks=64,
        log_stats_s=1,
        kv_transfer_config=text.replace(README_ROOT_DIR, str(tmp_path / "kv")),
    )
    server = VllmServer(model, options, tmp_path / "server.log")
    try:
        prompts = [prompt(300 + i, 300) for i in range(8)]  # 72 blocks overflow vLLM's 64: the tiers get work
        statuses = [complete(server, prompts[i % len(prompts)]) for i in range(16)]
        assert statuses == [200] * 16, server.output()[-3000:]
        # the engine's counts reach /metrics with vLLM's stats, a step or an interval later:
        # waited for as a fact, the server kept stepping meanwhile
        deadline = time.monotonic() + 120
        while not (hits := tier_counts(server, "hit_blocks")) and time.monotonic() < deadline:
            statuses.append(complete(server, prompts[len(statuses) % len(prompts)]))
        assert set(statuses) == {200} and server.process.poll() is None, server.output()[-3000:]
        stored = tier_counts(server, "blocks_stored")
        assert stored.get("cpu", 0) >= 9 and stored.get("file", 0) >= 9, stored
        assert sum(hits.values()) >= 9, hits
    finally:
        server.stop(signal.SIGINT)
    assert "AssertionError" not in server.output()
