"""The serving benchmark's configurations, each run against a fresh vLLM server.

- ``a``: vLLM with its prefix cache only;
- ``b``: vLLM with its prefix cache given the memory the engine's CPU tier uses (the
  honest baseline on a CPU-only machine, where that memory could hold vLLM's own blocks);
- ``c``: this engine, a CPU tier;
- ``d``: a CPU tier and a file tier;
- ``e``: a CPU tier and an S3 tier (an S3-compatible server on 127.0.0.1, started here);
- ``f``: a CPU tier and a file tier made slow on purpose (the ``faulty`` tier's latency on
  every operation);
- ``g``: the same, with ``recompute_tokens_per_s`` (load or recompute, `tiering.engine.recompute`).

Every configuration gets the same requests at the same arrival times, the same vLLM KV
cache (but ``b``'s) and its own server, so nothing is shared between them but the model.

Thread: the caller's.
"""

from __future__ import annotations

import contextlib
import logging
import math
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tiering.benchmarks.serve.breakdown import breakdown, read_request_log
from tiering.benchmarks.serve.client import Outcome, replay
from tiering.benchmarks.serve.floor import ALIGN, disk_floors
from tiering.benchmarks.serve.server import ServerOptions, VllmServer

logger = logging.getLogger("tiering.bench")

CONFIGURATIONS = {
    "a": "vLLM, prefix cache only",
    "b": "vLLM, prefix cache + the CPU tier's memory",
    "c": "engine: CPU tier",
    "d": "engine: CPU tier + file tier",
    "e": "engine: CPU tier + S3 tier",
    "f": "engine: CPU tier + slow file tier",
    "g": "engine: CPU tier + slow file tier, load or recompute",
}
FILE_TIER_DIR = "file-tier"  # d's, under the work directory

SOURCES = ("device", "host", "disk", "external_unspecified")
"""vLLM's sources of cached prompt tokens: its own cache, then the connector's (host: the
CPU tier, disk: the file tier, external_unspecified: other tiers such as S3)."""

S3_CREDENTIALS = {  # the local S3 server accepts any; nothing of the user's is read or sent
    "AWS_ACCESS_KEY_ID": "bench",
    "AWS_SECRET_ACCESS_KEY": "bench",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
    "AWS_CONFIG_FILE": "/nonexistent/aws-config",
    "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent/aws-credentials",
}


@dataclass(frozen=True)
class Setup:
    """What every configuration shares.

    Attributes:
        kv_bytes_per_token: the model's KV bytes per token (sizes ``b``'s extra blocks).
        cpu_bytes: the engine's CPU tier, bytes (``cpu_bytes_to_use``).
        gpu_blocks: vLLM's own KV cache, blocks of `block_size` tokens.
        work_dir: the tiers' files and the servers' logs go under it.
        slow_latency_s: the slow tier's latency per operation, seconds (``f``, ``g``).
        recompute_tokens_per_s: the prefill rate ``g`` is configured with.
        connector: the connector the engine runs behind (``server.CONNECTORS``).
        b_extra_bytes: the bytes ``b`` adds to vLLM's cache; None: `cpu_bytes` (the same
            memory as the engine's CPU tier).
    """

    model: Path
    kv_bytes_per_token: int
    block_size: int
    max_model_len: int
    gpu_blocks: int
    cpu_bytes: int
    work_dir: Path
    slow_latency_s: float = 0.5
    recompute_tokens_per_s: float | None = None
    connector: str = "KVTieringConnector"
    b_extra_bytes: int | None = None

    @property
    def extra_blocks(self) -> int:
        """vLLM blocks configuration ``b`` adds to vLLM's cache."""
        extra = self.cpu_bytes if self.b_extra_bytes is None else self.b_extra_bytes
        return extra // (self.block_size * self.kv_bytes_per_token)


def server_options(name: str, setup: Setup, s3_endpoint: str | None) -> ServerOptions:
    """The server of configuration `name` (one of `CONFIGURATIONS`)."""
    gpu_blocks = setup.gpu_blocks + (setup.extra_blocks if name == "b" else 0)
    kv_cache_gib = max(1, math.ceil(gpu_blocks * setup.block_size * setup.kv_bytes_per_token * 1.25 / (1 << 30)))
    slow = {"type": "faulty", "inner": {"type": "file", "root_dir": str(setup.work_dir / f"slow-{name}")}}
    tiers = {
        "c": [],
        "d": [{"type": "file", "root_dir": str(setup.work_dir / FILE_TIER_DIR)}],
        "e": [{"type": "s3", "bucket": "kv-bench", "endpoint_url": s3_endpoint, "create_bucket": True}],
        "f": [{**slow, "latency_s": setup.slow_latency_s}],
        "g": [{**slow, "latency_s": setup.slow_latency_s}],
    }
    engine: dict[str, Any] | None = None
    if name in tiers:
        engine = {
            "cpu_bytes_to_use": setup.cpu_bytes,
            "eviction_policy": "lru",
            "secondary_tiers": tiers[name],
            "request_log": str(request_log(name, setup)),
        }
        if name == "g":
            engine["recompute_tokens_per_s"] = setup.recompute_tokens_per_s
    return ServerOptions(
        engine=engine,
        connector=setup.connector,
        block_size=setup.block_size,
        max_model_len=setup.max_model_len,
        gpu_blocks=gpu_blocks,
        kv_cache_gib=kv_cache_gib,
        reserved_cpus=0,  # the model's threads on every core, in every configuration alike
        extra_args=["--enable-prompt-tokens-details", "--max-num-seqs", "16"],
        env=S3_CREDENTIALS if name == "e" else {},
    )


