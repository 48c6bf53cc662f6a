"""Overload ramp: a store rate ramped past what a secondary tier absorbs, with and without
admission control, in one run.

Thread: a command-line tool; the main thread is the scheduler (it calls the manager, as a
serving engine's scheduler does), the tier's I/O runs on the engine's loop and pool.

The engine is a real `TieringOffloadingManager`: a shared-memory CPU tier of `--rows` rows of
`--block-bytes`, and one secondary tier (`file` in `--dir`, or an emulated device: a
`memory` tier whose every call sleeps `--device-latency-s`). A step of the scheduler (every
`--scheduler-step-s`) stores new blocks at the offered rate (GPU -> CPU, then the cascade) and looks
up a few blocks only the tier still holds (a promotion, timed from the first lookup to the
block being loadable).

First the tier's absorbed rate is measured (stores offered far beyond it, unbounded, for a
few seconds); then the ramp offers `--ramp` multiples of it for `--ramp-step-s` each. Per
step: offered and absorbed GB/s, cascades dropped, GPU stores refused by the CPU tier,
rows pinned by cascades (peak), promotion p50/p99 and the p99 of every manager call.

    python -m tiering.benchmarks.overload --dir /path/on/the/disk --plot overload.png
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import tempfile
import time
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from tiering import (
    CPUPrimaryTierOffloadingManager,
    ReqContext,
    SecondaryTierFactory,
    SharedOffloadRegion,
    TieringOffloadingManager,
    make_offload_key,
)
from tiering.benchmarks.args import DURATION_HELP, duration_arg, positive_arg, rate_arg, size_arg
from tiering.benchmarks.json_report import provenance
from tiering.engine.admission import AdmissionConfig

UNBOUNDED = {"max_rows_in_flight": 1 << 40, "max_backlog_s": None}
REQUEST_BLOCKS = 16


class Rig:
    """One engine and the scheduler loop that drives it."""

    def __init__(self, args: argparse.Namespace, admission: dict[str, Any], directory: str):
        self.args = args
        self.region = SharedOffloadRegion(f"overload-{uuid.uuid4().hex[:8]}", args.rows, args.block_bytes)
        primary = CPUPrimaryTierOffloadingManager(args.rows, self.region)
        if args.device_latency_s:
            config = {"type": "memory", "latency_s": args.device_latency_s, "max_concurrency": args.concurrency}
        else:
            config = {"type": "file", "root_dir": directory, "max_concurrency": args.concurrency}
            config["capacity_bytes"] = args.tier_bytes  # it evicts: a long ramp never fills the disk
        if not args.device_latency_s:  # a fresh namespace per run: nothing an earlier run left is a hit
            config["root_dir"] = tempfile.mkdtemp(dir=directory)
        tier = SecondaryTierFactory.create_secondary_tier(config, primary.get_kv_memoryview(), None)
        self.manager = TieringOffloadingManager(primary, [tier], admission=[AdmissionConfig(**admission)])
        self.next_block = 0
        self.call_s: dict[str, list[float]] = {}

    def close(self) -> None:
        self.manager.shutdown()

    def call(self, method: Callable[..., Any], *args: Any) -> Any:
        start = time.perf_counter()
        result = method(*args)
        self.call_s.setdefault(method.__name__, []).append(time.perf_counter() - start)
        return result

    def run(self, gbps: float, seconds: float) -> dict[str, Any]:
        """Offer `gbps` of stores for `seconds`; the step's numbers."""
        manager, args = self.manager, self.args
        before = _counters(manager)
        self.call_s = {}
        per_step = gbps * 1e9 * args.scheduler_step_s / args.block_bytes
        owed, refused, offered, pinned = 0.0, 0, 0, 0
        promotions: list[float] = []
        waiting: dict[bytes, float] = {}
        start = time.perf_counter()
        step = 0
        while time.perf_counter() - start < seconds:
            step += 1
            context = ReqContext(f"step-{step}")
            owed += per_step
            count, owed = int(owed), owed - int(owed)
            for first in range(0, count, REQUEST_BLOCKS):  # a step's stores come as requests of 16 blocks
                keys = [_key(self.next_block + i) for i in range(min(REQUEST_BLOCKS, count - first))]
                self.next_block += len(keys)
                offered += len(keys)
                out = self.call(manager.prepare_store, keys, context)
                if out is None:
                    refused += len(keys)
                else:
                    self.call(manager.complete_store, out.keys_to_store, context)
            self._promote(waiting, promotions, context)
            self.call(manager.on_schedule_end)
            pinned = max(pinned, manager.cascades.admission[0].rows_in_flight)
            delay = args.scheduler_step_s * step - (time.perf_counter() - start)
            if delay > 0:
                time.sleep(delay)
        elapsed = time.perf_counter() - start
        after = _counters(manager)
        stored = after["bytes_stored"] - before["bytes_stored"]
        return {
            "offered_gbps": offered * args.block_bytes / elapsed / 1e9,
            "absorbed_gbps": stored / elapsed / 1e9,
            "cascades_dropped": after["cascades_dropped"] - before["cascades_dropped"],
            "cascaded_blocks": after["cascades_admitted"] - before["cascades_admitted"],
            "gpu_stores_refused_pct": 100.0 * refused / max(1, offered),
            "pinned_rows_peak": pinned,
            "promotion_p50_ms": _percentile(promotions, 50, 1e3),
            "promotion_p99_ms": _percentile(promotions, 99, 1e3),
            "promotions": len(promotions),
            "scheduler_call_p99_us": _percentile([s for calls in self.call_s.values() for s in calls], 99, 1e6),
            "call_p99_us": {name: _percentile(calls, 99, 1e6) for name, calls in self.call_s.items()},
        }

    def _promote(self, waiting: dict[bytes, float], promotions: list[float], context: ReqContext) -> None:
        """Look up blocks stored long ago (only the tier has them by now): one new each step,
        and the waiting ones again, as a scheduler retries a request whose lookup said None."""
        old = self.next_block - 4 * self.args.rows
        if old > 0 and len(waiting) < 4:
            waiting.setdefault(_key(int(np.random.randint(0, old))), time.perf_counter())
        for key, since in list(waiting.items()):
            answer = self.call(self.manager.lookup, key, context)
            if answer is None:
                continue
            del waiting[key]
            if answer:
                promotions.append(time.perf_counter() - since)


