"""A block-store tier's recovery of what its store holds, while the tier serves.

A tier opens its store and starts listing what it holds (`BlockStore.recover`: a file tier's
scan, an S3 listing) on the loop, as a job of its own; a listing that ends within
`START_WAIT_S` is indexed whole before the tier is built, a longer one goes on while the tier
serves. Until it ends, a lookup of a block not known yet answers False (a miss: the request computes
it), never waiting for the listing; stores go on (a store whose own state comes from the
listing, the file tier's segments, makes its calls wait for it, outside their timeout:
`BlockStore.ready`). The
blocks found are then indexed, `SLICE_BLOCKS` per call of `get_finished` (no step stalls on a
million of them), the newest first, each older than every block stored or found since the
start, in the order the store recorded (a file's last write, a segment's append order, an S3
object's last modification). A key held already (stored or found since) keeps its place; a key
evicted meanwhile is not taken back; blocks that do not fit the capacity are deleted.

Scheduler thread only (the loop thread only fills in `RecoverDone.found`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from tiering.contract.keys import OffloadKey
from tiering.tiers.base import Doorbell
from tiering.tiers.blockstore.index import BlockIndex
from tiering.tiers.blockstore.outbox import RecoverDone

logger = logging.getLogger(__name__)

SLICE_BLOCKS = 4096
"""Recovered blocks indexed per `get_finished` (about 5 ms of the scheduler thread)."""
START_WAIT_S = 1.0
"""Seconds a tier's construction waits for the listing: one that ends within it is indexed
whole before the first lookup (a small tier is warm at its first request, as an engine that
serves at once needs); a longer one goes on while the tier serves."""


class Recovery:
    """One generation's recovery, from the start of the listing until every block found is indexed.

    Attributes:
        done: the listing's outcome, handed to `BlockWorker.start_recover`.
        evicted: keys evicted while it runs (not taken back from the listing).
    """

    def __init__(self, name: str, delete: Callable[[list[OffloadKey]], None]):
        """`delete` takes the keys found that do not fit the capacity (their objects go)."""
        self.name = name
        self._delete = delete
        self.done = RecoverDone()
        self.evicted: set[OffloadKey] = set()
        self._started = time.monotonic()
        self._indexed = 0
        self._deleted = 0

    def index_next(self, index: BlockIndex, doorbell: Doorbell | None, everything: bool = False) -> bool:
        """Index the next `SLICE_BLOCKS` blocks found (all of them, `everything`), once the
        listing has ended, and ring `doorbell` while more are left (the next poll goes on);
        returns whether every block found is indexed now."""
        found = self.done.found
        if found is None:
            return False
        count = len(found) if everything else min(SLICE_BLOCKS, len(found))
        newest_first = found[len(found) - count :][::-1]
        del found[len(found) - count :]
        evicted = self.evicted
        unfit = index.add_recovered([item for item in newest_first if item[0] not in evicted])
        self._indexed += count - len(unfit)
        self._deleted += len(unfit)
        if unfit:
            self._delete(unfit)
        if found:
            if doorbell is not None:
                doorbell.ring()
            return False
        self._log(index)
        return True

    def _log(self, index: BlockIndex) -> None:
        seconds = time.monotonic() - self._started
        if self.done.failures:
            _, error = self.done.failures[0]
            logger.error(
                "tier %s: could not list the blocks its store holds (%s); it serves without them", self.name, error
            )
        extra = f"; {self._deleted} deleted, over the capacity" if self._deleted else ""
        logger.info(
            "tier %s: recovered %d blocks in %.1f s (%d held, %d bytes)%s",
            self.name,
            self._indexed,
            seconds,
            len(index),
            index.used_bytes,
            extra,
        )
