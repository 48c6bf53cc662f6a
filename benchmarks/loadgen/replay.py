"""One replay of the load generator: its inputs checked, the engine built, the requests
replayed through the scheduler loop, and the report.

Thread: the main thread (the scheduler's); `Interrupts` runs there as a signal handler.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import signal
import statistics
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from tiering import BlockStoreTier, KVLayout, TieringConfig, load_config, parse_config
from tiering.backends import FileBlockStore
from tiering.benchmarks.loadgen import runs
from tiering.benchmarks.loadgen.bounds import belady_hit_rate, prefix_hit_rate, unbounded_hit_rate
from tiering.benchmarks.loadgen.report import build_report, plot
from tiering.benchmarks.loadgen.run import RunStats, SchedulerLoop
from tiering.benchmarks.loadgen.workload import (
    BLOCK_TOKENS,
    Request,
    in_blocks_of,
    read_trace,
    synthetic,
    with_flood,
    with_hints,
)
from tiering.errors import describe_bind_error
from tiering.spec import block_tokens
from tiering.stats import Every
from tiering.tiers.blockstore.generations import record_namespace
from tiering.tiers.blockstore.leases import lease_namespace

if TYPE_CHECKING:
    from tiering.benchmarks.loadgen.engine import SimulatedEngine
    from tiering.engine.metrics import PrometheusExporter

DEFAULT_CONFIG = """\
cpu_bytes_to_use: ${TIERING_BENCH_CPU_BYTES}
eviction_policy: lru
secondary_tiers:
  - type: file
    root_dir: ${TIERING_BENCH_DIR}
    capacity_bytes: ${TIERING_BENCH_TIER_BYTES}