def _key(i: int) -> bytes:
    return make_offload_key(i.to_bytes(16, "big"), 0)


def _counters(manager: TieringOffloadingManager) -> dict[str, int]:
    counters = next(iter(manager.get_stats()["tiers"].values()))["counters"]
    return {name: counters.get(name, 0) for name in ("bytes_stored", "cascades_dropped", "cascades_admitted")}


def _percentile(values: list[float], q: float, scale: float) -> float | None:
    """The `q`th percentile of `values` (seconds) times `scale`; None (no such event in the
    phase: printed as '-', a gap in the plot) if there are none."""
    return float(np.percentile(values, q)) * scale if values else None


def ramp(args: argparse.Namespace, admission: dict[str, Any], directory: str, absorbed: float) -> list[dict]:
    """One row per offered rate of `args.ramp` (x `absorbed` GB/s)."""
    rig = Rig(args, admission, directory)
    try:
        return [{"offered_x": x, **rig.run(x * absorbed, args.ramp_step_s)} for x in args.ramp]
    finally:
        rig.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="tiering-bench overload",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--dir", help="directory of the file tier (None: a temporary one)")
    parser.add_argument(
        "--device-latency-s", type=rate_arg, default=0.0, help="> 0: an emulated device of this latency per call"
    )
    parser.add_argument("--rows", type=positive_arg, default=256, help="CPU tier rows")
    parser.add_argument("--block-bytes", type=size_arg, default="1MiB", help="a block's (and a CPU row's) size")
    parser.add_argument("--concurrency", type=positive_arg, default=8, help="the tier's max_concurrency")
    parser.add_argument("--tier-bytes", type=size_arg, default="2GiB", help="the file tier's capacity")
    parser.add_argument("--scheduler-step-s", type=rate_arg, default=0.01, help="seconds between scheduler steps")
    parser.add_argument(
        "--ramp-step-s", type=duration_arg, default=4.0, help=f"how long each offered rate runs, {DURATION_HELP}"
    )
    parser.add_argument(
        "--ramp", type=float, nargs="+", default=[0.25, 0.5, 1.0, 1.5, 2.0, 3.0], help="offered rates, x absorbed"
    )
    parser.add_argument("--output", "--json", metavar="FILE", help="write the results as JSON to FILE (None: no file)")
    parser.add_argument("--plot", help="write a plot (PNG) here (None: no plot)")
    args = parser.parse_args(argv)
    refusals = logging.getLogger("tiering.cpu.refusals")
    level = refusals.level
    refusals.setLevel(logging.ERROR)  # the run provokes them on purpose: the tables count them
    try:
        results = run_all(args)
    finally:
        refusals.setLevel(level)
    _print(results)
    if args.output:
        with open(args.output, "w") as out:
            json.dump({**results, "source": provenance()}, out, indent=2)
    if args.plot:
        _plot(results, args.plot)
    return 0