def request_log(name: str, setup: Setup) -> Path:
    """The engine's request log of configuration `name` (`tiering.engine.timeline`)."""
    return setup.work_dir / f"requests-{name}.jsonl"


@contextlib.contextmanager
def s3_server(needed: bool) -> Iterator[str | None]:
    """An S3-compatible server on 127.0.0.1 for configuration ``e`` (its endpoint), or None."""
    if not needed:
        yield None
        return
    from tiering.testing.s3_server import MotoServer

    server = MotoServer()
    server.start()
    try:
        yield server.endpoint_url
    finally:
        server.stop()


def run_configuration(
    name: str,
    setup: Setup,
    prompts: list[list[int]],
    arrivals_s: list[float],
    max_tokens: int,
    max_concurrency: int | None,
    s3_endpoint: str | None,
    hints: list[dict[str, Any] | None] | None = None,
) -> dict[str, Any]:
    """Start configuration `name`'s server, replay the requests (with their retention
    `hints`, `tiering.benchmarks.serve.client.replay`), read its counters, stop it.

    Returns:
        ``{"name", "description", "wall_s", "outcomes": [Outcome dicts], "vllm": counters,
        "recompute_tokens_per_s": g's (None for the others)}``;
        an outcome of a request that loaded blocks from the engine has its TTFT's parts
        under ``"engine"`` (`tiering.benchmarks.serve.breakdown`), else None there.

    Raises:
        RuntimeError: the server did not start (the message has its output).
    """
    options = server_options(name, setup, s3_endpoint)
    request_log(name, setup).unlink(missing_ok=True)
    log = setup.work_dir / f"server-{name}.log"
    logger.info("configuration %s (%s): starting vLLM, log in %s", name, CONFIGURATIONS[name], log)
    server = VllmServer(setup.model, options, log)
    try:
        start = time.perf_counter()
        outcomes = replay(server.url, server.model_name, prompts, arrivals_s, max_tokens, max_concurrency, hints=hints)
        wall_s = time.perf_counter() - start
        counters = settled_counters(server)
    finally:
        server.stop(signal.SIGINT)
    entries = read_request_log(request_log(name, setup))
    results = [outcome.as_dict() for outcome in outcomes]
    for result in results:
        result["engine"] = breakdown(result, entries.get(result["index"]))
    if name == "d":
        _add_disk_floors(results, setup)
    failed = sum(outcome.error is not None for outcome in outcomes)
    if failed:
        logger.warning("configuration %s: %d requests failed, first: %s", name, failed, _first_error(outcomes))
    return {
        "name": name,
        "description": CONFIGURATIONS[name],
        "wall_s": wall_s,
        "outcomes": results,
        "vllm": counters,
        "recompute_tokens_per_s": setup.recompute_tokens_per_s if name == "g" else None,
    }


def _add_disk_floors(results: list[dict[str, Any]], setup: Setup) -> None:
    """Each result that promoted blocks gets the disk's floor for their bytes (a block and its
    header page each), read from the file tier's directory the server just left."""
    parts = [result["engine"] for result in results if result["engine"] and result["engine"]["promoted_blocks"]]
    block_bytes = setup.block_size * setup.kv_bytes_per_token
    floors = disk_floors(setup.work_dir / FILE_TIER_DIR, block_bytes + ALIGN, {p["promoted_blocks"] for p in parts})
    if floors is None:
        logger.warning("configuration d: no disk floor (the file tier's directory takes no O_DIRECT reads)")
        return
    for part in parts:
        part["disk_floor_s"] = floors[part["promoted_blocks"]]


def _first_error(outcomes: list[Outcome]) -> str | None:
    return next((outcome.error for outcome in outcomes if outcome.error), None)


def settled_counters(server: VllmServer) -> dict[str, Any]:
    """vLLM's prompt-token counters and the engine's per-tier counts, once the engine's last
    counts reached vLLM (they travel with a scheduler step, at most once a second: one more
    short request after a second carries them)."""
    time.sleep(1.1)
    replay(server.url, server.model_name, [[2, 3]], [0.0], 1)
    samples = server.metrics()

    def total(name: str, **labels: str) -> float:
        values = samples.get(f"{name}_total", {})
        return sum(value for pairs, value in values.items() if labels.items() <= dict(pairs).items())

    engine: dict[str, dict[str, float]] = {}
    for sample, values in samples.items():
        if sample.startswith("vllm:kv_tiering_") and sample.endswith("_total"):
            counter = sample.removeprefix("vllm:kv_tiering_").removesuffix("_total")
            for pairs, value in values.items():
                tier = dict(pairs).get("tier", "")
                engine.setdefault(counter, {})[tier] = engine.get(counter, {}).get(tier, 0) + value
    return {
        "prompt_tokens": total("vllm:prompt_tokens"),
        "computed_tokens": total("vllm:prompt_tokens_by_source", source="local_compute"),
        "cached_tokens_by_source": {
            source: total("vllm:prompt_tokens_cached_by_source", source=source) for source in SOURCES
        },
        "generation_tokens": total("vllm:generation_tokens"),
        "load_bytes": total("vllm:kv_offload_load_bytes"),  # the worker's copies into vLLM's cache
        "load_seconds": total("vllm:kv_offload_load_time"),
        "engine": engine,
    }
