"""``tiering-bench``: replay real or synthetic traffic through the real engine.

With no arguments it runs a built-in default: a CPU tier and a file tier (in a temporary
directory) under a synthetic multi-turn chat workload, in well under a minute.

    tiering-bench                                       # the built-in default
    tiering-bench --config engine.yaml --trace conversation_trace.jsonl --verify --output run.json

Exit status: 0, or 1 if a loaded block failed verification, or 2 for bad input (a config
or trace that cannot be used; the message says what and where).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
from pathlib import Path

from pydantic import TypeAdapter, ValidationError
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from benchmarks.loadgen.bounds import belady_hit_rate, unbounded_hit_rate
from benchmarks.loadgen.engine import SimulatedEngine
from benchmarks.loadgen.report import build_report, plot, print_summary
from benchmarks.loadgen.run import SchedulerLoop
from benchmarks.loadgen.workload import BLOCK_TOKENS, WORKLOADS, read_trace, synthetic
from tiering import ConfigError, KVLayout, SharedOffloadRegion, load_config, parse_config
from tiering.factory import Size

DEFAULT_CONFIG = """\
cpu_bytes_to_use: 4MiB
eviction_policy: lru
secondary_tiers:
  - type: file
    root_dir: ${TIERING_BENCH_DIR}
    capacity_bytes: 48MiB
"""
LAYERS = 4  # KV tensors of the simulated model when sizing by --block-bytes


def _size(text: str) -> int:
    try:
        return int(TypeAdapter(Size).validate_python(text))
    except ValidationError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size such as 65536 or 64KiB") from None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="tiering-bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, help="engine YAML (default: a CPU tier and a file tier)")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--trace", type=Path, help="Mooncake JSONL trace to replay")
    source.add_argument("--workload", choices=WORKLOADS, default="multi-turn", help="synthetic workload")
    parser.add_argument("--max-requests", type=int, help="requests to replay (default: all; 300 synthetic)")
    sizing = parser.add_mutually_exclusive_group()
    sizing.add_argument("--block-bytes", type=_size, default=64 << 10, help="bytes per block (default 64KiB)")
    sizing.add_argument("--model", help="size blocks as this model's KV (for example llama-3.1-8b)")
    parser.add_argument("--gpu-blocks", type=int, help="GPU prefix cache, blocks (default: max(64, longest prompt))")
    parser.add_argument("--time-scale", type=float, default=0.0, help="trace seconds per replay second; 0: flat out")
    parser.add_argument("--verify", action="store_true", help="check every loaded byte")
    parser.add_argument("--output", type=Path, help="write the results as JSON")
    parser.add_argument("--plot", type=Path, help="write hit rates over the run as PNG")
    parser.add_argument("--seed", type=int, default=0, help="seed of synthetic workloads and payloads")
    parser.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on 127.0.0.1:PORT while running")
    return parser.parse_args(argv)


def layout_for(args: argparse.Namespace) -> KVLayout:
    """The simulated model: a preset, or `LAYERS` tensors adding up to --block-bytes."""
    if args.model:
        return KVLayout.from_preset(args.model, gpu_block_size=BLOCK_TOKENS)
    per_token_layer, remainder = divmod(args.block_bytes, LAYERS * BLOCK_TOKENS)
    if remainder or not per_token_layer:
        raise ValueError(f"--block-bytes must be a positive multiple of {LAYERS * BLOCK_TOKENS}")
    return KVLayout("loadgen", LAYERS, per_token_layer, gpu_block_size=BLOCK_TOKENS)


def run(args: argparse.Namespace, console: Console) -> dict:
    """Load inputs, build the engine, replay, and return the report.

    Raises:
        ConfigError, ValueError, OSError: unusable input or storage.
    """
    with tempfile.TemporaryDirectory(prefix="tiering-bench-", ignore_cleanup_errors=True) as scratch:
        environ = {**os.environ, "TIERING_BENCH_DIR": scratch}
        if args.config:
            config = load_config(args.config, environ)
        else:
            config = parse_config(DEFAULT_CONFIG, "<built-in default>", environ)
        if config.block_size not in (None, BLOCK_TOKENS):
            raise ValueError(f"the load generator replays {BLOCK_TOKENS}-token blocks: block_size must be omitted")
        if args.trace:
            requests = read_trace(args.trace, args.max_requests)
        else:
            requests = synthetic(args.workload, args.max_requests or 300, args.seed)
        if not requests:
            raise ValueError("no requests to replay")
        longest = max(len(request.hash_ids) for request in requests)
        gpu_blocks = args.gpu_blocks or max(64, longest)
        if gpu_blocks < longest:
            raise ValueError(f"--gpu-blocks {gpu_blocks} cannot hold the longest prompt ({longest} blocks)")
        engine = SimulatedEngine(config, layout_for(args), gpu_blocks, f"bench-{os.getpid()}", args.seed)
        exporter = None
        try:
            if args.metrics_port is not None:
                from tiering.metrics import PrometheusExporter

                exporter = PrometheusExporter(args.metrics_port)
                exporter.attach(engine.manager)
                console.print(f"metrics on http://127.0.0.1:{exporter.port}/metrics", highlight=False)
            loop = SchedulerLoop(engine, verify=args.verify)
            columns = (TextColumn("replaying"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
            with Progress(*columns, console=console, transient=True) as progress:
                task = progress.add_task("replay", total=len(requests))
                stats = loop.run(requests, args.time_scale, on_request=lambda: progress.advance(task))
            bounds = {
                "unbounded": unbounded_hit_rate(requests),
                "belady": belady_hit_rate(requests, engine.spec.num_blocks),
            }
            inputs = {
                "config": config.model_dump(),
                "trace": str(args.trace) if args.trace else None,
                "workload": None if args.trace else args.workload,
                "max_requests": args.max_requests,
                "bytes_per_block": engine.spec.bytes_per_block,
                "model": args.model,
                "gpu_blocks": gpu_blocks,
                "time_scale": args.time_scale,
                "seed": args.seed,
                "device": str(engine.device),
                "trace_span_s": (requests[-1].timestamp_ms - requests[0].timestamp_ms) / 1000.0,
            }
            report = build_report(stats, engine, bounds, inputs)
        finally:
            if exporter is not None:
                exporter.close()
            engine.shutdown()
    if args.plot:
        plot(stats, list(report["hit_rate"])[:-1], str(args.plot))
    return report


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    console = Console(stderr=True)
    # A terminated run still shuts the engine down (its shared memory, its tier threads),
    # and a run that was killed outright leaves a region the next run removes.
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    SharedOffloadRegion.remove_stale("bench-")
    try:
        report = run(args, console)
    except (ConfigError, ValueError, OSError) as exc:
        console.print(f"[bold red]tiering-bench: error:[/] {exc}", highlight=False)
        return 2
    finally:
        signal.signal(signal.SIGTERM, previous)
    print_summary(report, Console())
    if args.output:
        args.output.write_text(json.dumps(report, indent=2))
    return 1 if report["verify_failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
