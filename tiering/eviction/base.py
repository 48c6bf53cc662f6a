"""What every eviction policy is: `BlockStatus` (a resident block's row and ref count),
`CachePolicy` (the interface the CPU tier calls), and the registry of policies by name.

A policy orders the resident blocks and picks victims; it never frees rows itself. A block
whose ref count is not 0 (a write in flight, or readers) is never picked.

Thread: the scheduler thread only, through the CPU tier.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Collection, Container, Iterator, Sequence
from itertools import islice
from typing import Any

from tiering.contract.keys import OffloadKey


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

    def insert_all(self, keys: Sequence[OffloadKey], blocks: Sequence[BlockStatus]) -> None:
        """`insert` each of `keys` (none resident, no key twice) with its block, in order: the
        last ends most recent. The default calls `insert` for each; a policy overrides it
        where a batch costs less (the CPU tier reserves a request's rows in one call)."""
        for key, block in zip(keys, blocks, strict=False):
            self.insert(key, block)

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

    def park(self, key: OffloadKey) -> None:
        """Take resident `key` out of the eviction order while a retention deadline holds it
        (`tiering.eviction.retention`): `candidates` and `evict` never meet it, so no call
        pays for the blocks clients retain; it stays resident (`get`, `remove`, `items`,
        `len`, `coldest` last). The default keeps it in place (correct; eviction walks then
        step over it, `defer`)."""
        return

    def unpark(self, key: OffloadKey, recent: bool) -> None:
        """Put parked `key` back in the eviction order as its deadline ends (lapsed, given up
        or released): at the most recent end (`recent`: a request used it while parked, or
        eviction would not have reached it yet) or at the least recent. The default does
        nothing (`park` kept it in place)."""
        return

    def defer(self, key: OffloadKey) -> None:
        """Move resident `key` to the most recent end of its list without counting a use:
        eviction passed it over for a retention deadline (`tiering.eviction.retention`). The
        default keeps it in place (correct; each eviction walk then steps over it again)."""
        return

    def demote(self, key: OffloadKey) -> None:
        """Move resident `key` to the least recent end of its list without counting a use:
        its retention deadline lapsed after eviction deferred it. The default keeps it in place."""
        return

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


def evictable(blocks: OrderedDict[OffloadKey, BlockStatus], protected: Container[OffloadKey]):
    """Idle, unprotected entries of `blocks`, least recent first."""
    return ((k, b) for k, b in blocks.items() if b.ref_cnt == 0 and k not in protected)


def oldest_evictable(
    blocks: OrderedDict[OffloadKey, BlockStatus], n: int, protected: Container[OffloadKey]
) -> list[tuple[OffloadKey, BlockStatus]]:
    """The first `n` of `evictable` (fewer if there are not as many). The oldest `n` entries
    are checked first, without a generator: most often they are the answer."""
    oldest = list(islice(blocks.items(), n))
    for key, block in oldest:
        if block.ref_cnt or key in protected:
            return list(islice(evictable(blocks, protected), n))
    return oldest


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


def lists_candidates(policy: type[CachePolicy]) -> bool:
    """Whether `policy` implements `candidates` (and `candidate`, `evict_candidates`): what
    tenants and retention hints need of it."""
    return policy.candidates is not CachePolicy.candidates


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
