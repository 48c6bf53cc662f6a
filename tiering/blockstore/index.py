"""`BlockIndex`: which keys a block-store tier holds, their bytes, LRU order and readers.

Scheduler thread only, and nothing else: no loop, no lock, no I/O. It decides evictions;
the tier turns them into deletes.

Room: the index holds at most `capacity_bytes`. When the device fills up first (ENOSPC), it
holds at most what fit (`room_bytes`) until a retry time passes; then it forgets the room
and learns again from the next store, waiting longer (doubling up to the last of
`room_backoff_s`) each time the device is still full.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable

from tiering.keys import OffloadKey

logger = logging.getLogger(__name__)

ROOM_BACKOFF_S = (1.0, 30.0)  # first and longest wait before a full device is tried again


class Entry:
    """One key: its object's bytes, whether the store has it, and loads reading it now."""

    __slots__ = ("readers", "size", "stored")

    def __init__(self, size: int, stored: bool = False):
        self.size = size
        self.stored = stored
        self.readers = 0


class BlockIndex:
    """Keys in LRU order (least recent first), with capacity and eviction.

    Attributes:
        name: the tier's name, for log lines.
        capacity_bytes: the configured limit, or None.
        room_bytes: while the device is full, what it was found to hold; else None.
        used_bytes: bytes of every key held or being stored.
        evictions: keys evicted so far.
        max_keys: keys held at most, or None; beyond it the least recent idle stored keys are
            forgotten (not evicted: their objects stay, for a store that evicts by itself).
        forgotten: keys forgotten so far.
    """

    def __init__(
        self,
        name: str,
        capacity_bytes: int | None,
        room_backoff_s: tuple[float, float] | None = None,
        clock: Callable[[], float] = time.monotonic,
        max_keys: int | None = None,
    ):
        self.name = name
        self.capacity_bytes = capacity_bytes
        self.max_keys = max_keys
        self.room_bytes: int | None = None
        self.used_bytes = 0
        self.evictions = 0
        self.forgotten = 0
        self._entries: OrderedDict[OffloadKey, Entry] = OrderedDict()
        self._room_backoff = room_backoff_s or ROOM_BACKOFF_S
        self._room_wait_s = self._room_backoff[0]
        self._room_retry_at = 0.0
        self._clock = clock

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: OffloadKey) -> bool:
        return key in self._entries

    def get(self, key: OffloadKey) -> Entry | None:
        """The entry of `key`, or None if not held."""
        return self._entries.get(key)

    def reserve_all(
        self,
        items: Iterable[tuple[OffloadKey, int]],
        object_bytes: Callable[[OffloadKey], int],
        evicted: list[OffloadKey],
    ) -> tuple[list[tuple[OffloadKey, int]], bool]:
        """Hold each (key, row) of `items` not held yet as being stored, evicting idle
        least-recent keys (appended to `evicted`) to make room for its `object_bytes(key)`.

        Returns:
            The items reserved, and whether every item not held yet found room.
        """
        entries, reserved, complete = self._entries, [], True
        for key, row in items:
            if key in entries:
                continue
            size = object_bytes(key)
            if not self._make_room(size, evicted):
                complete = False
                continue
            entries[key] = Entry(size)
            self.used_bytes += size
            reserved.append((key, row))
        self._forget_beyond_max()
        return reserved, complete

    def add_stored(self, key: OffloadKey, size: int) -> list[OffloadKey]:
        """Hold an object that already exists (recovered, or found by a probe) as the most
        recent; returns the keys evicted if the index is now over its limit."""
        self._entries[key] = Entry(size, stored=True)
        self.used_bytes += size
        evicted: list[OffloadKey] = []
        self._make_room(0, evicted)
        self._forget_beyond_max()
        return evicted

    def remove(self, key: OffloadKey) -> None:
        """Stop holding `key` (a failed store, a missing or corrupt object)."""
        entry = self._entries.pop(key, None)
        if entry is not None:
            self.used_bytes -= entry.size

    def touch(self, keys: Iterable[OffloadKey]) -> None:
        """Make the held `keys` the most recent, the first one most."""
        entries = self._entries
        for key in reversed(list(keys)):
            if key in entries:
                entries.move_to_end(key)

    def start_reads(self, keys: Collection[OffloadKey]) -> bool:
        """Count a load of all `keys` (they cannot be evicted until `end_read`); False, with
        nothing counted, unless every key is held and stored."""
        entries = [self._entries.get(key) for key in keys]
        if not all(entry is not None and entry.stored for entry in entries):
            return False
        for entry in entries:
            entry.readers += 1  # type: ignore[union-attr]
        return True

    def end_read(self, key: OffloadKey) -> Entry | None:
        """One load of `key` is over; returns its entry, or None if no longer held."""
        entry = self._entries.get(key)
        if entry is not None:
            entry.readers -= 1
        return entry

    def device_full(self) -> None:
        """A store was refused for lack of space: hold at most what is held now, until the
        retry time (which backs off while the device stays full)."""
        if self.room_bytes is None:
            wait = self._room_wait_s
            self._room_wait_s = min(wait * 2, self._room_backoff[1])
            logger.warning(
                "tier %s: device full at %d bytes; holding at most that, retrying in %.0f s",
                self.name,
                self.used_bytes,
                wait,
            )
            self._room_retry_at = self._clock() + wait
        self.room_bytes = self.used_bytes

    def device_stored(self) -> None:
        """A store succeeded with no full-device refusal: the next full device waits the
        shortest time again."""
        if self.room_bytes is None:
            self._room_wait_s = self._room_backoff[0]

    def limit(self) -> int | None:
        """Bytes the index may hold now: the capacity, or less while the device is full."""
        if self.room_bytes is not None and self._clock() >= self._room_retry_at:
            logger.info("tier %s: retrying stores beyond the %d bytes a full device held", self.name, self.room_bytes)
            self.room_bytes = None
        if self.room_bytes is None or (self.capacity_bytes is not None and self.capacity_bytes < self.room_bytes):
            return self.capacity_bytes
        return self.room_bytes

    def _forget_beyond_max(self) -> None:
        if self.max_keys is None or len(self._entries) <= self.max_keys:
            return
        entries, excess, victims = self._entries, len(self._entries) - self.max_keys, []
        for key, entry in entries.items():  # least recent first: usually the first ones found
            if entry.stored and entry.readers == 0:
                victims.append(key)
                if len(victims) == excess:
                    break
        for key in victims:
            self.used_bytes -= entries.pop(key).size
        self.forgotten += len(victims)

    def _make_room(self, size: int, evicted: list[OffloadKey]) -> bool:
        limit = self.capacity_bytes if self.room_bytes is None else self.limit()
        if limit is None or self.used_bytes + size <= limit:
            return True
        if size > limit:
            return False
        entries = self._entries
        while self.used_bytes + size > limit:
            victim = next((key for key, entry in entries.items() if entry.stored and entry.readers == 0), None)
            if victim is None:
                return False
            self.used_bytes -= entries.pop(victim).size
            evicted.append(victim)
            self.evictions += 1
        return True
