"""How the blocks of the jobs a block-store tier starts together are cut into store calls.

Loop thread (plain functions, no I/O). The jobs queued by one run of the loop's callbacks
start together (`tiering.tiers.blockstore.worker`): their blocks, in the order the jobs were
submitted, go to the store in shared calls of at most ``batch_bytes``, so a step of many small
jobs costs the loop a hop per call, not per job (64 KiB blocks from the page cache, 2,048 in
jobs of 16: read at 1.64-1.75 GB/s one job a call, 2.87-2.94 with the same blocks in jobs of
256; peer-bench's file_tier_bench_v033, two runs each).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import anyio

from tiering.contract.keys import OffloadKey
from tiering.tiers.blockstore.outbox import JobDone

Block = tuple[JobDone, OffloadKey, int]  # the job it belongs to, its key, its primary row
Items = Sequence[tuple[OffloadKey, int]]  # a job's (key, primary row)

LOAD_SPREAD = 4
"""A promotion that is the tier's only load in flight reaches the store in up to this many
concurrent calls (each at most ``batch_bytes`` and, unless the whole job is smaller, at least
`LOAD_SPREAD_MIN_BYTES`): a request waits on it, and a device reads faster at a queue depth
above one (this VM's disk: 16 MiB of 512 KiB files with O_DIRECT in 13 ms from one thread, 9
ms from four). A store that `reads_in_order` gets calls of about `LOAD_SPREAD_MIN_BYTES`, this
many at a time: each call's rows land as it ends, and the worker copies them while the next
calls read. Promotions started together, or while other loads are in flight, keep the device
busy with their own calls, and go in batches of ``batch_bytes``, as stores always do (spread
like one, 16 jobs of 16 x 2 MiB read at 3.4 GB/s from the page cache, 5.3-5.6 otherwise):
each call costs the loop about 150 us (2 MiB blocks from the page cache, one per call, read
at 3.5 GB/s, in batches of 16 MiB at 5.3-5.9, see peer-bench's ab_file)."""
LOAD_SPREAD_MIN_BYTES = 2 << 20
"""Below this a call costs more in hops than its reads gain in parallel (64 KiB blocks from
the page cache: a 16-block job read at 0.42 GB/s in four calls, see peer-bench's ab_file)."""


def cut(
    blocks: Sequence[Block],
    batch_blocks: int,
    row_bytes: int,
    spread: int = 1,
    reads_in_order: bool = False,
) -> tuple[list[Sequence[Block]], float]:
    """`blocks` cut into store calls, in order, and how many of them may run at once
    (``math.inf``: all).

    Args:
        blocks: the blocks of the jobs started together.
        batch_blocks: blocks per call at most (``batch_bytes`` over `row_bytes`).
        row_bytes: bytes of one block.
        spread: `LOAD_SPREAD` for a promotion that is the tier's only load in flight, else 1.
        reads_in_order: the store's `reads_in_order`.
    """
    size, at_once = batch_blocks, math.inf
    if spread > 1:
        least = max(1, LOAD_SPREAD_MIN_BYTES // max(1, row_bytes))
        if reads_in_order:
            size, at_once = min(size, least), spread
        else:
            size = min(size, max(least, -(-len(blocks) // spread)))
    return [blocks[start : start + size] for start in range(0, len(blocks), size)], at_once


def jobs_of(batch: Sequence[Block]) -> list[JobDone]:
    """The jobs `batch`'s blocks belong to, each once, in order."""
    jobs: list[JobDone] = []
    for done, _, _ in batch:
        if not jobs or jobs[-1] is not done:
            jobs.append(done)
    return jobs


class QueuedJobs:
    """Store or load jobs queued for the loop's next turn, and the deletes they wait for."""

    def __init__(self) -> None:
        self.jobs: list[tuple[JobDone, Items]] = []
        self.waits: dict[int, anyio.Event] = {}
