"""What a finished store or load job changes in a block-store tier's index and counters.

Scheduler thread: called by `BlockStoreTier.get_finished` with outcomes of the tier's
current generation (an outcome of an earlier one changes nothing here).
"""

from __future__ import annotations

from tiering.tiers.blockstore.counters import TierCounters
from tiering.tiers.blockstore.existence import ExistenceChecks
from tiering.tiers.blockstore.index import BlockIndex
from tiering.tiers.blockstore.outbox import LoadDone, StoreDone


def apply_store(index: BlockIndex, counters: TierCounters, done: StoreDone, evicts_itself: bool) -> None:
    """Blocks stored are held, blocks that failed forgotten; a refusal for lack of room marks
    the device full (unless the store `evicts_itself`), a success makes room known again;
    the blocks stored are announced (`BlockIndex.events`), those in the engine's own memory
    as `LOCAL`."""
    stored = []
    for key in done.keys:
        if key not in done.ok:
            index.remove(key)
        elif (entry := index.mark_stored(key)) is not None:
            stored.append(key)
            counters.counts["bytes_stored"] += entry.size
    counters.counts["blocks_stored"] += len(stored)
    if index.events is not None:
        index.events.add(stored, removed=False, local=done.local)
    if done.no_space and not evicts_itself:
        index.device_full()
    elif done.ok:
        index.device_stored()


def apply_load(
    index: BlockIndex, counters: TierCounters, existence: ExistenceChecks, done: LoadDone, probing: bool
) -> None:
    """Blocks loaded are touched; blocks whose object was missing, corrupt or forged are
    forgotten (a forged one believed absent for a while, where the tier is `probing` misses)."""
    for key in done.keys:
        entry = index.end_read(key)
        if entry is None:
            continue
        if key in done.drop:
            index.remove(key)
            if key in done.forged and probing:
                existence.absent(key)
        elif key in done.ok:
            index.touch([key])
            counters.counts["blocks_loaded"] += 1
            counters.counts["bytes_loaded"] += entry.size
            counters.counts["found_blocks_loaded"] += entry.found
