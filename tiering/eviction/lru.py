"""LRU: least recently used, request-scoped as vLLM's (``lru``).

Thread: the scheduler thread only, through the CPU tier.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Container, Iterator, Sequence
from itertools import chain, islice

from tiering.contract.keys import OffloadKey
from tiering.eviction.base import BlockStatus, CachePolicy, oldest_evictable, register_cache_policy


@register_cache_policy("lru")
class LRUCachePolicy(CachePolicy):
    """Least recently used: a block is ranked most recent when its row is reserved, when
    it is touched, and when a request that used it finishes (head last, so a prefix's
    tail goes before its head). Blocks under a retention deadline wait outside the order
    (`park`)."""

    def __init__(self, capacity: int):
        super().__init__(capacity)
        self._blocks: OrderedDict[OffloadKey, BlockStatus] = OrderedDict()
        self._parked: dict[OffloadKey, BlockStatus] = {}  # retained: out of the eviction order (`park`)

    def get(self, key: OffloadKey) -> BlockStatus | None:
        block = self._blocks.get(key)
        return block if block is not None or not self._parked else self._parked.get(key)

    def insert(self, key: OffloadKey, block: BlockStatus) -> None:
        self._blocks[key] = block

    def insert_all(self, keys: Sequence[OffloadKey], blocks: Sequence[BlockStatus]) -> None:
        # A loop of item sets (OrderedDict.update takes longer), over a zip without `strict`
        # (which doubles the cost of a short zip in Python 3.11): the CPU tier's hot path.
        ordered = self._blocks
        for key, block in zip(keys, blocks, strict=False):
            ordered[key] = block

    def remove(self, key: OffloadKey) -> BlockStatus | None:
        block = self._blocks.pop(key, None)
        return block if block is not None or not self._parked else self._parked.pop(key, None)

    def touch(self, keys: Collection[OffloadKey]) -> None:
        move_to_end = self._blocks.move_to_end
        for key in reversed(keys if isinstance(keys, list | tuple) else list(keys)):
            try:  # noqa: SIM105 (suppress() costs a context manager per key; resident keys, the rule, take one call)
                move_to_end(key)
            except KeyError:
                pass

    def park(self, key: OffloadKey) -> None:
        block = self._blocks.pop(key, None)
        if block is not None:
            self._parked[key] = block

    def unpark(self, key: OffloadKey, recent: bool) -> None:
        block = self._parked.pop(key, None)
        if block is not None:
            self._blocks[key] = block
            if not recent:
                self._blocks.move_to_end(key, last=False)

    def defer(self, key: OffloadKey) -> None:
        self._blocks.move_to_end(key)

    def demote(self, key: OffloadKey) -> None:
        self._blocks.move_to_end(key, last=False)

    def candidates(self, n: int, protected: Container[OffloadKey]) -> list[tuple[OffloadKey, BlockStatus]]:
        return oldest_evictable(self._blocks, n, protected)

    def evict_candidates(self, chosen: list[tuple[OffloadKey, BlockStatus]]) -> list[tuple[OffloadKey, BlockStatus]]:
        for key, _ in chosen:
            del self._blocks[key]
        return chosen

    def candidate(self, key: OffloadKey) -> tuple[OffloadKey, BlockStatus] | None:
        block = self._blocks.get(key)
        return None if block is None else (key, block)

    def items(self) -> Iterator[tuple[OffloadKey, BlockStatus]]:
        return iter([*self._blocks.items(), *self._parked.items()])

    def coldest(self, n: int) -> list[OffloadKey]:
        return list(islice(chain(self._blocks, self._parked), n))

    def __len__(self) -> int:
        return len(self._blocks) + len(self._parked)
