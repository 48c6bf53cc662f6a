"""``tiering-bench serve``: time to first token and throughput of a real vLLM server, with
and without this engine, on a request trace or a built-in synthetic workload.

    tiering-bench serve --trace traces/conversation_trace.jsonl.gz --max-requests 200 --output serve.json

Runs in the environment of the third set-up command (vLLM installed). It makes a local
Llama (seeded random weights, no download), builds token prompts from the trace's block ids
(`tiering.benchmarks.serve.workload`), and sends them to vLLM's OpenAI server at the
trace's arrival times, once per configuration (`tiering.benchmarks.serve.run`), each on a
fresh server. The table shows TTFT percentiles of every request and of the requests whose
prefix an earlier request shared, throughput, and where prompt tokens came from; a second
table splits the TTFT of the requests that loaded blocks from the engine into its parts
(`tiering.benchmarks.serve.breakdown`, from the engine's ``request_log``).

With ``--replicas N`` it measures a fleet instead (`tiering.benchmarks.serve.fleet`): N
servers of the model behind the client, each pinned to its share of the cores, with private
file tiers or one tier they share (``--shared-tier``), the requests routed round-robin, by
conversation or by the replicas' KV events (``--routing``); the table adds a row per replica.
``--scale-out-at``, ``--kill-replica-at`` and ``--rolling-restart-at`` measure a moment that is
not steady, its requests apart (`tiering.benchmarks.serve.scenarios`).

    tiering-bench serve --workload multi-turn --replicas 2 --routing round-robin,kv-events --output fleet.json

Exit status: 0 ok; 2 bad input (an option or trace that cannot be used); 3 a server failed.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import logging
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from rich.console import Console

from tiering.benchmarks.args import check_output, hints_arg, positive_arg, rate_arg, size_arg
from tiering.benchmarks.loadgen.workload import HOT_SYSTEM_BLOCKS, WORKLOADS, read_trace, synthetic, with_hints
from tiering.benchmarks.serve.fleet import FLEET_CONFIGURATIONS, SHARED_TIERS, Fleet, run_fleet, shared_backing
from tiering.benchmarks.serve.model import SHAPES, VOCAB, make_model
from tiering.benchmarks.serve.report import build_report, observed_prefill_rate, plot, print_summary, summarize
from tiering.benchmarks.serve.restart import LASTING, run_restarts, split
from tiering.benchmarks.serve.routing import LOAD_WEIGHT, ROUTINGS, WEIGHTS, weights_arg
from tiering.benchmarks.serve.run import CONFIGURATIONS, Setup, run_configuration, s3_server
from tiering.benchmarks.serve.scenarios import FIRST_REQUESTS, SCENARIOS, Scenario
from tiering.benchmarks.serve.server import CONNECTORS
from tiering.benchmarks.serve.workload import conversations, prompts, reusable_prefix_tokens, sample_conversations

logger = logging.getLogger("tiering.bench")


def _names(text: str, known: dict[str, str] | tuple[str, ...]) -> list[str] | None:
    """The comma-separated names of `text` if every one is `known`, else None."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    return names if names and all(name in known for name in names) else None


