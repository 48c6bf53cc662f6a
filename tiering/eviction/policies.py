"""Eviction policies of the primary tier (LRU, ARC), registered by name.

A policy orders the resident blocks and picks victims; it never frees rows itself. A block
whose ref count is not 0 (a write in flight, or readers) is never picked.

Thread: the scheduler thread only, through the primary tier.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Collection, Container, Iterator, Sequence
from itertools import islice
from typing import Any

from tiering.contract.keys import OffloadKey
from tiering.eviction.sketch import CountMinSketch


class BlockStatus:
    """A resident block: its primary row and its ref count.

    ``ref_cnt`` is -1 while a write into the row is in flight, 0 when the block is idle
    (loadable and evictable), and n > 0 while n readers hold it.
    """

    __slots__ = ("block_id", "ref_cnt")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = -1

    def __repr__(self) -> str:
        return f"BlockStatus(block_id={self.block_id}, ref_cnt={self.ref_cnt})"


class CachePolicy(ABC):
    """Ordering of resident blocks for eviction. Used from the scheduler thread only.

    Recency is logical, as in vLLM's own policies: a block is ranked when its row is
    reserved (`insert`, at ``prepare_store``), not when its write completes, and a finished
    request re-ranks the blocks it used (`on_request_finished`) so that its head ends up
    more recent than its tail. Completion order, and the container a scheduler passes
    keys in, never changes which block goes first.
    """

    learns_from_store_misses = False
    """Whether `on_store_miss` does anything (the primary tier skips the call otherwise)."""

    def __init__(self, capacity: int):
        """`capacity`: how many blocks the tier holds at most (> 0)."""
        self.capacity = capacity

    @abstractmethod
    def get(self, key: OffloadKey) -> BlockStatus | None:
        """The resident block of `key`, or None. Does not change recency."""

    @abstractmethod
    def insert(self, key: OffloadKey, block: BlockStatus) -> None:
        """Add a block that is not resident, as the most recent."""

    @abstractmethod
    def remove(self, key: OffloadKey) -> BlockStatus | None:
        """Drop `key` without remembering it as evicted; returns its block or None."""

    @abstractmethod
    def touch(self, keys: Collection[OffloadKey]) -> None:
        """Record a use of the resident keys; the first key ends up the most recent."""

    def on_store_miss(self, keys: Sequence[OffloadKey]) -> None:
        """`keys` (not resident) are about to be inserted for a request that had not
        offered them before: a policy with ghost lists learns from them here, once per
        request. The default does nothing."""
        return

    def on_request_finished(
        self, keys: Sequence[OffloadKey], inserted: Collection[OffloadKey], reused: Collection[OffloadKey]
    ) -> None:
        """Apply a finished request's accesses once: `keys` head to tail (its prefix
        order), `inserted` the blocks whose rows it reserved, `reused` the ready blocks it
        loaded or offered again (a block in both counts as reused). The default touches
        `keys` (the head ends most recent)."""
        self.touch(keys)

    def evict(self, n: int, protected: Container[OffloadKey]) -> list[tuple[OffloadKey, BlockStatus]] | None:
        """Remove `n` idle blocks that are not in `protected`, least valuable first. The
        default: `candidates`, then `evict_candidates`.

        Returns:
            The removed (key, block) pairs, or None, removing nothing, if fewer than `n`
            blocks can be evicted.
        """
        chosen = self.candidates(n, protected)
        return None if len(chosen) < n else self.evict_candidates(chosen)

    def candidates(self, n: int, protected: Container[OffloadKey]) -> list[Any]:
        """Up to `n` idle blocks not in `protected`, in the order `evict` takes them, as
        tokens for `evict_candidates`; changes nothing. (Eviction across tenants plans with
        it; a policy without it cannot serve tenants.) Scheduler thread.

        Raises:
            NotImplementedError: the policy does not list candidates (the default).
        """
        raise NotImplementedError(f"{type(self).__name__} cannot list eviction candidates")

    def evict_candidates(self, chosen: list[Any]) -> list[tuple[OffloadKey, BlockStatus]]:
        """Evict blocks `candidates` returned, with nothing changed in between; returns them
        as (key, block) pairs. Scheduler thread.

        Raises:
            NotImplementedError: the policy does not list candidates (the default).
        """
        raise NotImplementedError(f"{type(self).__name__} cannot list eviction candidates")

    def candidate(self, key: OffloadKey) -> Any:
        """The `candidates` token of resident `key`, busy or not, for `evict_candidates`; a
        tuple whose first two items are the key and its `BlockStatus`. None: not resident.

        Raises:
            NotImplementedError: the policy does not list candidates (the default).
        """
        raise NotImplementedError(f"{type(self).__name__} cannot list eviction candidates")

    @abstractmethod
    def items(self) -> Iterator[tuple[OffloadKey, BlockStatus]]:
        """Every resident (key, block), in no particular order."""

    def coldest(self, n: int) -> list[OffloadKey]:
        """Up to `n` resident blocks in the order `evict` would consider them, busy ones
        included (a write-back tier copies them before they go). The default takes `items`
        order; a policy that knows its eviction order overrides it."""
        return [key for key, _ in islice(self.items(), n)]

    @abstractmethod
    def __len__(self) -> int:
        """Number of resident blocks."""


def _evictable(blocks: OrderedDict[OffloadKey, BlockStatus], protected: Container[OffloadKey]):
    """Idle, unprotected entries of `blocks`, least recent first."""
    return ((k, b) for k, b in blocks.items() if b.ref_cnt == 0 and k not in protected)


_POLICIES: dict[str, type[CachePolicy]] = {}


def register_cache_policy(name: str) -> Callable[[type[CachePolicy]], type[CachePolicy]]:
    """Class decorator: make a `CachePolicy` available under `name`."""

    def register(cls: type[CachePolicy]) -> type[CachePolicy]:
        _POLICIES[name] = cls
        return cls

    return register


def cache_policy_names() -> list[str]:
    """Names of the registered policies, sorted."""
    return sorted(_POLICIES)


def make_cache_policy(name: str, capacity: int) -> CachePolicy:
    """Build the policy registered under `name` for `capacity` blocks.

    Raises:
        ValueError: no policy is registered under `name`; the message lists the known ones.
    """
    try:
        cls = _POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown cache policy {name!r}; known policies: {', '.join(cache_policy_names())}") from None
    return cls(capacity)


@register_cache_policy("lru")
class LRUCachePolicy(CachePolicy):
    """Least recently used: a block is ranked most recent when its row is reserved, when
    it is touched, and when a request that used it finishes (head last, so a prefix's
    tail goes before its head)."""

    def __init__(self, capacity: int):
        super().__init__(capacity)
        self._blocks: OrderedDict[OffloadKey, BlockStatus] = OrderedDict()

    def get(self, key: OffloadKey) -> BlockStatus | None:
        return self._blocks.get(key)

    def insert(self, key: OffloadKey, block: BlockStatus) -> None:
        self._blocks[key] = block

    def remove(self, key: OffloadKey) -> BlockStatus | None:
        return self._blocks.pop(key, None)

    def touch(self, keys: Collection[OffloadKey]) -> None:
        blocks = self._blocks
        for key in reversed(keys if isinstance(keys, list | tuple) else list(keys)):
            if key in blocks:
                blocks.move_to_end(key)

    def candidates(self, n: int, protected: Container[OffloadKey]) -> list[tuple[OffloadKey, BlockStatus]]:
        return list(islice(_evictable(self._blocks, protected), n))

    def evict_candidates(self, chosen: list[tuple[OffloadKey, BlockStatus]]) -> list[tuple[OffloadKey, BlockStatus]]:
        for key, _ in chosen:
            del self._blocks[key]
        return chosen

    def candidate(self, key: OffloadKey) -> tuple[OffloadKey, BlockStatus] | None:
        block = self._blocks.get(key)
        return None if block is None else (key, block)

    def items(self) -> Iterator[tuple[OffloadKey, BlockStatus]]:
        return iter(list(self._blocks.items()))

    def coldest(self, n: int) -> list[OffloadKey]:
        return list(islice(self._blocks, n))

    def __len__(self) -> int:
        return len(self._blocks)


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
    T2's, else T1's.

    All of that is vLLM's own ARC, with one deliberate difference: a block stored again
    while its key is in a ghost list enters T2, as in the paper (it is that key's second
    use), where vLLM's enters T1. Measured with `tiering-bench` (CPU tier of 5% of the
    unique blocks, no GPU cache in front): 21.6% of prompt tokens against 18.7% on the
    Mooncake conversation trace, 37.8% against 32.2% on the synthetic chat + RAG trace.
    """

    learns_from_store_misses = True

    def __init__(self, capacity: int):
        super().__init__(capacity)
        self._t1: OrderedDict[OffloadKey, BlockStatus] = OrderedDict()
        self._t2: OrderedDict[OffloadKey, BlockStatus] = OrderedDict()
        self._b1: OrderedDict[OffloadKey, None] = OrderedDict()
        self._b2: OrderedDict[OffloadKey, None] = OrderedDict()
        self.target_t1_size = 0.0

    def get(self, key: OffloadKey) -> BlockStatus | None:
        block = self._t1.get(key)
        return block if block is not None else self._t2.get(key)

    def insert(self, key: OffloadKey, block: BlockStatus) -> None:
        if key in self._b1 or key in self._b2:  # its second use
            self._b1.pop(key, None)
            self._b2.pop(key, None)
            self._t2[key] = block
        else:
            self._t1[key] = block

    def remove(self, key: OffloadKey) -> BlockStatus | None:
        block = self._t1.pop(key, None)
        return block if block is not None else self._t2.pop(key, None)

    def _adapt_to_ghost_hit(self, key: OffloadKey) -> None:
        b1, b2 = self._b1, self._b2
        if key in b1:
            self.target_t1_size = min(float(self.capacity), self.target_t1_size + max(1.0, len(b2) / len(b1)))
            b1.move_to_end(key)
        elif key in b2:
            self.target_t1_size = max(0.0, self.target_t1_size - max(1.0, len(b1) / len(b2)))
            b2.move_to_end(key)

    def on_store_miss(self, keys: Sequence[OffloadKey]) -> None:
        b1, b2 = self._b1, self._b2
        for key in reversed(keys):
            if key in b1 or key in b2:
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
        for key in reversed(keys):
            if key in reused:
                if key in t1:
                    t2[key] = t1.pop(key)
                elif key in t2:
                    t2.move_to_end(key)
            elif key in inserted:  # a store is no reuse: keep the list, refresh recency
                if key in t1:
                    t1.move_to_end(key)
                elif key in t2:
                    t2.move_to_end(key)

    def evict(self, n: int, protected: Container[OffloadKey]) -> list[tuple[OffloadKey, BlockStatus]] | None:
        victims = self._evict_from_one_list(n, protected)
        if victims is None:  # from both lists: `_victims` chooses block by block
            return super().evict(n, protected)
        self._trim_ghosts()
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
        victims = list(islice(_evictable(blocks, protected), n))
        if len(victims) < n:
            return None
        for key, _ in victims:
            del blocks[key]
            ghosts[key] = None
        return victims

    def coldest(self, n: int) -> list[OffloadKey]:
        return [key for key, _, _ in islice(self._victims((), idle_only=False), n)]

    def _scans(
        self, protected: Container[OffloadKey], idle_only: bool
    ) -> tuple[Iterator[tuple[OffloadKey, BlockStatus]], Iterator[tuple[OffloadKey, BlockStatus]]]:
        """T1's and T2's entries, oldest first: the evictable ones, or all of them."""
        if idle_only:
            return _evictable(self._t1, protected), _evictable(self._t2, protected)
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
        return iter([*self._t1.items(), *self._t2.items()])

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)


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

    Measured with `tiering-bench` (README, "Eviction policies"): it beats ARC where the CPU
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
        for key, count in zip(reversed(keys), reversed(self.sketch.add_many(keys)), strict=True):
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
