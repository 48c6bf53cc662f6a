"""What the tier benchmarks share: a tier built from a config, fed store jobs then load jobs as
the manager would, timed; and interleaved repeats of several sides.

Scheduler thread (the caller's); the tier does its I/O on its own loop.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from tiering import BlockStoreTier, JobMetadata, ReqContext, SecondaryTierFactory, make_offload_key

CTX = ReqContext("bench")


def add_job_arguments(parser: argparse.ArgumentParser, repeats: int, repeats_help: str) -> None:
    """The options every tier benchmark takes: ``--total-mib``, ``--concurrency``,
    ``--job-blocks`` and ``--repeats`` (default `repeats`, described by `repeats_help`)."""
    parser.add_argument("--total-mib", type=int, default=128, help="data moved per measurement (default 128)")
    parser.add_argument("--concurrency", type=int, default=16, help="requests in flight (default 16)")
    parser.add_argument("--job-blocks", type=int, default=16, help="blocks per job (default 16)")
    parser.add_argument("--repeats", type=int, default=repeats, help=f"{repeats_help} (default {repeats})")


def run_tier_jobs(rows: np.ndarray, config: Mapping[str, Any], job_blocks: int) -> dict[str, float]:
    """Seconds to store every row of `rows` (2-D uint8, one block per row) through a tier of
    `config`, in jobs of `job_blocks` blocks submitted in one step, then to load them all
    back; each timed from the first submission to the last result. The tier's namespace is
    removed after.

    Raises:
        RuntimeError: a job failed, or a direction took over 600 s.
    """
    tier = SecondaryTierFactory.create_secondary_tier(dict(config), rows.data, None)
    assert isinstance(tier, BlockStoreTier)  # the benchmarks' tiers are block stores
    keys = [make_offload_key(i.to_bytes(16, "big"), 0) for i in range(len(rows))]
    spans = [range(i, min(i + job_blocks, len(rows))) for i in range(0, len(rows), job_blocks)]
    try:
        seconds = {}
        for direction, promotion in (("store", False), ("load", True)):
            submit = tier.submit_load if promotion else tier.submit_store
            start = time.perf_counter()
            for job_id, span in enumerate(spans):
                submit(JobMetadata(job_id, keys[span.start : span.stop], np.array(span), promotion, CTX))
            tier.on_schedule_end()
            if not tier.drain(600):
                raise RuntimeError(f"{config['type']} tier did not finish in 600 s")
            seconds[direction] = time.perf_counter() - start
            if not all(result.success for result in tier.get_finished()):
                raise RuntimeError(f"{config['type']} tier: a {direction} job failed")
        return seconds
    finally:
        tier.remove_namespace()


def interleaved(sides: Sequence[tuple[str, Callable[[], Mapping[str, float]]]], repeats: int) -> dict[str, list[float]]:
    """The seconds of each ``"<side> <measurement>"`` in each of `repeats` rounds, after one
    untimed round; the sides run in turn, in reverse order every other round, so that none
    always runs first (noisy, shared machines). Round i of every list ran in the same
    round, side by side."""
    runs: dict[str, list[float]] = {}
    for repeat in range(-1, repeats):
        for name, run in sides if repeat % 2 == 0 else sides[::-1]:
            for measurement, seconds in run().items():
                if repeat >= 0:
                    runs.setdefault(f"{name} {measurement}", []).append(seconds)
    return runs
