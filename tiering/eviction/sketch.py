"""`CountMinSketch`: approximate counts of how often keys were seen, in fixed memory.

Four rows of one-byte counters; a key is counted in one cell of each row and its estimate
is the smallest of its four cells: never below its true count (saturation and aging
aside), above it only where every one of its cells is shared with other keys. Counts age:
after `window` increments every counter is halved (TinyLFU's reset), so old popularity
fades. Counters saturate at `max_count`.

A key's cells come from Python's hash of its bytes (SipHash, already cached on every key
the engine uses as a dict key): its two 32-bit halves give the four cells by double
hashing (cell i = low + i x high, Kirsch and Mitzenmacher). That is nearly free on the
scheduler thread, fixed within a process, and different between processes unless
``PYTHONHASHSEED`` is set, so which keys collide (and so an estimate above the true
count) may change from run to run.

Used by the reuse filter of `tiering.engine.admission` and by the ``arc-s`` eviction policy.

Thread: the owner's thread only (the scheduler's).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from tiering.contract.keys import OffloadKey

ROWS = 4
_LOW = (1 << 32) - 1


class CountMinSketch:
    """Counts of keys in ``4 x width`` one-byte counters, halved every `window` increments."""

    def __init__(self, width: int, window: int, max_count: int = 255):
        """
        Args:
            width: counters per row; a power of two, at most 2**32.
            window: increments between two halvings (>= 1).
            max_count: where a counter saturates (1 to 255; 15 for 4-bit counters).

        Raises:
            ValueError: `width` is not a power of two in range, `window` < 1, or
                `max_count` out of range.
        """
        if width < 1 or width & (width - 1) or width > 2**32:
            raise ValueError(f"width must be a power of two up to 2**32, got {width}")
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        if not 1 <= max_count <= 255:
            raise ValueError(f"max_count must be 1 to 255, got {max_count}")
        self._rows = [bytearray(width) for _ in range(ROWS)]
        self._mask = width - 1
        self._bump = bytes(min(count + 1, max_count) for count in range(256))  # count -> count + 1, saturated
        self._window = window
        self._increments = 0

    def add(self, key: OffloadKey) -> int:
        """Count one sighting of `key`; returns its estimate, this one included."""
        return self.add_many([key])[0]

    def count(self, key: OffloadKey) -> int:
        """The estimated sightings of `key` (never fewer than the true count, aging and
        saturation aside)."""
        return self.estimate_many([key])[0]

    def add_many(self, keys: Iterable[OffloadKey]) -> list[int]:
        """Count one sighting of each of `keys`, in order (a key listed twice counts twice);
        returns a list of ``len(keys)`` ints, each key's estimate right after its own
        sighting. The halving, when due, comes after the last of them."""
        r0, r1, r2, r3 = self._rows
        mask, bump = self._mask, self._bump
        estimates = []
        for key in keys:
            h = hash(key)
            low, step = h & _LOW, (h >> 32) & _LOW | 1
            a, b, c, d = low & mask, (low + step) & mask, (low + 2 * step) & mask, (low + 3 * step) & mask
            r0[a] = va = bump[r0[a]]
            r1[b] = vb = bump[r1[b]]
            r2[c] = vc = bump[r2[c]]
            r3[d] = vd = bump[r3[d]]
            estimates.append(min(va, vb, vc, vd))
        self._increments += len(estimates)
        if self._increments >= self._window:
            for row in self._rows:
                counters = np.frombuffer(row, dtype=np.uint8)
                counters >>= 1
            self._increments = 0
        return estimates

    def estimate_many(self, keys: Iterable[OffloadKey]) -> list[int]:
        """`count` of each of `keys`, as a list of ``len(keys)`` ints in their order; counts
        nothing. Never raises for a hashable key."""
        r0, r1, r2, r3 = self._rows
        mask = self._mask
        estimates = []
        for key in keys:
            h = hash(key)
            low, step = h & _LOW, (h >> 32) & _LOW | 1
            estimates.append(
                min(r0[low & mask], r1[(low + step) & mask], r2[(low + 2 * step) & mask], r3[(low + 3 * step) & mask])
            )
        return estimates
