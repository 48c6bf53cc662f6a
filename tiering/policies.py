"""Eviction policies of the primary tier (LRU, ARC), registered by name.

A policy orders the resident blocks and picks victims; it never frees rows itself. A block
whose ref count is not 0 (a write in flight, or readers) is never picked.

Thread: the scheduler thread only, through the primary tier.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterator
from itertools import islice

from tiering.keys import OffloadKey


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
    """Ordering of resident blocks for eviction. Used from the scheduler thread only."""

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

    @abstractmethod
    def mark_recent(self, key: OffloadKey) -> None:
        """Make a resident key the most recent of its list without counting a use."""

    @abstractmethod
    def evict(self, n: int, protected: Collection[OffloadKey]) -> list[tuple[OffloadKey, BlockStatus]] | None:
        """Remove `n` idle blocks that are not in `protected`, least valuable first.

        Returns:
            The removed (key, block) pairs, or None, removing nothing, if fewer than `n`
            blocks can be evicted.
        """

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


def _evictable(blocks: OrderedDict[OffloadKey, BlockStatus], protected: Collection[OffloadKey]):
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
    """Least recently used: a completed store or a touch makes a block the most recent."""

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
        for key in reversed(list(keys)):
            if key in blocks:
                blocks.move_to_end(key)

    def mark_recent(self, key: OffloadKey) -> None:
        self._blocks.move_to_end(key)

    def evict(self, n: int, protected: Collection[OffloadKey]) -> list[tuple[OffloadKey, BlockStatus]] | None:
        victims = list(islice(_evictable(self._blocks, protected), n))
        if len(victims) < n:
            return None
        for key, _ in victims:
            del self._blocks[key]
        return victims

    def items(self) -> Iterator[tuple[OffloadKey, BlockStatus]]:
        return iter(list(self._blocks.items()))

    def coldest(self, n: int) -> list[OffloadKey]:
        return list(islice(self._blocks, n))

    def __len__(self) -> int:
        return len(self._blocks)


@register_cache_policy("arc")
class ARCCachePolicy(CachePolicy):
    """Adaptive replacement cache (Megiddo and Modha, FAST'03).

    Resident blocks live in T1 (seen once) or T2 (used again). A touch of a T1 block moves
    it to T2, so a block used twice survives a scan of blocks used once. Evicted keys are
    remembered in the ghost lists B1 and B2; inserting a key found there adapts the target
    size of T1 (towards recency after a B1 hit, towards frequency after a B2 hit) and puts the
    block straight into T2.
    """

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
        b1, b2 = len(self._b1), len(self._b2)
        if key in self._b1:
            self.target_t1_size = min(float(self.capacity), self.target_t1_size + max(1.0, b2 / b1))
            del self._b1[key]
            self._t2[key] = block
        elif key in self._b2:
            self.target_t1_size = max(0.0, self.target_t1_size - max(1.0, b1 / b2))
            del self._b2[key]
            self._t2[key] = block
        else:
            self._t1[key] = block

    def remove(self, key: OffloadKey) -> BlockStatus | None:
        block = self._t1.pop(key, None)
        return block if block is not None else self._t2.pop(key, None)

    def touch(self, keys: Collection[OffloadKey]) -> None:
        t1, t2 = self._t1, self._t2
        for key in reversed(list(keys)):
            if key in t1:
                t2[key] = t1.pop(key)
            elif key in t2:
                t2.move_to_end(key)

    def mark_recent(self, key: OffloadKey) -> None:
        (self._t1 if key in self._t1 else self._t2).move_to_end(key)

    def evict(self, n: int, protected: Collection[OffloadKey]) -> list[tuple[OffloadKey, BlockStatus]] | None:
        victims = self._victims(n, protected)
        if len(victims) < n:
            return None
        for key, _, in_t1 in victims:
            if in_t1:
                del self._t1[key]
                self._remember(self._b1, key)
            else:
                del self._t2[key]
                self._remember(self._b2, key)
        return [(key, block) for key, block, _ in victims]

    def coldest(self, n: int) -> list[OffloadKey]:
        return [key for key, _, _ in self._victims(n, (), idle_only=False)]

    def _victims(
        self, n: int, protected: Collection[OffloadKey], idle_only: bool = True
    ) -> list[tuple[OffloadKey, BlockStatus, bool]]:
        """Up to `n` (key, block, from T1) in the order `evict` takes them: evictable ones,
        or with `idle_only` False busy ones too."""
        if idle_only:
            from_t1, from_t2 = _evictable(self._t1, protected), _evictable(self._t2, protected)
        else:
            from_t1, from_t2 = iter(self._t1.items()), iter(self._t2.items())
        t1_size = len(self._t1)
        victims: list[tuple[OffloadKey, BlockStatus, bool]] = []
        while len(victims) < n:
            prefer_t1 = t1_size > 0 and t1_size >= max(1.0, self.target_t1_size)
            first, second = (from_t1, from_t2) if prefer_t1 else (from_t2, from_t1)
            picked = next(first, None)
            if picked is None:
                picked = next(second, None)
                if picked is None:
                    break
                first = second
            in_t1 = first is from_t1
            t1_size -= in_t1
            victims.append((*picked, in_t1))
        return victims

    def _remember(self, ghosts: OrderedDict[OffloadKey, None], key: OffloadKey) -> None:
        ghosts[key] = None
        if len(ghosts) > self.capacity:
            ghosts.popitem(last=False)

    def items(self) -> Iterator[tuple[OffloadKey, BlockStatus]]:
        return iter([*self._t1.items(), *self._t2.items()])

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)
