"""Offline bounds on the hit rate of a request stream, in tokens.

Every request references its full blocks, in order (its partial last block is computed
and never cached, as under vLLM: `Request.full_blocks`). A block is a hit if it is cached
when referenced; it is cached after it has been referenced (computed or loaded).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from tiering.benchmarks.loadgen.workload import Request


def _references(requests: Sequence[Request]) -> tuple[list[int], list[int], int]:
    """The block ids and token counts of every full block referenced, in order, and the
    tokens of every prompt (partial blocks included)."""
    blocks, tokens, total = [], [], 0
    for request in requests:
        full = request.full_blocks()
        counts = request.block_tokens()
        blocks.extend(request.hash_ids[:full])
        tokens.extend(counts[:full])
        total += sum(counts)
    return blocks, tokens, total


def unbounded_hit_rate(requests: Sequence[Request]) -> float:
    """Hit rate of a cache that never evicts: every reference after a block's first hits."""
    blocks, tokens, total = _references(requests)
    seen: set[int] = set()
    hits = 0
    for block, count in zip(blocks, tokens, strict=True):
        if block in seen:
            hits += count
        seen.add(block)
    return hits / max(1, total)


def prefix_hit_rate(requests: Sequence[Request]) -> float:
    """Hit rate of a cache that never evicts, with prefix semantics (as the engine serves
    them): a block hits only if it and every block before it in its request were seen
    before. This is the tightest bound any capacity can reach."""
    seen: set[int] = set()
    hits = total = 0
    for request in requests:
        full = request.full_blocks()
        counts = request.block_tokens()
        prefix = True
        for block, count in zip(request.hash_ids[:full], counts, strict=False):
            prefix = prefix and block in seen
            hits += count if prefix else 0
        total += sum(counts)
        seen.update(request.hash_ids[:full])
    return hits / max(1, total)


def belady_hit_rate(requests: Sequence[Request], capacity_blocks: int) -> float:
    """Hit rate of the offline-optimal cache of `capacity_blocks` blocks (Belady's MIN: on a
    miss with the cache full, evict the block whose next reference is farthest away, or
    never; a block never referenced again is not cached at all)."""
    blocks, tokens, total = _references(requests)
    if capacity_blocks <= 0:
        return 0.0
    never = len(blocks)
    next_use = [never] * len(blocks)
    last_seen: dict[int, int] = {}
    for position in range(len(blocks) - 1, -1, -1):
        next_use[position] = last_seen.get(blocks[position], never)
        last_seen[blocks[position]] = position
    cached: dict[int, int] = {}  # block -> its next reference
    farthest: list[tuple[int, int]] = []  # max-heap of (-next reference, block), lazily pruned
    hits = 0
    for position, block in enumerate(blocks):
        if block in cached:
            hits += tokens[position]
        elif next_use[position] == never:
            continue
        elif len(cached) >= capacity_blocks:
            while True:
                negative_next, victim = heapq.heappop(farthest)
                if cached.get(victim) == -negative_next:
                    break
            if -negative_next <= next_use[position]:  # everything cached is needed sooner
                heapq.heappush(farthest, (negative_next, victim))
                continue
            del cached[victim]
        if next_use[position] == never:
            cached.pop(block, None)
            continue
        cached[block] = next_use[position]
        heapq.heappush(farthest, (-next_use[position], block))
    return hits / max(1, total)
