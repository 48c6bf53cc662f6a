"""``tiering-bench``: replay real or synthetic traffic through the real engine.

With no arguments it runs a built-in default: a CPU tier and a file tier (in a temporary
directory) under a synthetic multi-turn chat workload, in well under a minute.

    tiering-bench                                       # the built-in default
    tiering-bench --config engine.yaml --trace conversation_trace.jsonl --verify --output run.json

Exit status: 0 ok; 1 a loaded block failed verification (a wrong byte); 2 bad input (a
config, trace, option or storage that cannot be used: one line says what and where);
3 the engine failed while replaying.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import signal
import sys
import tempfile
import threading
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

import tiering
from tiering import (
    BlockStoreTier,
    ConfigError,
    KVLayout,
    RegionInUseError,
    load_config,
    parse_config,
)
from tiering.backends import FileBlockStore
from tiering.benchmarks.loadgen import BENCH_MODULES, runs
from tiering.benchmarks.loadgen.args import (
    check_output,
    count_arg,
    natural_arg,
    port_arg,
    positive_arg,
    rate_arg,
    size_arg,
)
from tiering.benchmarks.loadgen.bounds import belady_hit_rate, prefix_hit_rate, unbounded_hit_rate
from tiering.benchmarks.loadgen.report import build_report, plot, print_summary
from tiering.benchmarks.loadgen.run import SchedulerLoop
from tiering.benchmarks.loadgen.workload import (
    BLOCK_TOKENS,
    WORKLOADS,
    read_trace,
    synthetic,
    with_flood,
    with_hints,
)
from tiering.errors import describe, describe_bind_error
from tiering.spec import MODEL_PRESETS
from tiering.stats import Every

if TYPE_CHECKING:
    pass

DEFAULT_CONFIG = """\
cpu_bytes_to_use: ${TIERING_BENCH_CPU_BYTES}
eviction_policy: lru
secondary_tiers:
  - type: file
    root_dir: ${TIERING_BENCH_DIR}
    capacity_bytes: ${TIERING_BENCH_TIER_BYTES}
"""
DEFAULT_SIZES = {
    "TIERING_BENCH_CPU_BYTES": (4 << 20, 8),
    "TIERING_BENCH_TIER_BYTES": (48 << 20, 24),
}  # bytes, or blocks
LAYERS = 4  # KV tensors of the simulated model when sizing by --block-bytes
PROGRESS_INTERVAL_S = 10.0  # seconds between two progress lines where no progress bar shows
EXIT_OK, EXIT_VERIFY_FAILED, EXIT_BAD_INPUT, EXIT_ENGINE_FAILED = 0, 1, 2, 3  # a signal: 128 + its number
EXIT_STATUS = """\
other commands:
  tiering-bench overload ...   an offered store rate ramped past what a tier absorbs (--help there)
  tiering-bench serve ...      time to first token under a real vLLM server (--help there)

exit status:
  0  ok
  1  a loaded block failed verification (a wrong byte)
  2  bad input: a config, trace, option or storage that cannot be used
  3  the engine failed while replaying
  130  interrupted by Ctrl-C (143: by SIGTERM): the partial results were still written
