"""``python -m tiering.benchmarks.versus_vllm``: ours beside vLLM 0.33's own KV offloading.

    python -m tiering.benchmarks.versus_vllm --rounds 7

Fetches vLLM's wheel once (`tree`), then runs `sched` for each side and policy in a child
process of its own, the sides interleaved and their order swapped every other round, and
prints each call's median microseconds and ours over vLLM's: the median of the rounds'
ratios, with the lowest and highest.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from tiering.benchmarks.args import names_arg, positive_arg
from tiering.benchmarks.versus_vllm import sched, tree

SIDES = ("ours", "vllm")


def run_side(side: str, policy: str, repeats: int, vllm_tree: Path) -> dict[str, float]:
    """One child process's medians (`sched.main`); vLLM's side imports from `vllm_tree`.

    Raises:
        RuntimeError: the child failed (its stderr's end in the message).
    """
    environment = dict(os.environ)
    if side == "vllm":
        environment["PYTHONPATH"] = os.pathsep.join(filter(None, [str(vllm_tree), environment.get("PYTHONPATH")]))
    command = [sys.executable, "-m", "tiering.benchmarks.versus_vllm.sched", side, policy, str(repeats)]
    done = subprocess.run(command, capture_output=True, text=True, env=environment)
    if done.returncode != 0:
        raise RuntimeError(f"{side} {policy}: {done.stderr.strip()[-2000:]}")
    return json.loads(done.stdout)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tiering.benchmarks.versus_vllm",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--rounds", type=positive_arg, default=7, help="interleaved rounds of every side and policy")
    parser.add_argument("--repeats", type=positive_arg, default=3, help="fresh managers per child (median kept)")
    parser.add_argument("--policies", type=names_arg(("lru", "arc")), default="lru,arc", help="eviction policies")
    parser.add_argument("--cache", type=Path, default=tree.default_cache(), help="where vLLM's wheel is kept")
    args = parser.parse_args(argv)
    try:
        vllm_tree = tree.build(args.cache)
    except RuntimeError as exc:
        print(f"versus_vllm: {exc}", file=sys.stderr)
        return 2
    runs: dict[tuple[str, str], list[dict[str, float]]] = {}
    for round_ in range(args.rounds):
        for policy in args.policies:
            for side in SIDES if round_ % 2 == 0 else SIDES[::-1]:
                runs.setdefault((side, policy), []).append(run_side(side, policy, args.repeats, vllm_tree))
    table = Table(title=f"Scheduler-thread cost, ours and vLLM {tree.VLLM_VERSION}'s, {args.rounds} rounds (us)")
    for column in ("policy", "call", "ours", f"vLLM {tree.VLLM_VERSION}", "ours / vLLM (lowest-highest)"):
        table.add_column(column, justify="left" if column in ("policy", "call") else "right")
    for policy in args.policies:
        for call in sched.CALLS:
            mine, theirs = ([run[call] for run in runs[(side, policy)]] for side in SIDES)
            ratios = [m / t for m, t in zip(mine, theirs, strict=True)]
            spread = f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f}x)"
            table.add_row(policy, call, f"{statistics.median(mine):.2f}", f"{statistics.median(theirs):.2f}", spread)
    Console(width=max(Console().width, 100)).print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
