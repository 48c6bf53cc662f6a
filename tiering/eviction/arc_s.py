"""ARC-S: ARC whose lists follow how many requests used a key (``arc-s``).

Thread: the scheduler thread only, through the CPU tier.
"""

from __future__ import annotations

from collections.abc import Collection, Container, Iterator, Sequence

from tiering.contract.keys import OffloadKey
from tiering.eviction.arc import ARCCachePolicy
from tiering.eviction.base import BlockStatus, CachePolicy, register_cache_policy
from tiering.eviction.sketch import CountMinSketch


@register_cache_policy("arc-s")
class ARCSCachePolicy(ARCCachePolicy):
    """ARC with frequency learned from requests (``arc-s``): ARC's lists, but a block's list
    follows how many requests used its key, counted in a `CountMinSketch`, not whether it
    was reused while resident. T1 holds keys counted once ("once"), T2 keys counted at
    least twice ("repeat"); B1 and B2 remember their evicted keys.

    - **Counting.** Once per request, every key the request loaded or offered for storage
      is counted (`on_request_finished`; `touch` counts its keys too), resident or not. The
      sketch has ``4 x width`` 4-bit counters (a byte each: 4 x 64 bytes per block of
      capacity at most), ``width`` at least 32 times the capacity (a narrower one lets
      collisions make new keys look repeated), and halves them every 10 times the
      capacity's increments (measured: every 20 times lost a point of hit rate with a tier
      of 1% of the Mooncake trace's blocks; 10 reproduces the simulation that chose ARC-S).
    - **Lists.** Counting a request's keys moves each resident one to the most recent end
      of its list (T2 if counted at least twice, else T1), tail first, so that the head of
      a prefix ends most recent; a block may move either way. A new block enters T2 if its
      key is in a ghost list, else T1, until its request finishes and counts it (measured
      with `tiering-bench`: placing it by its count at once changed no hit rate, and cost
      2 us a block).
    - **Ghosts.** B1 and B2 hold at most half the capacity each. A request storing a key
      found in B1 (once per request, `on_store_miss`) raises T1's target by `STEP` blocks;
      one found in B2 lowers it by `STEP` (within 0 and the capacity).
    - **Eviction** takes the least recent idle block of the list furthest over its target
      (T2's target is the capacity minus T1's), then of the other.

    Measured with `tiering-bench` (docs/configuration.md, "Eviction policies"): it beats ARC where the CPU
    tier is small against the working set, as it keeps blocks that many requests share
    even when each stay in the tier is too short for a reuse to happen there.
    """

    STEP = 4.0
    """Blocks a ghost hit moves T1's target by."""

    def __init__(self, capacity: int):
        super().__init__(capacity)
        self._max_ghosts = max(1, capacity // 2)
        width = 1 << max(10, (32 * capacity - 1).bit_length())  # >= 1024: no collisions to speak of in a tiny cache
        self.sketch = CountMinSketch(width, 10 * capacity, max_count=15)

    def on_store_miss(self, keys: Sequence[OffloadKey]) -> None:
        for key in keys:
            if key in self._b1:
                self.target_t1_size = min(float(self.capacity), self.target_t1_size + self.STEP)
            elif key in self._b2:
                self.target_t1_size = max(0.0, self.target_t1_size - self.STEP)

    def touch(self, keys: Collection[OffloadKey]) -> None:
        """Count `keys` as one use each and rank the resident ones, the first most recent."""
        self._count(list(keys))

    def on_request_finished(
        self, keys: Sequence[OffloadKey], inserted: Collection[OffloadKey], reused: Collection[OffloadKey]
    ) -> None:
        self._count(keys)

    def _count(self, keys: Sequence[OffloadKey]) -> None:
        t1, t2 = self._t1, self._t2
        for key, count in zip(reversed(keys), reversed(self.sketch.add_many(keys)), strict=False):
            into, other = (t2, t1) if count >= 2 else (t1, t2)
            if key in into:
                into.move_to_end(key)
            elif key in other:
                into[key] = other.pop(key)

    def evict(self, n: int, protected: Container[OffloadKey]) -> list[tuple[OffloadKey, BlockStatus]] | None:
        return CachePolicy.evict(self, n, protected)  # ARC's one-list shortcut orders blocks as ARC does

    def evict_candidates(
        self, chosen: list[tuple[OffloadKey, BlockStatus, bool]]
    ) -> list[tuple[OffloadKey, BlockStatus]]:
        victims = []
        for key, block, in_t1 in chosen:
            del (self._t1 if in_t1 else self._t2)[key]
            ghosts = self._b1 if in_t1 else self._b2
            ghosts[key] = None
            if len(ghosts) > self._max_ghosts:
                ghosts.popitem(last=False)
            victims.append((key, block))
        return victims

    def _victims(
        self, protected: Container[OffloadKey], idle_only: bool = True
    ) -> Iterator[tuple[OffloadKey, BlockStatus, bool]]:
        """(key, block, from T1) in the order `evict` takes them: evictable ones, or with
        `idle_only` False busy ones too. Each list is scanned once, oldest first."""
        t1, t2 = self._scans(protected, idle_only)
        t1_over = len(self._t1) - self.target_t1_size
        t2_over = len(self._t2) - (self.capacity - self.target_t1_size)
        while True:
            in_t1 = t1_over >= t2_over
            picked = next(t1 if in_t1 else t2, None)
            if picked is None:
                in_t1 = not in_t1
                picked = next(t1 if in_t1 else t2, None)
            if picked is None:
                return
            if in_t1:
                t1_over -= 1
            else:
                t2_over -= 1
            yield (*picked, in_t1)
