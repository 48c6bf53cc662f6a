"""Tenants of the CPU tier: who holds which rows, their shares, and eviction that keeps them.

Tenants of one engine share its CPU tier, so one tenant's burst of new prompts would evict
every other tenant's prefixes. With a ``tenants`` config each tenant has a share of the
tier's rows (a fraction of them, or bytes) and its blocks are ranked by a policy of their
own (the configured one: LRU, ARC, ...), and eviction follows these rules:

- a store or promotion evicts from tenants over their share first, the most over first,
  each down to its share, in its own policy's order;
- then, a tenant beyond its share (counting the blocks it is adding) evicts its own
  blocks: a tenant within its share is never evicted to make room for one beyond it.
  Without such blocks idle, the call is refused (``tenant_share``);
- a tenant within its share takes the rest from the fullest tenants for their share.

Shares are not reservations: rows a tenant does not use serve the others until it needs
them back. A request's tenant is `ReqContext.tenant`, or `TenantsConfig.default_tenant` when
that is None (the vLLM adapter sets it to the request's ``cache_salt``). Keys are not changed:
tenants' blocks never share a key because the block hashes they come from differ (vLLM mixes
the salt into the first block's hash, and every later hash chains on it).

Retention hints (`tiering.eviction.retention`) hold within a tenant: each tenant's deadlines are
capped by `retention_max_fraction` of its own share, and its eviction takes its released
blocks first and passes over its retained ones, by the same rules as without tenants. A
tenant's retained blocks never protect it beyond its share from the rules above.

State is bounded whatever clients send (`TenantsConfig.max_tenants`): a tenant holding
nothing keeps only its counters, and is forgotten first when a new one needs its place; each
tenant's policy is sized by its share.

Thread: the scheduler thread only, as the CPU tier that owns it.
"""

from __future__ import annotations

import heapq
import logging
from collections import Counter
from collections.abc import Container
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, Field

from tiering.contract.keys import OffloadKey, ReqContext
from tiering.eviction.base import lists_candidates
from tiering.eviction.policies import BlockStatus, CachePolicy, make_cache_policy
from tiering.eviction.retention import Retention, evict_retained, new_counters, retained_candidates
from tiering.options import STRICT, Count, parse_size

logger = logging.getLogger(__name__)