def _weights(text: str) -> dict[str, float]:
    try:
        return weights_arg(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _routings(text: str) -> list[str]:
    names = _names(text, ROUTINGS)
    if names is None:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of {', '.join(ROUTINGS)}; got {text!r}")
    return names


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="tiering-bench serve",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    for add in (_workload_arguments, _configuration_arguments, _server_arguments, _output_arguments):
        add(parser)
    args = parser.parse_args(argv)
    _check(parser, args)
    return args


def _workload_arguments(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--trace", type=Path, help="Mooncake JSONL trace")
    source.add_argument("--workload", choices=WORKLOADS, help="a built-in synthetic workload instead (seed 0)")
    parser.add_argument("--max-requests", type=positive_arg, default=100, help="requests to send (default 100)")
    parser.add_argument(
        "--conversation-sample",
        type=positive_arg,
        default=1,
        metavar="N",
        help="keep one conversation in N, whole, before --max-requests (default 1: every request)",
    )
    parser.add_argument(
        "--time-scale",
        type=rate_arg,
        default=1.0,
        help="seconds per trace second (default 1: the trace's own pace; 2: half its speed; 0: all at once)",
    )


def _configuration_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--configurations",
        help=f"comma-separated, default all: one server, {', '.join(CONFIGURATIONS)}; with --replicas, "
        f"{', '.join(FLEET_CONFIGURATIONS)}",
    )
    parser.add_argument(
        "--replicas", type=positive_arg, default=1, help="servers of the model behind the client (default 1)"
    )
    parser.add_argument(
        "--shared-tier", choices=SHARED_TIERS, default="file", help="the tier of the fleet's shared configuration"
    )
    parser.add_argument(
        "--routing",
        type=_routings,
        default=["round-robin"],
        help=f"how the fleet's requests reach replicas, comma-separated: {', '.join(ROUTINGS)} (default round-robin)",
    )
    parser.add_argument(
        "--router-weights",
        type=_weights,
        default={},
        metavar="PLACE=WEIGHT,...",
        help="kv-events routing: a block's weight by where a replica holds it (default "
        + ", ".join(f"{where}={weight:g}" for where, weight in WEIGHTS.items())
        + ")",
    )
    parser.add_argument(
        "--router-load-weight",
        type=rate_arg,
        default=LOAD_WEIGHT,
        metavar="BLOCKS",
        help=f"kv-shared routing: prefix credit a request in flight on a replica costs it (default {LOAD_WEIGHT:g})",
    )
    moment = parser.add_mutually_exclusive_group()
    moment.add_argument(
        "--scale-out-at",
        type=rate_arg,
        metavar="SECONDS",
        help=f"fleet: the last replica joins at this time of the replay; its first {FIRST_REQUESTS} requests apart",
    )
    moment.add_argument(
        "--kill-replica-at",
        type=rate_arg,
        metavar="SECONDS",
        help="fleet: the last replica is killed (SIGKILL) at this time of the replay; the next turn of each "
        "conversation it served, apart",
    )
    moment.add_argument(
        "--rolling-restart-at",
        type=rate_arg,
        metavar="SECONDS",
        help="fleet: from this time of the replay each replica in turn is drained, stopped (SIGTERM) and started "
        "again over its tiers; the requests until the last is back, apart",
    )


def _server_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model-shape", choices=sorted(SHAPES), default="bench", help="the local model (default bench)"
    )
    parser.add_argument("--tokens-per-id", type=positive_arg, default=32, help="prompt tokens per trace block id")
    parser.add_argument("--block-size", type=positive_arg, default=32, help="vLLM's block, tokens (a multiple of 32)")
    parser.add_argument("--max-model-len", type=positive_arg, default=2048, help="prompt tokens are cut to fit it")
    parser.add_argument("--max-tokens", type=positive_arg, default=4, help="output tokens per request (default 4)")
    parser.add_argument("--max-concurrency", type=positive_arg, help="requests in flight at most (default: no limit)")
    parser.add_argument("--gpu-blocks", type=positive_arg, default=80, help="vLLM's own KV cache, blocks (default 80)")
    parser.add_argument("--cpu-bytes", type=size_arg, default=256 << 20, help="the CPU tier (default 256MiB)")
    parser.add_argument(
        "--b-extra-bytes",
        type=size_arg,
        help="the bytes b adds to vLLM's cache (default: --cpu-bytes, the memory of the engine's CPU tier)",
    )
    parser.add_argument(
        "--slow-latency-s", type=rate_arg, default=0.5, help="the slow tier's latency per operation (f, g; default 0.5)"
    )
    parser.add_argument(
        "--recompute-tokens-per-s",
        type=rate_arg,
        help="the prefill rate g is configured with (default: the fastest prefill observed in a, which must run first)",
    )
    parser.add_argument(
        "--connector",
        choices=CONNECTORS,
        default="KVTieringConnector",
        help="the connector the engine runs behind (c-g): its own, whose loads feed the step that schedules them, "
        "or vLLM's",
    )
    parser.add_argument(
        "--hints",
        type=hints_arg,
        default="none",
        metavar="HINTS",
        help="retention hints the requests send in their body's kv_transfer_params (tiering.eviction.retention), every "
        "configuration alike, as tiering-bench --hints: 'continuation', 'retain:DURATION', 'release', 'none' (default)",
    )
    parser.add_argument(
        "--restart-at",
        type=rate_arg,
        metavar="SECONDS",
        help="stop the server gracefully at this time of the replay, start it again over its tiers and time the "
        "first 50 requests after, against a cold restart and none (configurations d, f or g; default d)",
    )
    parser.add_argument(
        "--restart-signal",
        choices=("term", "kill"),
        default="term",
        help="how --restart-at stops the server: 'term' (default), gracefully; 'kill', SIGKILL to all its processes, "
        "and restarted warm from its tiers alone and from the CPU tier it left too (cpu_tier.survive_crash)",
    )


