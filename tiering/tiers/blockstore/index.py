"""`BlockIndex`: which keys a block-store tier holds, their bytes, LRU order and readers.

Scheduler thread only, and nothing else: no loop, no lock, no I/O. It decides evictions;
the tier turns them into deletes.

Room: the index holds at most `capacity_bytes`. When the device fills up first (ENOSPC), it
holds at most what fit (`room_bytes`); at each retry time it raises the room by an eighth
while it uses it all (forgetting it once it does not), waiting longer (doubling up to the
last of `room_backoff_s`) each time a raise did not fit, and the shortest time after one
did. What fit counts the evicted objects whose deletes have not finished
(`deleting_bytes`): they still took the device's space. Counting them keeps the room where
the device is (a store that evicted to make room waits for those deletes:
`BlockStoreTier`), so churn never lowers it; it follows free space down (another program's
files) and, at each retry, up, evicting no more than the shortfall.

Retention (`tiering.eviction.retention`, the same rules as the CPU tier's): eviction takes released
keys first, then the least recent without a live deadline: a retained key waits outside the
eviction order (`park`), so no eviction walks over it; if none can go, the earliest deadlines
are given up.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable
from itertools import chain

from tiering.contract.keys import OffloadKey
from tiering.eviction.retention import Retention
from tiering.tiers.events import TierEvents

logger = logging.getLogger(__name__)

ROOM_BACKOFF_S = (1.0, 30.0)  # first and longest wait before a full device is tried again


class Entry:
    """One key: its object's bytes, whether the store has it, whether it was found there
    (recovered, or by a probe: not stored by this engine since it started), and loads
    reading it now."""

    __slots__ = ("found", "readers", "size", "stored")

    def __init__(self, size: int, stored: bool = False, found: bool = False):
        self.size = size
        self.stored = stored
        self.found = found
        self.readers = 0


class BlockIndex:
    """Keys in LRU order (least recent first), with capacity and eviction.

    Attributes:
        name: the tier's name, for log lines.
        capacity_bytes: the configured limit, or None.
        room_bytes: while the device is full, what it was found to hold; else None.
        used_bytes: bytes of every key held or being stored.
        reserved_bytes: the part of `used_bytes` being stored (not written yet).
        deleting_bytes: bytes of evicted objects whose deletes have not finished (`deleted`).
        evictions: keys evicted so far.
        max_keys: keys held at most, or None; beyond it the least recent idle stored keys are
            forgotten (not evicted: their objects stay, for a store that evicts by itself).
        forgotten: keys forgotten so far.
        events: the tier's KV events (`tiering.tiers.events`), or None: none are kept. The
            index announces what it evicts, forgets or drops; `apply_store` what is stored.
        retention: the deadlines and releases of requests' hints for up to `max_retained`
            keys, or None (`max_retained` 0): none are kept.
    """

    def __init__(
        self,
        name: str,
        capacity_bytes: int | None,
        room_backoff_s: tuple[float, float] | None = None,
        clock: Callable[[], float] = time.monotonic,
        max_keys: int | None = None,
        max_retained: int = 0,
    ):
        self.name = name
        self.retention = Retention(max_retained, self, clock) if max_retained else None
        self.events: TierEvents | None = None
        self.capacity_bytes = capacity_bytes
        self.max_keys = max_keys
        self.room_bytes: int | None = None
        self.used_bytes = 0
        self.reserved_bytes = 0
        self.deleting_bytes = 0
        self._deleting: dict[OffloadKey, int] = {}
        self.evictions = 0
        self.forgotten = 0
        self._entries: OrderedDict[OffloadKey, Entry] = OrderedDict()  # the eviction order, least recent first
        self._parked: dict[OffloadKey, Entry] = {}  # held under a retention deadline, out of that order (`park`)
        self._room_backoff = room_backoff_s or ROOM_BACKOFF_S
        self._room_wait_s = self._room_backoff[0]
        self._room_retry_at = 0.0
        self._raised = False  # the room was raised and no store has been refused since
        self._largest = 0  # the largest object seen, bytes: the least a raise adds
        self._clock = clock

    def __len__(self) -> int:
        return len(self._entries) + len(self._parked)

    def __contains__(self, key: OffloadKey) -> bool:
        return key in self._entries or key in self._parked

    def get(self, key: OffloadKey) -> Entry | None:
        """The entry of `key`, or None if not held."""
        entry = self._entries.get(key)
        return entry if entry is not None or not self._parked else self._parked.get(key)

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
        entries, parked, reserved, complete, before = self._entries, self._parked, [], True, len(evicted)
        for key, row in items:
            if key in entries or key in parked:
                continue
            self.deleted((key,))  # stored again: its object is replaced, not deleted
            size = object_bytes(key)
            self._largest = max(self._largest, size)
            if not self._make_room(size, evicted):
                complete = False
                continue
            entries[key] = Entry(size)
            self.used_bytes += size
            self.reserved_bytes += size
            reserved.append((key, row))
        self._forget_beyond_max()
        if self.events is not None:
            self.events.add(evicted[before:], removed=True)
        return reserved, complete

    def add_stored(self, key: OffloadKey, size: int) -> list[OffloadKey]:
        """Hold an object that already exists (recovered, or found by a probe) as the most
        recent; returns the keys evicted if the index is now over its limit."""
        self.deleted((key,))  # found again while its delete was pending: kept
        self._entries[key] = Entry(size, stored=True, found=True)
        self.used_bytes += size
        evicted: list[OffloadKey] = []
        self._make_room(0, evicted)
        self._forget_beyond_max()
        if self.events is not None:
            self.events.add((key,), removed=False)
            self.events.add(evicted, removed=True)
        return evicted

    def add_recovered(self, items: Iterable[tuple[OffloadKey, int]]) -> list[OffloadKey]:
        """Hold objects a previous run left (`tiering.tiers.blockstore.recovery`), `items`
        newest first, each as the least recent: older than every key held. Keys held already
        (stored or found since) are skipped. Returns the keys that do not fit the limit,
        whose objects are to be deleted (older than every key held, they are the victims)."""
        entries, limit, unfit, added = self._entries, self.limit(), [], []
        for key, size in items:
            if key in entries or key in self._parked:
                continue
            if limit is not None and self.used_bytes + size > limit:
                unfit.append(key)
                continue
            entries[key] = Entry(size, stored=True, found=True)
            entries.move_to_end(key, last=False)
            self.used_bytes += size
            added.append(key)
        self._forget_beyond_max()
        if self.events is not None:
            self.events.add(added, removed=False)
        return unfit

    def deleted(self, keys: Iterable[OffloadKey]) -> None:
        """The deletes of these evicted keys are over (done or failed): their objects no
        longer count against the room."""
        for key in keys:
            size = self._deleting.pop(key, 0)
            self.deleting_bytes -= size

    def mark_stored(self, key: OffloadKey) -> Entry | None:
        """The store of `key` succeeded; returns its entry, or None if no longer held."""
        entry = self.get(key)
        if entry is not None and not entry.stored:
            entry.stored = True
            self.reserved_bytes -= entry.size
        return entry

    def remove(self, key: OffloadKey) -> None:
        """Stop holding `key` (a failed store, a missing or corrupt object)."""
        entry = self._entries.pop(key, None)
        if entry is None and self._parked:
            entry = self._parked.pop(key, None)
        if entry is not None:
            if self.events is not None and entry.stored:
                self.events.add((key,), removed=True)
            if self.retention is not None:
                self.retention.forget((key,))
            self.used_bytes -= entry.size
            if not entry.stored:
                self.reserved_bytes -= entry.size

    def touch(self, keys: Iterable[OffloadKey]) -> None:
        """Make the held `keys` the most recent, the first one most."""
        entries = self._entries
        keys = list(keys)
        for key in reversed(keys):
            if key in entries:
                entries.move_to_end(key)
        if self.retention is not None:
            self.retention.used(keys)

    def stored_keys(self) -> list[OffloadKey]:
        """The keys whose objects are stored, least recent first (those retained last)."""
        return [key for key, entry in chain(self._entries.items(), self._parked.items()) if entry.stored]

    def start_events(self, events: TierEvents) -> None:
        """Keep `events` from now on, starting with the blocks held (those recovered)."""
        self.events = events
        events.add(self.stored_keys(), removed=False)

    def replaced_by(self, successor: BlockIndex) -> BlockIndex:
        """`successor`, the index of the tier's next generation, taking over the events
        after every block held here is announced removed."""
        if self.events is not None:
            self.events.add(self.stored_keys(), removed=True)
            successor.events = self.events
        return successor

    def park(self, key: OffloadKey) -> None:
        """Take held `key` out of the eviction order while it holds a retention deadline
        (`tiering.eviction.retention.Reorder`): no eviction walk meets it."""
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._parked[key] = entry

    def unpark(self, key: OffloadKey, recent: bool) -> None:
        """Put parked `key` back in the eviction order: at the most recent end (`recent`) or
        the least (`tiering.eviction.retention.Reorder`)."""
        entry = self._parked.pop(key, None)
        if entry is not None:
            self._entries[key] = entry
            if not recent:
                self._entries.move_to_end(key, last=False)

    def defer(self, key: OffloadKey) -> None:
        """Make held `key` the most recent without a use (`tiering.eviction.retention.Reorder`)."""
        self._entries.move_to_end(key)

    def demote(self, key: OffloadKey) -> None:
        """Make held `key` the least recent without a use (`tiering.eviction.retention.Reorder`)."""
        self._entries.move_to_end(key, last=False)

    def retain(self, keys: Collection[OffloadKey], seconds: float) -> list[OffloadKey]:
        """The held `keys` get a deadline `seconds` from now, or keep a later one; returns
        the keys not held (nor being stored)."""
        if self.retention is not None:
            self.retention.retain([key for key in keys if key in self], seconds)
        return [key for key in keys if key not in self]

    def release(self, keys: Collection[OffloadKey]) -> None:
        """The held `keys` lose their deadlines and are evicted first."""
        if self.retention is not None:
            self.retention.release(key for key in keys if key in self)

    def start_reads(self, keys: Collection[OffloadKey]) -> bool:
        """Count a load of all `keys` (they cannot be evicted until `end_read`); False, with
        nothing counted, unless every key is held and stored."""
        entries = [self.get(key) for key in keys]
        if not all(entry is not None and entry.stored for entry in entries):
            return False
        for entry in entries:
            entry.readers += 1  # type: ignore[union-attr]
        return True

    def end_read(self, key: OffloadKey) -> Entry | None:
        """One load of `key` is over; returns its entry, or None if no longer held."""
        entry = self.get(key)
        if entry is not None:
            entry.readers -= 1
        return entry

    def device_full(self) -> None:
        """A store was refused for lack of space: hold at most what the device held (the
        objects stored, and those evicted but not deleted yet; not the stores in flight).
        The room is raised again at the retry time, which backs off while raising fails."""
        held = self._on_device()
        if self.room_bytes is None or self._raised:
            if self.room_bytes is None:
                logger.warning("tier %s: device full at %d bytes; holding at most that", self.name, held)
            else:  # the last raise did not fit: wait longer before the next
                self._room_wait_s = min(self._room_wait_s * 2, self._room_backoff[1])
            self._raised = False
            self._room_retry_at = self._clock() + self._room_wait_s
        self.room_bytes = held

    def device_stored(self) -> None:
        """A store succeeded with no full-device refusal: while the device is full, the room
        is at least what it now holds (stores in flight at the refusal fit after all); else
        the next full device waits the shortest time again."""
        if self.room_bytes is None:
            self._room_wait_s = self._room_backoff[0]
        else:
            self.room_bytes = max(self.room_bytes, self._on_device())

    def _on_device(self) -> int:
        """Bytes the device holds for certain: objects stored, and evicted but not deleted."""
        return self.used_bytes - self.reserved_bytes + self.deleting_bytes

    def limit(self) -> int | None:
        """Bytes the index may hold now: the capacity, or less while the device is full.
        While full, the room is raised by an eighth at each retry time (more stores are
        tried: the device may have more space) as long as the index uses it all, and
        forgotten once the index does not (or it reaches the capacity)."""
        if self.room_bytes is not None and self._clock() >= self._room_retry_at:
            if self._raised:  # the last raise fit: climb again soon
                self._room_wait_s = self._room_backoff[0]
            if self.used_bytes + self.deleting_bytes < self.room_bytes:
                logger.info("tier %s: the device has room again", self.name)
                self.room_bytes, self._raised = None, False
            else:
                self.room_bytes += max(self.room_bytes // 8, 4 * self._largest)
                self._raised = True
                self._room_retry_at = self._clock() + self._room_wait_s
                if self.capacity_bytes is not None and self.room_bytes >= self.capacity_bytes:
                    self.room_bytes, self._raised = None, False
        if self.room_bytes is None or (self.capacity_bytes is not None and self.capacity_bytes < self.room_bytes):
            return self.capacity_bytes
        return self.room_bytes

    def _forget_beyond_max(self) -> None:
        if self.max_keys is None or len(self) <= self.max_keys:
            return
        entries, excess, victims = self._entries, len(self) - self.max_keys, []
        for key, entry in entries.items():  # least recent first: usually the first ones found
            if entry.stored and entry.readers == 0:
                victims.append(key)
                if len(victims) == excess:
                    break
        for key in victims:
            self.used_bytes -= entries.pop(key).size
        if self.retention is not None:
            self.retention.forget(victims)
        if self.events is not None:
            self.events.add(victims, removed=True)
        self.forgotten += len(victims)

    def _make_room(self, size: int, evicted: list[OffloadKey]) -> bool:
        """Evict idle least-recent keys until `size` more bytes fit the limit (never more than
        that shortfall); False if they cannot."""
        limit = self.limit()
        if limit is None:
            return True
        if size > limit:
            return False
        entries = self._entries
        while self.used_bytes + size > limit:
            victim = self._victim()
            if victim is None:
                return False
            victim_size = entries.pop(victim).size
            self.used_bytes -= victim_size
            self._deleting[victim] = victim_size
            self.deleting_bytes += victim_size
            evicted.append(victim)
            self.evictions += 1
        return True

    def _victim(self) -> OffloadKey | None:
        """The key to evict next: idle (stored, no reader), released first, then the least
        recent without a live deadline, giving up the earliest deadlines while there is none;
        None if no key is idle."""
        entries, retention = self._entries, self.retention

        def idle(key: OffloadKey) -> bool:
            entry = entries[key]
            return entry.stored and entry.readers == 0

        if retention is None or not retention.active:
            return next((key for key in entries if idle(key)), None)
        if retention.has_released and (released := retention.released(1, lambda key: key in entries and idle(key))):
            retention.forget(released)
            return released[0]
        while True:  # retained keys are parked, out of `entries`: the walk never meets one
            live = retention.live()  # (deadlines that passed put their keys back first)
            victim = next((key for key in entries if idle(key)), None)
            if victim is not None or not live or not retention.give_up(1, ()):
                break
        if victim is not None:
            retention.evicted((victim,))
        return victim