def run_all(args: argparse.Namespace) -> dict[str, Any]:
    """The tier's absorbed rate, then the ramp with and without admission, in one directory."""
    with tempfile.TemporaryDirectory(dir=args.dir) as directory:
        os.chmod(directory, 0o700)
        calibration = Rig(args, UNBOUNDED, directory)
        try:
            absorbed = calibration.run(20.0, args.ramp_step_s)["absorbed_gbps"]
        finally:
            calibration.close()
        return {
            "absorbed_gbps": absorbed,
            "admission": ramp(args, {}, directory, absorbed),
            "no_admission": ramp(args, UNBOUNDED, directory, absorbed),
        }


COLUMNS = (  # (JSON name, heading with its unit, format)
    ("offered_x", "offered (x absorbed)", "{:.2f}x"),
    ("offered_gbps", "offered GB/s", "{:.2f}"),
    ("absorbed_gbps", "absorbed GB/s", "{:.2f}"),
    ("cascades_dropped", "cascades dropped (blocks)", "{:,d}"),
    ("gpu_stores_refused_pct", "GPU stores refused %", "{:.1f}"),
    ("pinned_rows_peak", "pinned rows (peak)", "{:d}"),
    ("promotion_p50_ms", "promotion p50 ms", "{:.1f}"),
    ("promotion_p99_ms", "promotion p99 ms", "{:.1f}"),
    ("scheduler_call_p99_us", "scheduler call p99 us", "{:.1f}"),
)


def _print(results: dict[str, Any]) -> None:
    """One table per half of the run; '-' for a value not measured (no promotion in a step)."""
    console = Console()
    console.print(f"The tier absorbs {results['absorbed_gbps']:.2f} GB/s (offered far beyond it, unbounded).")
    for mode, title in (("admission", "with admission (the default)"), ("no_admission", "without admission")):
        table = Table(title=f"Overload ramp, {title}")
        for _, heading, _ in COLUMNS:
            table.add_column(heading, justify="right")
        for row in results[mode]:
            table.add_row(*(fmt.format(row[name]) if row[name] is not None else "-" for name, _, fmt in COLUMNS))
        console.print(table)


def _plot(results: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for mode, style in (("admission", "-o"), ("no_admission", "--x")):
        rows = results[mode]
        x = [row["offered_gbps"] for row in rows]
        axes[0].plot(x, [row["absorbed_gbps"] for row in rows], style, label=mode)
        axes[1].plot(x, [row["gpu_stores_refused_pct"] for row in rows], style, label=mode)
        axes[2].plot(x, [row["promotion_p99_ms"] for row in rows], style, label=mode)
    for axis, title in zip(axes, ("absorbed GB/s", "GPU stores refused %", "promotion p99 ms"), strict=True):
        axis.set_xlabel("offered GB/s")
        axis.set_title(title)
        axis.legend()
    fig.tight_layout()
    fig.savefig(path)


if __name__ == "__main__":
    raise SystemExit(main())
