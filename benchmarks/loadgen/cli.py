"""``tiering-bench``: replay real or synthetic traffic through the real engine.

With no arguments it runs a built-in default: a CPU tier and a file tier (in a temporary
directory) under a synthetic multi-turn chat workload, in well under a minute.

    tiering-bench                                       # the built-in default
    tiering-bench --config engine.yaml --trace traces/conversation_trace.jsonl.gz --verify --output run.json

Exit status: 0 ok; 1 a loaded block failed verification (a wrong byte); 2 bad input (a
config, trace, option or storage that cannot be used: one line says what and where);
3 the engine failed while replaying.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
from pathlib import Path

from rich.console import Console
from rich.markup import escape

import tiering
from tiering import ConfigError, RegionInUseError
from tiering.benchmarks.args import (
    check_output,
    count_arg,
    hints_arg,
    natural_arg,
    port_arg,
    positive_arg,
    rate_arg,
    size_arg,
)
from tiering.benchmarks.loadgen import BENCH_MODULES
from tiering.benchmarks.loadgen.replay import Interrupts, run
from tiering.benchmarks.loadgen.report import print_summary
from tiering.benchmarks.loadgen.workload import WORKLOADS
from tiering.errors import describe
from tiering.spec import MODEL_PRESETS

EXIT_OK, EXIT_VERIFY_FAILED, EXIT_BAD_INPUT, EXIT_ENGINE_FAILED = 0, 1, 2, 3  # a signal: 128 + its number
EXIT_STATUS = """\
other commands:
  tiering-bench overload ...   an offered store rate ramped past what a tier absorbs (--help there)
  tiering-bench serve ...      time to first token under a real vLLM server (--help there)

exit status:
  0  ok
  1  a loaded block failed verification (a wrong byte)
  2  bad input: a config, trace, option or storage that cannot be used
  3  the engine failed while replaying, or its hit rate exceeded the repeated-prefix bound
  130  interrupted by Ctrl-C (143: by SIGTERM): the partial results were still written
"""
logger = logging.getLogger("tiering.bench")


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
        type=hints_arg,
        default="none",
        metavar="HINTS",
        help="retention hints the requests send (tiering.eviction.retention): 'continuation' (retain 5m while the "
        "conversation has a later turn, release at its last), 'retain:DURATION' (every request retains: 5m, 1h, "
        "300), 'release' (every request releases), 'none' (default); deadlines follow the trace's clock",
    )
    parser.add_argument("--verify", action="store_true", help="check every loaded byte")
    parser.add_argument("--output", "--json", type=Path, metavar="FILE", help="write the results as JSON to FILE")
    parser.add_argument("--plot", type=Path, help="write hit rates over the run as PNG (none if no request ran)")
    parser.add_argument("--seed", type=natural_arg, default=0, help="seed of synthetic workloads and payloads (>= 0)")
    parser.add_argument(
        "--metrics-port", type=port_arg, help="serve Prometheus metrics on 127.0.0.1:PORT while running"
    )
    return parser.parse_args(argv)


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
    # From here on a signal ends the run with its own exit status, whenever it comes (also when
    # the stop it asked for cut a step in half and that raised: the error is printed); an
    # interrupted or terminated run still shuts the engine down (its shared memory, its tier
    # threads); a run killed outright leaves no region either (see tiering.cpu.shared_region).
    interrupts = Interrupts()
    previous = {signum: signal.signal(signum, interrupts) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        with interrupts.held():  # first, and both: a run stopped while starting leaves no old file behind
            check_output(args.output, "--output")
            check_output(args.plot, "--plot")
        report = run(args, console, interrupts)  # imports torch once the inputs are checked
    except KeyboardInterrupt:  # before or after the replay itself: nothing to report
        console.print("[bold red]tiering-bench: interrupted[/]", highlight=False)
        return interrupts.exit_status()
    except (ConfigError, ValueError, OSError, RegionInUseError) as exc:
        _print_error(console, "error", exc)
        return interrupts.exit_status() if interrupts.received else EXIT_BAD_INPUT
    except ImportError as exc:
        if (exc.name or "").partition(".")[0] in BENCH_MODULES:
            raise  # the bench extra is missing: `tiering.benchmarks.loadgen.main` says what to install
        _print_error(console, "error", exc)  # a tier's extra (s3, metrics), named by the tier
        return interrupts.exit_status() if interrupts.received else EXIT_BAD_INPUT
    except Exception as exc:  # EngineFailure, or a bug: one line, the traceback at debug level
        logger.debug("engine failure", exc_info=True)
        _print_error(console, "engine failure", exc)
        return interrupts.exit_status() if interrupts.received else EXIT_ENGINE_FAILED
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
