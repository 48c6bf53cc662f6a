"""The file tier's GB/s, ours or vLLM 0.33's fs tier, each against a raw thread pool in the
same process, directory and open mode: ``python -m tiering.benchmarks.versus_vllm.files SIDE
MODE BLOCK_BYTES BLOCKS DIR`` prints a JSON object of seconds (``store``, ``load``, ``raw
store``, ``raw load``).

Both tiers get the same jobs through their contract: every block stored in jobs of `JOB_BLOCKS`
(``submit_store``), then loaded back into other rows (``submit_load``), the finished jobs
polled every `POLL_S` as a scheduler's steps would; the loaded rows must equal the stored ones.
MODE ``direct`` is O_DIRECT for the tier and the pool; ``buffered`` the page cache for both
(vLLM's fs tier takes O_DIRECT where the filesystem allows it: its probe's answer is set to
no). The raw pool (`tiering.benchmarks.file_tier.run_raw`, no checksum) is the same in both
processes, so that its ratio to each tier cancels the machine's drift between them; it runs
before the tier and after it, the faster run kept: after vLLM's tier the pool read 64 KiB
with O_DIRECT 20-60% slower than before it in the same process (0.15 s before, 0.18-0.24
after, in four runs; after ours 0-20%), which charged vLLM's residue to ours.

Thread: the main thread of the child process.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from tiering.benchmarks.file_tier import aligned_rows, run_raw

JOB_BLOCKS, POLL_S, THREADS = 16, 0.0005, 16


def run_jobs(
    submit: Callable[[int, list[bytes], np.ndarray], None], finished: Callable[[], Iterable[Any]], jobs: list
) -> float:
    """Seconds from the first submission to the last job's end; every job must succeed.

    Raises:
        RuntimeError: a job failed, or they did not all end in 600 s.
    """
    start = time.perf_counter()
    for job_id, (keys, block_ids) in enumerate(jobs):
        submit(job_id, keys, block_ids)
    pending, deadline = len(jobs), start + 600
    while pending:
        for result in finished():
            if not result.success:
                raise RuntimeError(f"job {result.job_id} failed")
            pending -= 1
        if time.perf_counter() > deadline:
            raise RuntimeError(f"{pending} jobs did not end in 600 s")
        time.sleep(POLL_S)
    return time.perf_counter() - start


def ours(view: memoryview, directory: Path, direct: bool) -> tuple[Any, Callable, Callable, Callable]:
    """Our file tier; its store and load submissions and its finished jobs."""
    from tiering import JobMetadata, ReqContext, SecondaryTierFactory

    config = {"type": "file", "root_dir": str(directory), "max_concurrency": THREADS, "direct_io": direct}
    tier = SecondaryTierFactory.create_secondary_tier(config, view, None)
    context = ReqContext("bench")

    def submitter(method: Callable, promotion: bool) -> Callable:
        return lambda job_id, keys, ids: method(JobMetadata(job_id, keys, ids, promotion, context))

    return tier, submitter(tier.submit_store, False), submitter(tier.submit_load, True), tier.get_finished


def vllm(
    view: memoryview, directory: Path, direct: bool, detector: Any = None
) -> tuple[Any, Callable, Callable, Callable]:
    """vLLM 0.33's fs tier, built as its factory would for one group of 16-token blocks (with
    `detector`, a backpressure detector, if given)."""
    from vllm.v1.kv_offload import config as c
    from vllm.v1.kv_offload.base import ReqContext
    from vllm.v1.kv_offload.tiering.base import TransferJob
    from vllm.v1.kv_offload.tiering.fs.manager import FileSystemTierManager

    parallel = c.OffloadingParallelConfig(0, 1, 1, 1, 1, 1, 0, 1, None, True)
    config = c.OffloadingConfig(
        groups=(c.OffloadingGroupConfig(16, ("layer.0",), 0),),
        worker_kv_bytes_per_block=view.nbytes // len(view),
        enable_kv_cache_events=False,
        extra_config={},
        engine_id="versus-vllm",
        model=c.OffloadingModelConfig("versus-vllm", "float16"),
        cache=c.OffloadingCacheConfig(16, 1),
        parallel=parallel,
    )
    events = SimpleNamespace(enable_kv_cache_events=False)
    spec = SimpleNamespace(config=config, blocks_per_chunk=1, kv_events_config=events)
    tier = FileSystemTierManager(spec, view, "fs", str(directory), THREADS, THREADS, backpressure_detector=detector)
    tier._use_o_direct = direct and tier._use_o_direct  # buffered: as if the filesystem refused O_DIRECT
    context = ReqContext("bench")

    def submitter(method: Callable, promotion: bool) -> Callable:
        return lambda job_id, keys, ids: method(TransferJob(job_id, keys, ids, promotion, context))

    return tier, submitter(tier.submit_store, False), submitter(tier.submit_load, True), tier.get_finished_jobs


def measure(side: str, mode: str, block_bytes: int, blocks: int, directory: Path) -> dict[str, float]:
    """Seconds of the tier's store and load of `blocks` blocks, and of the raw pool's."""
    rows = aligned_rows(2 * blocks, block_bytes)  # stored from the first half, loaded into the second
    view = rows.data  # a 2-D view: a row per block
    keys = [i.to_bytes(32, "big") + bytes(4) for i in range(blocks)]
    starts = range(0, blocks, JOB_BLOCKS)
    stores = [(keys[i : i + JOB_BLOCKS], np.arange(i, min(i + JOB_BLOCKS, blocks))) for i in starts]
    loads = [(chunk, ids + blocks) for chunk, ids in stores]
    raw_mode = "direct" if mode == "direct" else "buffered"
    before = run_raw(rows[:blocks], directory / "raw before", THREADS, raw_mode, check=False)
    build = ours if side == "ours" else vllm
    tier, submit_store, submit_load, finished = build(view, directory / "tier", mode == "direct")
    try:
        results = {"store": run_jobs(submit_store, finished, stores), "load": run_jobs(submit_load, finished, loads)}
    finally:
        tier.shutdown()
    if not np.array_equal(rows[:blocks], rows[blocks:]):
        raise RuntimeError(f"{side}: the loaded rows differ from the stored ones")
    after = run_raw(rows[:blocks], directory / "raw after", THREADS, raw_mode, check=False)
    shutil.rmtree(directory, ignore_errors=True)
    return results | {f"raw {op}": min(before[op], after[op]) for op in ("store", "load")}


if __name__ == "__main__":
    side, mode, block_bytes, blocks, scratch = sys.argv[1:6]
    print(json.dumps(measure(side, mode, int(block_bytes), int(blocks), Path(scratch) / side)))
