"""Tenants of the CPU tier: who holds which rows, their shares, and eviction that keeps them.

Tenants of one engine share its CPU tier, so one tenant's burst of new prompts would evict
every other tenant's prefixes. With a ``tenants`` config each tenant has a share of the
tier's rows (a fraction of them, or bytes), and eviction follows two rules:

- a store or promotion evicts from tenants over their share first;
- a tenant over its share (counting the blocks it is adding) evicts only from tenants over
  theirs and from itself: a tenant within its share is never evicted to make room for one
  beyond it. Without such blocks idle, the call is refused, as when every row is busy.

Shares are not reservations: rows a tenant does not use serve the others until it needs
them back. A request's tenant is `ReqContext.tenant`, or `TenantsConfig.default_tenant` when
that is None (the vLLM adapter sets it to the request's ``cache_salt``). Keys are not changed:
tenants' blocks never share a key because the block hashes they come from differ (vLLM mixes
the salt into the first block's hash, and every later hash chains on it).

Thread: the scheduler thread only, as the CPU tier that owns it.
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Container, Iterable
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, Field

from tiering.keys import OffloadKey, ReqContext
from tiering.options import STRICT, Count, parse_size
from tiering.policies import BlockStatus, CachePolicy

OTHER = "other"  # the label of the tenants beyond the `metric_tenants` most active


def _share(value: Any) -> float | int:
    """A fraction of the tier (a number from 0 to 1, exclusive of 0) or bytes (an integer
    above 1, or a size string such as ``"8GiB"``)."""
    if isinstance(value, float | int) and not isinstance(value, bool) and 0 < value <= 1:
        return float(value)
    try:
        return parse_size(value)
    except ValueError:
        raise ValueError(f"expected a fraction of the tier (0 < x <= 1) or bytes such as 8GiB; got {value!r}") from None


Share = Annotated[float | int, BeforeValidator(_share)]
"""A tenant's share of the CPU tier: a fraction (a float, 0 < x <= 1) or bytes (above 1)."""


class TenantsConfig(BaseModel):
    """The ``tenants`` key of a config.

    Attributes:
        default_tenant: the tenant of requests that name none.
        default_share: the share of every tenant not in `quotas`.
        quotas: shares by tenant name.
        metric_tenants: tenants counted by name in stats and metrics (the most active);
            the rest are summed under ``other``, so labels stay few.
    """

    model_config = STRICT

    default_tenant: str = Field(default="default", min_length=1)
    default_share: Share = 1.0
    quotas: dict[str, Share] = Field(default_factory=dict)
    metric_tenants: Count = 8


class TenantShares:
    """Owners and shares of a CPU tier's rows, and the choice of victims that respects them.

    Args:
        config: the tenants and their shares.
        num_blocks: rows of the tier.
        row_bytes: bytes of one row (shares in bytes become rows).
    """

    def __init__(self, config: TenantsConfig, num_blocks: int, row_bytes: int):
        self.config = config
        self.row_bytes = row_bytes
        self._default_rows = self._rows(config.default_share, num_blocks)
        self._rows_by_tenant = {name: self._rows(share, num_blocks) for name, share in config.quotas.items()}
        self.owner: dict[OffloadKey, str] = {}
        self.held: Counter[str] = Counter()
        self.counters: dict[str, Counter[str]] = {}

    def _rows(self, share: float | int, num_blocks: int) -> int:
        if isinstance(share, float):
            return max(1, int(share * num_blocks))
        return max(1, share // self.row_bytes)

    def tenant_of(self, req_context: ReqContext) -> str:
        """The tenant of a call's request."""
        return getattr(req_context, "tenant", None) or self.config.default_tenant

    def share(self, tenant: str) -> int:
        """Rows `tenant` may hold while others need them."""
        return self._rows_by_tenant.get(tenant, self._default_rows)

    def count(self, tenant: str, name: str, amount: int = 1) -> None:
        """Add `amount` to `tenant`'s counter `name` (``hits``, ``misses``, ``blocks_stored``)."""
        counters = self.counters.get(tenant)
        if counters is None:
            counters = self.counters[tenant] = Counter()
        counters[name] += amount

    def added(self, keys: Iterable[OffloadKey], tenant: str) -> None:
        """`keys` got rows for `tenant`."""
        owner = self.owner
        added = 0
        for key in keys:
            owner[key] = tenant
            added += 1
        self.held[tenant] += added

    def removed(self, keys: Iterable[OffloadKey]) -> None:
        """`keys` lost their rows (evicted, dropped, reset)."""
        owner, held = self.owner, self.held
        for key in keys:
            tenant = owner.pop(key, None)
            if tenant is not None:
                held[tenant] -= 1

    def evict(
        self, policy: CachePolicy, n: int, protected: Container[OffloadKey], tenant: str, adding: int
    ) -> list[tuple[OffloadKey, BlockStatus]] | None:
        """`n` victims for `tenant`, which is adding `adding` blocks, by the rules of the
        module docstring, in `policy`'s order; None (nothing evicted) if there are too few."""
        held = self.held
        over = {name for name, rows in held.items() if rows > self.share(name)}
        beyond = held[tenant] + adding > self.share(tenant)
        if beyond:
            over.add(tenant)
        if over:
            victims = policy.evict(n, _OwnedOutside(protected, self.owner, over))
            if victims is not None or beyond:
                return victims
        elif beyond:
            return None
        return policy.evict(n, protected)

    def stats(self) -> dict[str, dict[str, Any]]:
        """Counters and gauges by tenant: the `metric_tenants` with the most lookups by
        name, the rest summed as ``other``."""
        names = set(self.counters) | {name for name, rows in self.held.items() if rows}
        activity = {name: sum(self.counters.get(name, Counter()).values()) for name in names}
        named = set(heapq.nlargest(self.config.metric_tenants, activity, key=lambda name: (activity[name], name)))
        out: dict[str, dict[str, Any]] = {}
        for name in names:
            label = name if name in named else OTHER
            part = out.setdefault(label, {"counters": Counter(), "gauges": Counter()})
            part["counters"].update(self.counters.get(name, Counter()))
            part["gauges"]["blocks"] += self.held[name]
            part["gauges"]["share_blocks"] += self.share(name)
        for part in out.values():
            part["counters"] = {
                "hits": part["counters"]["hits"],
                "misses": part["counters"]["misses"],
                "blocks_stored": part["counters"]["blocks_stored"],
                "bytes_stored": part["counters"]["blocks_stored"] * self.row_bytes,
            }
            part["gauges"] = {**part["gauges"], "bytes": part["gauges"]["blocks"] * self.row_bytes}
        return out


class _OwnedOutside(Container[OffloadKey]):
    """Keys `protected`, and keys owned by tenants not in `allowed`: what an eviction that
    may only take from `allowed` must leave."""

    __slots__ = ("_allowed", "_owner", "_protected")

    def __init__(self, protected: Container[OffloadKey], owner: dict[OffloadKey, str], allowed: set[str]):
        self._protected, self._owner, self._allowed = protected, owner, allowed

    def __contains__(self, key: object) -> bool:
        return key in self._protected or self._owner.get(key) not in self._allowed  # type: ignore[call-overload]
