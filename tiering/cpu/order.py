"""`EvictionOrder`: which of the CPU tier's blocks goes first, when the tier has no tenants.

One policy ranks every block, and the requests' retention hints give some of them soft
deadlines (`tiering.eviction.retention`). It answers the calls `tiering.cpu.tenants`'s
`TenantShares` answers for a tier with tenants, for the one tenant ``""``, so the CPU tier
calls either alike.

Thread: the scheduler thread only (owned by `CPUOffloadingManager`).
"""

from __future__ import annotations

import logging
from collections.abc import Container
from typing import Any

from tiering.contract.keys import OffloadKey, ReqContext
from tiering.eviction.base import lists_candidates
from tiering.eviction.policies import BlockStatus, CachePolicy, make_cache_policy
from tiering.eviction.retention import Retention, evict_retained, new_counters, retained_candidates

logger = logging.getLogger(__name__)


class EvictionOrder:
    """The policy `cache_policy` over `num_blocks` rows, and at most `max_retained` blocks
    under a retention deadline (0: hints are ignored).

    Raises:
        ValueError: `cache_policy` is unknown.
    """

    def __init__(self, cache_policy: str, num_blocks: int, max_retained: int):
        self._cache_policy, self._num_blocks = cache_policy, num_blocks
        self._policy = make_cache_policy(cache_policy, num_blocks)
        if max_retained and not lists_candidates(type(self._policy)):
            logger.warning("eviction policy %r lists no eviction candidates: retention hints are ignored", cache_policy)
            max_retained = 0
        self._retention = Retention(max_retained, self._policy) if max_retained else None
        self.retention_counters: dict[str, int] = (
            self._retention.counters if self._retention is not None else new_counters()
        )

    def tenant_of(self, req_context: ReqContext) -> str:
        """``""``: every request is the one tenant."""
        return ""

    def policy(self, tenant: str) -> CachePolicy:
        """The policy that ranks every block."""
        return self._policy

    def retention(self, tenant: str) -> Retention | None:
        """The blocks' retention deadlines, or None if hints are ignored."""
        return self._retention

    @property
    def retained_blocks(self) -> int:
        """Blocks holding a deadline."""
        return 0 if self._retention is None else len(self._retention)

    def insert_all(self, keys: list[OffloadKey], blocks: list[BlockStatus], tenant: str) -> None:
        """`keys` got rows (`blocks`, in order): ranked as the most recent, the last most."""
        self._policy.insert_all(keys, blocks)

    def remove(self, key: OffloadKey) -> None:
        """`key` lost its row without being evicted (a failed write)."""
        self._policy.remove(key)
        if self._retention is not None:
            self._retention.forget((key,))

    def evict(
        self, n: int, protected: Container[OffloadKey], tenant: str, adding: int
    ) -> list[tuple[OffloadKey, BlockStatus]] | None:
        """`n` idle blocks not in `protected`, evicted by the policy, by the retention rules
        while some block is retained or released; None (nothing evicted) if there are too
        few. (`tenant`, `adding`: as for `TenantShares.evict`; unused.)"""
        retention = self._retention
        if retention is None or not retention.active:
            return self._policy.evict(n, protected=protected)
        chosen: list[Any] = retained_candidates(self._policy, retention, n, protected)
        if len(chosen) < n:
            return None
        return evict_retained(self._policy, retention, chosen)

    def coldest(self, n: int) -> list[OffloadKey]:
        """Up to `n` blocks in the order the policy would evict them, busy ones included."""
        return self._policy.coldest(n)

    def reset(self) -> None:
        """Forget every block and deadline."""
        self._policy = make_cache_policy(self._cache_policy, self._num_blocks)
        if self._retention is not None:
            self._retention.clear()
            self._retention.order = self._policy
