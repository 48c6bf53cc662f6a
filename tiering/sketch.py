"""`CountMinSketch`: approximate counts of how often keys were seen, in fixed memory.

Four rows of counters; a key is counted in one cell of each row (chosen by a keyed hash of
its bytes, the same in every process and run) and its estimate is the smallest of its four
cells: never below its true count, above it only where every one of its cells is shared
with other keys. Counts age: after `window` increments every counter is halved (TinyLFU's
reset), so old popularity fades. Counters saturate at `max_count`.

Used by the reuse filter of `tiering.admission` (one key at a time) and by the ``arc-s``
eviction policy (a request's keys at once).

Thread: the owner's thread only (the scheduler's).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from tiering.keys import OffloadKey

ROWS = 4


class CountMinSketch:
    """Counts of keys in ``4 x width`` counters, halved every `window` increments."""

    def __init__(self, width: int, window: int, max_count: int = 2**32 - 1):
        """
        Args:
            width: counters per row; a power of two, at most 2**32.
            window: increments between two halvings (>= 1).
            max_count: where a counter saturates (15: 4-bit counters, held in bytes).

        Raises:
            ValueError: `width` is not a power of two in range, or `window` < 1.
        """
        if width < 1 or width & (width - 1) or width > 2**32:
            raise ValueError(f"width must be a power of two up to 2**32, got {width}")
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        dtype = np.uint8 if max_count <= 255 else np.uint32
        self._counts = np.zeros((ROWS, width), dtype=dtype)
        self._mask = width - 1
        self._max = max_count
        self._window = window
        self._increments = 0

    def add(self, key: OffloadKey) -> int:
        """Count one sighting of `key`; returns its estimate, this one included."""
        return int(self.add_many([key])[0])

    def count(self, key: OffloadKey) -> int:
        """The estimated sightings of `key` (never fewer than the true count, aging and
        saturation aside)."""
        return int(self.estimate_many([key])[0])

    def estimate_many(self, keys: Sequence[OffloadKey]) -> np.ndarray:
        """`count` of each of `keys`, shape ``(len(keys),)``; counts nothing."""
        if not keys:
            return np.zeros(0, dtype=np.int64)
        return self._counts[np.arange(ROWS), self._cells(keys)].min(axis=1).astype(np.int64)

    def add_many(self, keys: Sequence[OffloadKey]) -> np.ndarray:
        """Count one sighting of each of `keys` (a key listed twice is counted twice);
        returns their estimates after all of them were counted, shape ``(len(keys),)``.
        The halving, when due, comes after the estimates are read."""
        if not keys:
            return np.zeros(0, dtype=np.int64)
        cells = self._cells(keys)
        counts = self._counts
        for row in range(ROWS):
            cell, hits = np.unique(cells[:, row], return_counts=True)  # keys sharing a cell each count
            counts[row, cell] = np.minimum(counts[row, cell] + hits, self._max)
        estimates = counts[np.arange(ROWS), cells].min(axis=1).astype(np.int64)
        self._increments += len(keys)
        if self._increments >= self._window:
            counts >>= 1
            self._increments = 0
        return estimates

    def _cells(self, keys: Sequence[OffloadKey]) -> np.ndarray:
        """The cell of each key in each row, shape ``(len(keys), ROWS)``."""
        digests = b"".join(hashlib.blake2b(key, digest_size=4 * ROWS).digest() for key in keys)
        return (np.frombuffer(digests, dtype="<u4").reshape(len(keys), ROWS) & self._mask).astype(np.intp)
