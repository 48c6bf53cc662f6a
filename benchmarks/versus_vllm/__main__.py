"""``python -m tiering.benchmarks.versus_vllm``: ours beside vLLM 0.33's own KV offloading.

    python -m tiering.benchmarks.versus_vllm sched --rounds 7
    python -m tiering.benchmarks.versus_vllm files --rounds 3 --dir /path/on/the/disk
    python -m tiering.benchmarks.versus_vllm overload --rounds 3 --dir /path/on/the/disk

Fetches vLLM's wheel once (`tree`), then runs each side in a child process of its own
(`sched`: the scheduler-thread cost of each manager call, per policy; `files`: the file
tier's GB/s against a raw pool, per block size and open mode; `overload`: stores offered
beyond what a file tier writes), the sides interleaved and their order swapped every other
round, and prints ours over vLLM's: the median of the rounds' ratios, with the lowest and
highest (for `overload`, each side's medians).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from rich.table import Table

from tiering.benchmarks.args import (
    DURATION_HELP,
    duration_arg,
    format_size,
    names_arg,
    positive_arg,
    rate_arg,
    sizes_arg,
)
from tiering.benchmarks.json_report import add_json_argument, open_report
from tiering.benchmarks.versus_vllm import sched, tree

SIDES = ("ours", "vllm")
FILE_BLOCKS = {64 << 10: 2048, 2 << 20: 256}  # blocks per run of each size: 128 and 512 MiB


def run_side(side: str, module: str, arguments: list[str], vllm_tree: Path) -> dict[str, float]:
    """One child process's JSON (`sched.main`, `files`); vLLM's side imports from `vllm_tree`.

    Raises:
        RuntimeError: the child failed (its stderr's end in the message).
    """
    environment = dict(os.environ)
    if side.startswith("vllm"):
        environment["PYTHONPATH"] = os.pathsep.join(filter(None, [str(vllm_tree), environment.get("PYTHONPATH")]))
    command = [sys.executable, "-m", f"tiering.benchmarks.versus_vllm.{module}", side, *arguments]
    done = subprocess.run(command, capture_output=True, text=True, env=environment)
    if done.returncode != 0:
        raise RuntimeError(f"{side} {' '.join(arguments)}: {done.stderr.strip()[-2000:]}")
    return json.loads(done.stdout)


Runs = dict[tuple[str, str], list[dict[str, float]]]
"""(side, case) -> each round's results, in the order the rounds ran."""


def interleaved(
    rounds: int, cases: list[tuple[str, list[str]]], module: str, vllm_tree: Path, sides: tuple[str, ...] = SIDES
) -> Runs:
    """Every case's results for each side, over `rounds` rounds, sides swapped every other round."""
    runs: Runs = {}
    for round_ in range(rounds):
        for name, arguments in cases:
            for side in sides if round_ % 2 == 0 else sides[::-1]:
                runs.setdefault((side, name), []).append(run_side(side, module, arguments, vllm_tree))
    return runs


def spread(ratios: list[float]) -> str:
    return f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f}x)"


def sched_table(args: argparse.Namespace, vllm_tree: Path) -> tuple[Table, Runs]:
    cases = [(policy, [policy, str(args.repeats)]) for policy in args.policies]
    runs = interleaved(args.rounds, cases, "sched", vllm_tree)
    table = Table(title=f"Scheduler-thread cost, ours and vLLM {tree.VLLM_VERSION}'s, {args.rounds} rounds (us)")
    for column in ("policy", "call", "ours", f"vLLM {tree.VLLM_VERSION}", "ours / vLLM (lowest-highest)"):
        table.add_column(column, justify="left" if column in ("policy", "call") else "right")
    for policy in args.policies:
        for call in sched.CALLS:
            mine, theirs = ([run[call] for run in runs[(side, policy)]] for side in SIDES)
            ratios = [m / t for m, t in zip(mine, theirs, strict=True)]
            medians = (f"{statistics.median(mine):.2f}", f"{statistics.median(theirs):.2f}")
            table.add_row(policy, call, *medians, spread(ratios))
    return table, runs


