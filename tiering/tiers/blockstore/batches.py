"""How the blocks of the jobs a block-store tier starts together are cut into store calls.

Loop thread (plain functions, no I/O). The jobs queued by one run of the loop's callbacks
start together (`tiering.tiers.blockstore.worker`): their blocks, in the order the jobs were
submitted, go to the store in shared calls of at most ``batch_bytes``, so a step of many small
jobs costs the loop a hop per call, not per job. The measurements behind the constants here:
docs/results.md, "The measurements behind the constants".
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
above one. A store that `reads_in_order` gets calls of about `LOAD_SPREAD_MIN_BYTES`, this
many at a time: each call's rows land as it ends, and the worker copies them while the next
calls read. Promotions started together, or while other loads are in flight, keep the device
busy with their own calls, and go in batches of ``batch_bytes``, as stores always do: each
call costs the loop a hop."""
LOAD_SPREAD_MIN_BYTES = 2 << 20
"""Below this a call costs more in hops than its reads gain in parallel."""


def cut(
    blocks: Sequence[Block],
    batch_blocks: int,
    row_bytes: int,
    spread: int = 1,
    reads_in_order: bool = False,
    calls_at_once: int | None = None,
) -> tuple[list[Sequence[Block]], float]:
    """`blocks` cut into store calls, in order, and how many of them may run at once
    (``math.inf``: all).

    Args:
        blocks: the blocks of the jobs started together.
        batch_blocks: blocks per call at most (``batch_bytes`` over `row_bytes`), unless
            `calls_at_once` asks for fewer calls.
        row_bytes: bytes of one block.
        spread: `LOAD_SPREAD` for a promotion that is the tier's only load in flight, else 1.
        reads_in_order: the store's `reads_in_order`.
        calls_at_once: the store's `calls_at_once`: when not spread, the blocks go out in
            at most this many calls, each larger than ``batch_bytes`` if need be.
    """
    size, at_once = batch_blocks, math.inf
    if spread > 1:
        least = max(1, LOAD_SPREAD_MIN_BYTES // max(1, row_bytes))
        if reads_in_order:
            size, at_once = min(size, least), spread
        else:
            size = min(size, max(least, -(-len(blocks) // spread)))
    elif calls_at_once is not None:
        size = max(size, -(-len(blocks) // calls_at_once))
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