"""
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


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="tiering-bench",
        description=__doc__.split("\n\n")[0],
        epilog=EXIT_STATUS,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"tiering-bench (kv-tiering) {tiering.__version__}")
    parser.add_argument(
        "--log-level",
        type=str.upper,
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        default="INFO",
        help="the engine's log lines shown on stderr (default INFO)",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bar and only warnings and errors")
    parser.add_argument("--config", type=Path, help="engine YAML (default: a CPU tier and a file tier)")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--trace", type=Path, help="Mooncake JSONL trace to replay")
    source.add_argument("--workload", choices=WORKLOADS, default="multi-turn", help="synthetic workload")
    parser.add_argument("--max-requests", type=positive_arg, help="requests to replay (default: all; 300 synthetic)")
    sizing = parser.add_mutually_exclusive_group()
    sizing.add_argument("--block-bytes", type=size_arg, default=64 << 10, help="bytes per block (default 64KiB)")
    sizing.add_argument("--model", choices=sorted(MODEL_PRESETS), help="size blocks as this model's KV")
    parser.add_argument(
        "--gpu-cache-blocks",
        "--gpu-blocks",
        dest="gpu_blocks",
        type=count_arg,
        help="GPU prefix cache in front of the engine, blocks (default: max(64, longest prompt)); 0 switches it "
        "off, so the CPU tier sees every block, as offline simulations do",
    )
    parser.add_argument(
        "--keep",
        action="store_true",
        help="keep the tiers' files this run wrote, to look at (default: remove them at the end); a later "
        "--warm-start run does not use them: start with --warm-start to build a cache runs share",
    )
    parser.add_argument(
        "--warm-start",
        action="store_true",
        help="use, and keep, what earlier warm-start runs left in the tiers (the bounds then do not apply)",
    )
    parser.add_argument(
        "--time-scale",
        type=rate_arg,
        default=0.0,
        help="replay seconds per trace second: 1 replays at the trace's own pace, 2 at half its speed, 0.5 at twice; "
        "0 (default): flat out",
    )
    parser.add_argument(
        "--flood",
        type=positive_arg,
        metavar="FACTOR",
        help="a second tenant ('flood') sends FACTOR prompts of blocks nobody else has per replayed request, each "
        "as long as it; the replayed requests become tenant 'replay' (shares: the config's tenants section)",
    )
    parser.add_argument(
        "--hints",
        default="none",
        metavar="MODE",
        help="retention hints the requests send (tiering.eviction.retention): 'continuation' (retain 5 min while the "
        "conversation has a later turn, release at its last), 'ttl:SECONDS' (every request retains), 'none' "
        "(default); deadlines follow the trace's clock",
    )
    parser.add_argument("--verify", action="store_true", help="check every loaded byte")
    parser.add_argument("--output", type=Path, help="write the results as JSON")
    parser.add_argument("--plot", type=Path, help="write hit rates over the run as PNG")
    parser.add_argument("--seed", type=natural_arg, default=0, help="seed of synthetic workloads and payloads (>= 0)")
    parser.add_argument(
        "--metrics-port", type=port_arg, help="serve Prometheus metrics on 127.0.0.1:PORT while running"
    )
    return parser.parse_args(argv)


def layout_for(args: argparse.Namespace) -> KVLayout:
    """The simulated model: a preset, or `LAYERS` tensors adding up to --block-bytes. A
    hybrid preset's KV-cache groups are simulated as one, of all its layers: a block is one
    key here (the bound on its bytes; a sliding-window group stores only its window's tail)."""
    if args.model:
        layout = KVLayout.from_preset(args.model, gpu_block_size=BLOCK_TOKENS)
        return dataclasses.replace(layout, num_layers=layout.num_layers * layout.kv_groups, kv_groups=1)
    per_token_layer, remainder = divmod(args.block_bytes, LAYERS * BLOCK_TOKENS)
    if remainder or not per_token_layer:
        raise ValueError(
            f"--block-bytes: read {args.block_bytes:,} bytes, not a multiple of {LAYERS * BLOCK_TOKENS:,} "
            f"({LAYERS} layers of {BLOCK_TOKENS} tokens); for example 64KiB or 2MiB"
        )
    return KVLayout("loadgen", LAYERS, per_token_layer, gpu_block_size=BLOCK_TOKENS)


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

    def __call__(self, signum: int, _frame: object) -> None:
        self.received.append(signum)
        if not self.replaying or self.stop.is_set():
            raise Interrupted
        self.stop.set()

    def exit_status(self) -> int:
        """128 + the signal's number (130 for Ctrl-C, 143 for SIGTERM)."""
        return 128 + (self.received[0] if self.received else signal.SIGINT)


def run(args: argparse.Namespace, console: Console, interrupts: Interrupts) -> dict:
    """Load inputs, build the engine, replay, and return the report.

    Raises:
        ConfigError, ValueError, OSError, RegionInUseError: unusable input or storage.
        EngineFailure: the engine raised while replaying.
    """
    with tempfile.TemporaryDirectory(prefix="tiering-bench-", ignore_cleanup_errors=True) as scratch:
        layout = layout_for(args)
        if not args.warm_start:  # a namespace of its own: nothing an earlier run left is a hit
            layout = dataclasses.replace(layout, model=f"{layout.model}/run-{uuid.uuid4().hex[:12]}")
        block_bytes = layout.kv_bytes_per_token * BLOCK_TOKENS
        sizes = {name: str(max(floor, blocks * block_bytes)) for name, (floor, blocks) in DEFAULT_SIZES.items()}
        environ = {**sizes, **os.environ, "TIERING_BENCH_DIR": scratch}
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
        if args.flood:
            requests = with_flood(requests, args.flood)
        requests = with_hints(requests, args.hints)
        longest = max(len(request.hash_ids) for request in requests)
        prefix_cache = args.gpu_blocks != 0
        gpu_blocks = args.gpu_blocks or max(64 if prefix_cache else 1, longest)
        if gpu_blocks < longest:
            raise ValueError(f"--gpu-cache-blocks {gpu_blocks} cannot hold the longest prompt ({longest} blocks)")
        from tiering.benchmarks.loadgen.engine import SimulatedEngine

        for tier in config.secondary_tiers:  # what runs killed before their end left
            if tier["type"] == "file":
                runs.sweep(Path(tier["root_dir"]))
        engine = SimulatedEngine(config, layout, gpu_blocks, f"bench-{os.getpid()}", args.seed, prefix_cache)
        exporter, claim = None, runs.RunClaim()
        try:
            if not args.warm_start:
                for tier in engine.manager.secondary_tiers:
                    if isinstance(tier, BlockStoreTier) and isinstance(tier.store, FileBlockStore):
                        claim.claim(tier.store.directory)
            if args.metrics_port is not None:
                from tiering.engine.metrics import PrometheusExporter

                try:
                    exporter = PrometheusExporter(args.metrics_port)
                except OSError as exc:
                    raise ValueError(
                        f"--metrics-port: {describe_bind_error(exc, '127.0.0.1', args.metrics_port)}"
                    ) from None
                exporter.attach(engine.manager)
                console.print(f"metrics on http://127.0.0.1:{exporter.port}/metrics", highlight=False)
            loop = SchedulerLoop(engine, verify=args.verify)
            columns = (TextColumn("replaying"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
            try:
                with Progress(*columns, console=console, transient=True, disable=args.quiet) as progress:
                    task = progress.add_task("replay", total=len(requests))
                    interrupts.replaying = True
                    try:
                        tick = ProgressLines(len(requests)) if not (console.is_terminal or args.quiet) else None

                        def advance() -> None:
                            progress.advance(task)
                            if tick is not None:
                                tick()

                        stats = loop.run(requests, args.time_scale, advance, interrupts.stop)
                    finally:
                        interrupts.replaying = False
            except Exception as exc:
                raise EngineFailure(f"{type(exc).__name__}: {exc}") from exc
            replayed = requests[: stats.requests]  # all of them, unless interrupted
            all_blocks = engine.capacity_blocks(gpu_blocks if prefix_cache else 0)
            bounds = {
                "unbounded": unbounded_hit_rate(replayed),
                "prefix": prefix_hit_rate(replayed),
                "belady": belady_hit_rate(replayed, engine.spec.num_blocks),
                "belady_all_tiers": None if all_blocks is None else belady_hit_rate(replayed, all_blocks),
                "all_tiers_blocks": all_blocks,
            }
            inputs = {
                "config": config.model_dump(),
                "trace": str(args.trace) if args.trace else None,
                "workload": None if args.trace else args.workload,
                "max_requests": args.max_requests,
                "bytes_per_block": engine.spec.bytes_per_block,
                "model": args.model,
                "gpu_blocks": gpu_blocks,
                "gpu_prefix_cache": prefix_cache,
                "warm_start": args.warm_start,
                "namespace": layout.model,
                "time_scale": args.time_scale,
                "flood": args.flood,
                "hints": args.hints,
                "seed": args.seed,
                "device": str(engine.device),
                "trace_span_s": (replayed[-1].timestamp_ms - replayed[0].timestamp_ms) / 1000.0 if replayed else 0.0,
            }
            report = build_report(stats, engine, bounds, inputs)
            if not args.warm_start and report["hit_rate"]["total"] > bounds["prefix"] + 1e-9:
                raise EngineFailure(
                    f"hit rate {report['hit_rate']['total']:.4f} above its bound {bounds['prefix']:.4f}"
                )
        finally:
            if exporter is not None:
                exporter.close()
            try:
                if not (args.keep or args.warm_start):
                    engine.remove_namespaces()
                claim.release()  # what --keep kept is never swept
            finally:
                engine.shutdown()
    if args.plot:
        plot(stats, list(report["hit_rate"])[:-1], str(args.plot))
    return report


def _print_error(console: Console, kind: str, exc: BaseException) -> None:
    """One line on stderr: the kind of failure and what went wrong."""
    console.print(f"[bold red]tiering-bench: {kind}:[/] {escape(describe(exc))}", highlight=False, soft_wrap=True)


def main(argv: list[str] | None = None) -> int:
    """Run the command; returns the exit status.

    Raises:
        ImportError: torch (the ``bench`` extra) is not installed.
    """
    args = parse_args(argv)
    logging.basicConfig(
        level="WARNING" if args.quiet else args.log_level,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    console = Console(stderr=True)
    # From here on a signal ends the run with its own exit status, whenever it comes; an
    # interrupted or terminated run still shuts the engine down (its shared memory, its tier
    # threads); a run killed outright leaves no region either (see tiering.cpu.shared_region).
    interrupts = Interrupts()
    previous = {signum: signal.signal(signum, interrupts) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        check_output(args.output, "--output")  # first: a run stopped while starting leaves no old file behind
        check_output(args.plot, "--plot")
        import tiering.benchmarks.loadgen.engine  # noqa: F401 - torch: loaded only once there is work to do

        report = run(args, console, interrupts)
    except KeyboardInterrupt:  # before or after the replay itself: nothing to report
        console.print("[bold red]tiering-bench: interrupted[/]", highlight=False)
        return interrupts.exit_status()
    except (ConfigError, ValueError, OSError, RegionInUseError) as exc:
        _print_error(console, "error", exc)
        return EXIT_BAD_INPUT
    except ImportError as exc:
        if (exc.name or "").partition(".")[0] in BENCH_MODULES:
            raise  # the bench extra is missing: `tiering.benchmarks.loadgen.main` says what to install
        _print_error(console, "error", exc)  # a tier's extra (s3, metrics), named by the tier
        return EXIT_BAD_INPUT
    except Exception as exc:  # EngineFailure, or a bug: one line, the traceback at debug level
        logger.debug("engine failure", exc_info=True)
        _print_error(console, "engine failure", exc)
        return EXIT_ENGINE_FAILED
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    print_summary(report, Console())
    if args.output:
        args.output.write_text(json.dumps(report, indent=2))
    if report["interrupted"]:
        console.print(f"[bold red]tiering-bench: interrupted after {report['requests']} requests[/]", highlight=False)
        return interrupts.exit_status()
    return EXIT_VERIFY_FAILED if report["verify_failures"] else EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