def _output_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--work-dir", type=Path, help="the model, tiers and server logs (default: a temporary one)")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    parser.add_argument("--output", "--json", type=Path, metavar="FILE", help="write the results as JSON to FILE")
    parser.add_argument("--plot", type=Path, help="write the TTFT CDF as PNG")
    parser.add_argument("--quiet", action="store_true", help="only warnings and errors")


def _check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The rules between options (each broken one a usage error), and the configurations
    resolved to names."""
    known = FLEET_CONFIGURATIONS if args.replicas > 1 else CONFIGURATIONS
    if args.replicas < 2 and (scenario := _scenario(args)) is not None:
        parser.error(f"--{scenario.kind}-at: a fleet's moment, with --replicas 2 or more")
    if args.restart_signal != "term" and args.restart_at is None:
        parser.error(f"--restart-signal {args.restart_signal}: the signal of --restart-at, which is missing")
    if args.restart_at is not None:
        if args.replicas > 1:
            parser.error("--restart-at: one server only (a fleet's restart is not measured yet)")
        known = {name: CONFIGURATIONS[name] for name in LASTING}
        args.configurations = args.configurations or "d"
    names = list(known) if args.configurations is None else _names(args.configurations, known)
    if names is None:
        listed = ", ".join(f"{name} ({what})" for name, what in known.items())
        parser.error(f"--configurations: expected a comma-separated list of {listed}; got {args.configurations!r}")
    args.configurations = names
    if "g" in names and not args.recompute_tokens_per_s and ("a" not in names or names.index("a") > names.index("g")):
        parser.error("configuration g needs --recompute-tokens-per-s, or configuration a before it to measure it")


def _scenario(args: argparse.Namespace) -> Scenario | None:
    """The fleet's moment the command line asks for (``--scale-out-at``, ``--kill-replica-at``), or None."""
    for kind in SCENARIOS:
        at_s = getattr(args, kind.replace("-", "_") + "_at")
        if at_s is not None:
            return Scenario(kind, at_s, max(args.replicas, 2))
    return None


def _setup(args: argparse.Namespace, model: Path, kv_bytes_per_token: int, work_dir: Path) -> Setup:
    """What every configuration's server is started with, from the command line."""
    return Setup(
        model,
        kv_bytes_per_token,
        args.block_size,
        args.max_model_len,
        args.gpu_blocks,
        args.cpu_bytes,
        work_dir,
        args.slow_latency_s,
        args.recompute_tokens_per_s,
        args.connector,
        args.b_extra_bytes,
    )


def _log_summary(name: str, summary: dict) -> None:
    """One line per configuration as it ends: its TTFT and the prompt tokens it computed."""
    logger.info(
        "configuration %s: TTFT p50 %.0f ms, of requests with a reusable prefix %.0f ms; "
        "%d of %d prompt tokens computed",
        name,
        (summary["ttft_s"]["p50"] or 0) * 1000,
        (summary["ttft_reusable_s"]["p50"] or 0) * 1000,
        summary["computed_tokens"],
        summary["prompt_tokens"],
    )


@dataclasses.dataclass
class Workload:
    """The requests: token prompts, arrival times (s), conversations, retention hints."""

    prompts: list[list[int]]
    arrivals_s: list[float]
    conversation_of: list[int]
    hints: list[dict | None]


def _server_runs(args: argparse.Namespace, setup: Setup, work: Workload, runs: list[dict]) -> Iterator[dict]:
    """Each configuration on a server of its own (``g`` after ``a``: its prefill rate, from `runs`)."""
    with s3_server("e" in args.configurations) as endpoint:
        for name in args.configurations:
            if name == "g" and not setup.recompute_tokens_per_s:
                observed = observed_prefill_rate(next(run for run in runs if run["name"] == "a"))
                setup = dataclasses.replace(setup, recompute_tokens_per_s=observed)
            yield run_configuration(
                name, setup, work.prompts, work.arrivals_s, args.max_tokens, args.max_concurrency, endpoint, work.hints
            )


def _restart_runs(args: argparse.Namespace, setup: Setup, work: Workload) -> Iterator[dict]:
    """Each configuration with no restart, a warm and a cold one (`tiering.benchmarks.serve.restart`)."""
    for name in args.configurations:
        yield from run_restarts(
            name,
            setup,
            work.prompts,
            work.arrivals_s,
            args.restart_at,
            args.max_tokens,
            args.max_concurrency,
            None,
            kill=args.restart_signal == "kill",
        )


