"""ARC: the adaptive replacement cache, request-scoped as vLLM's (``arc``).

Thread: the scheduler thread only, through the CPU tier.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Container, Iterator, Sequence
from itertools import chain, islice

from tiering.contract.keys import OffloadKey
from tiering.eviction.base import BlockStatus, CachePolicy, evictable, oldest_evictable, register_cache_policy


@register_cache_policy("arc")
class ARCCachePolicy(CachePolicy):
    """Adaptive replacement cache (Megiddo and Modha, FAST'03), request-scoped as vLLM's.

    Resident blocks live in T1 (seen once) or T2 (used again). A block enters T1 when its
    row is reserved; it moves to T2 when a request reuses it once ready (a touch, or a
    finished request that loaded it or offered it again), so a block used twice survives a
    scan of blocks used once. A block a request only stored keeps its list. Evicted keys
    are remembered in the ghost lists B1 and B2 (at most `capacity` each); a request that
    stores a key found there (once per request, `on_store_miss`) or touches it adapts the
    target size of T1: towards recency after a B1 hit, towards frequency after a B2 hit.
    Eviction takes T1's least recent idle block while T1 holds at least its target, else
    T2's, else T1's. Blocks under a retention deadline wait outside both lists (`park`).

    All of that is vLLM's own ARC, with one deliberate difference: a block stored again
    while its key is in a ghost list enters T2, as in the paper (it is that key's second
    use), where vLLM's enters T1. Measured with `tiering-bench` (CPU tier of 5% of the
    unique blocks, no GPU cache in front, at 5ef3e48): 22.0% of prompt tokens against 19.4% on
    the Mooncake conversation trace, 37.8% against 32.3% on the synthetic chat + RAG trace.
    """

    learns_from_store_misses = True

    def __init__(self, capacity: int):
        super().__init__(capacity)
        self._t1: OrderedDict[OffloadKey, BlockStatus] = OrderedDict()
        self._t2: OrderedDict[OffloadKey, BlockStatus] = OrderedDict()
        self._b1: OrderedDict[OffloadKey, None] = OrderedDict()
        self._b2: OrderedDict[OffloadKey, None] = OrderedDict()
        self.target_t1_size = 0.0
        self._no_ghost_hits: Sequence[OffloadKey] | None = None  # keys `on_store_miss` found in no ghost list
        self._parked: dict[OffloadKey, tuple[BlockStatus, bool]] = {}  # retained (`park`): block, from T1

    def get(self, key: OffloadKey) -> BlockStatus | None:
        block = self._t1.get(key)
        if block is None:
            block = self._t2.get(key)
        if block is None and self._parked and (parked := self._parked.get(key)) is not None:
            return parked[0]
        return block

    def insert(self, key: OffloadKey, block: BlockStatus) -> None:
        if key in self._b1 or key in self._b2:  # its second use
            self._b1.pop(key, None)
            self._b2.pop(key, None)
            self._t2[key] = block
        else:
            self._t1[key] = block

    def insert_all(self, keys: Sequence[OffloadKey], blocks: Sequence[BlockStatus]) -> None:
        # The CPU tier inserts the very keys it just reported to `on_store_miss` (a request's
        # first store, the rule): their ghost lists were checked there, and the evictions in
        # between add only resident keys to them.
        checked, self._no_ghost_hits = self._no_ghost_hits, None
        if keys is not checked and self._ghost_hits(keys):
            super().insert_all(keys, blocks)
        else:  # the rule: all of them enter T1
            t1 = self._t1  # (a loop of item sets: OrderedDict.update takes longer)
            for key, block in zip(keys, blocks, strict=False):
                t1[key] = block

    def _ghost_hits(self, keys: Sequence[OffloadKey]) -> set[OffloadKey]:
        """Those of `keys` in a ghost list (a set operation per list, in C: the ghosts are
        many, a request's keys few)."""
        b1, b2 = self._b1, self._b2
        hits = b1.keys() & keys if b1 else set()
        return hits | (b2.keys() & keys) if b2 else hits

    def remove(self, key: OffloadKey) -> BlockStatus | None:
        block = self._t1.pop(key, None)
        if block is None:
            block = self._t2.pop(key, None)
        if block is None and self._parked and (parked := self._parked.pop(key, None)) is not None:
            return parked[0]
        return block

    def _adapt_to_ghost_hit(self, key: OffloadKey) -> None:
        b1, b2 = self._b1, self._b2
        if key in b1:
            self.target_t1_size = min(float(self.capacity), self.target_t1_size + max(1.0, len(b2) / len(b1)))
            b1.move_to_end(key)
        elif key in b2:
            self.target_t1_size = max(0.0, self.target_t1_size - max(1.0, len(b1) / len(b2)))
            b2.move_to_end(key)

    def on_store_miss(self, keys: Sequence[OffloadKey]) -> None:
        hits = self._ghost_hits(keys)
        self._no_ghost_hits = None if hits else keys
        if hits:
            for key in reversed(keys):
                if key in hits:
                    self._adapt_to_ghost_hit(key)

    def touch(self, keys: Collection[OffloadKey]) -> None:
        t1, t2 = self._t1, self._t2
        for key in reversed(list(keys)):
            if key in t1:
                block = t1.pop(key)
                (t1 if block.ref_cnt < 0 else t2)[key] = block  # a write in flight is no reuse
            elif key in t2:
                t2.move_to_end(key)
            else:
                self._adapt_to_ghost_hit(key)

    def on_request_finished(
        self, keys: Sequence[OffloadKey], inserted: Collection[OffloadKey], reused: Collection[OffloadKey]
    ) -> None:
        t1, t2 = self._t1, self._t2
        if not reused and len(inserted) == len(keys):  # it only stored (`keys` holds `inserted`): no lookups
            for key in reversed(keys):
                if key in t1:
                    t1.move_to_end(key)
                elif key in t2:
                    t2.move_to_end(key)
            return
        for key in reversed(keys):
            if reused and key in reused:  # (most requests reuse nothing: no lookup then)
                if key in t1:
                    t2[key] = t1.pop(key)
                elif key in t2:
                    t2.move_to_end(key)
            elif key in inserted:  # a store is no reuse: keep the list, refresh recency
                if key in t1:
                    t1.move_to_end(key)
                elif key in t2:
                    t2.move_to_end(key)

    def park(self, key: OffloadKey) -> None:
        if key in self._t1:
            self._parked[key] = (self._t1.pop(key), True)
        elif key in self._t2:
            self._parked[key] = (self._t2.pop(key), False)

    def unpark(self, key: OffloadKey, recent: bool) -> None:
        """Back into the list it left, at its most recent end (`recent`) or its least."""
        parked = self._parked.pop(key, None)
        if parked is None:
            return
        block, in_t1 = parked
        blocks = self._t1 if in_t1 else self._t2
        blocks[key] = block
        if not recent:
            blocks.move_to_end(key, last=False)

    def defer(self, key: OffloadKey) -> None:
        (self._t1 if key in self._t1 else self._t2).move_to_end(key)

    def demote(self, key: OffloadKey) -> None:
        (self._t1 if key in self._t1 else self._t2).move_to_end(key, last=False)

    def evict(self, n: int, protected: Container[OffloadKey]) -> list[tuple[OffloadKey, BlockStatus]] | None:
        victims = self._evict_from_one_list(n, protected)
        if victims is None:  # from both lists: `_victims` chooses block by block
            return super().evict(n, protected)
        return victims

    def candidates(self, n: int, protected: Container[OffloadKey]) -> list[tuple[OffloadKey, BlockStatus, bool]]:
        return list(islice(self._victims(protected), n))

    def candidate(self, key: OffloadKey) -> tuple[OffloadKey, BlockStatus, bool] | None:
        block = self._t1.get(key)
        if block is not None:
            return key, block, True
        block = self._t2.get(key)
        return None if block is None else (key, block, False)

    def evict_candidates(
        self, chosen: list[tuple[OffloadKey, BlockStatus, bool]]
    ) -> list[tuple[OffloadKey, BlockStatus]]:
        for key, _, in_t1 in chosen:
            (self._b1 if in_t1 else self._b2)[key] = None
            del (self._t1 if in_t1 else self._t2)[key]
        self._trim_ghosts()
        return [(key, block) for key, block, _ in chosen]

    def _trim_ghosts(self) -> None:
        for ghosts in (self._b1, self._b2):
            for _ in range(len(ghosts) - self.capacity):
                ghosts.popitem(last=False)

    def _evict_from_one_list(
        self, n: int, protected: Container[OffloadKey]
    ) -> list[tuple[OffloadKey, BlockStatus]] | None:
        """Evict, as `_victims` orders them, `n` blocks that all come from one list (the
        common case: T1 stays at or above its target for all `n`, or is below it while T2
        has `n` idle blocks), without its per-block choice; None (nothing done) otherwise."""
        t1_size, target = len(self._t1), int(self.target_t1_size)
        if t1_size - n + 1 >= target:
            blocks, ghosts = self._t1, self._b1
        elif t1_size < target:
            blocks, ghosts = self._t2, self._b2
        else:
            return None
        victims = oldest_evictable(blocks, n, protected)
        if len(victims) < n:
            return None
        for _ in range(len(ghosts) + n - self.capacity):  # room first, as `_trim_ghosts` would after:
            ghosts.popitem(last=False)  # an OrderedDict that keeps its size does not resize (a quarter cheaper)
        for key, _ in victims:
            del blocks[key]
            ghosts[key] = None
        return victims

    def coldest(self, n: int) -> list[OffloadKey]:
        victims = (key for key, _, _ in self._victims((), idle_only=False))
        return list(islice(chain(victims, self._parked), n))

    def _scans(
        self, protected: Container[OffloadKey], idle_only: bool
    ) -> tuple[Iterator[tuple[OffloadKey, BlockStatus]], Iterator[tuple[OffloadKey, BlockStatus]]]:
        """T1's and T2's entries, oldest first: the evictable ones, or all of them."""
        if idle_only:
            return evictable(self._t1, protected), evictable(self._t2, protected)
        return iter(self._t1.items()), iter(self._t2.items())

    def _victims(
        self, protected: Container[OffloadKey], idle_only: bool = True
    ) -> Iterator[tuple[OffloadKey, BlockStatus, bool]]:
        """(key, block, from T1) in the order `evict` takes them: evictable ones, or with
        `idle_only` False busy ones too. Each list is scanned once, oldest first."""
        from_t1, from_t2 = self._scans(protected, idle_only)
        t1_size, target = len(self._t1), int(self.target_t1_size)
        while True:
            picked = next(from_t1, None) if t1_size >= target else None
            in_t1 = picked is not None
            if picked is None:
                picked = next(from_t2, None)
            if picked is None:
                picked = next(from_t1, None)
                in_t1 = True
            if picked is None:
                return
            t1_size -= in_t1
            yield (*picked, in_t1)

    def items(self) -> Iterator[tuple[OffloadKey, BlockStatus]]:
        parked = [(key, block) for key, (block, _) in self._parked.items()]
        return iter([*self._t1.items(), *self._t2.items(), *parked])

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2) + len(self._parked)
