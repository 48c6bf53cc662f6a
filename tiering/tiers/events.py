"""`TierEvents`: a secondary tier's KV events, for routers that follow where each engine's
blocks are (`SecondaryTierManager.take_events`).

A tier announces a block when it holds it (stored, recovered, or found by a probe) and again
on every way it leaves (eviction, a missing, corrupt or unusable object dropped, a key
forgotten, a reset that moves to other weights), each event with the tier's medium,
locality and name (its owner) and ``removal_expected`` set: every block announced is
announced again when it leaves, so vLLM's event tracker may keep its metadata until then.
A block of a `REMOTE` tier whose object sits in this engine's own memory (a Mooncake segment
it lends, `BlockStore.local_keys`) is announced `LOCAL`, stored and removed alike.
Events wait for `take` up to `MAX_EVENT_BLOCKS` blocks; past that the oldest are dropped and
counted (`dropped`), so a tier whose events nobody takes stays bounded.

Scheduler thread only (the tier's).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection

from tiering.contract.keys import OffloadKey
from tiering.contract.mediums import LOCAL, OffloadingEvent

MAX_EVENT_BLOCKS = 1 << 20
"""Blocks a tier's events may hold between two `take`s (a step's, under vLLM)."""
MERGE_BLOCKS = 4096
"""An event grows by the blocks of the next of its kind up to this many; then a new one
starts, so that the oldest can be dropped whole (a drop never moves a million keys)."""


class TierEvents:
    """The events of tier `owner` (its name) of `medium` and `locality`
    (`tiering.contract.mediums`), at most `max_blocks` blocks waiting."""

    def __init__(self, medium: str, locality: str, owner: str, max_blocks: int = MAX_EVENT_BLOCKS):
        self.medium, self.locality, self.owner, self.max_blocks = medium, locality, owner, max_blocks
        self._events: deque[OffloadingEvent] = deque()
        self._blocks = 0
        self.dropped = 0  # blocks of events dropped unread, past `max_blocks`
        self._local: set[OffloadKey] = set()  # held blocks announced LOCAL, until announced removed

    def add(self, keys: Collection[OffloadKey], removed: bool, local: Collection[OffloadKey] = ()) -> None:
        """`keys` were stored (or found), or `removed`; of those stored, the ones in `local`
        are announced `LOCAL` (and so is their removal), the others at the tier's locality.
        Each part is joined to the last event if it is of the same kind."""
        if self._local and removed:  # leaving: at the locality they were announced at
            here = [key for key in keys if key in self._local]
            self._local.difference_update(here)
        else:
            here = [key for key in keys if key in local] if local and self.locality != LOCAL else []
            self._local.update(here)
        if here:
            self._append(here, removed, LOCAL)
            moved = set(here)
            keys = [key for key in keys if key not in moved]
        self._append(keys, removed, self.locality)

    def _append(self, keys: Collection[OffloadKey], removed: bool, locality: str) -> None:
        if not keys:
            return
        last = self._events[-1] if self._events else None
        if last is not None and (last.removed, last.locality) == (removed, locality) and len(last.keys) < MERGE_BLOCKS:
            last.keys.extend(keys)
        else:
            self._events.append(OffloadingEvent(list(keys), self.medium, removed, locality, self.owner, True))
        self._blocks += len(keys)
        while self._blocks > self.max_blocks:
            if len(self._events) > 1:
                count = len(self._events.popleft().keys)
            else:  # one event past the bound (of one large add, or a small bound): its oldest blocks go
                count = self._blocks - self.max_blocks
                del self._events[0].keys[:count]
            self._blocks -= count
            self.dropped += count

    def take(self) -> list[OffloadingEvent]:
        """The events since the last call, oldest first."""
        events, self._events, self._blocks = list(self._events), deque(), 0
        return events
