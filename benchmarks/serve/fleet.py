"""The fleet benchmark: replicas of one model behind the load generator's client
(``tiering-bench serve --replicas N``), each a `vllm serve` with its own CPU tier, pinned to
its share of the cores.

Configurations, each run under every ``--routing`` (`tiering.benchmarks.serve.routing`) on
fresh servers and fresh tiers:

- ``a``: vLLM's prefix cache alone, the baseline;
- ``private``: the engine, a CPU tier and a file tier of its own per replica;
- ``shared``: the engine, a CPU tier per replica and one tier every replica stores to and
  loads from (``--shared-tier``): a directory (``shared: true``, probing for what the others
  stored), a Valkey cluster or an S3 bucket, the last two started here on 127.0.0.1, or a
  Mooncake Store pool whose memory is the replicas' own segments (`MOONCAKE_SEGMENT_BYTES`
  each), its master in a network namespace of its own (`tiering.testing.mooncake_pool`).

A request's prompt tokens are computed, or served from vLLM's cache, the CPU tier or a
secondary tier (vLLM's sources); of the secondary tier's, those of blocks another replica
stored (the shared tier's ``found_blocks_loaded``) are counted apart.

Thread: the caller's (servers start on threads of their own).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import logging
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from tiering.benchmarks.serve.breakdown import breakdown, read_request_log
from tiering.benchmarks.serve.client import replay
from tiering.benchmarks.serve.restart import SHUTDOWN_TIMEOUT_S
from tiering.benchmarks.serve.routing import LOAD_WEIGHT, PREFIX_ROUTINGS, KvEventsIndex, Routing
from tiering.benchmarks.serve.run import S3_CREDENTIALS, Setup, server_options, settled_counters
from tiering.benchmarks.serve.scenarios import Scenario
from tiering.benchmarks.serve.server import ServerOptions, VllmServer

logger = logging.getLogger("tiering.bench")

FLEET_CONFIGURATIONS = {
    "a": "vLLM, prefix cache only",
    "private": "engine: CPU tier + a file tier per replica",
    "shared": "engine: CPU tier per replica + one shared tier",
}
SHARED_TIERS = ("file", "valkey", "s3", "mooncake")
MOONCAKE_SEGMENT_BYTES = 512 << 20  # what each replica lends the pool


@dataclass(frozen=True)
class Fleet:
    """The replicas: how many, the kind of the shared tier, the KV-events router's weights
    (`tiering.benchmarks.serve.routing.WEIGHTS` changed) and ``kv-shared``'s cost of a
    request in flight, the moment measured (None: a steady run), and each one's cores."""

    replicas: int
    shared_tier: str = "file"
    router_weights: dict[str, float] = field(default_factory=dict)
    load_weight: float = LOAD_WEIGHT
    scenario: Scenario | None = None

    def cpus(self) -> list[tuple[int, ...]]:
        """Each replica's cores: this process's cores split evenly (a replica gets one of them
        in turn when there are fewer cores than replicas)."""
        cores = sorted(os.sched_getaffinity(0))
        share = max(1, len(cores) // self.replicas)
        return [tuple(cores[(i * share) % len(cores) :][:share]) for i in range(self.replicas)]


@contextlib.contextmanager
def shared_backing(kind: str, needed: bool) -> Iterator[dict[str, Any]]:
    """The servers the shared tier of `kind` needs (none for a directory), started on
    127.0.0.1 if `needed`: the tier config's connection keys."""
    if not needed or kind == "file":
        yield {}
        return
    if kind == "mooncake":
        from tiering.testing.mooncake_pool import MooncakePool

        pool = MooncakePool(members=0)  # the replicas' segments are the pool
        try:
            yield pool.tier_options(segment_bytes=MOONCAKE_SEGMENT_BYTES, recover_index=False)
        finally:
            pool.stop()
        return
    from tiering.testing.s3_server import MotoServer
    from tiering.testing.valkey_server import ValkeyCluster

    server = ValkeyCluster() if kind == "valkey" else MotoServer()
    server.start()
    try:
        if isinstance(server, ValkeyCluster):
            yield {"addresses": server.addresses, "cluster_mode": True}
        else:
            yield {"endpoint_url": server.endpoint_url, "create_bucket": True}
    finally:
        server.stop()


def shared_tier(kind: str, run: str, setup: Setup, backing: dict[str, Any]) -> dict[str, Any]:
    """The config of run `run`'s shared tier (its own directory, key prefix or bucket)."""
    fresh = run.replace("/", "-")
    if kind == "file":
        return {
            "type": "file",
            "root_dir": str(setup.work_dir / f"shared-{fresh}"),
            "shared": True,
            "probe_misses": True,
        }
    if kind in ("valkey", "mooncake"):
        return {"type": kind, "key_prefix": f"fleet-{fresh}", **backing}
    return {"type": "s3", "bucket": f"fleet-{fresh}", **backing}


def replica_options(
    name: str, replica: int, fleet: Fleet, setup: Setup, tier: dict[str, Any] | None, events: dict[str, Any] | None
) -> ServerOptions:
    """Replica `replica`'s server in configuration `name`: `tier` its secondary tier (None:
    ``a``), `events` its ``--kv-events-config`` (None: none), its request log in its
    directory (`replica_log`)."""
    options = server_options("a" if name == "a" else "c", setup, None)
    if options.engine is not None:
        options.engine |= {"secondary_tiers": [tier], "request_log": str(replica_log(setup, replica))}
    extra = [*options.extra_args, "--kv-events-config", json.dumps(events)] if events else options.extra_args
    if fleet.scenario is not None and fleet.scenario.kind == "rolling-restart":  # the engine drains as it stops
        extra = [*extra, "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S)]
    env = S3_CREDENTIALS if fleet.shared_tier == "s3" and name == "shared" else {}
    return replace(options, cpus=fleet.cpus()[replica], extra_args=extra, env=env)


def replica_log(setup: Setup, replica: int) -> Path:
    """The engine's request log of `replica` (`tiering.engine.timeline`)."""
    return setup.work_dir / f"requests-replica-{replica}.jsonl"


def run_fleet(
    name: str,
    routing_name: str,
    fleet: Fleet,
    setup: Setup,
    prompts: list[list[int]],
    arrivals_s: list[float],
    conversation_of: list[int],
    max_tokens: int,
    max_concurrency: int | None,
    backing: dict[str, Any],
    hints: list[dict[str, Any] | None] | None = None,
) -> dict[str, Any]:
    """Start configuration `name`'s replicas, replay the requests routed by `routing_name`,
    read every replica's counters, stop them.

    Returns:
        ``{"name", "description", "routing", "wall_s", "outcomes", "vllm": the replicas'
        counters summed, "replicas": [{"cpus", "vllm"}]}``; each outcome says its replica.

    Raises:
        RuntimeError: a server did not start (the message has its output).
    """
    run = f"{name}/{routing_name}"
    shared_places = frozenset({"STORAGE/LOCAL", "STORAGE/REMOTE"} if name == "shared" else ())  # the shared tier's
    index = None
    if routing_name in PREFIX_ROUTINGS:
        index = KvEventsIndex(fleet.replicas, setup.block_size, fleet.router_weights, shared_places)
    servers: list[VllmServer] = []
    try:
        _start_replicas(name, run, fleet, setup, backing, index, servers)
        routing = Routing(routing_name, fleet.replicas, conversation_of, index, fleet.load_weight)
        actions = fleet.scenario.actions(routing, servers) if fleet.scenario else []
        start = time.perf_counter()
        urls = [server.url for server in servers]
        outcomes = replay(
            urls,
            servers[0].model_name,
            prompts,
            arrivals_s,
            max_tokens,
            max_concurrency,
            hints=hints,
            routing=routing,
            actions=actions,
        )
        wall_s = time.perf_counter() - start
        counters = [settled_counters(server) for server in servers]
    finally:
        for server in servers:
            server.stop(signal.SIGINT)
        if index is not None:
            index.close()
    results = [outcome.as_dict() for outcome in outcomes]
    _add_request_logs(results, fleet.replicas, setup)
    scenario = fleet.scenario
    moment = f"; {scenario.describe()}" if scenario else ""
    return {
        "name": run,
        "description": f"{FLEET_CONFIGURATIONS[name]}, {routing_name}{moment}",
        "routing": routing_name,
        "wall_s": wall_s,
        "outcomes": results,
        "vllm": sum_counters(counters),
        "replicas": [{"cpus": list(cpus), "vllm": c} for cpus, c in zip(fleet.cpus(), counters, strict=True)],
        "apart": scenario.apart(results, conversation_of) if scenario else None,
    }


def _start_replicas(
    name: str,
    run: str,
    fleet: Fleet,
    setup: Setup,
    backing: dict[str, Any],
    index: KvEventsIndex | None,
    servers: list[VllmServer],
) -> None:
    """Start run `run`'s replicas of configuration `name` together, each appended to
    `servers` once it answers.

    Raises:
        RuntimeError: a server did not start (those that did are in `servers`, to stop).
    """
    options = []
    for replica in range(fleet.replicas):
        tier = None
        if name == "private":
            tier = {"type": "file", "root_dir": str(setup.work_dir / f"private-{run.replace('/', '-')}-{replica}")}
        elif name == "shared":
            tier = shared_tier(fleet.shared_tier, run, setup, backing)
        events = index.publisher_config(replica) if index is not None else None
        options.append(replica_options(name, replica, fleet, setup, tier, events))
        replica_log(setup, replica).unlink(missing_ok=True)
    logger.info("fleet %s: starting %d vLLM servers on cores %s", run, fleet.replicas, fleet.cpus())
    with concurrent.futures.ThreadPoolExecutor(fleet.replicas) as pool:
        starting = [
            pool.submit(VllmServer, setup.model, option, setup.work_dir / f"server-{run.replace('/', '-')}-{i}.log")
            for i, option in enumerate(options)
        ]
        for future in starting:
            with contextlib.suppress(RuntimeError):
                servers.append(future.result())
        for future in starting:
            future.result()  # the first that failed, raised (the others are stopped by the caller)


def _add_request_logs(results: list[dict[str, Any]], replicas: int, setup: Setup) -> None:
    """Each result gets its TTFT's parts (`breakdown`) and the blocks its promotions brought
    from secondary tiers (``promoted_blocks``), from its replica's request log."""
    for replica in range(replicas):
        entries = read_request_log(replica_log(setup, replica))
        for result in results:
            if result["replica"] == replica:
                entry = entries.get(result["index"])
                result["engine"] = breakdown(result, entry)
                result["promoted_blocks"] = sum((entry or {}).get("promoted_blocks", {}).values())


def sum_counters(counters: list[dict[str, Any]]) -> dict[str, Any]:
    """The replicas' counters (`settled_counters`) added up, nested dicts by key."""

    def add(a: Any, b: Any) -> Any:
        if isinstance(a, dict) or isinstance(b, dict):
            a, b = a or {}, b or {}
            return {key: add(a.get(key), b.get(key)) for key in a.keys() | b.keys()}
        return (a or 0) + (b or 0)

    total: dict[str, Any] = {}
    for one in counters:
        total = add(total, one)
    return total
