"""Readers of the CPU tier's rows: a request's blocks pinned, and released, in one pass each.

A block's ref count is -1 while a write into its row is in flight, 0 when idle, n > 0 while
n readers hold it (`tiering.eviction.base.BlockStatus`). Both calls change every block or
none: on the hot path of every load and cascade, each checks and applies in one pass, and
undoes what it applied when a block turns out not to allow it.

Thread: the scheduler thread only (through `CPUOffloadingManager`).
"""

from __future__ import annotations

from collections.abc import Collection
from operator import attrgetter

import numpy as np

from tiering.contract.keys import OffloadKey
from tiering.eviction.base import BlockStatus

BLOCK_ID = attrgetter("block_id")
"""A `BlockStatus`'s row (to map over statuses in C, on hot paths)."""


class Reading:
    """Rows pinned for the secondary tiers to read (a cascade): `rows`, their ids in the order
    of `keys` (and `block_ids`, the same as a 1-D int64 array, for the tiers' jobs), and their
    statuses, which `CPUPrimaryTierOffloadingManager.complete_read` releases without looking
    the keys up again (the rows stay theirs while pinned)."""

    __slots__ = ("block_ids", "blocks", "keys", "rows")

    def __init__(self, keys: Collection[OffloadKey], blocks: list[BlockStatus]):
        self.keys = keys
        self.blocks = blocks
        self.rows: list[int] = list(map(BLOCK_ID, blocks))
        self.block_ids = np.array(self.rows, dtype=np.int64)


def add_readers(blocks: list[BlockStatus]) -> tuple[int, bool]:
    """Add a reader to each block of `blocks` not being written; returns how many rows got
    their first reader, and whether a block is being written (ref count -1, left as it is:
    the caller pins it early or calls `undo_readers`)."""
    first, writing = 0, False
    for block in blocks:
        ref_cnt = block.ref_cnt
        if ref_cnt > 0:
            block.ref_cnt = ref_cnt + 1
        elif ref_cnt == 0:
            block.ref_cnt = 1
            first += 1
        else:
            writing = True
    return first, writing


def undo_readers(blocks: list[BlockStatus]) -> None:
    """Take back what `add_readers` did to `blocks`."""
    for block in blocks:
        if block.ref_cnt > 0:
            block.ref_cnt -= 1


def release_readers(blocks: list[BlockStatus], keys: Collection[OffloadKey], caller: str) -> int:
    """Remove a reader from each block of `blocks` (those of `keys`, in order); returns how
    many rows have none left.

    Raises:
        KeyError: a block has no reader (named with its key); no block is changed.
    """
    released = 0
    for i, block in enumerate(blocks):
        ref_cnt = block.ref_cnt
        if ref_cnt < 1:
            for done in blocks[:i]:
                done.ref_cnt += 1
            raise KeyError(f"{caller}: key {list(keys)[i].hex()} is ref count {ref_cnt}")
        block.ref_cnt = ref_cnt - 1
        released += ref_cnt == 1
    return released