"""
DEFAULT_CPU_BYTES, DEFAULT_TIER_BYTES = 4 << 20, 48 << 20  # the built-in config's smallest tiers (`default_sizes`)
LAYERS = 4  # KV tensors of the simulated model when sizing by --block-bytes
PROGRESS_INTERVAL_S = 10.0  # seconds between two progress lines where no progress bar shows
logger = logging.getLogger("tiering.bench")


class ProgressLines:
    """Where no progress bar shows (stderr is not a terminal: a CI log, a pipe), a log line
    every `PROGRESS_INTERVAL_S` seconds of the replay instead."""

    def __init__(self, total: int):
        self.total, self.done = total, 0
        self._every = Every(PROGRESS_INTERVAL_S)

    def __call__(self) -> None:
        """One more request replayed."""
        self.done += 1
        if self._every.due():
            logger.info(
                "replayed %d of %d requests (%.0f%%) in %.0f s",
                self.done,
                self.total,
                100 * self.done / self.total,
                self._every.elapsed(),
            )


class EngineFailure(Exception):
    """The engine raised while replaying (exit status 3)."""


def layout_for(args: argparse.Namespace, tokens: int | None = None) -> KVLayout:
    """The simulated model, its GPU blocks of `tokens` tokens (None: the layout's default,
    `block_tokens`' fallback: a preset's 16, the made-up model's `BLOCK_TOKENS`): a preset,
    or `LAYERS` tensors adding up to --block-bytes per block. A hybrid preset's KV-cache
    groups are simulated as one, of all its layers: a block is one key here (the bound on its
    bytes; a sliding-window group stores only its window's tail).

    Raises:
        ValueError: --block-bytes does not split into `LAYERS` layers of `tokens` tokens.
    """
    if args.model:
        layout = KVLayout.from_preset(args.model)
        tokens = tokens or layout.gpu_block_size
        return dataclasses.replace(
            layout, num_layers=layout.num_layers * layout.kv_groups, kv_groups=1, gpu_block_size=tokens
        )
    tokens = tokens or BLOCK_TOKENS
    per_token_layer, remainder = divmod(args.block_bytes, LAYERS * tokens)
    if remainder or not per_token_layer:
        raise ValueError(
            f"--block-bytes: read {args.block_bytes:,} bytes, not a multiple of {LAYERS * tokens:,} "
            f"({LAYERS} layers of {tokens} tokens); for example 64KiB or 2MiB"
        )
    return KVLayout("loadgen", LAYERS, per_token_layer, gpu_block_size=tokens)


class Interrupted(KeyboardInterrupt):
    """What `Interrupts` raises. A subclass on purpose: when an exception of exactly
    KeyboardInterrupt leaves code that CPython runs from source text (``exec``/``eval`` of a
    string, as ``dataclasses`` does while a lazy import defines a class), CPython 3.11 marks
    the process and, at exit, kills it with SIGINT, even if the exception was caught and the
    run exited 143. A subclass passes every ``except KeyboardInterrupt`` but not that check."""


class Interrupts:
    """The handler of SIGINT (Ctrl-C) and SIGTERM, run on the main thread: during the replay
    the first one asks it to stop before the next request (no engine call is cut in half, so
    the shutdown finds the engine whole); otherwise, or the second time, it raises
    `Interrupted`, a KeyboardInterrupt."""

    def __init__(self) -> None:
        self.received: list[int] = []
        self.stop = threading.Event()
        self.replaying = False
        self._holding = False

    def __call__(self, signum: int, _frame: object) -> None:
        self.received.append(signum)
        if self._holding:
            return  # acted on at the end of `held`
        if not self.replaying or self.stop.is_set():
            raise Interrupted
        self.stop.set()

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Run the body whole: a signal that comes during it raises `Interrupted` at its end.
        (Blocking the signals would not do: another thread of the process may take them.)"""
        before, self._holding = len(self.received), True
        try:
            yield
        finally:
            self._holding = False
        if len(self.received) > before:
            raise Interrupted

    def exit_status(self) -> int:
        """128 + the signal's number (130 for Ctrl-C, 143 for SIGTERM)."""
        return 128 + (self.received[0] if self.received else signal.SIGINT)


@dataclasses.dataclass
class Replay:
    """What a run replays: the simulated model, the engine's config, the requests, and the
    GPU cache in front (`gpu_blocks`; `prefix_cache`: whether it keeps blocks across requests)."""

    layout: KVLayout
    config: TieringConfig
    requests: list[Request]
    gpu_blocks: int
    prefix_cache: bool


def run(args: argparse.Namespace, console: Console, interrupts: Interrupts) -> dict:
    """Load inputs, build the engine, replay, and return the report.

    Raises:
        ConfigError, ValueError, OSError, RegionInUseError: unusable input or storage.
        EngineFailure: the engine raised while replaying.
    """
    with runs.scratch_directory() as scratch:
        replay = _prepare(args, scratch)
        from tiering.benchmarks.loadgen.engine import SimulatedEngine

        for tier in replay.config.secondary_tiers:  # what runs killed before their end left
            if tier["type"] == "file":
                runs.sweep(Path(tier["root_dir"]))
        engine = SimulatedEngine(
            replay.config, replay.layout, replay.gpu_blocks, f"bench-{os.getpid()}", args.seed, replay.prefix_cache
        )
        exporter, claim = None, runs.RunClaim()
        try:
            if not args.warm_start:
                for tier in engine.manager.secondary_tiers:
                    if isinstance(tier, BlockStoreTier) and isinstance(tier.store, FileBlockStore):
                        identity = engine.spec.layout_fingerprint  # the run's manifest and lease go with it
                        for name in (record_namespace(identity).hex(), lease_namespace(identity).hex()):
                            claim.claim(tier.store.directory.with_name(name))
                        claim.claim(tier.store.directory)
            else:  # a warm start measures what earlier runs left, not how soon the tiers list it
                for tier in engine.manager.secondary_tiers:
                    if isinstance(tier, BlockStoreTier):
                        tier.wait_recovered()
            exporter = _start_exporter(args, engine, console)
            stats = _replay(args, SchedulerLoop(engine, verify=args.verify), replay.requests, console, interrupts)
            report = _report(args, replay, engine, stats)
        finally:
            if exporter is not None:
                exporter.close()
            try:
                if not (args.keep or args.warm_start):
                    engine.remove_namespaces()
                claim.release()  # what --keep kept is never swept
            finally:
                engine.shutdown()
    if args.plot and report["requests"]:  # a run stopped before its first request has nothing to plot
        plot(stats, list(report["hit_rate"])[:-1], str(args.plot))
    return report


def _prepare(args: argparse.Namespace, scratch: str) -> Replay:
    """The run's inputs, checked; file tiers of the built-in default go under `scratch`.

    Raises:
        ConfigError, ValueError, OSError: unusable input.
    """
    if args.trace:
        requests = read_trace(args.trace, args.max_requests)
    else:
        requests = synthetic(args.workload, args.max_requests or 300, args.seed)
    if not requests:
        raise ValueError("no requests to replay")
    if args.flood:
        requests = with_flood(requests, args.flood)
    default = layout_for(args)  # the layout of a config without block_size
    environ = {**default_sizes(default, requests), **os.environ, "TIERING_BENCH_DIR": scratch}
    if args.config:
        config = load_config(args.config, environ)
    else:
        config = parse_config(DEFAULT_CONFIG, "<built-in default>", environ)
    tokens = block_tokens(config, default)  # as tiering-config check and the engine read them
    layout = layout_for(args, tokens)
    config = config.model_copy(update={"block_size": tokens})
    if not args.warm_start:  # a namespace of its own: nothing an earlier run left is a hit
        layout = dataclasses.replace(layout, model=f"{layout.model}/run-{uuid.uuid4().hex[:12]}")
    requests = in_blocks_of(with_hints(requests, args.hints), tokens)
    _check_cpu_rows(config, layout, requests)
    longest = max(len(request.hash_ids) for request in requests)
    prefix_cache = args.gpu_blocks != 0
    gpu_blocks = args.gpu_blocks or max(64 if prefix_cache else 1, longest)
    if gpu_blocks < longest:
        raise ValueError(f"--gpu-cache-blocks {gpu_blocks} cannot hold the longest prompt ({longest} blocks)")
    return Replay(layout, config, requests, gpu_blocks, prefix_cache)


def default_sizes(layout: KVLayout, requests: list[Request]) -> dict[str, str]:
    """The built-in config's sizes, bytes by variable, for `layout`'s KV: a CPU tier of at
    least `DEFAULT_CPU_BYTES`, 8 blocks of `BLOCK_TOKENS` tokens and two typical (median)
    requests' tokens, so that `_check_cpu_rows` passes at any block size; a file tier of at
    least `DEFAULT_TIER_BYTES`, 24 such blocks and twice the CPU tier."""
    per_token = layout.kv_bytes_per_token
    typical = statistics.median_high(request.input_length for request in requests)
    cpu = max(DEFAULT_CPU_BYTES, 8 * BLOCK_TOKENS * per_token, 2 * typical * per_token)
    tier = max(DEFAULT_TIER_BYTES, 24 * BLOCK_TOKENS * per_token, 2 * cpu)
    return {"TIERING_BENCH_CPU_BYTES": str(cpu), "TIERING_BENCH_TIER_BYTES": str(tier)}


def _check_cpu_rows(config: TieringConfig, layout: KVLayout, requests: list[Request]) -> None:
    """Refuse a run whose CPU tier holds fewer blocks than a typical (median) request stores:
    most stores would be refused and the run would measure nothing; warn where it holds fewer
    than the longest request stores (that request's stores are refused).

    Raises:
        ValueError: says the block, the rows and the blocks requests store.
    """
    tokens = block_tokens(config, layout)
    block_bytes = layout.kv_bytes_per_token * tokens
    rows = config.cpu_bytes_to_use // block_bytes
    typical = statistics.median_high(request.full_blocks() for request in requests)
    longest = max(request.full_blocks() for request in requests)
    holds = (
        f"cpu_bytes_to_use ({config.cpu_bytes_to_use:,}) holds {rows:,} blocks of {tokens} tokens of "
        f"{layout.model.partition('/run-')[0]} ({block_bytes:,} bytes each)"
    )
    if rows < typical:
        raise ValueError(
            f"{config.source}: {holds}; half the requests store {typical:,} or more: give the CPU tier at least "
            f"{typical * block_bytes:,} bytes"
        )
    if rows < longest:
        logger.warning("%s: %s; the longest request stores %d: its stores are refused", config.source, holds, longest)


def _start_exporter(args: argparse.Namespace, engine: SimulatedEngine, console: Console) -> PrometheusExporter | None:
    """The Prometheus exporter of ``--metrics-port``, serving the engine's stats; None without it.

    Raises:
        ValueError: the port cannot be bound.
    """
    if args.metrics_port is None:
        return None
    from tiering.engine.metrics import PrometheusExporter

    try:
        exporter = PrometheusExporter(args.metrics_port)
    except OSError as exc:
        raise ValueError(f"--metrics-port: {describe_bind_error(exc, '127.0.0.1', args.metrics_port)}") from None
    exporter.attach(engine.manager)
    console.print(f"metrics on http://127.0.0.1:{exporter.port}/metrics", highlight=False)
    return exporter


def _replay(
    args: argparse.Namespace, loop: SchedulerLoop, requests: list[Request], console: Console, interrupts: Interrupts
) -> RunStats:
    """Replay `requests` with a progress bar (progress lines when not on a terminal).

    Raises:
        EngineFailure: the engine raised.
    """
    columns = (TextColumn("replaying"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    try:
        with Progress(*columns, console=console, transient=True, disable=args.quiet) as progress:
            task = progress.add_task("replay", total=len(requests))
            interrupts.replaying = True
            if interrupts.received:  # a signal before the replay whose exception a library swallowed
                interrupts.stop.set()  # (a bare ``except:`` in an import it landed in): no request served
            try:
                tick = ProgressLines(len(requests)) if not (console.is_terminal or args.quiet) else None

                def advance() -> None:
                    progress.advance(task)
                    if tick is not None:
                        tick()

                return loop.run(requests, args.time_scale, advance, interrupts.stop)
            finally:
                interrupts.replaying = False
    except Exception as exc:
        raise EngineFailure(f"{type(exc).__name__}: {exc}") from exc


def _report(args: argparse.Namespace, replay: Replay, engine: SimulatedEngine, stats: RunStats) -> dict:
    """The run's report: its stats, the hit-rate bounds of what it replayed, its inputs.

    Raises:
        EngineFailure: the hit rate is above its bound (a block was found that no tier could hold).
    """
    replayed = replay.requests[: stats.requests]  # all of them, unless interrupted
    all_blocks = engine.capacity_blocks(replay.gpu_blocks if replay.prefix_cache else 0)
    bounds = {
        "unbounded": unbounded_hit_rate(replayed),
        "prefix": prefix_hit_rate(replayed),
        "belady": belady_hit_rate(replayed, engine.spec.num_blocks),
        "belady_all_tiers": None if all_blocks is None else belady_hit_rate(replayed, all_blocks),
        "all_tiers_blocks": all_blocks,
    }
    inputs = {
        "config": replay.config.model_dump(),
        "trace": str(args.trace) if args.trace else None,
        "workload": None if args.trace else args.workload,
        "max_requests": args.max_requests,
        "bytes_per_block": engine.spec.bytes_per_block,
        "model": args.model,
        "gpu_blocks": replay.gpu_blocks,
        "gpu_prefix_cache": replay.prefix_cache,
        "warm_start": args.warm_start,
        "namespace": replay.layout.model,
        "time_scale": args.time_scale,
        "flood": args.flood,
        "hints": args.hints,
        "seed": args.seed,
        "device": str(engine.device),
        "trace_span_s": (replayed[-1].timestamp_ms - replayed[0].timestamp_ms) / 1000.0 if replayed else 0.0,
    }
    report = build_report(stats, engine, bounds, inputs)
    if not args.warm_start and report["hit_rate"]["total"] > bounds["prefix"] + 1e-9:
        raise EngineFailure(f"hit rate {report['hit_rate']['total']:.4f} above its bound {bounds['prefix']:.4f}")
    return report