def files_table(args: argparse.Namespace, vllm_tree: Path) -> tuple[Table, Runs]:
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="versus-vllm-") as scratch:
        cases = [
            (f"{size} {mode}", [mode, str(size), str(FILE_BLOCKS.get(size, max(16, (256 << 20) // size))), scratch])
            for size in args.block_sizes
            for mode in args.modes
        ]
        runs = interleaved(args.rounds, cases, "files", vllm_tree)
    title = f"File tier over a raw pool, ours and vLLM {tree.VLLM_VERSION}'s fs tier, {args.rounds} rounds"
    table = Table(title=title)
    columns = ("block", "mode", "op", "ours / raw", f"vLLM {tree.VLLM_VERSION} / raw", "ours / vLLM (lowest-highest)")
    for column in columns:
        table.add_column(column, justify="left" if column in ("block", "mode", "op") else "right")
    for name, _ in cases:
        size, mode = name.split()
        for op in ("store", "load"):
            mine, theirs = ([run[f"raw {op}"] / run[op] for run in runs[(side, name)]] for side in SIDES)
            ratios = [m / t for m, t in zip(mine, theirs, strict=True)]
            cells = (f"{statistics.median(mine):.2f}x", f"{statistics.median(theirs):.2f}x", spread(ratios))
            table.add_row(format_size(int(size)), mode, op, *cells)
    return table, runs


OVERLOAD_SIDES = ("ours", "vllm", "vllm+bp")


def overload_table(args: argparse.Namespace, vllm_tree: Path) -> tuple[Table, Runs]:
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="versus-vllm-") as scratch:
        cases = [("ramp", [str(args.gbps), str(args.seconds), scratch])]
        runs = interleaved(args.rounds, cases, "overload", vllm_tree, OVERLOAD_SIDES)
    title = (
        f"{args.gbps:g} GB/s of 4 MiB stores offered to a file tier, {args.seconds:g} s, ours and vLLM "
        f"{tree.VLLM_VERSION}'s (+bp: its backpressure detector), medians of {args.rounds} rounds"
    )
    table = Table(title=title)
    names = ("step p50 us", "step p99 us", "refused", "written GB/s", "not cascaded")
    for column in ("side", *names):
        table.add_column(column, justify="left" if column == "side" else "right")
    for side in OVERLOAD_SIDES:
        medians = {name: statistics.median(run[name] for run in runs[(side, "ramp")]) for name in names}
        table.add_row(side, *(f"{value:.2f}" if "GB/s" in name else f"{value:,.0f}" for name, value in medians.items()))
    return table, runs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tiering.benchmarks.versus_vllm",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--cache", type=Path, default=tree.default_cache(), help="where vLLM's wheel is kept")
    commands = parser.add_subparsers(dest="command", required=True)
    defaults = argparse.ArgumentDefaultsHelpFormatter
    cost = commands.add_parser("sched", help="the scheduler-thread cost of each call", formatter_class=defaults)
    cost.add_argument("--rounds", type=positive_arg, default=7, help="interleaved rounds of every side and policy")
    cost.add_argument("--repeats", type=positive_arg, default=3, help="fresh managers per child (median kept)")
    cost.add_argument("--policies", type=names_arg(("lru", "arc")), default="lru,arc", help="eviction policies")
    files = commands.add_parser("files", help="the file tier's GB/s against a raw pool", formatter_class=defaults)
    files.add_argument("--dir", type=Path, required=True, help="a directory on the disk to measure (not tmpfs)")
    files.add_argument("--rounds", type=positive_arg, default=3, help="interleaved rounds of every side and case")
    files.add_argument("--block-sizes", type=sizes_arg, default="2MiB,64KiB", help="block sizes")
    files.add_argument("--modes", type=names_arg(("direct", "buffered")), default="direct,buffered", help="open modes")
    ramp = commands.add_parser("overload", help="stores offered beyond a file tier's speed", formatter_class=defaults)
    ramp.add_argument("--dir", type=Path, required=True, help="a directory on the disk to measure (not tmpfs)")
    ramp.add_argument("--rounds", type=positive_arg, default=3, help="interleaved rounds of every side")
    ramp.add_argument("--gbps", type=rate_arg, default=2.0, help="GB/s of stores offered")
    ramp.add_argument("--seconds", type=duration_arg, default=10.0, help=f"each run's length, {DURATION_HELP}")
    for command in (cost, files, ramp):
        add_json_argument(command)
    parser.epilog = "".join(command.format_usage() for command in (cost, files, ramp))
    args = parser.parse_args(argv)
    if args.command in ("files", "overload") and not args.dir.is_dir():
        parser.error(f"--dir: {args.dir} is not a directory")
    report = open_report(parser, args, f"versus_vllm {args.command}", argv)
    try:
        vllm_tree = tree.build(args.cache)
        table, runs = {"sched": sched_table, "files": files_table, "overload": overload_table}[args.command](
            args, vllm_tree
        )
    except RuntimeError as exc:
        print(f"versus_vllm: {exc}", file=sys.stderr)
        return 2
    report.add("vllm", tree.VLLM_VERSION)
    report.print(table, runs)
    report.write()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