def _fleet_runs(args: argparse.Namespace, setup: Setup, work: Workload) -> Iterator[dict]:
    """Each fleet configuration under each routing, on fresh replicas."""
    fleet = Fleet(args.replicas, args.shared_tier, args.router_weights, args.router_load_weight, _scenario(args))
    with shared_backing(args.shared_tier, "shared" in args.configurations) as backing:
        for name in args.configurations:
            for routing in args.routing:
                yield run_fleet(
                    name,
                    routing,
                    fleet,
                    setup,
                    work.prompts,
                    work.arrivals_s,
                    work.conversation_of,
                    args.max_tokens,
                    args.max_concurrency,
                    backing,
                    work.hints,
                )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if importlib.util.find_spec("vllm") is None or importlib.util.find_spec("transformers") is None:
        print(
            "tiering-bench serve needs vLLM: run it in the environment of README's third set-up command (.venv-vllm)",
            file=sys.stderr,
        )
        return 2
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO, format="%(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request otherwise
    try:
        check_output(args.output, "--output")
        check_output(args.plot, "--plot")
        source = read_trace(args.trace) if args.trace else synthetic(args.workload, args.max_requests)
        shared_ids = HOT_SYSTEM_BLOCKS if args.workload == "hot-prefix" else 1  # ids every conversation starts with
        sampled = sample_conversations(source, args.conversation_sample, shared_ids)
        requests = with_hints(sampled[: args.max_requests], args.hints)
    except (ValueError, OSError) as exc:
        print(f"tiering-bench serve: {exc}", file=sys.stderr)
        return 2
    work_dir = args.work_dir or Path(tempfile.mkdtemp(prefix="tiering-serve-"))
    work_dir.mkdir(parents=True, exist_ok=True)
    try:
        shape = SHAPES[args.model_shape]
        model = work_dir / f"llama-{args.model_shape}"
        if not (model / "config.json").exists():
            make_model(model, shape, max_len=args.max_model_len)
        token_prompts = prompts(requests, args.tokens_per_id, args.max_model_len - args.max_tokens, VOCAB)
        first = requests[0].timestamp_ms if requests else 0.0
        arrivals = [(r.timestamp_ms - first) / 1000 * args.time_scale for r in requests]
        reusable = reusable_prefix_tokens(token_prompts, args.block_size)
        setup = _setup(args, model, shape.kv_bytes_per_token, work_dir)
        hints = [request.hint for request in requests]
        runs: list[dict] = []

        def report() -> dict:
            inputs = {key: str(value) if isinstance(value, Path) else value for key, value in vars(args).items()}
            inputs |= {
                "kv_bytes_per_token": shape.kv_bytes_per_token,
                "extra_blocks_of_b": setup.extra_blocks,
                "recompute_tokens_per_s": next(  # g's, observed in a where not given
                    (run["recompute_tokens_per_s"] for run in runs if run.get("recompute_tokens_per_s")),
                    setup.recompute_tokens_per_s,
                ),
            }
            return build_report(runs, reusable, inputs)

        workload = Workload(token_prompts, arrivals, conversations(requests, shared_ids), hints)
        if args.restart_at is not None:
            try:
                split(arrivals, args.restart_at)  # before any server starts
            except ValueError as exc:
                print(f"tiering-bench serve: {exc}", file=sys.stderr)
                return 2
            runner = _restart_runs(args, setup, workload)
        elif args.replicas > 1:
            runner = _fleet_runs(args, setup, workload)
        else:
            runner = _server_runs(args, setup, workload, runs)
        for run in runner:
            runs.append(run)
            _log_summary(run["name"], summarize(run, reusable))
            if args.output:  # after each configuration: a long run stopped keeps what it measured
                args.output.write_text(json.dumps(report(), indent=1))
    except RuntimeError as exc:
        print(f"tiering-bench serve: {exc}", file=sys.stderr)
        return 3
    finally:
        if not args.keep and args.work_dir is None:
            shutil.rmtree(work_dir, ignore_errors=True)
    results = report()
    console = Console()
    print_summary(results, Console(width=max(console.width, 140)))  # a markdown table: rows never wrap
    if args.plot:
        plot(results, str(args.plot))
    return 0
