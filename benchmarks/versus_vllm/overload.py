"""Stores offered faster than a file tier writes, ours or vLLM 0.33's (``vllm``; ``vllm+bp``
with its EMA backpressure detector at the fs tier's defaults): ``python -m
tiering.benchmarks.versus_vllm.overload SIDE GBPS SECONDS DIR`` prints a JSON object.

Both sides get the same steps: every `STEP_S` a request of new blocks (as many `BLOCK_BYTES`
blocks as `GBPS` asks for, fractions carried over) through ``on_new_request``,
``prepare_store``, ``complete_store``, ``on_request_finished``, ``on_schedule_end`` and
``take_events``, into a CPU tier of `ROWS` rows that cascades every block to a file tier in
DIR. Reported: the step's p50 and p99 (microseconds, the manager's calls only), the blocks the
CPU tier refused (``prepare_store`` gave None: no free row), the GB/s the file tier finished
writing, and the blocks not cascaded (ours: its admission's ``cascades_dropped``; vLLM's:
those its backpressure policy skipped).

Thread: the main thread of the child process.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from tiering.benchmarks.versus_vllm.files import vllm as vllm_fs
from tiering.benchmarks.versus_vllm.sched import Region

ROWS, BLOCK_BYTES, STEP_S = 512, 4 << 20, 0.02


def ours(directory: Path) -> tuple[Any, Any, dict[str, Any]]:
    """Our manager over a file tier, its step, and how to read what the tier wrote and dropped."""
    from tiering import CPUPrimaryTierOffloadingManager, ReqContext, SecondaryTierFactory, TieringOffloadingManager

    primary = CPUPrimaryTierOffloadingManager(ROWS, Region(ROWS, BLOCK_BYTES), cache_policy="lru")
    config = {"type": "file", "root_dir": str(directory)}
    tier = SecondaryTierFactory.create_secondary_tier(config, primary.get_kv_memoryview(), None)
    manager = TieringOffloadingManager(primary, [tier])

    def counts() -> tuple[int, int]:  # the tier's counters with its admission's (the manager's view)
        (counters,) = (stats["counters"] for stats in manager.get_stats()["tiers"].values())
        return counters.get("bytes_stored", 0), counters["cascades_dropped"]

    return manager, manager.on_schedule_end, {"context": ReqContext, "counts": counts}


def vllm(directory: Path, backpressure: bool) -> tuple[Any, Any, dict[str, Any]]:
    """vLLM 0.33's manager over its fs tier (with its detector when `backpressure`)."""
    import functools

    from vllm.v1.kv_offload.base import ReqContext, ScheduleEndContext
    from vllm.v1.kv_offload.tiering.backpressure import EMABackpressureDetector
    from vllm.v1.kv_offload.tiering.manager import CPUPrimaryTierOffloadingManager, TieringOffloadingManager

    region = Region(ROWS, BLOCK_BYTES)
    primary = CPUPrimaryTierOffloadingManager(num_chunks=ROWS, mmap_region=region, cache_policy="lru")
    written, dropped = [0], [0]
    detector = None
    if backpressure:
        detector = EMABackpressureDetector(**EMABackpressureDetector.default_config("fs", locality=None))
        skipped = detector.policy.on_store_skipped

        def counting_skipped(num_blocks: int) -> None:
            dropped[0] += num_blocks
            skipped(num_blocks)

        detector.policy.on_store_skipped = counting_skipped
    tier, _, _, _ = vllm_fs(primary.get_kv_memoryview(), directory, True, detector)
    finished = tier.get_finished_jobs

    def counting_finished() -> list:
        results = list(finished())
        written[0] += sum(result.transfer_bytes or 0 for result in results if result.success)
        return results

    tier.get_finished_jobs = counting_finished
    manager = TieringOffloadingManager(primary, [tier])
    step = functools.partial(manager.on_schedule_end, ScheduleEndContext((), ()))
    return manager, step, {"context": ReqContext, "counts": lambda: (written[0], dropped[0])}


def measure(side: str, gbps: float, seconds: float, directory: Path) -> dict[str, float]:
    """The step's p50/p99 (us), blocks refused, GB/s written and blocks not cascaded."""
    manager, on_schedule_end, parts = ours(directory) if side == "ours" else vllm(directory, side == "vllm+bp")
    context, counts = parts["context"], parts["counts"]
    per_step, owed, refused, key, steps = gbps * 1e9 * STEP_S / BLOCK_BYTES, 0.0, 0, 0, []
    start = time.perf_counter()
    try:
        for step in range(int(seconds / STEP_S)):
            owed += per_step
            keys = [(key + i).to_bytes(32, "big") + bytes(4) for i in range(int(owed))]
            key, owed = key + len(keys), owed - len(keys)
            request = context(f"r{step}")
            began = time.perf_counter()
            manager.on_new_request(request)
            if keys and manager.prepare_store(keys, request) is None:
                refused += len(keys)
            elif keys:
                manager.complete_store(keys, request)
            manager.on_request_finished(request)
            on_schedule_end()
            list(manager.take_events())
            steps.append(time.perf_counter() - began)
            delay = start + (step + 1) * STEP_S - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
        written, dropped = counts()
        elapsed = time.perf_counter() - start
    finally:
        manager.shutdown()
        shutil.rmtree(directory, ignore_errors=True)
    p50, p99 = (float(np.percentile(steps, q)) * 1e6 for q in (50, 99))
    rate = written / elapsed / 1e9
    return {"step p50 us": p50, "step p99 us": p99, "refused": refused, "written GB/s": rate, "not cascaded": dropped}


if __name__ == "__main__":
    side, gbps, seconds, scratch = sys.argv[1:5]
    print(json.dumps(measure(side, float(gbps), float(seconds), Path(scratch) / side)))