OTHER = "other"  # the label of the tenants beyond the `metric_tenants` most active
MAX_TENANT_CHARS = 256
"""The longest tenant name a request may give (under vLLM its ``cache_salt``): a longer one
counts as ``other``, logged once per engine (a name is a dict key and a metric label)."""


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
        max_tenants: tenants tracked at once besides those in `quotas` (a client may name
            any number: under vLLM a tenant is a request's ``cache_salt``). A new one beyond
            it takes the place of the tracked tenant that has held nothing longest, or
            else counts as ``other`` (one tenant, of `default_share`).
    """

    model_config = STRICT

    default_tenant: str = Field(default="default", min_length=1)
    default_share: Share = 1.0
    quotas: dict[str, Share] = Field(default_factory=dict)
    metric_tenants: Count = 8
    max_tenants: Count = 256


class TenantShares:
    """Owners, shares and per-tenant eviction order of a CPU tier's rows.

    Args:
        config: the tenants and their shares.
        num_blocks: rows of the tier.
        row_bytes: bytes of one row (shares in bytes become rows).
        cache_policy: the eviction policy each tenant's blocks are ranked by.
        retention_max_fraction: the share of each tenant's share that its requests'
            retention hints may hold (0: hints are ignored).

    Raises:
        ValueError: the policy cannot list eviction candidates (`CachePolicy.candidates`).
    """

    def __init__(
        self,
        config: TenantsConfig,
        num_blocks: int,
        row_bytes: int,
        cache_policy: str = "lru",
        retention_max_fraction: float = 0.0,
    ):
        self.config = config
        self._retention_max_fraction = retention_max_fraction
        self._retentions: dict[str, Retention] = {}  # of the tenants holding blocks, made by a hint
        self.retention_counters = new_counters()  # every tenant's, summed
        self.row_bytes = row_bytes
        self.num_blocks = num_blocks
        self._cache_policy = cache_policy
        if not lists_candidates(type(make_cache_policy(cache_policy, 1))):
            raise ValueError(f"eviction policy {cache_policy!r} cannot serve tenants: it lists no eviction candidates")
        self._default_rows = self._rows(config.default_share)
        self._rows_by_tenant = {name: self._rows(share) for name, share in config.quotas.items()}
        self._policies: dict[str, CachePolicy] = {}  # of the tenants holding blocks
        self.owner: dict[OffloadKey, str] = {}
        self.held: Counter[str] = Counter()
        self.counters: dict[str, Counter[str]] = {}  # of every tracked tenant
        self._idle: dict[str, None] = {}  # tracked tenants holding nothing, forgettable, longest idle first
        self._long_name_logged = False

    def _rows(self, share: float | int) -> int:
        if isinstance(share, float):
            return max(1, int(share * self.num_blocks))
        return max(1, share // self.row_bytes)

    def tenant_of(self, req_context: ReqContext) -> str:
        """The tenant of a call's request: its name while it is tracked (see
        `TenantsConfig.max_tenants`) and not longer than `MAX_TENANT_CHARS`, else ``other``."""
        name = getattr(req_context, "tenant", None) or self.config.default_tenant
        if len(name) > MAX_TENANT_CHARS:
            if not self._long_name_logged:
                self._long_name_logged = True
                logger.warning(
                    "request %.64s: a tenant name of %d characters (at most %d) counts as %r; later ones go unlogged",
                    getattr(req_context, "req_id", "?"),
                    len(name),
                    MAX_TENANT_CHARS,
                    OTHER,
                )
            name = OTHER
        if name in self.counters:
            return name
        quotas_seen = sum(name in self.counters for name in self._rows_by_tenant)  # walks the (few) quotas
        forgettable = len(self.counters) - quotas_seen - (OTHER in self.counters)
        if name not in self._rows_by_tenant and forgettable >= self.config.max_tenants and not self._forget_idle():
            name = OTHER
        if name not in self.counters:
            self.counters[name] = Counter()
            self._went_idle(name)
        return name

    def _went_idle(self, name: str) -> None:
        """`name` holds nothing now: it is forgotten first if a new tenant needs its place."""
        if name not in self._rows_by_tenant and name != OTHER:
            self._idle[name] = None

    def _forget_idle(self) -> bool:
        """Forget the tenant that has held nothing longest, its counters added to
        ``other``'s; False if every tracked tenant holds blocks."""
        if not self._idle:
            return False
        name = next(iter(self._idle))
        del self._idle[name]
        self._policies.pop(name, None)  # an empty one, made for a touch
        self._retentions.pop(name, None)
        self.counters.setdefault(OTHER, Counter()).update(self.counters.pop(name))
        return True

    def share(self, tenant: str) -> int:
        """Rows `tenant` may hold while others need them."""
        return self._rows_by_tenant.get(tenant, self._default_rows)

    def policy(self, tenant: str) -> CachePolicy:
        """The policy that ranks `tenant`'s blocks, sized by its share (a tenant holding
        nothing gets a new one, dropped again if it inserts nothing)."""
        policy = self._policies.get(tenant)
        if policy is None:
            policy = self._policies[tenant] = make_cache_policy(self._cache_policy, self.share(tenant))
        return policy

    def retention(self, tenant: str) -> Retention | None:
        """The deadlines of `tenant`'s blocks (made when first asked for), capped by its
        share; None if hints are ignored (`retention_max_fraction` 0, or a share too small)."""
        retention = self._retentions.get(tenant)
        if retention is None:
            max_blocks = int(self._retention_max_fraction * self.share(tenant))
            if not max_blocks:
                return None
            retention = self._retentions[tenant] = Retention(
                max_blocks, self.policy(tenant), counters=self.retention_counters
            )
        return retention

    @property
    def retained_blocks(self) -> int:
        """Blocks holding a deadline, every tenant's."""
        return sum(len(retention) for retention in self._retentions.values())

    def count(self, tenant: str, name: str, amount: int = 1) -> None:
        """Add `amount` to the counter `name` (``hits``, ``misses``, ``blocks_stored``) of
        `tenant` (as `tenant_of` named it, or ``other`` if forgotten since)."""
        counters = self.counters.get(tenant)
        if counters is None:
            counters = self.counters.setdefault(OTHER, Counter())
        counters[name] += amount

    def insert_all(self, keys: list[OffloadKey], blocks: list[BlockStatus], tenant: str) -> None:
        """`keys` got rows (`blocks`, in order) for `tenant` (as `tenant_of` named it): ranked
        by its policy as the most recent, the last most."""
        if tenant not in self.counters:  # forgotten between its lookup and its store
            tenant = OTHER
            self.counters.setdefault(OTHER, Counter())
        self.owner.update(dict.fromkeys(keys, tenant))
        self.held[tenant] += len(keys)
        self._idle.pop(tenant, None)
        self.policy(tenant).insert_all(keys, blocks)

    def remove(self, key: OffloadKey) -> None:
        """`key` lost its row without being evicted (a failed write)."""
        tenant = self.owner.pop(key, None)
        if tenant is not None:
            self._policies[tenant].remove(key)
            if (retention := self._retentions.get(tenant)) is not None:
                retention.forget((key,))
            self._released(tenant, 1)

    def _released(self, tenant: str, count: int) -> None:
        self.held[tenant] -= count
        if not self.held[tenant]:
            del self.held[tenant]
            self._policies.pop(tenant, None)
            self._retentions.pop(tenant, None)
            self._went_idle(tenant)

    def reset(self) -> None:
        """Forget every block (the counters stay)."""
        for tenant in list(self.held):
            self._went_idle(tenant)
        self._policies.clear()
        self._retentions.clear()
        self.owner.clear()
        self.held.clear()

    def coldest(self, n: int) -> list[OffloadKey]:
        """Up to `n` blocks as eviction would start on them: the tenants fullest for their
        share first, each in its policy's order (busy blocks included)."""
        out: list[OffloadKey] = []
        for tenant in self._fullest():
            out += self._policies[tenant].coldest(n - len(out))
            if len(out) >= n:
                break
        return out

    def evict(
        self, n: int, protected: Container[OffloadKey], tenant: str, adding: int
    ) -> list[tuple[OffloadKey, BlockStatus]] | None:
        """`n` idle blocks not in `protected` evicted for `tenant`, which is adding `adding`
        blocks, by the rules of the module docstring; None (nothing evicted) if there are
        too few."""
        held, planned = self.held, Counter[str]()
        plan: dict[str, list[Any]] = {}

        def take(name: str, count: int) -> None:
            chosen = plan.setdefault(name, [])
            taken = {token[0] for token in chosen}
            more = [token for token in self._candidates(name, len(chosen) + count, protected) if token[0] not in taken]
            chosen.extend(more[:count])
            planned[name] = len(chosen)

        over = sorted((rows - self.share(name), name) for name, rows in held.items() if rows > self.share(name))
        for excess, name in reversed(over):
            take(name, min(n - sum(planned.values()), excess))
            if sum(planned.values()) == n:
                break
        beyond = held[tenant] + adding > self.share(tenant)
        for name in [tenant] if beyond else self._fullest():
            missing = n - sum(planned.values())
            if missing == 0:
                break
            if name in self._policies:
                take(name, missing)
        if sum(planned.values()) < n:
            return None
        victims = []
        for name, chosen in plan.items():
            evicted = evict_retained(self._policies[name], self._retentions.get(name), chosen)
            for key, _ in evicted:
                del self.owner[key]
            self._released(name, len(evicted))
            victims += evicted
        return victims

    def _candidates(self, name: str, n: int, protected: Container[OffloadKey]) -> list[Any]:
        """Up to `n` of `name`'s idle blocks not in `protected`, as its policy's tokens: its
        released blocks first, then those without a live deadline, then (giving up the
        earliest deadlines) retained ones."""
        return retained_candidates(self._policies[name], self._retentions.get(name), n, protected)

    def _fullest(self) -> list[str]:
        """Tenants with blocks, the fullest for their share first."""
        return sorted(
            (name for name in self._policies if self.held[name]), key=lambda name: -self.held[name] / self.share(name)
        )

    def stats(self) -> dict[str, dict[str, Any]]:
        """Counters and gauges by tenant: the `metric_tenants` most active (lookups and
        blocks stored) by name, the rest summed as ``other``."""
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
