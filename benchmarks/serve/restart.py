"""The serving benchmark's restart scenario (``--restart-at T``): the first requests after a
graceful restart, over the tiers the server left (warm), over empty ones (cold), and with no
restart at all; with ``--restart-signal kill``, after a crash (SIGKILL to every process of the
server), warm from the tiers alone and warm from the CPU tier it left too (``memory``: the
engine's ``cpu_tier: {survive_crash: true}``).

The requests that arrive before ``T`` seconds of the replay go to a server of one of the
engine's configurations (`tiering.benchmarks.serve.run`); it is then stopped as a service
manager stops it (SIGTERM, with ``--shutdown-timeout`` long enough for the engine's drain),
started again over the same tiers, and sent the first `AFTER_RESTART` requests that arrive
after ``T``, their gaps kept, from the moment it answers. The same requests go to:

- ``warm``: the restarted server;
- ``cold``: a fresh server over empty tiers (a restart that lost its tiers);
- ``none``: the first server, not restarted (its counters read before them, so the run's
  counts are of these requests alone);
- ``memory`` (killed only): a server whose CPU tier survives crashes, killed and started
  again: it adopts the CPU tier's blocks, and finds the file tier's.

Each result is shaped as `run_configuration`'s, its outcomes those requests (indexed as in
the whole workload), so the report's table compares them directly.

Thread: the caller's.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import signal
import time
from collections.abc import Iterator
from typing import Any

from tiering.benchmarks.serve.client import replay
from tiering.benchmarks.serve.run import CONFIGURATIONS, Setup, server_options, settled_counters
from tiering.benchmarks.serve.server import VllmServer

logger = logging.getLogger("tiering.bench")

AFTER_RESTART = 50
"""Requests measured after the restart."""
RESTARTS = {"none": "no restart", "warm": "restarted over its tiers", "cold": "restarted over empty tiers"}
KILLED = {
    "none": "no restart",
    "memory": "killed, restarted over the CPU tier it left (survive_crash) and its tiers",
    "warm": "killed, restarted over its tiers",
    "cold": "restarted over empty tiers",
}
"""The restarts of ``--restart-signal kill``."""
LASTING = ("d", "f", "g")
"""The configurations with a lasting tier under the work directory: those a restart can find
warm, and a cold restart empty (``e``'s bucket is shared by every run)."""
SHUTDOWN_TIMEOUT_S = 60
"""vLLM's ``--shutdown-timeout``: the engine's drain runs within it (vLLM's default, 0, kills
the engine core at once)."""


def split(arrivals_s: list[float], restart_at_s: float) -> tuple[list[int], list[int]]:
    """The requests before the restart, and the first `AFTER_RESTART` after it (indexes).

    Raises:
        ValueError: no request arrives before, or after, `restart_at_s`.
    """
    before = [i for i, arrival in enumerate(arrivals_s) if arrival < restart_at_s]
    after = [i for i, arrival in enumerate(arrivals_s) if arrival >= restart_at_s][:AFTER_RESTART]
    if not before or not after:
        last = max(arrivals_s, default=0.0)
        window = f"the requests arrive from 0 to {last:.1f} s"
        raise ValueError(f"--restart-at {restart_at_s:g}: {window}; choose a time between")
    return before, after


def run_restarts(
    name: str,
    setup: Setup,
    prompts: list[list[int]],
    arrivals_s: list[float],
    restart_at_s: float,
    max_tokens: int,
    max_concurrency: int | None,
    s3_endpoint: str | None,
    kill: bool = False,
) -> Iterator[dict[str, Any]]:
    """Configuration `name` (one of `LASTING`) with no restart, a warm and a cold one (`kill`:
    the server killed, and `KILLED`'s), each on servers and tiers of its own under
    ``setup.work_dir``; yields each result as it ends.

    Raises:
        RuntimeError: a server did not start (the message has its output).
    """
    before, after = split(arrivals_s, restart_at_s)

    def send(server: VllmServer, indexes: list[int]) -> list[dict[str, Any]]:
        first = arrivals_s[indexes[0]]
        outcomes = replay(
            server.url,
            server.model_name,
            [prompts[i] for i in indexes],
            [arrivals_s[i] - first for i in indexes],
            max_tokens,
            max_concurrency,
        )
        return [outcome.as_dict() | {"index": i} for outcome, i in zip(outcomes, indexes, strict=True)]

    for restart, description in (KILLED if kill else RESTARTS).items():
        restarted = restart != "none"
        own = dataclasses.replace(setup, work_dir=setup.work_dir / f"restart-{restart}")
        own.work_dir.mkdir(parents=True, exist_ok=True)
        options = server_options(name, own, s3_endpoint)
        extra_args = [*options.extra_args, "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S)]
        engine = options.engine or {}
        if restart == "memory":  # the region outlives a kill; the last graceful stop drops it
            engine = {**engine, "cpu_tier": {"survive_crash": True, "keep_on_stop": False}}
        options = dataclasses.replace(options, extra_args=extra_args, engine=engine)
        server = None
        try:
            if restart != "cold":
                server = _start(own, options, f"{name}-{restart}-before")
                send(server, before)
            if restart != "none":
                if server is not None and kill:
                    server.stop(signal.SIGKILL, group=True)  # every process at once: no stop runs
                elif server is not None:
                    server.stop(signal.SIGTERM)  # the engine drains what only its CPU tier holds
                    drained = re.search(r"shutdown: wrote .*", server.output())
                    logger.info("%s %s: %s", name, restart, drained[0] if drained else "no drain logged")
                server = _start(own, options, f"{name}-{restart}-after")
            assert server is not None
            earlier = settled_counters(server)
            start = time.perf_counter()
            outcomes = send(server, after)
            wall_s = time.perf_counter() - start
            counters = _minus(settled_counters(server), earlier)
        finally:
            if server is not None:
                server.stop(signal.SIGTERM)
        yield {
            "name": f"{name} {restart}",
            "restart": restart,
            "description": f"{CONFIGURATIONS[name]}, {description}" + (f" at {restart_at_s:g} s" if restarted else ""),
            "wall_s": wall_s,
            "outcomes": outcomes,
            "vllm": counters,
            "recompute_tokens_per_s": None,
        }


def _start(setup: Setup, options: Any, label: str) -> VllmServer:
    log = setup.work_dir / f"server-{label}.log"
    logger.info("%s: starting vLLM, log in %s", label, log)
    return VllmServer(setup.model, options, log)


def _minus(after: Any, before: Any) -> Any:
    """`after` less `before`, number by number, in nested dicts of counters."""
    if isinstance(after, dict):
        earlier = before if isinstance(before, dict) else {}
        return {key: _minus(value, earlier.get(key, 0)) for key, value in after.items()}
    return after - before
